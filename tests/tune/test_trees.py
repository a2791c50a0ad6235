"""Which tree a run decodes with (tune/trees.py): `--tree` as a preset, a node budget N built from the
checkpoint's heads_accuracy.json, or a JSON file of choices; without `--tree`, the device's default.
Every bad input is a one-line ValueError that says what to do."""

import json

import pytest
import torch

from medusa_mini.tree import Tree, build_tree, chain, preset
from medusa_mini.tune.acceptance_tables import save_accuracy
from medusa_mini.tune.trees import default_tree_spec, resolve_tree

VICUNA = torch.tensor([[a * 0.45**r for r in range(10)] for a in (0.56, 0.32, 0.20, 0.15)])


def resolve(spec, ckpt_dir, *, device="cpu", num_heads=4):
    return resolve_tree(spec, ckpt_dir=str(ckpt_dir), device=device, num_heads=num_heads)


def test_a_preset_names_its_tree(tmp_path):
    assert resolve("cpu", tmp_path) == (preset("cpu"), "cpu")
    assert resolve("gpu", tmp_path) == (preset("gpu"), "gpu")
    assert resolve("chain3", tmp_path) == (chain(3), "chain3")


def test_a_node_budget_builds_the_best_tree_of_that_size_from_the_measured_accuracies(tmp_path):
    save_accuracy(tmp_path, VICUNA)
    tree, name = resolve("8", tmp_path)
    assert (tree, name) == (build_tree(VICUNA, 8)[0], "8") and tree.num_nodes == 9
    assert resolve("64", tmp_path)[0].num_nodes == 65
    shallow, _ = resolve("64", tmp_path, num_heads=2)  # a table measured for more heads than are loaded
    assert shallow == build_tree(VICUNA, 64)[0].truncated(2) and shallow.depth == 2


def test_without_a_tree_the_device_decides_and_measured_accuracies_beat_the_preset(tmp_path):
    assert default_tree_spec("cpu", str(tmp_path)) == "cpu" and default_tree_spec("cuda", str(tmp_path)) == "gpu"
    assert default_tree_spec("cpu", None) == "cpu"
    assert resolve(None, tmp_path) == (preset("cpu"), "cpu")
    save_accuracy(tmp_path, VICUNA)
    assert default_tree_spec("cpu", str(tmp_path)) == "8" and default_tree_spec("cuda:0", str(tmp_path)) == "64"
    assert resolve(None, tmp_path) == (build_tree(VICUNA, 8)[0], "8")


@pytest.mark.parametrize("content", [[[0], [1], [0, 0]], {"choices": [[0], [1], [0, 0]]}], ids=["list", "object"])
def test_a_json_file_of_choices_is_a_tree(tmp_path, monkeypatch, content):
    (tmp_path / "mine.json").write_text(json.dumps(content))
    want = Tree.from_choices([(0,), (1,), (0, 0)])
    assert resolve(str(tmp_path / "mine.json"), tmp_path / "elsewhere") == (want, "mine.json")
    monkeypatch.chdir(tmp_path.parent)  # a relative name: the working directory, then the checkpoint
    assert resolve("mine.json", tmp_path) == (want, "mine.json")


@pytest.mark.parametrize("spec, content, message", [
    ("huge", None, r"unknown tree 'huge'"), ("0", None, r"--tree 0: a node budget must be between 1 and 256"),
    ("300", None, r"--tree 300: a node budget must be between 1 and 256"),
    ("8", None, r"--tree 8 needs heads accuracies: run python -m medusa_mini.cli.measure --ckpt"),
    ("gone.json", None, r"tree file gone.json does not exist"),
    ("t.json", "[[0], [1", r"t.json is not readable JSON .*; a tree file holds"),
    ("t.json", '"cpu"', r"must hold a list of choices"),
    ("t.json", '{"nodes": [[0]]}', r"must hold a list of choices"),
    ("t.json", "[]", r"has no choices; give at least one"),
    ("t.json", "[[0], [1, 0]]", r"t.json: tree choice \[1, 0\] has no parent: add \[1\]"),
    ("t.json", '[[0], ["a"]]', r"t.json: tree choice \['a'\] must be a list of integer ranks"),
    ("t.json", "[[0], [0, 0], [0, 0, 0]]", r"depth 3 but there are only 2 heads"),
    ("chain3", None, r"tree has depth 3 but the model has 2 Medusa heads"),
])
def test_bad_input_is_a_one_line_error(tmp_path, spec, content, message):
    if content is not None:
        (tmp_path / spec).write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        resolve(spec, tmp_path, num_heads=2)
    assert "\n" not in str(error.value)
