"""Which tree a command-line run decodes with: a preset, a JSON file, N nodes or `auto`, per rule.

Greedy and typical acceptance use the tree built from the greedy table; rejection sampling, when the
checkpoint's heads_accuracy.json has a table measured under sampling, gets a tree of its own
(`TreeChoice`). Errors are one-line ValueErrors, as everywhere in the command-line code.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from .head_accuracy import ACCURACY_FILE, load_accuracy, load_greedy_ranks, sampled_temperature
from .safetensors_io import read_json
from .tree import Tree, preset
from .tree_search import auto_tree, build_tree, measure_verify_cost



def default_tree_name(device: torch.device, ckpt_dir: str | None = None) -> str:
    """'auto' when the checkpoint has measured head accuracies, else the device's preset.

    On a GPU a 64-node verify pass costs about one step; on a CPU every node costs time, and the
    right size depends on the heads and the machine, which is what 'auto' measures.
    """
    if ckpt_dir is not None and os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        return "auto"
    return "gpu" if device.type == "cuda" else "cpu"


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


@dataclass
class TreeChoice:
    """The tree for each acceptance rule: greedy and typical acceptance use `greedy`; rejection
    sampling uses `sampled` (the same tree unless auto or N found a table measured under sampling)."""

    greedy: Tree
    sampled: Tree

    def for_rule(self, acceptance: str, temperature: float) -> Tree:
        return self.sampled if acceptance == "rejection" and temperature > 0 else self.greedy

    def rejection_nodes(self) -> int | None:
        """N of the rejection rows' own tree, or None when they use the greedy one (a results footer)."""
        return None if self.sampled == self.greedy else self.sampled.num_nodes


def trees_from_accuracy_and_cost(*, ckpt_dir: str, model, heads, device: torch.device) -> TreeChoice:
    """`--tree auto`: per acceptance table, the node budget with the most expected tokens per second.

    Expected tokens per step come from the heads' measured acceptance (heads_accuracy.json: the greedy
    table and, when present, the one measured under sampling); the cost of a step with N nodes is
    measured here and now, once per rule (a rejection step also draws and tries its candidates).
    What it chose and why goes to stderr.
    """
    path = os.path.join(ckpt_dir, ACCURACY_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"--tree auto needs {path}: run python -m medusa_mini.tree_search --ckpt {ckpt_dir}"
        )
    if heads is None:
        raise ValueError("--tree auto needs Medusa heads in the checkpoint")
    acc = load_accuracy(ckpt_dir)
    temperature = sampled_temperature(ckpt_dir)
    cost = measure_verify_cost(model, heads=heads, device=device, repeat=9)
    tree, why = auto_tree(acc, cost, ranks=load_greedy_ranks(ckpt_dir))
    print(f"--tree auto (measured on {device}), greedy acceptance table:\n{why}", file=sys.stderr)
    if temperature is None:
        return TreeChoice(tree, tree)
    cost = measure_verify_cost(model, heads=heads, device=device, repeat=9, acceptance="rejection",
                               temperature=temperature)
    sampled, why = auto_tree(load_accuracy(ckpt_dir, sampled=True), cost)
    print(f"rejection sampling table (measured at T={temperature:g}):\n{why.splitlines()[-1]}", file=sys.stderr)
    return TreeChoice(tree, sampled)


def trees_of_budget(nodes: int, *, ckpt_dir: str) -> TreeChoice:
    """`--tree N`: build_tree with N candidate nodes from each table of heads_accuracy.json (the sampled
    table's tree for rejection sampling, when the file has one)."""
    if not 1 <= nodes <= 256:
        raise ValueError(f"--tree {nodes}: a node budget must be between 1 and 256")
    hint = f"--tree {nodes} needs heads accuracies: run python -m medusa_mini.tree_search --ckpt {ckpt_dir}"
    if not os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        raise ValueError(hint)
    greedy = build_tree(load_accuracy(ckpt_dir), nodes)[0]
    if sampled_temperature(ckpt_dir) is None:
        return TreeChoice(greedy, greedy)
    return TreeChoice(greedy, build_tree(load_accuracy(ckpt_dir, sampled=True), nodes)[0])


def resolve_trees(
    spec: str | None, *, num_heads: int | None, ckpt_dir: str, device: torch.device, model=None, heads=None
) -> TreeChoice:
    """Trees from a preset name ('cpu', 'gpu', 'chainN'), 'auto', a node budget N, or a JSON file.

    None means the device's default. A relative file name is looked up in the working directory,
    then in the checkpoint directory. A tree must not be deeper than the model has heads. Only 'auto'
    and N give rejection sampling a tree of its own (from the table measured under sampling).
    """
    spec = spec or default_tree_name(device, ckpt_dir)
    if spec == "auto":
        choice = trees_from_accuracy_and_cost(ckpt_dir=ckpt_dir, model=model, heads=heads, device=device)
    elif spec.isdigit():
        choice = trees_of_budget(int(spec), ckpt_dir=ckpt_dir)
    elif spec.endswith(".json") or os.path.sep in spec:
        candidates = [spec] if os.path.isabs(spec) else [spec, os.path.join(ckpt_dir, spec)]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise ValueError(f"tree file {spec} does not exist")
        tree = _tree_from_json(path, num_heads=num_heads)
        choice = TreeChoice(tree, tree)
    else:
        tree = preset(spec)
        choice = TreeChoice(tree, tree)
    if num_heads is not None:
        choice.greedy.check_heads(num_heads)
        choice.sampled.check_heads(num_heads)
    return choice


def tree_nodes_text(nodes: int, rejection_nodes: int | None) -> str:
    """A results footer's tree size: "9 nodes incl. root", plus the rejection rows' own tree (None: the same)."""
    text = f"{nodes} nodes incl. root"
    if rejection_nodes is not None:
        text += f"; rejection: {rejection_nodes}, from the sampled table"
    return text
