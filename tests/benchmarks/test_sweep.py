"""benchmarks/sweep.py: per rule, drafter, draft vocabulary and node budget, tokens/step and tokens/s against
plain decoding of the same rule."""

import dataclasses
import json
import os
import shlex
import shutil

import pytest
import torch

import decode
from benchmarks import sweep
from conftest import refused, save_small_checkpoint
from medusa_mini.cli import measure
from medusa_mini.heads import make_heads
from medusa_mini.train.accuracy import load_accuracy, save_accuracy
from medusa_mini.tree import build_tree, expected_tokens_per_step

FAST = ["--budgets", "2,4", "--max-new-tokens", "8", "--repeat", "1", "--num-prompts", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def medusa_ckpt(tmp_path_factory):
    """save_small_checkpoint and its heads_accuracy.json. Its Medusa heads start as the identity, so they
    guess the backbone's next token: right wherever its text repeats."""
    save_small_checkpoint(directory := tmp_path_factory.mktemp("medusa"))
    measure.main(["--ckpt", str(directory), "--num-prompts", "4", "--max-new-tokens", "8"])
    return str(directory)


def run_json(ckpt: str, capsys, *extra: str) -> dict:
    assert sweep.main(["--ckpt", ckpt, *FAST, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_rule_and_budget_is_a_row_against_the_plain_decoder_of_its_temperature(medusa_ckpt, capsys, monkeypatch):
    result = run_json(medusa_ckpt, capsys, "--rules", ",".join(sweep.RULES) + ",greedy")  # a name twice: once
    rows, acc, drawn = result["rows"], load_accuracy(medusa_ckpt), load_accuracy(medusa_ckpt, drawn=True)
    assert [(r["rule"], r["nodes"], r["draft_vocab"]) for r in rows] == [  # the checkpoint's draft vocabulary
        (rule, n, None if rule.startswith("lookup") else 300) for rule in sweep.RULES for n in (2, 4)]
    plain = {p["temperature"]: p for p in result["plain"].values()}
    assert sorted(result["plain"]) == ["plain greedy", "plain sampling (T=0.8)"] and plain[0]["tokens_per_step"] == 1
    for r in rows:
        assert r["temperature"] == (0 if r["rule"].endswith("greedy") else 0.8) and r["new_tokens"] == 16
        assert r["same_as_plain_greedy"] is (True if r["temperature"] == 0 else None)  # lossless, lookup too
        assert 1 <= r["tokens_per_step"] <= r["verified_nodes"] + 1 and 1 <= r["verified_nodes"] <= r["nodes"]
        table = drawn if r["rule"] == "rejection-drawn" else acc  # the drawn candidates' own table builds theirs
        tree = build_tree(table, r["nodes"])[0]
        assert r["expected_tokens_per_step"] == (pytest.approx(expected_tokens_per_step(table, tree))
                                                 if r["rule"] in ("greedy", "rejection-drawn") else None)
        assert r["verified_nodes"] == (r["nodes"] if r["rule"].startswith("lookup") else tree.num_nodes - 1)  # chain
        assert sweep.expected_tokens_per_s(r, r["tokens_per_step"]) == pytest.approx(r["tokens_per_s"])  # the plot's
        assert sweep.expected_tokens_per_s(r, r["tokens_per_step"] + 1) == pytest.approx(  # a token more a step
            (r["new_tokens"] + r["steps"]) / r["seconds"])
    eot, real = plain[0]["tokens"][0][1], sweep.load_for_decoding  # an end token the rows make: decoded past
    monkeypatch.setattr(sweep, "load_for_decoding", lambda *a, **kw: dataclasses.replace(real(*a, **kw), eot_id=eot))
    assert {r["new_tokens"] for r in run_json(medusa_ckpt, capsys, "--rules", "greedy")["rows"]} == {16}


def test_heads_rows_are_named_by_the_heads_kind(medusa_ckpt, capsys, monkeypatch):
    def with_hydra_heads(*args, **kwargs):  # the checkpoint, Hydra heads of its own size in place of its Medusa heads
        ck = decode.load_for_decoding(*args, **kwargs)
        return dataclasses.replace(ck, heads=make_heads(dataclasses.replace(ck.heads.config, kind="hydra")))
    for heads, loader in (("Medusa", decode.load_for_decoding), ("Hydra", with_hydra_heads)):
        monkeypatch.setattr(sweep, "load_for_decoding", loader)
        rows = run_json(medusa_ckpt, capsys, "--rules", "greedy,lookup-greedy", "--budgets", "2")["rows"]
        assert [r["method"] for r in rows] == [f"{heads} M300 greedy 2 greedy", "prompt lookup lookup-greedy 2 greedy"]


def test_prompt_lookup_needs_neither_heads_nor_their_table(medusa_ckpt, capsys, tmp_path):
    bare = shutil.copytree(medusa_ckpt, tmp_path / "bare", ignore=shutil.ignore_patterns("medusa_*", "heads_*"))
    rows = run_json(str(bare), capsys, "--rules", "lookup-greedy", "--draft-vocab", "20")["rows"]
    assert [(r["method"], r["draft_vocab"], r["same_as_plain_greedy"]) for r in rows] == [  # budgets 2 and 4
        ("prompt lookup lookup-greedy 2 greedy", None, True), ("prompt lookup lookup-greedy 4 greedy", None, True)]


def test_each_rule_and_draft_vocabulary_gets_its_block_and_an_old_table_stands_in(medusa_ckpt, capsys, tmp_path):
    """Before the drawn table existed, heads_accuracy.json held greedy's alone: it builds the drawn candidates'
    trees, and no estimate is given for their rows, which it does not describe."""
    pytest.importorskip("matplotlib")  # the figure itself: tests/cli/test_plots.py
    old, png = shutil.copytree(medusa_ckpt, tmp_path / "old"), tmp_path / "sweep.png"
    save_accuracy(old, acc := load_accuracy(old)[:1, :1])  # greedy's table alone, of one node: lookup's chain is n
    result = run_json(str(old), capsys, "--rules", "greedy,rejection-drawn,lookup-greedy", "--budgets", "1,2",
                      "--draft-vocab", "300,20", "--plot", str(png))
    series = [(rule, m) for rule in ("greedy", "rejection-drawn") for m in (20, 300)] + [("lookup-greedy", None)]
    assert [(r["rule"], r["draft_vocab"], r["nodes"]) for r in result["rows"]] == [
        (rule, m, n) for rule, m in series for n in (1, 2)]
    drawn = [r for r in result["rows"] if r["rule"] == "rejection-drawn"]
    assert [r["verified_nodes"] for r in drawn] == [build_tree(acc, n)[0].num_nodes - 1 for n in (1, 2)] * 2
    assert all(r["expected_tokens_per_step"] is None for r in drawn) and png.stat().st_size > 0
    assert [r["verified_nodes"] for r in result["rows"] if r["rule"] == "lookup-greedy"] == [1, 2]
    names = [f"{rule}, draft vocabulary {m}" for rule in ("greedy", "rejection-drawn (T=0.8)") for m in (20, 300)]
    assert [(name, [r["nodes"] for r in rows]) for name, _, rows in sweep.series(result)] == [
        (name, [1, 2]) for name in names + ["lookup-greedy"]]
    lines = sweep.format_sweep(result).splitlines()
    for name, plain, rows in sweep.series(result):  # a line per budget, a greedy one ending in plain greedy's prompts
        i = lines.index(f"{name}: {plain['method']} {plain['tokens_per_s']:.1f} tokens/s")
        assert lines[i + 2].split()[0] == "1" and lines[i + 3].endswith("  2/2") == (plain["temperature"] == 0)
        greedy = int(plain["temperature"] == 0)  # each budget's measured columns, from its own row
        for cells, r in zip(map(str.split, lines[i + 2 :]), rows):
            assert cells[len(cells) - 4 - greedy : len(cells) - greedy] == [f"{r['tokens_per_step']:.2f}",
                f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x"]


@pytest.mark.parametrize("script, case", [  # the error names what follows "->", else the first flag given
    *(("sweep", case) for case in (
        "--budgets 0,4", "--budgets two", "--rules dynamic", "--repeat 0", "--temperature 0", "--num-prompts 0",
        "--max-new-tokens 64", "--max-new-tokens 1", "--draft-vocab 4000", "--temperature 1e39", "--temperature nan",
        "--seed 99999999999999999999", "--plot ''", "--draft-vocab 1 --max-new-tokens 8",  # draft 1 < ranks
        "--ckpt {tmp}/unmeasured -> medusa_mini.cli.measure", "--ckpt {tmp}/never_right -> train the heads",
        "--ckpt {tmp}/headless -> or sweep lookup-greedy")),
    *(("measure", case) for case in ("--num-prompts 0", "--top-k 0", "--max-new-tokens 2", "--temperature 0",
                                     "--seed -1", "--ckpt {tmp}/missing -> missing")),  # sweep's types, above
    # without prompts.json, each says how to give prompts as it takes them
    *((script, "--ckpt {tmp}/bare -> train_tiny.py writes it") for script in ("sweep", "measure")),
    ("decode", "--ckpt {tmp}/bare -> --prompt TEXT")])
def test_bad_input_is_one_line_before_any_decoding_or_write(medusa_ckpt, capsys, monkeypatch, tmp_path, script, case):
    copies = {n: shutil.copytree(medusa_ckpt, tmp_path / n, ignore=shutil.ignore_patterns(*gone)) for n, gone in (
        ("ckpt", []), ("bare", ["prompts.json"]), ("unmeasured", ["heads_accuracy.json"]), ("never_right", []),
        ("headless", ["medusa_*"]))}
    save_accuracy(copies["never_right"], torch.zeros(3, 10))  # no head's guess ever right: every tree the root
    table = (copies["ckpt"] / "heads_accuracy.json").read_text()  # what measure would replace
    monkeypatch.setattr(sweep, "compare", lambda *a, **k: pytest.fail("decoded despite bad input"))
    main, base = {"sweep": (sweep.main, FAST), "decode": (decode.main, ["--max-new-tokens", "4", "--device", "cpu"]),
                  "measure": (measure.main, ["--num-prompts", "4", "--max-new-tokens", "8"])}[script]
    args, _, needle = case.partition(" -> ")
    err = refused(capsys, main, ["--ckpt", str(copies["ckpt"]), *base, *shlex.split(args.format(tmp=tmp_path))])
    assert (needle or args.split()[0]) in err, err
    assert (copies["ckpt"] / "heads_accuracy.json").read_text() == table and set(os.listdir(tmp_path)) == set(copies)
