"""Which tree a run decodes with, per acceptance rule: stored, a preset, a JSON file, N nodes or `auto`.

Greedy and typical acceptance use the tree built from the greedy table; rejection sampling, when the
checkpoint's heads_accuracy.json has a table measured under sampling, gets a tree of its own
(`RuleTrees`). `auto` sizes the trees on step costs measured now, which vary with machine load; so
training measures them once and stores them in trees.json, per device type, and decoding uses the
stored trees by default: the same command and seed then print the same tokens every run.
Errors are one-line ValueErrors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..io.safetensors import atomic_write_text, read_json
from ..sampling import Sampling
from ..tree import Tree, build_tree, preset
from .acceptance_tables import (
    ACCURACY_FILE,
    load_accuracy,
    load_greedy_ranks,
    sampled_temperature,
)
from .sizing import auto_tree, measure_verify_cost

TREES_FILE = "trees.json"
# Without stored trees, a tree of this many nodes is built from the tables: a CPU pays for every
# node, a GPU at batch 1 verifies 64 nodes in about the time of one.
DEFAULT_BUDGET = {"cpu": 8, "cuda": 64}
MEASURE_HINT = "python -m medusa_mini.cli.measure --ckpt {}"


@dataclass(frozen=True)
class RuleTrees:
    """The tree for each acceptance rule: greedy and typical acceptance use `greedy`; rejection
    sampling uses `sampled` (the same tree unless it was built from a table measured under sampling)."""

    greedy: Tree
    sampled: Tree

    def for_rule(self, sampling: Sampling) -> Tree:
        return self.sampled if sampling.rule == "rejection" else self.greedy

    def rejection_nodes(self) -> int | None:
        """N of the rejection rows' own tree, or None when they use the greedy one (a results footer)."""
        return None if self.sampled == self.greedy else self.sampled.num_nodes


