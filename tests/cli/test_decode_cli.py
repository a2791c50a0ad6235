"""decode.py end to end on a tiny saved checkpoint: every mode prints what it promises, batches and the
reference make the engine's tokens, and bad input ends in one line on stderr and exit status 2."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch

import decode
from conftest import PROMPTS, ROOT, save_tiny
from medusa_mini.heads import HeadsConfig, make_heads
from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt_no_heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_no_heads")
    save_tiny(d, with_heads=False)
    return str(d)


@pytest.fixture(scope="module")
def ckpt_hydra(ckpt, tmp_path_factory):  # the tiny checkpoint with dependent (hydra) heads
    d = tmp_path_factory.mktemp("hydra") / "ckpt"
    shutil.copytree(ckpt, d)
    model, _, config = load_checkpoint(d)
    heads = make_heads(HeadsConfig(4, model.config.n_embd, model.config.vocab_size, kind="hydra"))
    save_checkpoint(d, model, heads=heads, extra=config["medusa_mini"], write_model=False)
    return str(d)


def run(capsys, *argv: str) -> str:
    assert decode.main(list(argv)) == 0
    return capsys.readouterr().out


def tokens_of(capsys, *argv: str) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in run(capsys, *argv, "--json").splitlines()]


def test_json_gives_one_object_per_prompt(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--json", "--max-new-tokens", "10", "--num-prompts", "2")
    objs = [json.loads(line) for line in out.splitlines()]
    assert [(o["prompt"], o["method"], len(o["tokens"]), o["stop_reason"]) for o in objs] == [
        (p, "medusa_greedy", 10, "max_new_tokens") for p in PROMPTS[:2]]
    assert all(o["steps"] >= 1 and o["tokens_per_step"] >= 1.0 and o["seconds"] > 0 for o in objs)


@pytest.mark.parametrize("rule, needles", [
    ([], ("Prefill", "Root token", "head 4", "■", "backbone argmax", "emitted", "[0] root", "accepted path")),
    (["--method", "rejection"], ("min(1, p(x)/q(x))", "Rejection sampling draws the candidates", "bonus token")),
])
def test_explain_walks_through_one_step(ckpt, capsys, rule, needles):
    out = run(capsys, "--ckpt", ckpt, "--explain", *rule)
    assert all(needle in out for needle in needles), out


def test_show_brackets_each_step_and_joins_to_the_plain_text(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "20"]
    ref = json.loads(run(capsys, *argv, "--json", "--method", "plain"))
    medusa = json.loads(run(capsys, *argv, "--json"))
    out = run(capsys, *argv, "--show")  # not a terminal: brackets, no colour
    assert "\x1b[" not in out and "attention mask" in out and "[0] root" in out and "(bonus token counted)" in out
    assert "ms/token as streamed (printing included" in out  # the clock ran while the text printed
    header = "the first from the prefill ===\n"
    shown = out[out.index(header) + len(header): out.rindex("\nstats: ")]
    assert "[" not in ref["text"] and shown.replace("[", "").replace("]", "") == ref["text"]
    assert shown.count("[") == medusa["steps"] + 1  # the prefill's token, then one chunk per step


def test_plain_show_needs_no_heads_and_shows_no_tree(ckpt_no_heads, capsys):
    out = run(capsys, "--ckpt", ckpt_no_heads, "--method", "plain", "--show", "--max-new-tokens", "6")
    assert "=== plain greedy; one [chunk] per forward pass" in out and "attention mask" not in out and "root" not in out


def test_plain_decoding_never_asks_the_heads_to_fill_a_tree(ckpt, capsys, tmp_path):
    (tmp_path / "wide.json").write_text("[[100000]]")  # a rank past the draft vocabulary: Medusa refuses it
    out = run(capsys, "--ckpt", ckpt, "--method", "plain", "--tree", str(tmp_path / "wide.json"), "--max-new-tokens",
              "4", "--num-prompts", "1")
    assert "plain greedy" in out


def test_plain_decoding_needs_no_heads(ckpt_no_heads, capsys):
    out = run(capsys, "--ckpt", ckpt_no_heads, "--method", "plain", "--max-new-tokens", "5", "--num-prompts", "1")
    assert "plain greedy" in out and "1.00 tokens/step" in out


def test_generation_stops_cleanly_at_the_context_limit(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--prompt", " ".join(["the cat sat on the mat"] * 6), "--max-new-tokens", "50"]  # 55 of 64
    obj = json.loads(run(capsys, *argv, "--json"))
    assert obj["stop_reason"] == "context" and obj["prompt_tokens"] + len(obj["tokens"]) == 64
    assert "stopped at the context limit" in run(capsys, *argv)
    assert "stopped at the context limit" in run(capsys, *argv, "--reference")
    exact = argv[:-1] + ["9"]  # 55 + 9 = 64: a budget that ends with the context is what stopped it
    assert [json.loads(run(capsys, *exact, "--json", *ref))["stop_reason"] for ref in ([], ["--reference"])] == [
        "max_new_tokens", "max_new_tokens"]


@pytest.mark.parametrize("rule", [["--method", "greedy"], ["--method", "typical"], ["--method", "rejection"]])
def test_the_reference_decoder_prints_the_engines_tokens_and_stop_reasons(ckpt, capsys, rule):
    argv = ["--ckpt", ckpt, "--max-new-tokens", "16", "--seed", "2", *rule, "--json"]
    ends = [[(o["tokens"], o["stop_reason"]) for o in map(json.loads, run(capsys, *argv, *ref).splitlines())]
            for ref in ([], ["--reference"])]
    assert ends[0] == ends[1] and {reason for _, reason in ends[0]} <= {"eos", "max_new_tokens"}


@pytest.mark.parametrize("rule", [[], ["--method", "plain"]])
def test_a_batch_of_prompts_decodes_each_as_if_alone_when_greedy(ckpt, capsys, rule):
    argv = ["--ckpt", ckpt, "--max-new-tokens", "14", *rule]
    assert tokens_of(capsys, *argv, "--batch-size", "2") == tokens_of(capsys, *argv)
    assert run(capsys, *argv, "--num-prompts", "3", "--batch-size", "2").count(" ms/token over its batch of 2,") == 2


def test_hydra_heads_decode_and_explain_like_medusa_heads(ckpt_hydra, capsys):
    argv = ["--ckpt", ckpt_hydra, "--max-new-tokens", "12"]
    assert tokens_of(capsys, *argv) == tokens_of(capsys, *argv, "--method", "plain")  # greedy: lossless
    assert "Dependent (hydra) heads" in run(capsys, *argv, "--explain")


@pytest.mark.slow
def test_the_demo_explains_a_step_without_any_checkpoint(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no out/tiny here
    monkeypatch.setattr(decode, "demo_checkpoint", functools.partial(decode.demo_checkpoint, steps=100))
    out = run(capsys, "--explain", "--demo")
    assert out.startswith("DEMO:") and "accepted path" in out and "7. Result" in out


def test_two_runs_of_the_same_sampled_decode_print_the_same_tokens(ckpt):
    argv = [sys.executable, "decode.py", "--ckpt", ckpt, "--method", "rejection", "--seed", "3", "--json"]
    runs = [subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120) for _ in range(2)]
    objs = [[json.loads(line) for line in r.stdout.splitlines()] for r in runs]
    assert objs[0][0]["temperature"] == 0.8 and len(objs[0]) == 3  # the sampling default when none is given
    assert [o["tokens"] for o in objs[0]] == [o["tokens"] for o in objs[1]]


def test_a_bad_checkpoint_ends_the_real_process_with_status_2_and_one_line(tmp_path):
    """As a user meets it: the process's exit status and stderr, for an error found after parsing (the rest
    of the bad inputs run in-process below, through the same main)."""
    r = subprocess.run([sys.executable, "decode.py", "--ckpt", str(tmp_path / "nowhere")], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("decode.py: error: checkpoint directory") and r.stderr.count("\n") == 1, r.stderr


@pytest.fixture(scope="module")
def broken_ckpt(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("broken") / "ckpt"
    shutil.copytree(ckpt, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return str(d)


@pytest.mark.parametrize("argv, needle", [  # bad trees: tests/cli/test_tree_choice.py
    (["--ckpt", "{tmp}/nowhere"], "does not exist"), (["--ckpt", "{broken}"], "model.safetensors"),
    (["--ckpt", "{no_heads}"], "no Medusa heads"), (["--ckpt", "{no_heads}", "--compare"], "no Medusa heads"),
    (["--tree", "chain6"], "4 Medusa heads"), (["--prompt", ""], "empty"),
    (["--prompt", "the cat " * 100], "context holds 64"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--method", "greedy", "--temperature", "0.7"], "--method greedy is for temperature 0"),
    (["--max-new-tokens", "many"], "invalid int"), (["--batch-size", "2", "--show"], "--batch-size"),
    (["--batch-size", "1,2"], "a list of sizes goes with --compare"),
    (["--compare", "--batch-size", "1,x"], "a size >= 1"),
    (["--plot", "{tmp}/b.png"], "--plot draws the batch table"), (["--demo"], "--demo goes with --explain"),
    (["--compare", "--batch-size", "1,2", "--plot", "{tmp}/no/b.png"], "folder does not exist"),
    (["--reference", "--method", "plain"], "--reference decodes with Medusa"),
    (["--ckpt", "{hydra}", "--reference"], "hydra heads read the tokens drafted"),  # the heads' own check
    (["--ckpt", "{tmp}/nothing"], "holds neither model.safetensors"), (["--ckpt", "{ckpt}/config.json"], "is a file, not a checkpoint"),
    (["--compare", "--max-new-tokens", "1"], "at least 2"), (["--compare", "--method", "typical"], "leave out --method"),
    (["--explain", "--method", "plain"], "--explain walks through a Medusa step"),
    (["--compare", "--batch-size", "1,2", "--reference"], "--reference adds its rows"),
    (["--tree", ""], "--tree is empty"), (["--batch-size", " "], "--batch-size is empty"),
    (["--seed", str(2**64)], "not a seed"), (["--tree", "{tmp}/wide.json"], "the draft vocabulary has"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"), (["--json", "--show"], "--json cannot"),
    (["--json", "--explain"], "--json cannot"), (["--batch-size", "2", "--reference"], "one at a time"),
    (["--batch-size", "2", "--explain"], "one at a time"), (["--batch-size", "²"], "a size >= 1"),
    (["--method", "typical", "--temperature", "0"], "--method typical samples: give --temperature > 0"),
    (["--method", "rejection", "--temperature", "0"], "or use --method greedy for temperature 0"),
    (["--explain", "--compile"], "leave out --compile"), (["--explain", "--reference"], "leave out --reference"),
    (["--temperature", "inf"], "--temperature must be a number from 0"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, ckpt, ckpt_no_heads, ckpt_hydra, broken_ckpt, tmp_path, capsys):
    (tmp_path / "wide.json").write_text("[[100000]]")  # a rank past any draft vocabulary: refused before output
    (tmp_path / "nothing").mkdir()
    argv = [a.format(tmp=str(tmp_path), broken=broken_ckpt, no_heads=ckpt_no_heads, hydra=ckpt_hydra, ckpt=ckpt)
            for a in argv]
    with pytest.raises(SystemExit) as exc:
        decode.main(argv if "--ckpt" in argv else ["--ckpt", ckpt, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("decode.py: error: ") and err.count("\n") == 1, err
    assert needle in err, err


@pytest.mark.parametrize("mode", [[], ["--method", "rejection"], ["--method", "plain", "--temperature", "0.8"],
                                  ["--reference", "--method", "rejection"], ["--compare", "--json"],
                                  ["--explain", "--method", "rejection"]])
def test_every_generator_decode_makes_lives_on_the_models_device(ckpt, capsys, monkeypatch, mode):
    """On a GPU a CPU generator cannot draw for the device's tensors; on a CPU nothing would tell: each
    generator must name its device, the model's (by keyword or position)."""
    devices = []

    class Recorded(torch.Generator):  # a real generator that notes the device it was asked for
        def __new__(cls, *args, **kw):
            devices.append(kw.get("device", args[0] if args else None))
            return super().__new__(cls, *args, **kw)

    monkeypatch.setattr(torch, "Generator", Recorded)
    run(capsys, "--ckpt", ckpt, "--max-new-tokens", "4", "--num-prompts", "1", *mode)
    assert devices and all(d is not None and torch.device(d) == torch.device("cpu") for d in devices), devices
