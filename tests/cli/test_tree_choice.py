"""`--tree` (cli/trees.py): a preset, a node budget N built from heads_accuracy.json (which `python -m
medusa_mini.cli.measure` measures), or a JSON file of choices; else the device's default."""

import json

import pytest
import torch

from conftest import save_small_checkpoint
from medusa_mini.cli import measure
from medusa_mini.cli.trees import CPU_MIN_GAIN, draw_mask, draw_tree, resolve_tree
from medusa_mini.train.accuracy import load_accuracy, save_accuracy
from medusa_mini.tree import Tree, build_tree, chain, preset

VICUNA = torch.tensor([[a * 0.45**r for r in range(10)] for a in (0.56, 0.32, 0.20, 0.15)])


def resolve(spec, ckpt_dir, *, device="cpu", num_heads=4, drawn=False):
    return resolve_tree(spec, ckpt_dir=str(ckpt_dir), device=device, num_heads=num_heads, drawn=drawn)


def test_a_node_budget_builds_the_best_tree_of_that_size_cut_to_the_heads_loaded(tmp_path):
    save_accuracy(tmp_path, VICUNA)
    assert resolve("8", tmp_path) == (build_tree(VICUNA, 8)[0], "8", 8)
    assert resolve("64", tmp_path, num_heads=2)[0] == build_tree(VICUNA, 64)[0].truncated(2)
    assert resolve("chain3", tmp_path) == (chain(3), "chain3", 3)  # a preset names its tree, its size the budget


def test_without_a_tree_the_device_picks_the_budget_or_without_accuracies_its_preset(tmp_path):
    assert resolve(None, tmp_path) == (preset("cpu"), "cpu", preset("cpu").num_nodes - 1)
    assert resolve(None, tmp_path, device="cuda") == (preset("gpu"), "gpu", preset("gpu").num_nodes - 1)
    save_accuracy(tmp_path, VICUNA)
    acc = load_accuracy(tmp_path)  # as stored: rounded, which may break the table's ties otherwise
    cpu_tree, name, budget = resolve(None, tmp_path)  # on a CPU, at most 8 nodes, each worth its time
    assert (cpu_tree, name) == (build_tree(acc, 8, min_gain=CPU_MIN_GAIN)[0], "auto")
    assert resolve("auto", tmp_path) == (cpu_tree, name, budget)
    assert cpu_tree.num_nodes - 1 == 6 and cpu_tree == build_tree(acc, 6)[0]
    assert budget == 8  # prompt lookup's chain: it verifies only what it finds, so it takes the whole budget
    assert resolve(None, tmp_path, device="cuda:0") == (build_tree(acc, 64)[0], "auto", 64)


DRAWN = torch.tensor([[a * 0.3**r for r in range(10)] for a in (0.35, 0.28, 0.26, 0.25)])  # drawn candidates


def test_drawn_candidates_grow_their_budget_tree_from_their_own_table_or_else_greedys(tmp_path):
    """A drawn candidate passes far less often than a top-1 guess: its tree spends a budget on more tries
    at the root before depth. A table measured before drawn candidates had theirs stands in with greedy's."""
    save_accuracy(tmp_path, VICUNA)
    assert resolve("8", tmp_path, drawn=True) == resolve("8", tmp_path)  # no table of its own yet
    assert load_accuracy(tmp_path, drawn=True) is None
    save_accuracy(tmp_path, VICUNA, drawn=DRAWN)
    drawn, greedy = resolve("8", tmp_path, drawn=True), resolve("8", tmp_path)
    assert drawn == (build_tree(load_accuracy(tmp_path, drawn=True), 8)[0], "8", 8)
    assert greedy[0] == build_tree(VICUNA, 8)[0]
    assert drawn.tree != greedy.tree
    on_cpu = resolve("auto", tmp_path, drawn=True)  # on a CPU only the nodes worth their time
    assert on_cpu.tree == build_tree(load_accuracy(tmp_path, drawn=True), 8, min_gain=CPU_MIN_GAIN)[0]
    assert on_cpu.tree.choices == ((0,), (1,), (0, 0)) and resolve("auto", tmp_path).tree.num_nodes == 7
    assert resolve("chain3", tmp_path, drawn=True) == resolve("chain3", tmp_path)  # a tree given whole is no budget


@pytest.mark.parametrize("content", [[[0], [1], [0, 0]], {"choices": [[0], [1], [0, 0]]}], ids=["list", "object"])
def test_a_json_file_of_choices_is_a_tree(tmp_path, monkeypatch, content):
    """In a file (looked up in the working directory, then the checkpoint), or inline."""
    (tmp_path / "mine.json").write_text(json.dumps(content))
    want = Tree.from_choices([(0,), (1,), (0, 0)])
    assert resolve(str(tmp_path / "mine.json"), tmp_path / "elsewhere") == (want, "mine.json", 3)
    monkeypatch.chdir(tmp_path.parent)  # a relative name: the working directory, then the checkpoint
    assert resolve("mine.json", tmp_path) == (want, "mine.json", 3)
    assert resolve(json.dumps(content), tmp_path) == (want, "inline", 3)


