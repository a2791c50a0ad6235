"""cli/measure.py: `python -m medusa_mini.cli.measure` measures heads_accuracy.json, and `--tree` is a preset,
a node budget N built from it, or a JSON file of choices; else the device's default. The drawings: explain.py."""

import json

import pytest

from conftest import DRAWN, VICUNA, refused, save_small_checkpoint
from medusa_mini.cli import measure
from medusa_mini.cli.explain import draw_mask, draw_tree
from medusa_mini.cli.measure import CPU_MIN_GAIN, resolve_tree
from medusa_mini.train.accuracy import load_accuracy, save_accuracy
from medusa_mini.tree import Tree, build_tree, chain, preset


def resolve(spec, ckpt_dir, *, device="cpu", num_heads=4, drawn=False):
    return resolve_tree(spec, ckpt_dir=str(ckpt_dir), device=device, num_heads=num_heads, drawn=drawn)


def test_a_budget_builds_the_best_tree_from_its_rules_table_else_the_device_picks_it(tmp_path, monkeypatch):
    """A drawn candidate passes far less often than a top-1 guess: its tree, from its own table, spends a budget
    on more tries at the root before depth; a table measured before drawn candidates had theirs: greedy's. A model
    without a folder (--explain --demo's) never reads the working directory's table: another model's."""
    assert resolve(None, tmp_path) == (preset("cpu"), "cpu", preset("cpu").num_nodes - 1)  # no accuracies yet
    assert resolve(None, tmp_path, device="cuda") == (preset("gpu"), "gpu", preset("gpu").num_nodes - 1)
    assert resolve(None, tmp_path, num_heads=2).tree == preset("cpu").truncated(2)  # fewer heads: the preset cut
    save_accuracy(tmp_path, VICUNA)
    acc = load_accuracy(tmp_path)  # as stored: rounded, which may break the table's ties otherwise
    assert resolve("8", tmp_path) == resolve("8", tmp_path, drawn=True) == (build_tree(acc, 8)[0], "8", 8)
    assert resolve("64", tmp_path, num_heads=2)[0] == build_tree(acc[:2], 64)[0]  # all 64 on the heads loaded
    assert resolve("1", tmp_path) == (build_tree(acc, 1)[0], "1", 1)  # the smallest budget: one node
    cpu_tree, name, _ = resolve(None, tmp_path)  # on a CPU, at most 8 nodes, each worth its time
    assert (cpu_tree, name) == (build_tree(acc, 8, min_gain=CPU_MIN_GAIN)[0], "auto") == resolve("auto", tmp_path)[:2]
    assert resolve(None, tmp_path, device="cuda:0") == (build_tree(acc, 64)[0], "auto", 64)
    save_accuracy(tmp_path, VICUNA, drawn=DRAWN)
    drawn = load_accuracy(tmp_path, drawn=True)
    assert resolve("8", tmp_path, drawn=True) == (build_tree(drawn, 8)[0], "8", 8) != resolve("8", tmp_path)
    on_cpu = resolve("auto", tmp_path, drawn=True).tree
    assert on_cpu == build_tree(drawn, 8, min_gain=CPU_MIN_GAIN)[0] and on_cpu.choices == ((0,), (1,), (0, 0))
    # a preset names its tree, its size the budget: a tree given whole is no budget, for either table
    assert resolve("chain3", tmp_path) == resolve("chain3", tmp_path, drawn=True) == (chain(3), "chain3", 3)
    monkeypatch.chdir(tmp_path)
    assert resolve(None, "") == (preset("cpu"), "cpu", preset("cpu").num_nodes - 1)
    pytest.raises(ValueError, resolve, "auto", "").match(r"^--tree auto needs heads accuracies: .*\(--demo\) has none")


@pytest.mark.parametrize("content", [[[0], [1], [0, 0]], {"choices": [[0], [1], [0, 0]]}], ids=["list", "object"])
def test_a_json_file_of_choices_is_a_tree(tmp_path, monkeypatch, content):  # or inline
    (tmp_path / "mine.json").write_text(json.dumps(content))
    want = Tree.from_choices([(0,), (1,), (0, 0)])
    assert resolve(str(tmp_path / "mine.json"), tmp_path / "elsewhere") == (want, "mine.json", 3)
    monkeypatch.chdir(tmp_path.parent)  # a relative name: the working directory, then the checkpoint
    assert resolve("mine.json", tmp_path) == (want, "mine.json", 3)
    (here := tmp_path / "here").mkdir()  # one in the working directory too: it comes first
    (here / "mine.json").write_text("[[0]]")
    monkeypatch.chdir(here)
    assert resolve("mine.json", tmp_path).tree == Tree.from_choices([(0,)])
    assert resolve(json.dumps(content), tmp_path) == (want, "inline", 3)


