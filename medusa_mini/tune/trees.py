"""Which tree a run decodes with, per acceptance rule: stored, a preset, a JSON file, N nodes or `auto`.

Greedy and typical acceptance use the tree built from the greedy table; rejection sampling, when the
checkpoint's heads_accuracy.json has a table measured under sampling, gets a tree of its own
(`RuleTrees`). `auto` sizes the trees on step costs measured now (sizing.py); training measures them
once and stores them in trees.json, and decoding uses the stored trees by default: the same command
and seed then print the same tokens every run.

A step's cost depends on how it runs, so trees.json keys its trees by how their costs were measured:
device type, dtype, eager or compiled ("cpu/float32/eager", "cuda/bfloat16/compiled"; float32 always
means full-precision matmuls, as decode.py runs them, never TF32). Decoding takes the entry for the
way it runs; when there is none, the closest of the same device type (the same dtype first, then one
of the same width, then the same eager or compiled), and says so in one line; when the device type
has none, the default of `default_tree_name`. Files from before the keys said more than the device
type ("cpu") read as float32/eager, which is how they were measured. Errors are one-line ValueErrors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..dynamic import DynamicTree
from ..io.safetensors import atomic_write_text, read_json
from ..sampling import Sampling
from ..tree import Tree, build_tree, preset
from .acceptance_tables import (
    ACCURACY_FILE,
    load_accuracy,
    load_greedy_ranks,
    sampled_temperature,
)
from .calibration import load_calibration
from .sizing import auto_tree, measure_verify_cost, steps_compiled

TREES_FILE = "trees.json"
# Without stored trees, a tree of this many nodes is built from the tables: a CPU pays for every
# node, a GPU at batch 1 verifies 64 nodes in about the time of one.
DEFAULT_BUDGET = {"cpu": 8, "cuda": 64}
MEASURE_HINT = "python -m medusa_mini.cli.measure --ckpt {}"


def trees_key(device: torch.device | str, *, dtype: torch.dtype = torch.float32, compiled: bool = False) -> str:
    """trees.json's key for one way of running a step: 'cpu/float32/eager', 'cuda/bfloat16/compiled'."""
    return f"{torch.device(device).type}/{str(dtype).removeprefix('torch.')}/{'compiled' if compiled else 'eager'}"


def measured_key(model, device: torch.device | str) -> str:
    """The key for steps of `model` as it is now: its dtype, and whether cli/compiled.py compiled it."""
    return trees_key(device, dtype=model.lm_head.weight.dtype, compiled=steps_compiled(model))


def _dtype_distance(a: str, b: str) -> int:
    """0 for the same dtype, 1 for another of the same width (bfloat16, float16), 2 for any other."""
    if a == b:
        return 0
    sizes = [getattr(getattr(torch, name, None), "itemsize", None) for name in (a, b)]
    return 1 if None not in sizes and sizes[0] == sizes[1] else 2


def closest_key(keys, wanted: str) -> str | None:
    """Of trees.json's `keys`, `wanted` itself, else the closest of its device type (the nearest dtype,
    then the same eager or compiled; ties by name); None when the device type has none."""
    device_type, dtype, mode = wanted.split("/")
    mine = [k.split("/") for k in keys if k.count("/") == 2 and k.split("/")[0] == device_type]
    if not mine:
        return None
    return "/".join(min(mine, key=lambda k: (_dtype_distance(k[1], dtype), k[2] != mode, k)))


def _stored_entries(ckpt_dir: str) -> dict[str, dict]:
    """trees.json's entries by full key ({} without the file); an old file's device-type keys ('cpu')
    read as '<type>/float32/eager', unless the file also holds that key."""
    path = os.path.join(ckpt_dir, TREES_FILE)
    if not os.path.isfile(path):
        return {}
    obj = read_json(path, hint=f"re-measure with {MEASURE_HINT.format(ckpt_dir)}")
    if not isinstance(obj, dict):
        return {}
    entries = {key: entry for key, entry in obj.items() if "/" in key}
    for key, entry in obj.items():
        if "/" not in key:
            entries.setdefault(trees_key(key), entry)
    return entries


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
    report = f"tree auto (measured on {device} as {measured_key(model, device)}), greedy acceptance table:\n{why}"
    temperature = sampled_temperature(ckpt_dir)
    if temperature is None:
        return RuleTrees(tree, tree), report
    cost = measure_verify_cost(model, heads=heads, device=device, repeat=9,
                               sampling=Sampling(acceptance="rejection", temperature=temperature))
    sampled, why = auto_tree(load_accuracy(ckpt_dir, sampled=True), cost)
    report += f"\nrejection sampling table (measured at T={temperature:g}):\n{why.splitlines()[-1]}"
    return RuleTrees(tree, sampled), report


