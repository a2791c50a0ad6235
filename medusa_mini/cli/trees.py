"""Which tree a run decodes with (`--tree`): a preset, choices (a JSON file or inline), or a node budget N, the
best tree of N nodes for heads_accuracy.json. By default ('auto') 64 nodes on a GPU, where a verify of 64 costs
little more than one of 1; on a CPU, where every node costs time, at most 8 and only those that pay for
themselves (`CPU_MIN_GAIN`); without the table, the device's preset."""

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
HINT = 'a tree file holds [[0], [1], [0, 0], ...] or {"choices": [...]}'


class TreeChoice(NamedTuple):
    """The heads' tree, its name, and the nodes a step may verify (N, auto's ceiling, else the tree's own):
    prompt lookup's chain, which verifies only what it finds, so the heads' cost rule is not its own."""

    tree: Tree
    name: str
    budget: int


def resolve_tree(spec: str | None, *, ckpt_dir: str, device: torch.device | str, num_heads: int,
                 drawn: bool = False) -> TreeChoice:
    """The tree of a node budget N, 'auto', a preset, or choices inline or in a JSON file (the working
    directory's, else the checkpoint's). `drawn`: for rejection sampling's drawn candidates, whose budget trees
    grow from their own table: they pass far less often than top-1 guesses, so siblings beat depth."""
    gpu, measured = torch.device(device).type != "cpu", os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE))
    if spec is None:
        spec = "auto" if ckpt_dir and measured else ("gpu" if gpu else "cpu")
    budget = None  # a tree given whole (a preset, choices): its own size
    count = spec.isascii() and spec.isdigit()  # a node budget ('²' is a digit to str.isdigit, not to int)
    inline = spec.lstrip().startswith(("[", "{"))
    if spec == "auto" or count:
        if count and not 1 <= int(spec) <= 256:
            raise ValueError(f"--tree {spec}: a node budget must be between 1 and 256")
        if not measured:
            raise ValueError(f"--tree {spec} needs heads accuracies: run python -m medusa_mini.cli.measure "
                             f"--ckpt {ckpt_dir}")
        budget, min_gain = (int(spec), 0.0) if count else (64, 0.0) if gpu else (8, CPU_MIN_GAIN)
        acc = load_accuracy(ckpt_dir, drawn=True) if drawn else None
        if acc is None:  # measured before drawn candidates had a table of their own: greedy's stands in
            acc = load_accuracy(ckpt_dir)
        tree = build_tree(acc, budget, min_gain=min_gain)[0].truncated(num_heads)  # it may describe more heads
    elif inline or spec.endswith(".json") or os.path.sep in spec:
        if inline:
            where, name = f"--tree {spec}", "inline"
            try:
                obj = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}); write choices as '[[0], [1], [0, 0]]'") from None
        else:
            path = next((p for p in (spec, os.path.join(ckpt_dir, spec)) if os.path.isfile(p)), None)
            if path is None:
                raise ValueError(f"tree file {spec} does not exist")
            obj, where, name = read_json(path, hint=HINT), f"tree file {path}", os.path.basename(spec)
        choices = obj.get("choices") if isinstance(obj, dict) else obj
        if not isinstance(choices, list) or not choices:
            raise ValueError(f'{where} has no choices: it must hold a list of choices or {{"choices": [...]}}')
        try:
            tree, spec = Tree.from_choices(choices, num_heads=num_heads), name
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
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
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}[{node}] head {tree.depths[node]} rank "
                         f"{tree.ranks[node]}{label}")
            prefix += "   " if last else "│  "
        for j, kid in enumerate(tree.children[node]):
            visit(kid, prefix if node else "", j == len(tree.children[node]) - 1)

    visit(0, "", True)
    return "\n".join(lines)


def draw_mask(tree: Tree) -> str:
    """The N x N tree attention mask: row = query node, column = key node, ■ = may attend."""
    mask, N = tree.tensors().ancestor_mask, tree.num_nodes
    w = len(str(N - 1))
    return "\n".join([" " * (w + 1) + " ".join(f"{j:>{w}}" for j in range(N))] + [
        f"{i:>{w}} " + " ".join(f"{'■' if mask[i, j] else '·':>{w}}" for j in range(N)) for i in range(N)])