@pytest.mark.parametrize("spec, content, message", [
    ("huge", None, r"unknown --tree 'huge': give a node budget N .* or choices inline"),
    ("chain0", None, r"unknown --tree 'chain0'"), ("²", None, r"unknown --tree '²'"),
    ("[[0], [1", None, r"--tree \[\[0\], \[1: not JSON"), ("[[0], [1, 0]]", None, r"--tree .*: tree choice \[1, 0\] has no parent"),
    ("[]", None, r"--tree \[\] has no choices"), ("300", None, r"--tree 300: a node budget must be between 1 and 256"),
    ("8", None, r"--tree 8 needs heads accuracies: run python -m medusa_mini.cli.measure --ckpt"),
    ("auto", None, r"--tree auto needs heads accuracies"),
    ("gone.json", None, r"tree file gone.json does not exist"), ("chain3", None, r"depth 3 but the model has 2"),
    ("t.json", "[[0], [1", r"t.json is not readable JSON .*; a tree file holds"),
    ("t.json", '{"nodes": [[0]]}', r"must hold a list of choices"), ("t.json", "[]", r"has no choices"),
    ("t.json", "[[0], [1, 0]]", r"t.json: tree choice \[1, 0\] has no parent: add \[1\]"),
    ("t.json", "[[0], [0, 0], [0, 0, 0]]", r"depth 3 but there are only 2 heads"),
])
def test_bad_trees_are_one_line_errors(tmp_path, spec, content, message):
    if content is not None:
        (tmp_path / spec).write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        resolve(spec, tmp_path, num_heads=2)
    assert "\n" not in str(error.value)


def test_measure_saves_the_accuracy_table_and_prints_the_product_rule_by_node_budget(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8", "--marginal",
                         "--temperature", "0.5", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    acc = load_accuracy(tmp_path)
    assert acc.shape == (3, 10) and "top-1" in out
    assert f"8 nodes: {build_tree(acc, 8)[1]:.2f}" in out  # the estimate printed is build_tree's own
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert saved["num_prompts"] == 3 and saved["max_new_tokens"] == 8 and saved["top_k"] == 10
    drawn = load_accuracy(tmp_path, drawn=True)  # and rejection sampling's table of drawn candidates
    assert drawn.shape == (3, 10) and not drawn.equal(acc)
    want = "  ".join(f"{n} nodes: {build_tree(drawn, n)[1]:.2f}" for n in (8, 16, 32, 64))
    assert out.strip().splitlines()[-2].endswith(want)  # the expected tokens/step of its trees
    sampled = next(line for line in out.splitlines() if line.startswith("rejection sampling at T=0.5"))
    marginal = out.strip().splitlines()[-1]  # under rejection sampling: one rate per head
    assert len(sampled.split("=")[-1].split()) == 3
    assert all(0 <= float(v) <= 1 for v in sampled.split("=")[-1].split())
    assert marginal.startswith("head 1 with q = the exact marginal over the root") and "Σ min(p, q) = 0." in marginal
    capsys.readouterr()
    measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8", "--temperature", "0.5", "--seed", "4"])
    assert sampled not in capsys.readouterr().out  # the seed draws other continuations


@pytest.mark.parametrize("argv, needle", [
    (["--ckpt", "{tmp}/missing"], "missing"), (["--ckpt", "{tmp}", "--prompts", "0"], "--prompts"),
    (["--ckpt", "{tmp}", "--max-new-tokens", "2"], "--max-new-tokens"),
    (["--ckpt", "{tmp}", "--temperature", "0"], "--temperature"), (["--ckpt", "{tmp}", "--temperature", "inf"], "--temperature")])
def test_measure_refuses_bad_input_in_one_line_with_exit_status_2(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        measure.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("python -m medusa_mini.cli.measure: error: ") and needle in err
    assert err.count("\n") == 1


def test_the_drawings_show_every_node_and_every_mask_entry():
    TREE = Tree.from_choices([(1,), (0, 0, 0), (0,), (0, 1), (0, 0)])  # [0] root, [1] (0,), [2] (1,), ...
    drawing = draw_tree(TREE, labels=["'a'", "'b'", "'c'", "'d'", "'e'", "'f'"])
    assert drawing.splitlines()[0] == "[0] root 'a'"
    assert "[5] head 3 rank 0 'f'" in drawing and len(drawing.splitlines()) == 6
    rows = draw_mask(TREE).splitlines()[1:]
    filled = [row.split()[1:].count("■") for row in rows]
    assert filled == [1, 2, 2, 3, 3, 4]  # each node's path
