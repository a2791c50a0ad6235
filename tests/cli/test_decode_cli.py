"""decode.py end to end on a tiny saved checkpoint: every mode prints what it promises, Medusa greedy
matches plain greedy, and bad input ends in one line on stderr and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import PROMPTS, ROOT, save_tiny

import decode  # noqa: E402
from medusa_mini.cli.compare import format_compare
from medusa_mini.io.tokenizer import load_tokenizer
from medusa_mini.tune.trees import resolve_trees


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


def test_compare_table_has_five_rows_and_greedy_rows_match_plain_greedy(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--compare", "--max-new-tokens", "12")
    rows = {
        "plain greedy": "yes", "Medusa greedy": "yes", "Medusa typical (T=0.8)": "-",
        "plain sampling (T=0.8)": "-", "Medusa rejection (T=0.8)": "-",
    }
    for label, same in rows.items():
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert line.split()[-1] == same, line
    assert "bonus token" in out and "3 prompts" in out and "tree cpu (12 nodes" in out
    assert "max-new-tokens 12" in out and "1 thread;" in out


def test_compare_json_medusa_greedy_tokens_equal_plain_greedy(ckpt, capsys):
    result = json.loads(run(capsys, "--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "16"))
    rows = {row["key"]: row for row in result["rows"]}
    keys = ["plain_greedy", "medusa_greedy", "medusa_typical", "plain_sampling", "medusa_rejection"]
    assert list(rows) == keys
    assert rows["medusa_greedy"]["tokens"] == rows["plain_greedy"]["tokens"]
    assert rows["medusa_greedy"]["same_as_plain_greedy"] is True
    assert rows["plain_greedy"]["tokens_per_step"] == 1.0 and rows["plain_greedy"]["speedup"] == 1.0
    assert rows["medusa_rejection"]["same_as_plain_greedy"] is None
    for row in result["rows"]:
        assert {"steps", "tokens_per_step", "ms_per_token", "speedup", "method"} <= row.keys()
    assert result["prompts"] == 3 and result["tree"] == "cpu" and result["tree_nodes"] == 12


def test_compare_repeats_each_generation_and_keeps_the_same_tokens(ckpt, capsys):
    once = json.loads(run(capsys, "--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "10", "--repeat", "1"))
    thrice = json.loads(run(capsys, "--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "10", "--repeat", "3"))
    assert once["repeat"] == 1 and thrice["repeat"] == 3
    for a, b in zip(once["rows"], thrice["rows"]):  # seeded: repeats change only the times
        assert (a["tokens"], a["steps"], a["tokens_per_step"]) == (b["tokens"], b["steps"], b["tokens_per_step"])
    assert "fastest of 3 runs in turns" in format_compare(thrice)
    assert "fastest of" not in format_compare(once)


def test_json_gives_one_object_per_prompt(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--json", "--max-new-tokens", "10", "--num-prompts", "2")
    objs = json_lines(out)
    assert [o["prompt"] for o in objs] == PROMPTS[:2]
    for o in objs:
        assert o["method"] == "medusa" and o["acceptance"] == "greedy"
        assert len(o["tokens"]) == 10 and o["stop_reason"] == "max_new_tokens"
        assert o["steps"] >= 1 and o["tokens_per_step"] >= 1.0 and o["seconds"] > 0
        assert isinstance(o["text"], str) and o["prompt_tokens"] > 0


def test_sampling_is_reproducible_with_a_seed(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--json", "--acceptance", "rejection", "--max-new-tokens", "12", "--seed", "3"]
    first, second = json_lines(run(capsys, *argv)), json_lines(run(capsys, *argv))
    assert [o["tokens"] for o in first] == [o["tokens"] for o in second]
    assert first[0]["temperature"] == 0.8  # the sampling default when no temperature is given


def test_typical_acceptance_runs_to_the_token_limit(ckpt, capsys):
    # The last step before the limit verifies a tree cut down to its root alone.
    for n in (2, 7, 12):
        out = run(capsys, "--ckpt", ckpt, "--json", "--acceptance", "typical", "--max-new-tokens", str(n))
        assert all(len(o["tokens"]) == n for o in json_lines(out))


def test_explain_walks_through_one_step(ckpt, capsys):
    out = run(capsys, "--ckpt", ckpt, "--explain")
    for needle in ("Prefill", "Root token", "head 1", "head 2", "head 3", "head 4", "mask", "■",
                   "backbone argmax", "accepted path", "bonus token", "emitted"):
        assert needle in out, needle
    assert "[0] root" in out  # the tree drawing, labelled with token text


@pytest.mark.parametrize("draft,needle", [("sampled", "min(1, p(x)/q(x))"), ("topk", "with probability p(x)")])
def test_explain_with_rejection_sampling_names_how_the_candidates_were_chosen(ckpt, capsys, draft, needle):
    out = run(capsys, "--ckpt", ckpt, "--explain", "--acceptance", "rejection", "--draft", draft)
    assert needle in out and "accepted path" in out
    assert ("Rejection sampling draws the candidates" in out) == (draft == "sampled")


def test_both_drafts_of_rejection_sampling_run_from_the_command_line(ckpt, capsys):
    for draft in ("sampled", "topk"):
        obj = json_lines(run(capsys, "--ckpt", ckpt, "--json", "--acceptance", "rejection", "--draft", draft,
                             "--max-new-tokens", "12", "--num-prompts", "1"))[0]
        assert len(obj["tokens"]) == 12
    out = run(capsys, "--ckpt", ckpt, "--compare", "--draft", "topk", "--max-new-tokens", "4", "--num-prompts", "1",
              "--repeat", "1")
    assert "rejection candidates: the heads' top-k" in out


def test_show_brackets_each_step_and_joins_to_the_plain_text(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "20"]
    ref = json_lines(run(capsys, *argv, "--json", "--method", "plain"))[0]
    medusa = json_lines(run(capsys, *argv, "--json"))[0]
    out = run(capsys, *argv, "--show", "--no-color", "--show-tree")
    assert "\x1b[" not in out and "attention mask" in out and "[0] root" in out
    header = "the first from the prefill ===\n"
    shown = out[out.index(header) + len(header): out.rindex("\nstats: ")]
    def strip(s: str) -> str:
        return s.replace("[", "").replace("]", "")
    assert strip(shown) == strip(ref["text"])
    if "[" not in ref["text"] and "]" not in ref["text"]:
        assert shown.count("[") == medusa["steps"] + 1  # the prefill's token, then one chunk per step
    assert "tokens/step (bonus token counted)" in out


def test_plain_method_works_without_heads(ckpt_no_heads, capsys):
    out = run(capsys, "--ckpt", ckpt_no_heads, "--method", "plain", "--max-new-tokens", "5",
              "--num-prompts", "1")
    assert "plain greedy" in out and "1.00 tokens/step" in out


@pytest.mark.parametrize("method", ["plain", "medusa"])
def test_generation_stops_cleanly_at_the_context_limit(ckpt, capsys, method):
    enc = load_tokenizer(ckpt)
    prompt = enc.decode(enc.encode_ordinary(" ".join(["the cat sat on the mat"] * 30))[:55])  # of 64
    argv = ["--ckpt", ckpt, "--prompt", prompt, "--method", method, "--max-new-tokens", "50"]
    obj = json_lines(run(capsys, *argv, "--json"))[0]
    assert obj["stop_reason"] == "context" and obj["prompt_tokens"] + len(obj["tokens"]) == 64
    assert "stopped at the context limit" in run(capsys, *argv)


# ---- bad input --------------------------------------------------------------------------------


def expect_usage_error(capsys, argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        decode.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("decode.py: error: "), err
    assert needle in err, err


@pytest.fixture(scope="module")
def broken_ckpt(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("broken") / "ckpt"
    shutil.copytree(ckpt, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return str(d)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ckpt", "{tmp}/nowhere"], "does not exist"),
        (["--ckpt", "{broken}"], "model.safetensors"),
        (["--ckpt", "{no_heads}"], "no Medusa heads"),
        (["--ckpt", "{no_heads}", "--compare"], "no Medusa heads"),
        (["--tree", "chain6"], "4 Medusa heads"),
        (["--tree", "{tmp}/bad.json"], "not readable JSON"),
        (["--tree", "{tmp}/orphan.json"], "no parent"),
        (["--tree", "{tmp}/missing.json"], "does not exist"),
        (["--tree", "oak"], "unknown tree"),
        (["--prompt", ""], "empty"),
        (["--prompt", "the cat " * 100], "context holds 64"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--compare", "--repeat", "0"], "--repeat"),
        (["--acceptance", "greedy", "--temperature", "0.7"], "greedy acceptance"),
        (["--max-new-tokens", "many"], "invalid int"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "2", "--show"], "--batch-size"),
        (["--batch-sizes", "1,2"], "--batch-sizes goes with --compare"),
        (["--compare", "--batch-sizes", "1,x"], "sizes >= 1"),
        (["--plot", "{tmp}/b.png"], "--plot draws the batch table"),
        (["--compare", "--batch-sizes", "1", "--plot", "{tmp}/no/b.png"], "folder does not exist"),
        (["--demo"], "--demo goes with --explain"),
        (["--tree", "dynamic:x"], "budget of a dynamic tree"),
        (["--reference", "--method", "plain"], "leave out --method plain"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, ckpt, ckpt_no_heads, broken_ckpt, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "orphan.json").write_text(json.dumps({"choices": [[0], [1, 0]]}))
    fill = {"tmp": str(tmp_path), "broken": broken_ckpt, "no_heads": ckpt_no_heads}
    argv = [a.format(**fill) for a in argv]
    if "--ckpt" not in argv:
        argv = ["--ckpt", ckpt] + argv
    expect_usage_error(capsys, argv, needle)


def test_resolve_tree_reads_presets_and_both_json_shapes(ckpt, tmp_path):
    cpu = torch.device("cpu")
    assert resolve_trees(None, num_heads=4, ckpt_dir=ckpt, device=cpu).greedy.num_nodes == 12
    assert resolve_trees("chain3", num_heads=4, ckpt_dir=ckpt, device=cpu).greedy.depth == 3
    (tmp_path / "list.json").write_text("[[0], [1], [0, 0]]")
    (tmp_path / "obj.json").write_text('{"choices": [[0], [1], [0, 0]]}')
    for name in ("list.json", "obj.json"):
        tree = resolve_trees(str(tmp_path / name), num_heads=4, ckpt_dir=ckpt, device=cpu).greedy
        assert tree.num_nodes == 4 and tree.depth == 2
    with pytest.raises(ValueError, match="heads_accuracy.json"):
        resolve_trees("auto", num_heads=4, ckpt_dir=ckpt, device=cpu)


def test_help_shows_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exc:
        decode.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--compare", "--explain", "--show", "--tree", "--acceptance",
                 "default: out/tiny", "default: 128"):
        assert flag in out, flag


def test_exit_code_2_as_a_subprocess(ckpt):
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "decode.py"), "--ckpt", ckpt, "--tree", "chain9"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_tree_auto_builds_from_measured_accuracy_and_step_cost(tmp_path, capsys):
    from medusa_mini.tune.acceptance_tables import save_accuracy

    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    # heads that are right half the time at rank 0 and rarely below: a deep, narrow tree pays off
    acc = torch.tensor([[0.5] + [0.01] * 9] * 4, dtype=torch.float64)
    save_accuracy(ckpt, acc, meta={"measured_on": "test"})
    rc = decode.main(["--ckpt", ckpt, "--tree", "auto", "--max-new-tokens", "8", "--json", "--num-prompts", "1"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "tree auto" in captured.err and "chose" in captured.err
    row = json.loads(captured.out.splitlines()[0])
    assert len(row["tokens"]) == 8


def test_tree_n_builds_n_nodes_from_each_table(tmp_path, capsys):
    from medusa_mini.tune.acceptance_tables import save_accuracy
    from medusa_mini.tune.trees import resolve_trees

    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    with pytest.raises(SystemExit) as exc:  # no accuracies yet
        decode.main(["--ckpt", ckpt, "--tree", "6"])
    assert exc.value.code == 2 and "medusa_mini.cli.measure" in capsys.readouterr().err
    greedy = torch.tensor([[0.9] + [0.01] * 9] * 4, dtype=torch.float64)  # a deep chain pays off
    sampled = torch.zeros(4, 10, dtype=torch.float64)
    sampled[0] = 0.09  # only head 1 is ever accepted: a wide, flat tree
    save_accuracy(ckpt, greedy, sampled=sampled, temperature=0.8)
    trees = resolve_trees("6", num_heads=4, ckpt_dir=ckpt, device=torch.device("cpu"))
    assert trees.greedy.num_nodes == trees.sampled.num_nodes == 7
    assert trees.greedy.depth == 4 and trees.sampled.depth == 1
    assert decode.main(["--ckpt", ckpt, "--tree", "6", "--compare", "--json", "--max-new-tokens", "4",
                        "--num-prompts", "1", "--repeat", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tree_nodes"] == 7 and result["rejection_tree_nodes"] == 7  # the same size, another tree
    with pytest.raises(SystemExit) as exc:
        decode.main(["--ckpt", ckpt, "--tree", "0"])
    assert exc.value.code == 2 and "between 1 and 256" in capsys.readouterr().err


def test_first_prompt_selects_which_stored_prompt_is_used(tmp_path, capsys):
    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    assert decode.main(["--ckpt", ckpt, "--json", "--first-prompt", "2", "--num-prompts", "1",
                        "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt"] == PROMPTS[2]
    with pytest.raises(SystemExit) as exc:
        decode.main(["--ckpt", ckpt, "--first-prompt", "9"])
    assert exc.value.code == 2 and "holds 3 prompts" in capsys.readouterr().err


# ---- reproducible by default ----------------------------------------------------------------


def test_decode_uses_the_stored_trees_and_never_measures_by_default(tmp_path, capsys, monkeypatch):
    from medusa_mini.tree import Tree
    from medusa_mini.tune import trees as trees_module
    from medusa_mini.tune.acceptance_tables import save_accuracy
    from medusa_mini.tune.trees import RuleTrees, default_tree_name, store_trees

    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    save_accuracy(ckpt, torch.tensor([[0.5] + [0.01] * 9] * 4, dtype=torch.float64))
    assert default_tree_name(torch.device("cpu"), ckpt) == "8"  # tables but no stored trees: N nodes
    stored = RuleTrees(Tree.from_choices([[0], [0, 0], [1]]), Tree.from_choices([[0], [1], [2]]))
    store_trees(ckpt, stored, device=torch.device("cpu"), note="test")
    assert default_tree_name(torch.device("cpu"), ckpt) == "stored"
    assert default_tree_name(torch.device("cuda"), ckpt) == "64"  # another device type keeps its own

    def measuring_is_not_allowed(*a, **k):
        raise AssertionError("the default decode must not measure step costs")

    monkeypatch.setattr(trees_module, "measure_verify_cost", measuring_is_not_allowed)
    assert decode.main(["--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "4",
                        "--num-prompts", "1", "--repeat", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tree_nodes"] == 4 and result["rejection_tree_nodes"] == 4  # the stored trees, root included


def _stored(ckpt, **entries):
    """Write trees.json by hand: key -> greedy choices (rejection gets the same tree)."""
    obj = {key: {"greedy": choices, "rejection": choices, "how": "test"} for key, choices in entries.items()}
    with open(os.path.join(ckpt, "trees.json"), "w") as f:
        json.dump(obj, f)


FP32 = [[0], [1]]  # 3 nodes with the root
BF16 = [[0], [0, 0], [0, 0, 0]]  # 4
COMPILED = [[0], [1], [2], [3]]  # 5


def test_stored_trees_are_taken_by_device_type_dtype_and_compile_else_the_closest_with_one_line(ckpt, tmp_path):
    d = str(tmp_path / "ck")
    shutil.copytree(ckpt, d)
    _stored(d, **{"cpu/float32/eager": FP32, "cpu/bfloat16/eager": BF16, "cpu/float32/compiled": COMPILED,
                  "cuda/float16/compiled": FP32})
    cpu = torch.device("cpu")

    def resolve(**how):
        lines = []
        trees = resolve_trees(None, num_heads=4, ckpt_dir=d, device=cpu, log=lines.append, **how)
        return trees.greedy.num_nodes, lines

    assert resolve() == (3, [])  # decode.py's defaults: float32, eager
    assert resolve(dtype=torch.bfloat16) == (4, [])
    assert resolve(compiled=True) == (5, [])
    nodes, lines = resolve(dtype=torch.float16)  # none: the same width comes first
    assert nodes == 4 and len(lines) == 1 and "\n" not in lines[0]
    assert "cpu/float16/eager" in lines[0] and "using those sized for cpu/bfloat16/eager" in lines[0]
    assert "--dtype float16" in lines[0]  # the command that sizes them
    nodes, lines = resolve(dtype=torch.bfloat16, compiled=True)  # the dtype first, then eager or compiled
    assert nodes == 4 and "cpu/bfloat16/eager" in lines[0] and "--compile" in lines[0]


def test_an_old_trees_file_keyed_by_device_type_reads_as_float32_eager(ckpt, tmp_path):
    from medusa_mini.tree import Tree
    from medusa_mini.tune.trees import RuleTrees, store_trees

    d = str(tmp_path / "ck")
    shutil.copytree(ckpt, d)
    _stored(d, cpu=BF16)  # what training wrote before trees.json said more than the device type
    lines = []
    trees = resolve_trees("stored", num_heads=4, ckpt_dir=d, device=torch.device("cpu"), log=lines.append)
    assert trees.greedy.num_nodes == 4 and lines == []
    resolve_trees(None, num_heads=4, ckpt_dir=d, device=torch.device("cpu"), dtype=torch.bfloat16, log=lines.append)
    assert len(lines) == 1 and "cpu/float32/eager" in lines[0]
    tree = Tree.from_choices(FP32)
    store_trees(d, RuleTrees(tree, tree), device=torch.device("cpu"), dtype=torch.bfloat16, note="test")
    with open(os.path.join(d, "trees.json")) as f:
        assert set(json.load(f)) == {"cpu/float32/eager", "cpu/bfloat16/eager"}  # the old key, in full


def test_decode_says_in_one_line_which_stored_trees_it_uses_for_another_setup(ckpt, tmp_path, capsys):
    d = str(tmp_path / "ck")
    shutil.copytree(ckpt, d)
    _stored(d, **{"cpu/float32/eager": BF16})
    argv = ["--ckpt", d, "--json", "--num-prompts", "1", "--max-new-tokens", "4"]
    assert decode.main(argv) == 0
    assert "tree:" not in capsys.readouterr().err  # sized for exactly this: nothing to say
    assert decode.main(argv + ["--dtype", "bfloat16"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tree:")]
    assert len(err) == 1 and "cpu/bfloat16/eager" in err[0] and "cpu/float32/eager" in err[0]
    _stored(d, **{"cuda/float32/eager": BF16})  # trees for another device type only: the default
    assert decode.main(argv + ["--compare", "--repeat", "1"]) == 0
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("tree:")]
    assert len(err) == 1 and "none sized for cpu" in err[0] and "the cpu preset" in err[0]
    assert json.loads(captured.out)["tree_nodes"] == 12  # the cpu preset: no heads_accuracy.json here


def test_two_runs_of_the_same_sampled_decode_print_the_same_tokens(tmp_path):
    from medusa_mini.io.loading import load_for_decoding
    from medusa_mini.tune.acceptance_tables import save_accuracy
    from medusa_mini.tune.trees import measure_and_store_trees

    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    save_accuracy(ckpt, torch.tensor([[0.6, 0.2] + [0.01] * 8] * 4, dtype=torch.float64))
    loaded = load_for_decoding(ckpt, device=torch.device("cpu"))
    measure_and_store_trees(ckpt, model=loaded.model, heads=loaded.heads, device=torch.device("cpu"))
    argv = [sys.executable, "decode.py", "--ckpt", ckpt, "--acceptance", "rejection", "--temperature", "0.8",
            "--seed", "3", "--max-new-tokens", "16", "--json", "--num-prompts", "2"]
    runs = [subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    tokens = [[row["tokens"] for row in json_lines(r.stdout)] for r in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2 and all(len(t) == 16 for t in tokens[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compare_in_half_precision_runs_every_row_and_reports_any_difference(ckpt, capsys, dtype):
    out = run(capsys, "--ckpt", ckpt, "--compare", "--json", "--dtype", dtype, "--max-new-tokens", "12",
              "--num-prompts", "3", "--repeat", "1")
    result = json.loads(out)
    assert result["dtype"] == dtype and len(result["rows"]) == 5
    for row in result["rows"]:
        assert all(len(t) == 12 for t in row["tokens"])
        if row["temperature"] == 0:  # equal, or each difference located
            assert row["same_as_plain_greedy"] == (not row["differences"])
            assert all(0 <= d["position"] < 12 and d["margin"] >= 0 for d in row["differences"])
