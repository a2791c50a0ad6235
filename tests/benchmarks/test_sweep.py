"""benchmarks/sweep.py: per rule, drafter, draft vocabulary and node budget, tokens/step and tokens/s against
plain decoding of the same rule."""

import json
import shutil

import pytest

import decode
from benchmarks import sweep
from conftest import save_small_checkpoint, save_tiny
from medusa_mini.cli import measure, plots
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
    assert [(r["rule"], r["nodes"]) for r in rows] == [(rule, n) for rule in sweep.RULES for n in (2, 4)]
    assert sorted(result["plain"]) == ["plain greedy", "plain sampling (T=0.8)"]
    assert result["plain"]["plain greedy"]["tokens_per_step"] == 1.0
    for r in rows:
        assert r["temperature"] == (0 if r["rule"].endswith("greedy") else 0.8) and r["new_tokens"] == 16
        assert 1 <= r["tokens_per_step"] <= r["verified_nodes"] + 1 and 1 <= r["verified_nodes"] <= r["nodes"]
    for r in (r for r in rows if r["temperature"] == 0):  # lossless: heads and prompt lookup alike
        assert r["same_as_plain_greedy"] == 2
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


def test_each_draft_vocabulary_gets_its_rows_and_greedy_stays_lossless(medusa_ckpt, capsys):
    result = run_json(medusa_ckpt, capsys, "--rules", "greedy,rejection-drawn", "--draft-vocab", "300,20")
    assert [(r["rule"], r["draft_vocab"], r["nodes"]) for r in result["rows"]] == [
        (rule, m, n) for rule in ("greedy", "rejection-drawn") for m in (20, 300) for n in (2, 4)]
    assert all(r["same_as_plain_greedy"] == 2 for r in result["rows"] if r["rule"] == "greedy")
    assert {r["draft_vocab"] for r in run_json(medusa_ckpt, capsys, "--rules", "greedy")["rows"]} == {300}


def test_the_table_and_the_plot_give_each_rule_and_draft_vocabulary_its_block_and_series(
        medusa_ckpt, capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")  # the figure itself: tests/cli/test_plots.py
    drawn = []
    monkeypatch.setattr(sweep, "plot_node_sweep", lambda series, path, **kw: drawn.append((series, kw)) or
                        plots.plot_node_sweep(series, path, **kw))
    png = tmp_path / "sweep.png"
    result = run_json(medusa_ckpt, capsys, "--rules", "greedy,lookup-greedy", "--budgets", "1,2", "--plot", str(png))
    lines = sweep.format_sweep(result).splitlines()
    heads, lookup = (lines.index(ln) for ln in lines if ln.startswith(("greedy, draft", "lookup-greedy")))
    plain = result["plain"]["plain greedy"]["tokens_per_s"]
    assert lines[heads] == f"greedy, draft vocabulary 300: plain greedy {plain:.1f} tokens/s"
    assert lines[heads + 2].split()[::6] == ["1", "2/2"] and lines[lookup + 2].split()[::5] == ["1", "2/2"]
    (series, kw), = drawn
    assert [name for name, _ in series] == ["greedy, draft vocabulary 300", "lookup-greedy"]
    assert [[r["nodes"] for r in rows] for _, rows in series] == [[1, 2], [1, 2]] and png.stat().st_size > 0
    assert kw["plain_tokens_per_s"] == {"plain greedy": plain}


@pytest.mark.parametrize("flags, message", [
    (["--budgets", "0,4"], "--budgets"), (["--budgets", "two"], "--budgets"), (["--rules", "dynamic"], "--rules"),
    (["--repeat", "0"], "--repeat"), (["--temperature", "0"], "--temperature"),
    (["--num-prompts", "0"], "--num-prompts"), (["--plot", "/no/such/folder/s.png"], "--plot"),
    (["--max-new-tokens", "64"], "no room for a prompt"), (["--draft-vocab", "4000"], "--draft-vocab"),
    (["--draft-vocab", "1", "--max-new-tokens", "8"], "--draft-vocab 1: the trees of --budgets"),  # fewer tokens than the tree's ranks
    (["--temperature", "inf"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--rules", "greedy", "--temperature", "-1"], "--temperature"), (["--seed", "99999999999999999999"], "--seed"),
    # a plot path savefig would not write as named: refused before decoding, not after
    (["--plot", ""], "--plot needs a file name"), (["--plot", "{tmp}"], "is a folder"),
    (["--plot", "{tmp}/s.txt"], "end the name in .png"), (["--plot", "{tmp}/s"], "end the name in .png"),
])
def test_bad_flags_exit_2_with_one_line_before_decoding(medusa_ckpt, capsys, monkeypatch, tmp_path, flags, message):
    monkeypatch.setattr(sweep, "run_in_turns", lambda *a, **k: pytest.fail("decoded despite a bad flag"))
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", medusa_ckpt, "--device", "cpu", *(f.format(tmp=tmp_path) for f in flags)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("measured, message", [(False, "medusa_mini.cli.measure"), (True, "train the heads")])
def test_a_missing_table_says_to_measure_it_and_heads_never_right_to_train_them(tmp_path, capsys, measured, message):
    save_tiny(tmp_path, with_heads=True)  # random heads: their top guesses miss on every continuation
    if measured:
        measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8"])
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", str(tmp_path), *FAST])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "0"], "--prompts must be at least 1"), (["--top-k", "0"], "--top-k must be at least 1"),
    (["--max-new-tokens", "2"], "--max-new-tokens must be at least 3"),
    (["--temperature", "nan"], "--temperature must be"), (["--temperature", "inf"], "--temperature must be"),
    (["--seed", "99999999999999999999"], "--seed"), (["--seed", "-1"], "--seed"),
])
def test_measure_names_the_bad_flag_before_it_replaces_the_table_sweep_reads(medusa_ckpt, tmp_path, capsys, flags,
                                                                             message):
    ckpt = shutil.copytree(medusa_ckpt, tmp_path / "ckpt")
    table = (ckpt / "heads_accuracy.json").read_text()
    with pytest.raises(SystemExit) as exc:
        measure.main(["--ckpt", str(ckpt), "--prompts", "4", "--max-new-tokens", "8", "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("python -m medusa_mini.cli.measure: error: ") and message in err
    assert err.count("\n") == 1 and (ckpt / "heads_accuracy.json").read_text() == table


@pytest.mark.parametrize("command, hint", [
    (lambda d: measure.main(["--ckpt", d, "--max-new-tokens", "8", "--device", "cpu"]), "train_tiny.py writes it"),
    (lambda d: sweep.main(["--ckpt", d, *FAST]), "train_tiny.py writes it"),
    (lambda d: decode.main(["--ckpt", d, "--max-new-tokens", "4", "--device", "cpu"]), "--prompt TEXT"),
], ids=["measure", "sweep", "decode"])
def test_a_missing_prompts_json_says_how_to_give_prompts_the_way_each_command_takes_them(
        medusa_ckpt, tmp_path, capsys, command, hint):
    ckpt = shutil.copytree(medusa_ckpt, tmp_path / "ckpt")
    (ckpt / "prompts.json").unlink()
    with pytest.raises(SystemExit) as exc:
        command(str(ckpt))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "prompts.json is missing" in err and hint in err
    assert ("--prompt" in err) == (hint == "--prompt TEXT")  # only decode.py has --prompt