def measure_trees(ckpt_dir: str, *, model, heads, device: torch.device) -> tuple[RuleTrees, str]:
    """`auto`: per acceptance table, the node budget with the most expected tokens per second.

    Expected tokens per step come from the heads' measured acceptance (heads_accuracy.json: the greedy
    table and, when present, the one measured under sampling); the cost of a step with N nodes is
    measured here and now, once per rule (a rejection step also draws and tries its candidates).
    Returns the trees and what was chosen and why.
    """
    path = os.path.join(ckpt_dir, ACCURACY_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--tree auto needs {path}: run {MEASURE_HINT.format(ckpt_dir)}")
    if heads is None:
        raise ValueError("--tree auto needs Medusa heads in the checkpoint")
    cost = measure_verify_cost(model, heads=heads, device=device, repeat=9)
    tree, why = auto_tree(load_accuracy(ckpt_dir), cost, ranks=load_greedy_ranks(ckpt_dir))
    report = f"tree auto (measured on {device}), greedy acceptance table:\n{why}"
    temperature = sampled_temperature(ckpt_dir)
    if temperature is None:
        return RuleTrees(tree, tree), report
    cost = measure_verify_cost(model, heads=heads, device=device, repeat=9,
                               sampling=Sampling(acceptance="rejection", temperature=temperature))
    sampled, why = auto_tree(load_accuracy(ckpt_dir, sampled=True), cost)
    report += f"\nrejection sampling table (measured at T={temperature:g}):\n{why.splitlines()[-1]}"
    return RuleTrees(tree, sampled), report


def store_trees(ckpt_dir: str, trees: RuleTrees, *, device: torch.device, note: str) -> str:
    """Record `trees` as the default for `device`'s type in trees.json (other devices' entries kept)."""
    path = os.path.join(ckpt_dir, TREES_FILE)
    obj = read_json(path, hint="") if os.path.isfile(path) else {}
    obj = obj if isinstance(obj, dict) else {}
    obj[torch.device(device).type] = {
        "greedy": [list(c) for c in trees.greedy.choices],
        "rejection": [list(c) for c in trees.sampled.choices], "how": note,
    }
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")
    return path


def measure_and_store_trees(ckpt_dir: str, *, model, heads, device: torch.device) -> str:
    """`measure_trees`, then `store_trees` for this device type; returns the report."""
    trees, report = measure_trees(ckpt_dir, model=model, heads=heads, device=device)
    note = (f"greedy {trees.greedy.num_nodes - 1} nodes, rejection {trees.sampled.num_nodes - 1} nodes "
            f"(root excluded), sized on step costs measured on {torch.device(device).type}")
    store_trees(ckpt_dir, trees, device=device, note=note)
    return f"{report}\n{note}"


def stored_trees(ckpt_dir: str, device: torch.device) -> RuleTrees | None:
    """The trees stored for `device`'s type, or None when trees.json has none for it."""
    path = os.path.join(ckpt_dir, TREES_FILE)
    if not os.path.isfile(path):
        return None
    obj = read_json(path, hint=f"re-measure with {MEASURE_HINT.format(ckpt_dir)}")
    entry = obj.get(torch.device(device).type) if isinstance(obj, dict) else None
    if entry is None:
        return None
    try:
        return RuleTrees(Tree.from_choices(entry["greedy"]), Tree.from_choices(entry["rejection"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad tree entry for {torch.device(device).type} ({e}); "
                         f"re-measure with {MEASURE_HINT.format(ckpt_dir)}") from None


def default_tree_name(device: torch.device, ckpt_dir: str | None = None) -> str:
    """'stored' when trees.json has trees for this device type; else N (DEFAULT_BUDGET) when the
    checkpoint has measured accuracies; else the device's preset. Never a fresh measurement."""
    if ckpt_dir is not None and stored_trees(ckpt_dir, device) is not None:
        return "stored"
    if ckpt_dir is not None and os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        return str(DEFAULT_BUDGET.get(torch.device(device).type, DEFAULT_BUDGET["cuda"]))
    return "gpu" if torch.device(device).type == "cuda" else "cpu"


def trees_of_budget(nodes: int, *, ckpt_dir: str) -> RuleTrees:
    """`--tree N`: build_tree with N candidate nodes from each table of heads_accuracy.json (the sampled
    table's tree for rejection sampling, when the file has one)."""
    if not 1 <= nodes <= 256:
        raise ValueError(f"--tree {nodes}: a node budget must be between 1 and 256")
    if not os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        raise ValueError(f"--tree {nodes} needs heads accuracies: run {MEASURE_HINT.format(ckpt_dir)}")
    greedy = build_tree(load_accuracy(ckpt_dir), nodes)[0]
    if sampled_temperature(ckpt_dir) is None:
        return RuleTrees(greedy, greedy)
    return RuleTrees(greedy, build_tree(load_accuracy(ckpt_dir, sampled=True), nodes)[0])


def _tree_from_json(path: str, *, num_heads: int | None) -> Tree:
    obj = read_json(path, hint='a tree file holds [[0], [1], [0, 0], ...] or {"choices": [...]}')
    choices = obj.get("choices") if isinstance(obj, dict) else obj
    if not isinstance(choices, list):
        raise ValueError(f'tree file {path} must hold a list of choices or {{"choices": [[0], [0, 1], ...]}}')
    if not choices:
        raise ValueError(f"tree file {path} has no choices; give at least one, e.g. [[0]]")
    try:
        return Tree.from_choices(choices, num_heads=num_heads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tree file {path}: {e}") from None


def resolve_trees(
    spec: str | None, *, num_heads: int | None, ckpt_dir: str, device: torch.device, model=None, heads=None,
    log=None,
) -> RuleTrees:
    """Trees from 'stored', 'auto', a node budget N, a preset ('cpu', 'gpu', 'chainN') or a JSON file.

    None means `default_tree_name`. A relative file name is looked up in the working directory, then
    in the checkpoint directory. A tree must not be deeper than the model has heads. Only 'stored',
    'auto' and N give rejection sampling a tree of its own. `log(text)` receives auto's report.
    """
    spec = spec or default_tree_name(device, ckpt_dir)
    if spec == "stored":
        trees = stored_trees(ckpt_dir, device)
        if trees is None:
            raise ValueError(f"{os.path.join(ckpt_dir, TREES_FILE)} has no trees for {torch.device(device).type}; "
                             f"store them with {MEASURE_HINT.format(ckpt_dir)}")
    elif spec == "auto":
        trees, report = measure_trees(ckpt_dir, model=model, heads=heads, device=device)
        if log is not None:
            log(report)
    elif spec.isdigit():
        trees = trees_of_budget(int(spec), ckpt_dir=ckpt_dir)
    elif spec.endswith(".json") or os.path.sep in spec:
        candidates = [spec] if os.path.isabs(spec) else [spec, os.path.join(ckpt_dir, spec)]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise ValueError(f"tree file {spec} does not exist")
        tree = _tree_from_json(path, num_heads=num_heads)
        trees = RuleTrees(tree, tree)
    else:
        tree = preset(spec)
        trees = RuleTrees(tree, tree)
    if num_heads is not None:
        trees.greedy.check_heads(num_heads)
        trees.sampled.check_heads(num_heads)
    return trees


def tree_nodes_text(nodes: int, rejection_nodes: int | None) -> str:
    """A results footer's tree size: "9 nodes incl. root", plus the rejection rows' own tree (None: the same)."""
    text = f"{nodes} nodes incl. root"
    if rejection_nodes is not None:
        text += f"; rejection: {rejection_nodes}, from the sampled table"
    return text