def store_trees(
    ckpt_dir: str, trees: RuleTrees, *, device: torch.device, dtype: torch.dtype = torch.float32,
    compiled: bool = False, note: str,
) -> str:
    """Record `trees` in trees.json under `trees_key` (other entries kept, old keys rewritten in full)."""
    path = os.path.join(ckpt_dir, TREES_FILE)
    entries = _stored_entries(ckpt_dir)
    entries[trees_key(device, dtype=dtype, compiled=compiled)] = {
        "greedy": [list(c) for c in trees.greedy.choices],
        "rejection": [list(c) for c in trees.sampled.choices], "how": note,
    }
    atomic_write_text(path, json.dumps(entries, indent=1) + "\n")
    return path


def measure_and_store_trees(ckpt_dir: str, *, model, heads, device: torch.device) -> str:
    """`measure_trees`, then `store_trees` under the key of how the steps ran; returns the report."""
    trees, report = measure_trees(ckpt_dir, model=model, heads=heads, device=device)
    key = measured_key(model, device)
    note = (f"greedy {trees.greedy.num_nodes - 1} nodes, rejection {trees.sampled.num_nodes - 1} nodes "
            f"(root excluded), sized on step costs measured as {key}")
    store_trees(ckpt_dir, trees, device=device, dtype=model.lm_head.weight.dtype,
                compiled=steps_compiled(model), note=note)
    return f"{report}\n{note}"


def stored_trees(
    ckpt_dir: str, device: torch.device, *, dtype: torch.dtype = torch.float32, compiled: bool = False,
) -> tuple[RuleTrees, str] | None:
    """The trees stored for this device type, dtype and eager or compiled, else the closest of the
    device type (`closest_key`), with the key they were stored under; None when it has none."""
    entries = _stored_entries(ckpt_dir)
    key = closest_key(entries, trees_key(device, dtype=dtype, compiled=compiled))
    if key is None:
        return None
    try:
        entry = entries[key]
        return RuleTrees(Tree.from_choices(entry["greedy"]), Tree.from_choices(entry["rejection"])), key
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{os.path.join(ckpt_dir, TREES_FILE)}: bad tree entry for {key} ({e}); "
                         f"re-measure with {MEASURE_HINT.format(ckpt_dir)}") from None


def default_tree_name(device: torch.device, ckpt_dir: str | None = None) -> str:
    """'stored' when trees.json has trees for this device type (for any dtype, eager or compiled);
    else N (DEFAULT_BUDGET) when the checkpoint has measured accuracies; else the device's preset.
    Never a fresh measurement."""
    if ckpt_dir is not None and closest_key(_stored_entries(ckpt_dir), trees_key(device)) is not None:
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


def _fallback_note(ckpt_dir: str, *, wanted: str, used: str | None, spec: str) -> str | None:
    """One line on which trees a run uses when trees.json has none for `wanted`, the key of how the
    run decodes; None when it has them, or when there is no trees.json at all."""
    if used == wanted or not os.path.isfile(os.path.join(ckpt_dir, TREES_FILE)):
        return None
    device_type, dtype, mode = wanted.split("/")
    measure = f"{MEASURE_HINT.format(ckpt_dir)} --device {device_type} --dtype {dtype}" + (
        " --compile" if mode == "compiled" else "")
    if used is not None:
        return (f"tree: {TREES_FILE} has none sized for {wanted}; using those sized for {used}, the closest "
                f"stored (size these with {measure})")
    default = f"{spec} nodes built from {ACCURACY_FILE}" if spec.isdigit() else f"the {spec} preset"
    return (f"tree: {TREES_FILE} has none sized for {device_type}; using the default, {default} "
            f"(size these with {measure})")


