"""The tree size from measured step cost: the node budget with the most expected tokens per second.

acc[k][r] (acceptance_tables.py) gives each tree's expected tokens per step (`tree.build_tree`); what
a step with N nodes costs depends on the device, so it is measured here (EAGLE-2's idea: size the
draft by what a forward pass costs on this device). `auto_tree` weighs the two.

A budget N always counts candidate nodes, the root excluded: the verify pass feeds N + 1 tokens and
`Tree.num_nodes == N + 1`.

The chosen budget should depend on the checkpoint and the device, not on the machine's load while it
was measured. A budget is a step function of the costs, so no rule can make two noisy measurements
agree every time; this one keeps the steps few and the estimate steady:

1. Costs. Each budget's step is timed in turns with the others (clock.time_in_turns), and the
   fastest of its repetitions counts: load only ever adds time, so the minimum is the steadiest
   estimate of what the step itself costs, where a median moves with the load.
2. Model. cost(N) = fixed + per_node·N, fitted by least squares over every measured budget, on
   relative error (timing noise scales with the time), both coefficients non-negative. A line
   averages out the noise of single budgets, and a step's cost is close to a line in N: the work
   on the N tokens grows with N, the weights are read once. The slope is kept only when it stands
   more than SLOPE_Z standard errors from zero; otherwise the cost counts as flat (a GPU at batch 1
   verifies 64 nodes in about the time of one), and the choice no longer depends on the noise.
3. Choice. On a coarse grid of budgets (CHOICE_BUDGETS, within the measured range), tokens per step
   over the modelled cost; the smallest budget whose rate is within CLEAR_GAIN of the best wins: a
   larger tree, which costs memory and time on every other device, must be better by a clear margin.
   The margin is wider than what the model can tell apart: on the cpu preset, 24 sizings of one
   checkpoint fitted slopes (per node, relative to the fixed cost) from 0.013 to 0.021, which moves
   the modelled gain of 8 nodes over 4 by about 2.5 points, and rejection sampling's gain sat near 3%:
   with a 3% margin the stored tree flipped between 4 and 8 nodes from one training to the next.

tests/tune/test_sizing.py feeds cost tables with ±20% noise and checks the choice does not move. The
chosen trees are stored with the checkpoint (trees.py), so decoding never re-measures unless asked.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

import torch

from ..decoding import make_proposer, prefill
from ..model import GPT, KVCache
from ..sampling import Sampling
from ..step import medusa_step
from ..tree import Tree, build_tree
from .acceptance_tables import HeadsFn
from .clock import time_in_turns
from .replay import replay_greedy

REPORT_BUDGETS = (4, 8, 16, 32, 64)
MEASURED_BUDGETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64)  # the line is fitted on these
CHOICE_BUDGETS = (1, 2, 4, 8, 16, 32, 64)  # the tree is chosen among these
SLOPE_Z = 3.0  # a slope closer to zero than this many standard errors counts as noise: flat cost
CLEAR_GAIN = 0.05  # a larger budget must beat a smaller one's tokens/s by more than this


def steps_compiled(model: GPT) -> bool:
    """Whether `model`'s steps run under torch.compile: cli/compiled.py puts a CompiledSteps, which
    keeps the caches its graphs replay on, in place of model.forward (tune does not import cli)."""
    return callable(getattr(model.forward, "cache", None))


@contextmanager
def decoding_matmuls() -> Iterator[None]:
    """float32 matmuls at full precision while measuring, as decode.py runs them: training turns TF32
    on (train/device.py), and a cost measured under TF32 would be stored as float32's."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@torch.no_grad()
