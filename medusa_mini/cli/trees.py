"""Which tree a run decodes with (`--tree`): a preset, a JSON file of choices, or a node budget N, the best
tree of N nodes for heads_accuracy.json. By default ('auto') 64 nodes on a GPU, where a verify of 64 costs
little more than one of 1; on a CPU, where every node costs time, at most 8 and only those that pay
for themselves (`CPU_MIN_GAIN`); without the table, the device's preset."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch

from ..io.files import read_json
from ..train.accuracy import ACCURACY_FILE, load_accuracy
from ..tree import Tree, build_tree, preset

# On two CPU cores a node adds 2.5-3.5% to a Medusa step of the cpu preset (bench_step.py --configs tiny:
# a verify over 9 nodes against 1, per node, over the whole step); a node worth less than that share of
# the tokens per step so far slows the step more than it adds. 2.5% gave this project's four-head checkpoints
# 6 nodes (Medusa heads) and 4 (Hydra heads), the budgets the node-budget sweep finds fastest (BENCHMARKS.md);
# the five-head preset's Medusa heads get a 5-node chain.
CPU_MIN_GAIN = 0.025


class TreeChoice(NamedTuple):
    """What `--tree` chose: the heads' tree, its name for reports, and the nodes a step may verify: N, or
    auto's ceiling, else the tree's own. Prompt lookup drafts a chain of `budget` nodes: it verifies only
    what it finds (rounded up to a power of two), so the heads' cost rule is not its own."""

    tree: Tree
    name: str
    budget: int


def tree_from_choices(choices: object, *, num_heads: int, where: str) -> Tree:
    """The tree of a list of choices from the user (`where` names it in the one-line error)."""
    if not isinstance(choices, list) or not choices:
        raise ValueError(f'{where} has no choices: it must hold a list of choices or {{"choices": [...]}}')
    try:
        return Tree.from_choices(choices, num_heads=num_heads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def resolve_tree(spec: str | None, *, ckpt_dir: str, device: torch.device | str, num_heads: int,
                 drawn: bool = False) -> TreeChoice:
    """The tree from a node budget N, 'auto', a preset ('cpu', 'gpu', 'chainN') or a JSON file of choices
    ([[0], [1], [0, 0], ...] or {"choices": [...]}), looked up in the working directory, then in the
    checkpoint's. A tree must not be deeper than the model has heads. `drawn`: for rejection sampling's
    drawn candidates, whose budget trees grow from their own table (`load_accuracy`): a drawn candidate
    passes far less often than a top-1 guess, so siblings, more tries at a node, are worth more than depth."""
    gpu, measured = torch.device(device).type != "cpu", os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE))
    if spec is None:
        spec = "auto" if ckpt_dir and measured else ("gpu" if gpu else "cpu")
    budget = None  # a tree given whole (a preset, a file): its own size
    count = spec.isascii() and spec.isdigit()  # a node budget ('²' is a digit to str.isdigit, not to int)
    if spec == "auto" or count:
        if count and not 1 <= int(spec) <= 256:
            raise ValueError(f"--tree {spec}: a node budget must be between 1 and 256")
        if not measured:
            raise ValueError(f"--tree {spec} needs heads accuracies: run python -m medusa_mini.cli.measure "
                             f"--ckpt {ckpt_dir}")
        budget, min_gain = (int(spec), 0.0) if count else (64, 0.0) if gpu else (8, CPU_MIN_GAIN)
        # The table may have been measured for more heads than are loaded.
        acc = load_accuracy(ckpt_dir, drawn=True) if drawn else None
        if acc is None:  # measured before drawn candidates had a table of their own: greedy's stands in
            acc = load_accuracy(ckpt_dir)
        tree = build_tree(acc, budget, min_gain=min_gain)[0].truncated(num_heads)
    elif spec.lstrip().startswith(("[", "{")):  # choices inline
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--tree {spec}: not JSON ({e.msg}); write choices as '[[0], [1], [0, 0]]'") from None
        choices = obj.get("choices") if isinstance(obj, dict) else obj
        tree, spec = tree_from_choices(choices, num_heads=num_heads, where=f"--tree {spec}"), "inline"
    elif spec.endswith(".json") or os.path.sep in spec:
        path = next((p for p in (spec, os.path.join(ckpt_dir, spec)) if os.path.isfile(p)), None)
        if path is None:
            raise ValueError(f"tree file {spec} does not exist")
        obj = read_json(path, hint='a tree file holds [[0], [1], [0, 0], ...] or {"choices": [...]}')
        choices, spec = obj.get("choices") if isinstance(obj, dict) else obj, os.path.basename(spec)
        tree = tree_from_choices(choices, num_heads=num_heads, where=f"tree file {path}")
    else:
        try:
            tree = preset(spec)
        except ValueError:
            raise ValueError(f"unknown --tree {spec!r}: give a node budget N (1 to 256), auto, a preset (cpu, gpu, "
                             "chainN with N >= 1), a JSON file of choices, or choices inline: '[[0], [1], [0, 0]]'"
                             ) from None
    tree.check_heads(num_heads)
    return TreeChoice(tree, spec, budget or max(tree.num_nodes - 1, 1))


def draw_tree(tree: Tree, labels: list[str] | None = None) -> str:
    """The tree as indented text, one node a line: `[i] head d rank r label`."""
    lines: list[str] = []

    def visit(node: int, prefix: str, last: bool) -> None:
        label = f" {labels[node]}" if labels is not None else ""
        if node == 0:
            lines.append(f"[0] root{label}")
        else:
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}[{node}] head {tree.depths[node]} rank {tree.ranks[node]}{label}")
            prefix += "   " if last else "│  "
        kids = tree.children[node]
        for j, kid in enumerate(kids):
            visit(kid, prefix if node else "", j == len(kids) - 1)

    visit(0, "", True)
    return "\n".join(lines)


def draw_mask(tree: Tree) -> str:
    """The N x N tree attention mask: row = query node, column = key node, ■ = may attend."""
    mask, N = tree.tensors().ancestor_mask, tree.num_nodes
    width = len(str(N - 1))
    rows = [" " * (width + 1) + " ".join(f"{j:>{width}}" for j in range(N))]
    for i in range(N):
        rows.append(f"{i:>{width}} " + " ".join(f"{'■' if mask[i, j] else '·':>{width}}" for j in range(N)))
    return "\n".join(rows)
