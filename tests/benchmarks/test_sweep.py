"""benchmarks/sweep.py: per rule, drafter, draft vocabulary and node budget, tokens/step and tokens/s against
plain decoding of the same rule."""

import json
import os
import shlex
import shutil

import pytest

import decode
from benchmarks import sweep
from conftest import save_small_checkpoint, save_tiny
from medusa_mini.cli import measure
from medusa_mini.train.accuracy import load_accuracy, save_accuracy
from medusa_mini.tree import build_tree, expected_tokens_per_step

FAST = ["--budgets", "2,4", "--max-new-tokens", "8", "--repeat", "1", "--num-prompts", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def medusa_ckpt(tmp_path_factory):
    """save_small_checkpoint and its heads_accuracy.json. Its Medusa heads start as the identity, so they
    guess the backbone's next token: right wherever its text repeats."""
    directory = tmp_path_factory.mktemp("medusa")
    save_small_checkpoint(directory)
    measure.main(["--ckpt", str(directory), "--prompts", "4", "--max-new-tokens", "8"])
    return str(directory)


def run_json(ckpt: str, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert sweep.main(["--ckpt", ckpt, *FAST, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_rule_and_budget_is_a_row_against_the_plain_decoder_of_its_temperature(medusa_ckpt, capsys):
    result = run_json(medusa_ckpt, capsys, "--rules", ",".join(sweep.RULES))
    rows, acc = result["rows"], load_accuracy(medusa_ckpt)
    assert [(r["rule"], r["nodes"], r["draft_vocab"]) for r in rows] == [  # the checkpoint's draft vocabulary
        (rule, n, None if rule.startswith("lookup") else 300) for rule in sweep.RULES for n in (2, 4)]
    assert sorted(result["plain"]) == ["plain greedy", "plain sampling (T=0.8)"]
    assert result["plain"]["plain greedy"]["tokens_per_step"] == 1.0
    for r in rows:
        assert r["temperature"] == (0 if r["rule"].endswith("greedy") else 0.8) and r["new_tokens"] == 16
        assert 1 <= r["tokens_per_step"] <= r["verified_nodes"] + 1 and 1 <= r["verified_nodes"] <= r["nodes"]
    for r in (r for r in rows if r["temperature"] == 0):  # lossless: heads and prompt lookup alike
        assert r["same_as_plain_greedy"] is True
    plain = {p["temperature"]: p["tokens_per_s"] for p in result["plain"].values()}
    assert len(set(plain.values())) == 2  # two baselines, and each row is set against its own
    assert all(r["speedup"] == pytest.approx(r["tokens_per_s"] / plain[r["temperature"]]) for r in rows)
    drawn = load_accuracy(medusa_ckpt, drawn=True)  # the drawn candidates' own table builds their trees
    for r in rows:  # the product rule's estimate beside the heads' greedy and drawn rows only
        table = drawn if r["rule"] == "rejection-drawn" else acc
        tree = build_tree(table, r["nodes"])[0]
        assert r["expected_tokens_per_step"] == (pytest.approx(expected_tokens_per_step(table, tree))
                                                 if r["rule"] in ("greedy", "rejection-drawn") else None)
        if not r["rule"].startswith("lookup"):
            assert r["verified_nodes"] == tree.num_nodes - 1


def test_a_table_without_drawn_candidates_builds_their_trees_from_greedys_and_predicts_nothing(medusa_ckpt, capsys,
                                                                                               tmp_path):
    """A heads_accuracy.json measured before the drawn table existed: greedy's builds the trees, and no
    estimate is printed for the drawn rows, which greedy's table does not describe."""
    old = tmp_path / "old"
    shutil.copytree(medusa_ckpt, old)
    save_accuracy(old, load_accuracy(old))  # greedy's table alone
    rows = run_json(str(old), capsys, "--rules", "rejection-drawn")["rows"]
    acc = load_accuracy(old)
    assert [r["verified_nodes"] for r in rows] == [build_tree(acc, n)[0].num_nodes - 1 for n in (2, 4)]
    assert all(r["expected_tokens_per_step"] is None for r in rows)


def test_each_rule_and_draft_vocabulary_gets_its_rows_block_and_series_and_greedy_stays_lossless(
        medusa_ckpt, capsys, tmp_path):
    pytest.importorskip("matplotlib")  # the figure itself: tests/cli/test_plots.py
    png = tmp_path / "sweep.png"
    result = run_json(medusa_ckpt, capsys, "--rules", "greedy,lookup-greedy", "--budgets", "1,2", "--draft-vocab",
                      "300,20", "--plot", str(png))
    assert [(r["rule"], r["draft_vocab"], r["nodes"]) for r in result["rows"]] == [
        ("greedy", m, n) for m in (20, 300) for n in (1, 2)] + [("lookup-greedy", None, n) for n in (1, 2)]
    assert all(r["same_as_plain_greedy"] is True for r in result["rows"])
    lines = sweep.format_sweep(result).splitlines()
    names = ["greedy, draft vocabulary 20", "greedy, draft vocabulary 300", "lookup-greedy"]
    plain = result["plain"]["plain greedy"]["tokens_per_s"]
    blocks = [lines.index(f"{name}: plain greedy {plain:.1f} tokens/s") for name in names]
    # a line per budget, ending in the prompts that made plain greedy's tokens
    assert [(lines[i + 2].split()[0], lines[i + 3].split()[-1]) for i in blocks] == [("1", "2/2")] * 3
    assert [(name, [r["nodes"] for r in rows]) for name, _, rows in sweep.series(result)] == [
        (name, [1, 2]) for name in names] and png.stat().st_size > 0


@pytest.mark.parametrize("measured, message", [(False, "medusa_mini.cli.measure"), (True, "train the heads")])
def test_a_missing_table_says_to_measure_it_and_heads_never_right_to_train_them(tmp_path, capsys, measured, message):
    save_tiny(tmp_path, with_heads=True)  # random heads: their top guesses miss on every continuation
    if measured:
        measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8"])
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", str(tmp_path), *FAST])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


MAINS = {"sweep": (sweep.main, FAST), "measure": (measure.main, ["--prompts", "4", "--max-new-tokens", "8"]),
         "decode": (decode.main, ["--max-new-tokens", "4", "--device", "cpu"])}


@pytest.mark.parametrize("script, case", [  # the error names what follows "->", else the first flag given
    *(("sweep", case) for case in (
        "--budgets 0,4", "--budgets two", "--rules dynamic", "--repeat 0", "--temperature 0", "--num-prompts 0",
        "--max-new-tokens 64", "--draft-vocab 4000", "--draft-vocab 1 --max-new-tokens 8",  # below the trees' ranks
        "--temperature inf", "--temperature nan", "--rules greedy --temperature -1 -> --temperature",
        "--seed 99999999999999999999", "--plot {tmp}/no/s.png", "--plot ''", "--plot {tmp}", "--plot {tmp}/s.txt",
        "--plot {tmp}/s")),  # a path savefig would not write as named: refused before decoding, not after
    *(("measure", case) for case in ("--prompts 0", "--top-k 0", "--max-new-tokens 2", "--temperature 0",
                                     "--temperature nan", "--temperature inf", "--seed 99999999999999999999",
                                     "--seed -1", "--ckpt {tmp}/missing -> missing")),
    # without prompts.json, each says how to give prompts as it takes them
    ("sweep", "--ckpt {tmp}/bare -> train_tiny.py writes it"), ("measure", "--ckpt {tmp}/bare -> train_tiny.py "
     "writes it"), ("decode", "--ckpt {tmp}/bare -> --prompt TEXT"),
])
def test_bad_input_exits_2_with_one_line_before_anything_is_decoded_or_replaced(medusa_ckpt, capsys, monkeypatch,
                                                                                 tmp_path, script, case):
    ckpt, bare = shutil.copytree(medusa_ckpt, tmp_path / "ckpt"), shutil.copytree(medusa_ckpt, tmp_path / "bare")
    (bare / "prompts.json").unlink()
    table = (ckpt / "heads_accuracy.json").read_text()  # what measure would replace
    monkeypatch.setattr(sweep, "compare", lambda *a, **k: pytest.fail("decoded despite bad input"))
    main, base = MAINS[script]
    args, _, needle = case.partition(" -> ")
    with pytest.raises(SystemExit) as exc:
        main(["--ckpt", str(ckpt), *base, *shlex.split(args.format(tmp=tmp_path))])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and (needle or args.split()[0]) in err, err
    assert (ckpt / "heads_accuracy.json").read_text() == table and sorted(os.listdir(tmp_path)) == ["bare", "ckpt"]
