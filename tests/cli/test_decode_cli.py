"""decode.py end to end on a tiny saved checkpoint: every mode prints what it promises, Medusa greedy
matches plain greedy, and bad input ends in one line on stderr and exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import PROMPTS, ROOT, save_tiny

import decode  # noqa: E402
from medusa_mini.io.tokenizer import load_tokenizer
from medusa_mini.tune.acceptance_tables import save_accuracy


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt_no_heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_no_heads")
    save_tiny(d, with_heads=False)
    return str(d)


def run(capsys, *argv: str) -> str:
    assert decode.main(list(argv)) == 0
    return capsys.readouterr().out


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# ---- modes ----------------------------------------------------------------------------------


def test_compare_prints_five_rows_and_medusa_greedy_makes_plain_greedys_tokens(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--compare", "--max-new-tokens", "12")
    for label, same in (("plain greedy", "yes"), ("Medusa greedy", "yes"), ("Medusa typical (T=0.8)", "-"),
                        ("plain sampling (T=0.8)", "-"), ("Medusa rejection (T=0.8)", "-")):
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert line.split()[-1] == same, line
    for needle in ("bonus token", "3 prompts", "tree cpu (12 nodes", "max-new-tokens 12", "1 thread;",
                   "fastest of 3 runs in turns"):
        assert needle in out, needle
    result = json.loads(run(capsys, "--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "16"))
    rows = {row["key"]: row for row in result["rows"]}
    assert list(rows) == ["plain_greedy", "medusa_greedy", "medusa_typical", "plain_sampling", "medusa_rejection"]
    assert rows["medusa_greedy"]["tokens"] == rows["plain_greedy"]["tokens"]
    assert rows["medusa_greedy"]["same_as_plain_greedy"] is True and rows["medusa_rejection"]["same_as_plain_greedy"] is None
    assert rows["plain_greedy"]["tokens_per_step"] == 1.0 and rows["plain_greedy"]["speedup"] == 1.0
    assert (result["prompts"], result["tree"], result["tree_nodes"]) == (3, "cpu", 12)


def test_json_gives_one_object_per_prompt(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--json", "--max-new-tokens", "10", "--num-prompts", "2")
    objs = json_lines(out)
    assert [o["prompt"] for o in objs] == PROMPTS[:2]
    for o in objs:
        assert o["method"] == "medusa" and o["acceptance"] == "greedy" and o["prompt_tokens"] > 0
        assert len(o["tokens"]) == 10 and o["stop_reason"] == "max_new_tokens" and isinstance(o["text"], str)
        assert o["steps"] >= 1 and o["tokens_per_step"] >= 1.0 and o["seconds"] > 0


def test_typical_acceptance_runs_to_the_token_limit(ckpt, capsys):
    # The last step before the limit verifies a tree cut down to its root alone.
    for n in (2, 7, 12):
        out = run(capsys, "--ckpt", ckpt, "--json", "--method", "typical", "--max-new-tokens", str(n))
        assert all(len(o["tokens"]) == n for o in json_lines(out))


@pytest.mark.parametrize("rule, needles", [
    ([], ("Prefill", "Root token", "head 1", "head 4", "mask", "■", "backbone argmax", "emitted", "[0] root")),
    (["--method", "rejection"], ("min(1, p(x)/q(x))", "Rejection sampling draws the candidates")),  # drafts from q
])
def test_explain_walks_through_one_step(ckpt, capsys, rule, needles):
    out = run(capsys, "--ckpt", ckpt, "--explain", *rule)
    for needle in ("accepted path", "bonus token", *needles):
        assert needle in out, needle


def test_show_brackets_each_step_and_joins_to_the_plain_text(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "20"]
    ref = json_lines(run(capsys, *argv, "--json", "--method", "plain"))[0]
    medusa = json_lines(run(capsys, *argv, "--json"))[0]
    out = run(capsys, *argv, "--show")  # not a terminal: brackets, no colour
    assert "\x1b[" not in out and "attention mask" in out and "[0] root" in out and "(bonus token counted)" in out
    header = "the first from the prefill ===\n"
    shown = out[out.index(header) + len(header): out.rindex("\nstats: ")]
    assert shown.replace("[", "").replace("]", "") == ref["text"].replace("[", "").replace("]", "")
    if "[" not in ref["text"] and "]" not in ref["text"]:
        assert shown.count("[") == medusa["steps"] + 1  # the prefill's token, then one chunk per step


def test_plain_method_works_without_heads(ckpt_no_heads, capsys):
    out = run(capsys, "--ckpt", ckpt_no_heads, "--method", "plain", "--max-new-tokens", "5", "--num-prompts", "1")
    assert "plain greedy" in out and "1.00 tokens/step" in out


@pytest.mark.parametrize("method", ["plain", "greedy"])
def test_generation_stops_cleanly_at_the_context_limit(ckpt, capsys, method):
    enc = load_tokenizer(ckpt)
    prompt = enc.decode(enc.encode_ordinary(" ".join(["the cat sat on the mat"] * 30))[:55])  # of 64
    argv = ["--ckpt", ckpt, "--prompt", prompt, "--method", method, "--max-new-tokens", "50"]
    obj = json_lines(run(capsys, *argv, "--json"))[0]
    assert obj["stop_reason"] == "context" and obj["prompt_tokens"] + len(obj["tokens"]) == 64
    assert "stopped at the context limit" in run(capsys, *argv)


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_ckpt(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("broken") / "ckpt"
    shutil.copytree(ckpt, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return str(d)


@pytest.mark.parametrize("argv, needle", [  # bad trees: tests/tune/test_trees.py
    (["--ckpt", "{tmp}/nowhere"], "does not exist"), (["--ckpt", "{broken}"], "model.safetensors"),
    (["--ckpt", "{no_heads}"], "no Medusa heads"), (["--ckpt", "{no_heads}", "--compare"], "no Medusa heads"),
    (["--tree", "chain6"], "4 Medusa heads"), (["--prompt", ""], "empty"),
    (["--prompt", "the cat " * 100], "context holds 64"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--method", "greedy", "--temperature", "0.7"], "--method greedy is for temperature 0"),
    (["--max-new-tokens", "many"], "invalid int"), (["--batch-size", "2", "--show"], "--batch-size"),
    (["--batch-size", "1,2"], "a list of sizes goes with --compare"), (["--compare", "--batch-size", "1,x"], "a size >= 1"),
    (["--plot", "{tmp}/b.png"], "--plot draws the batch table"), (["--demo"], "--demo goes with --explain"),
    (["--compare", "--batch-size", "1,2", "--plot", "{tmp}/no/b.png"], "folder does not exist"),
    (["--reference", "--method", "plain"], "--reference decodes with Medusa"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, ckpt, ckpt_no_heads, broken_ckpt, tmp_path, capsys):
    fill = {"tmp": str(tmp_path), "broken": broken_ckpt, "no_heads": ckpt_no_heads}
    argv = [a.format(**fill) for a in argv]
    if "--ckpt" not in argv:
        argv = ["--ckpt", ckpt] + argv
    with pytest.raises(SystemExit) as exc:
        decode.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("decode.py: error: ") and err.count("\n") == 1, err
    assert needle in err, err


def test_help_shows_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exc:
        decode.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--compare", "--explain", "--show", "--tree", "--method", "--reference", "--demo", "--plot",
                 "--dtype", "--compile", "--batch-size", "default: out/tiny", "default: 128"):
        assert flag in out, flag
    options = [line for line in out.splitlines() if line.startswith("  --")]
    assert len(options) <= 20, f"{len(options)} options: --help must stay readable on one screen"


def test_tree_n_builds_n_nodes_from_the_measured_accuracy_for_every_rule(tmp_path, capsys):
    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    save_accuracy(ckpt, torch.tensor([[0.9] + [0.01] * 9] * 4, dtype=torch.float64))  # a deep chain pays off
    assert decode.main(["--ckpt", ckpt, "--tree", "6", "--compare", "--json", "--max-new-tokens", "4",
                        "--num-prompts", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tree"] == "6" and result["tree_nodes"] == 7
    assert decode.main(["--ckpt", ckpt, "--show", "--max-new-tokens", "4", "--num-prompts", "1"]) == 0
    assert "tree 8: 8 nodes + root" in capsys.readouterr().out  # the CPU default: 8 nodes from the table


def test_two_runs_of_the_same_sampled_decode_print_the_same_tokens_and_bad_input_exits_2(tmp_path):
    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    save_accuracy(ckpt, torch.tensor([[0.6, 0.2] + [0.01] * 8] * 4, dtype=torch.float64))
    argv = [sys.executable, "decode.py", "--ckpt", ckpt, "--method", "rejection",
            "--seed", "3", "--max-new-tokens", "16", "--json", "--num-prompts", "2"]
    runs = [subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    tokens = [[row["tokens"] for row in json_lines(r.stdout)] for r in runs]
    assert json_lines(runs[0].stdout)[0]["temperature"] == 0.8  # the sampling default when none is given
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2 and all(len(t) == 16 for t in tokens[0])
    bad = subprocess.run([*argv[:4], "--tree", "chain9"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compare_in_half_precision_runs_every_row_and_reports_any_difference(ckpt, capsys, dtype):
    out = run(capsys, "--ckpt", ckpt, "--compare", "--json", "--dtype", dtype, "--max-new-tokens", "12",
              "--num-prompts", "3")
    result = json.loads(out)
    assert result["dtype"] == dtype and len(result["rows"]) == 5
    for row in result["rows"]:
        assert all(len(t) == 12 for t in row["tokens"])
        if row["temperature"] == 0:  # equal, or each difference located
            assert row["same_as_plain_greedy"] == (not row["differences"])
            assert all(0 <= d["position"] < 12 and d["margin"] >= 0 for d in row["differences"])