def measure_verify_cost(
    model: GPT, *, heads: HeadsFn | None = None, num_heads: int = 4,
    node_counts: Sequence[int] = MEASURED_BUDGETS, prefix_len: int | None = None,
    repeat: int = 5, device: torch.device | str | None = None, sampling: Sampling = Sampling(),
) -> dict[int, float]:
    """{N: fastest ms of one Medusa step with N candidate nodes} after a random prefix.

    A step as medusa_generate runs it: the heads at one hidden state (when `heads` is given; else
    random logits stand in for theirs), then `step.medusa_step` under `sampling`: candidates
    (drawn from the heads for sampled rejection drafts), the tree-masked verify
    of N + 1 tokens, acceptance, KV compaction. Trees come from
    build_tree on a decaying accuracy table, so they look like real ones. `device` is where the model
    lives (default: its parameters' device); clocks wait for it. The root and the stand-in guesses
    are drawn and moved to the device untimed, as decoding keeps its root on the device.
    """
    device = torch.device(device) if device is not None else model.device
    K = getattr(heads, "num_heads", num_heads)
    V, block = model.config.vocab_size, model.config.block_size
    prefix_len = prefix_len if prefix_len is not None else block // 2
    if not 0 < prefix_len < block - K:
        raise ValueError(f"prefix_len must be between 1 and {block - K - 1} for this context and {K} heads")
    shape_acc = 0.6 * 0.6 ** torch.arange(10.0)[None].repeat(K, 1)  # [K, 10]
    gen = torch.Generator().manual_seed(0)
    rule_gen = torch.Generator(device=device).manual_seed(0)  # the sampling rules' draws
    max_len = prefix_len + max(node_counts) + 1
    compiled = steps_compiled(model)
    # Compiled steps replay on the caches they were captured with: measure on theirs, emptied first.
    cache = model.forward.cache(model, max_len) if compiled else KVCache(
        model.config, max_len=max_len, device=device, dtype=model.lm_head.weight.dtype)
    cache.lengths = 0
    _, hidden = prefill(model, torch.randint(V, (1, prefix_len), generator=gen).to(device), cache)  # [1, C]
    drawn: dict = {}  # this call's root and stand-in guesses, drawn untimed before it

    def stand_in(h: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        return drawn["guesses"]  # [K, 1, V]: random logits in place of heads

    stand_in.num_heads = K
    proposers = {n: make_proposer(model, heads if heads is not None else stand_in, build_tree(shape_acc, n)[0])
                 for n in node_counts}

    def reset() -> None:
        drawn["root"] = torch.randint(V, (1,), generator=gen).to(device)  # [1] on the device
        drawn["guesses"] = torch.randn(K, 1, V, generator=gen).to(device) if heads is None else None
        cache.lengths = prefix_len  # every repetition verifies after the same prefix

    def step(n: int) -> None:
        medusa_step(model, cache, proposers[n], drawn["root"], hidden, sampling=sampling, generator=rule_gen)

    # Budgets take turns, one step each per round: a burst of load on a shared machine then slows
    # every budget alike. The first round warms up kernels and allocators; compiled, three do (under
    # CUDA graphs: an eager call, a recording, a replay).
    with decoding_matmuls():
        ms, _ = time_in_turns({n: partial(step, n) for n in node_counts}, reset=reset, device=device,
                              repeat=repeat, warmup=3 if compiled else 1, statistic=min)
    return ms


@dataclass(frozen=True)
class StepCost:
    """A step's modelled cost in ms, cost(N) = fixed + per_node·N, and how it was fitted."""

    fixed: float
    per_node: float
    budgets: int  # how many measured budgets it was fitted on
    slope_z: float | None  # the fitted slope in standard errors; None when too few budgets tell

    def __call__(self, nodes: int) -> float:
        return self.fixed + self.per_node * nodes

    def describe(self) -> str:
        text = f"step cost {self.fixed:.3f} + {self.per_node:.4f}·N ms, fitted on {self.budgets} budgets"
        if self.per_node == 0 and self.slope_z is not None:
            text += f" (flat: the slope, {max(self.slope_z, 0.0):.1f} standard errors, is within noise)"
        elif self.slope_z is not None:
            z = f"{self.slope_z:.1f}" if self.slope_z < 1000 else "over 1000"  # a noiseless table's: huge
            text += f" (slope {z} standard errors from 0)"
        return text


def fit_step_cost(step_ms: dict[int, float]) -> StepCost:
    """cost(N) = fixed + per_node·N by least squares on relative error, both coefficients >= 0, the
    slope set to 0 unless it stands SLOPE_Z standard errors from 0. step_ms: {N: ms}, ms > 0."""
    ns = sorted(step_ms)
    c = [float(step_ms[n]) for n in ns]
    w = [1.0 / x**2 for x in c]  # relative error: timing noise scales with the time
    sw, swc = sum(w), sum(wi * ci for wi, ci in zip(w, c))
    swn = sum(wi * n for wi, n in zip(w, ns))
    swnn = sum(wi * n * n for wi, n in zip(w, ns))
    swnc = sum(wi * n * ci for wi, n, ci in zip(w, ns, c))
    det = sw * swnn - swn**2
    flat = StepCost(swc / sw, 0.0, len(ns), None)  # the weighted mean
    if len(ns) < 2 or det <= 0:
        return flat
    fixed, per_node = (swnn * swc - swn * swnc) / det, (sw * swnc - swn * swc) / det
    z = None
    if len(ns) > 2:
        rss = sum(wi * (ci - fixed - per_node * n) ** 2 for wi, ci, n in zip(w, c, ns))
        se = math.sqrt(rss / (len(ns) - 2) * sw / det)
        z = per_node / se if se > 0 else (math.inf if per_node > 0 else 0.0)
    # A slope that no clock could show (an exactly flat table's rounding) is no slope either.
    if per_node * ns[-1] <= 1e-9 * max(c) or (z is not None and z < SLOPE_Z):
        return StepCost(flat.fixed, 0.0, len(ns), z)
    if fixed < 0:  # the best line through the origin
        return StepCost(0.0, swnc / swnn, len(ns), z)
    return StepCost(fixed, per_node, len(ns), z)


def choose_budget(rates: dict[int, float], *, clear_gain: float = CLEAR_GAIN) -> int:
    """The smallest budget whose tokens/s is within `clear_gain` of the best one's."""
    best = max(rates.values())
    return min(n for n, rate in rates.items() if rate * (1 + clear_gain) >= best)


def auto_tree(
    acc: torch.Tensor, step_ms: dict[int, float], *, ranks: list[str] | None = None,
    budgets: Sequence[int] = CHOICE_BUDGETS,
) -> tuple[Tree, str]:
    """The tree whose budget N (candidates, root excluded) gives the most expected tokens per second.

    step_ms {N: ms} is fitted by `fit_step_cost`; for each N of `budgets` within the measured range
    (or the measured budgets, if none is): build_tree(acc, N), its tokens per step replayed on
    measured greedy continuations when `ranks` are given (replay.replay_greedy: exact
    there), else the product rule's; expected tokens/s = tokens per step / modelled cost(N); then
    `choose_budget`. Returns the tree and a table explaining the choice, the choice on its last line.
    """
    if not step_ms:
        raise ValueError("step_ms is empty: measure at least one node budget")
    for n, ms in step_ms.items():
        if not ms > 0:
            raise ValueError(f"step time for {n} nodes must be positive, got {ms}")
    cost = fit_step_cost(step_ms)
    grid = [n for n in sorted(budgets) if min(step_ms) <= n <= max(step_ms)] or sorted(step_ms)
    rows = {}
    for n in grid:
        tree, expected = build_tree(acc, n)
        if ranks is not None:
            expected = replay_greedy(ranks, tree)
        rows[n] = (tree, expected, cost(n), 1000 * expected / cost(n))
    chosen = choose_budget({n: row[3] for n, row in rows.items()})
    best = max(rows, key=lambda n: rows[n][3])
    how = "replayed" if ranks is not None else "expected"
    lines = [f"nodes  tokens/step  ms/step measured  ms/step model  tokens/s   "
             f"({how}; nodes exclude the root, bonus token counted)"]
    for n, (_, expected, ms, rate) in rows.items():
        measured = f"{step_ms[n]:>16.2f}" if n in step_ms else f"{'-':>16}"
        lines.append(f"{n:>5}  {expected:>11.2f}  {measured}  {ms:>13.2f}  {rate:>8.1f}"
                     + ("   <- chosen" if n == chosen else ""))
    lines.append(cost.describe())
    tree, expected, ms, rate = rows[chosen]
    why = f"chose {chosen} nodes: {expected:.2f} tokens/step at {ms:.2f} ms/step = {rate:.1f} tokens/s"
    bigger = [n for n in rows if n > chosen]
    if best != chosen:
        why += (f"; {best} nodes would give {rows[best][3]:.1f} tokens/s, less than the {CLEAR_GAIN:.0%} "
                f"more a larger tree must gain")
    elif bigger:
        b = rows[bigger[0]]
        why += (f"; {bigger[0]} nodes: {b[1] - expected:+.2f} tokens/step for {b[2] - ms:+.2f} ms/step "
                f"= {b[3]:.1f} tokens/s")
    return tree, "\n".join(lines + [why])
