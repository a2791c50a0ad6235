"""Which tree a run decodes with: `--tree` as a preset, a node budget N, or a JSON file of choices.

N builds the best tree of N nodes from heads_accuracy.json (`tree.build_tree`). Without `--tree`, N is
8 on a CPU, where every node costs time, and 64 on a GPU, which verifies 64 nodes at batch 1 in about
the time of one; without the table, the device's preset.
"""

from __future__ import annotations

import os

import torch

from ..io.files import read_json
from ..train.report import ACCURACY_FILE, load_accuracy
from ..tree import Tree, build_tree, preset


def tree_of_budget(nodes: int, *, ckpt_dir: str) -> Tree:
    """`--tree N`: `build_tree` with N candidate nodes from heads_accuracy.json."""
    if not 1 <= nodes <= 256:
        raise ValueError(f"--tree {nodes}: a node budget must be between 1 and 256")
    if not os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        raise ValueError(f"--tree {nodes} needs heads accuracies: run python -m medusa_mini.cli.measure "
                         f"--ckpt {ckpt_dir}")
    return build_tree(load_accuracy(ckpt_dir), nodes)[0]


def tree_from_json(path: str, *, num_heads: int | None) -> Tree:
    """A tree file: a JSON list of choices, or {"choices": [...]}."""
    obj = read_json(path, hint='a tree file holds [[0], [1], [0, 0], ...] or {"choices": [...]}')
    choices = obj.get("choices") if isinstance(obj, dict) else obj
    if not isinstance(choices, list) or not choices:
        raise ValueError(f'tree file {path} has no choices: it must hold a list of choices or {{"choices": [...]}}')
    try:
        return Tree.from_choices(choices, num_heads=num_heads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tree file {path}: {e}") from None


def resolve_tree(spec: str | None, *, ckpt_dir: str, device: torch.device | str,
                 num_heads: int | None) -> tuple[Tree, str]:
    """(the tree, its name for reports) from a node budget N, a preset ('cpu', 'gpu', 'chainN') or a JSON
    file, looked up in the working directory, then in the checkpoint's. A tree must not be deeper than
    the model has heads."""
    gpu = torch.device(device).type != "cpu"
    if spec is None:
        measured = ckpt_dir and os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE))
        spec = ("64" if gpu else "8") if measured else ("gpu" if gpu else "cpu")
    if spec.isdigit():
        tree = tree_of_budget(int(spec), ckpt_dir=ckpt_dir)
        if num_heads is not None:  # the table may have been measured for more heads than are loaded
            tree = tree.truncated(num_heads)
    elif spec.endswith(".json") or os.path.sep in spec:
        candidates = [spec] if os.path.isabs(spec) else [spec, os.path.join(ckpt_dir, spec)]
        path = next((p for p in candidates if os.path.isfile(p)), None)
        if path is None:
            raise ValueError(f"tree file {spec} does not exist")
        tree, spec = tree_from_json(path, num_heads=num_heads), os.path.basename(spec)
    else:
        tree = preset(spec)
    if num_heads is not None:
        tree.check_heads(num_heads)
    return tree, spec