@pytest.mark.parametrize("spec, content, message", [  # content: of the file named spec
    ("huge", None, "unknown --tree 'huge'"), ("chain0", None, "unknown --tree"), ("0", None, "between 1 and 256"),
    ("chain257", None, "N from 1 to 256"), ("/", None, "file / is a folder"), ("/dev/null", None, "null is no file"),
    ("[[0], [1", None, "not JSON"), ("[[0], [1, 0]]", None, "has no parent"), ("[]", None, "has no choices"),
    ("300", None, "between 1 and 256"), ("8", None, "medusa_mini.cli.measure --ckpt"), ("auto", None, "measure"),
    ("gone.json", None, "does not exist"), ("chain3", None, "^--tree chain3 has depth 3 but the checkpoint has 2"),
    ("t.json", "[[0], [1", "not readable JSON"), ("t.json", '{"nodes": [[0]]}', "list of choices"),
    ("t.json", "[[0], [0, 0], [0, 0, 0]]", "depth 3 but there are only 2 heads"), ("²", None, "unknown --tree"),
    pytest.param("[" * 5000, None, "JSON", id="deep"), pytest.param("t.json", "[" * 5000, "JSON", id="deep-file")])
def test_bad_trees_are_one_line_errors(tmp_path, spec, content, message):
    if content is not None:
        (tmp_path / spec).write_text(content)
    error = pytest.raises(ValueError, resolve, spec, tmp_path, num_heads=2)
    assert error.match(message) and "\n" not in str(error.value)


def test_measure_saves_both_tables_and_prints_their_trees_estimates_and_the_sampled_rates(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    argv = ["--ckpt", str(tmp_path), "--num-prompts", "3", "--max-new-tokens", "8", "--temperature", "0.5"]
    assert measure.main(argv + ["--marginal", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    acc, drawn = load_accuracy(tmp_path), load_accuracy(tmp_path, drawn=True)  # rejection sampling's too
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert acc.shape == drawn.shape == (3, 10) and not drawn.equal(acc) and "top-1" in lines[2]
    assert (saved["num_prompts"], saved["max_new_tokens"], saved["top_k"]) == (3, 8, 10)
    for table in (acc, drawn):  # the estimates printed are build_tree's own, each table's
        assert any(line.endswith("  ".join(f"{n} nodes: {build_tree(table, n)[1]:.2f}" for n in (8, 16, 32, 64)))
                   for line in lines)
    sampled = next(line for line in lines if line.startswith("rejection sampling at T=0.5"))
    rates = [float(v) for v in sampled.split("=")[-1].split()]  # one per head
    assert len(rates) == 3 and all(0 <= v <= 1 for v in rates)
    assert lines[-1].startswith("head 1 with q = the exact marginal over the root") and "Σ min(p, q) = 0." in lines[-1]
    measure.main(argv + ["--seed", "4", "--num-prompts", "9", "--top-k", "301"])  # more than there are: a note each
    assert sampled not in (o := capsys.readouterr()).out and "9: prompts.json gives 4;" in o.err and "301: the" in o.err
    assert measure.main(argv[:2] + ["--max-new-tokens", "8"]) == 0 and not capsys.readouterr().err  # all: no note
    for n in ("3", "0"):  # the third head would have none to guess: the least that works, named at once
        assert f"--max-new-tokens {n}: give at least 4" in refused(capsys, measure.main, [*argv, "--max-new-tokens", n])
    (table := tmp_path / "heads_accuracy.json").unlink()
    table.mkdir()  # a folder where the table goes: refused before measuring, not at the final write
    assert "heads_accuracy.json is a folder where a file goes" in refused(capsys, measure.main, argv)


def test_the_drawings_show_every_node_and_every_mask_entry():
    TREE = Tree.from_choices([(1,), (0, 0, 0), (0,), (0, 1), (0, 0)])  # [0] root, [1] (0,), [2] (1,), ...
    drawing = draw_tree(TREE, labels=["'a'", "'b'", "'c'", "'d'", "'e'", "'f'"])
    assert drawing.splitlines()[:2] == ["[0] root 'a'", "├─ [1] head 1 rank 0 'b'"]
    assert "[5] head 3 rank 0 'f'" in drawing and len(drawing.splitlines()) == 6
    assert [row.split()[1:].count("■") for row in draw_mask(TREE).splitlines()[1:]] == [1, 2, 2, 3, 3, 4]  # paths