def resolve_trees(
    spec: str | None, *, num_heads: int | None, ckpt_dir: str, device: torch.device,
    dtype: torch.dtype = torch.float32, compiled: bool = False, model=None, heads=None, log=None,
) -> RuleTrees:
    """Trees from 'stored', 'auto', a node budget N, a preset ('cpu', 'gpu', 'chainN') or a JSON file.

    None means `default_tree_name`. 'stored' takes the trees sized for `device`'s type, `dtype` and
    `compiled`, else the closest stored (`stored_trees`). A relative file name is looked up in the
    working directory, then in the checkpoint directory. A tree must not be deeper than the model
    has heads. Only 'stored', 'auto' and N give rejection sampling a tree of its own. `log(text)`
    receives auto's report, and one line when the stored trees were sized for another setup.
    """
    defaulted = spec is None
    spec = spec or default_tree_name(device, ckpt_dir)
    found = stored_trees(ckpt_dir, device, dtype=dtype, compiled=compiled) if spec == "stored" else None
    if log is not None and (found is not None or defaulted):
        note = _fallback_note(ckpt_dir, wanted=trees_key(device, dtype=dtype, compiled=compiled),
                              used=found[1] if found else None, spec=spec)
        if note is not None:
            log(note)
    if spec == "stored":
        if found is None:
            raise ValueError(f"{os.path.join(ckpt_dir, TREES_FILE)} has no trees for {torch.device(device).type}; "
                             f"store them with {MEASURE_HINT.format(ckpt_dir)}")
        trees = found[0]
    elif spec == "dynamic" or spec.startswith("dynamic:"):
        base = None if spec != "dynamic" else resolve_trees(None, num_heads=num_heads, ckpt_dir=ckpt_dir,
                                                            device=device, dtype=dtype, compiled=compiled)
        trees = dynamic_trees(spec, base=base, ckpt_dir=ckpt_dir, device=device, num_heads=num_heads)
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


def candidate_count(budget: int) -> int:
    """How many candidates a dynamic tree of `budget` nodes chooses from: enough that a confident step
    can go deep and a torn one wide (4x), never so many that filling them costs more than a few nodes."""
    return min(max(4 * budget, 32), 128)


def dynamic_trees(spec: str, *, base: RuleTrees | None, ckpt_dir: str, device: torch.device,
                  num_heads: int | None) -> RuleTrees:
    """`--tree dynamic` (the budget of `base`, the trees this checkpoint would use) or `dynamic:N`:
    each step keeps its N most confident candidates (dynamic.py), confidence read through
    heads_calibration.json when the checkpoint has it. The candidates are the tree build_tree grows
    for a bigger budget from heads_accuracy.json (else the gpu preset); sampled drafts keep a fixed
    tree of the same budget. Rejection sampling's tree takes the tables measured under sampling when
    there are some: its candidates grow from the sampled accuracy, its confidence is read through the
    sampled calibration (how often a guess is the token p draws, which is when a top-k draft is accepted)."""
    budget_text = spec.partition(":")[2]
    if budget_text and not (budget_text.isdigit() and 1 <= int(budget_text) <= 256):
        raise ValueError(f"--tree {spec}: the budget of a dynamic tree must be a number of nodes from 1 to 256")
    budget = int(budget_text) if budget_text else base.greedy.num_nodes - 1
    if os.path.isfile(os.path.join(ckpt_dir, ACCURACY_FILE)):
        acc = load_accuracy(ckpt_dir)
        sampled_acc = load_accuracy(ckpt_dir, sampled=True) if sampled_temperature(ckpt_dir) is not None else acc
        candidates = tuple(build_tree(a, candidate_count(budget))[0] for a in (acc, sampled_acc))
        fixed = (build_tree(acc, budget)[0], build_tree(sampled_acc, budget)[0])
    else:
        gpu = preset("gpu")
        candidates = (gpu.truncated(min(gpu.depth, num_heads or gpu.depth)),) * 2
        small = preset("cpu").truncated(min(preset("cpu").depth, num_heads or 4))
        fixed = (small, small)
    budget = min(budget, candidates[0].num_nodes - 1, candidates[1].num_nodes - 1)
    cal = load_calibration(ckpt_dir)
    sampled_cal = load_calibration(ckpt_dir, sampled=True) or cal
    return RuleTrees(DynamicTree(budget, candidates[0], fixed[0], cal),
                     DynamicTree(budget, candidates[1], fixed[1], sampled_cal))


def tree_nodes_text(nodes: int, rejection_nodes: int | None) -> str:
    """A results footer's tree size: "9 nodes incl. root", plus the rejection rows' own tree (None: the same)."""
    text = f"{nodes} nodes incl. root"
    if rejection_nodes is not None:
        text += f"; rejection: {rejection_nodes}, from the sampled table"
    return text
