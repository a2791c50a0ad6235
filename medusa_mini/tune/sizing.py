"""The tree size from measured step cost: the node budget with the most expected tokens per second.

acc[k][r] (acceptance_tables.py) gives each tree's expected tokens per step (`tree.build_tree`); what
a step with N nodes costs depends on the device, so it is measured here (EAGLE-2's idea: size the
draft by what a forward pass costs on this device). `auto_tree` weighs the two.

A budget N always counts candidate nodes, the root excluded: the verify pass feeds N + 1 tokens and
`Tree.num_nodes == N + 1`. Measured costs vary with machine load, so a chosen tree is stored with the
checkpoint (trees.py) and re-measured only when asked.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from ..decoding import prefill
from ..hydra import heads_input
from ..model import GPT, KVCache
from ..sampling import Sampling
from ..step import medusa_step
from ..tree import Tree, build_tree
from .acceptance_tables import HeadsFn, replay_greedy
from .clock import time_in_turns

REPORT_BUDGETS = (4, 8, 16, 32, 64)


@torch.no_grad()
def measure_verify_cost(
    model: GPT, *, heads: HeadsFn | None = None, num_heads: int = 4,
    node_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), prefix_len: int | None = None,
    repeat: int = 5, device: torch.device | str | None = None, sampling: Sampling = Sampling(),
) -> dict[int, float]:
    """{N: median ms of one Medusa step with N candidate nodes} after a random prefix.

    A step as medusa_generate runs it: the heads at one hidden state (when `heads` is given; else
    random logits stand in for theirs), then `step.medusa_step` under `sampling`: candidates
    (drawn from the heads for sampled rejection drafts), the tree-masked verify
    of N + 1 tokens, acceptance, KV compaction. Trees come from
    build_tree on a decaying accuracy table, so they look like real ones. `device` is where the model
    lives (default: its parameters' device); clocks wait for it.
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
    cache = KVCache(model.config, max_len=prefix_len + max(node_counts) + 1, device=device,
                    dtype=model.lm_head.weight.dtype)
    _, hidden = prefill(model, torch.randint(V, (prefix_len,), generator=gen).to(device), cache)
    trees = {n: build_tree(shape_acc, n)[0] for n in node_counts}
    drawn: dict = {}  # this call's root and stand-in guesses, drawn untimed before it

    def reset() -> None:
        drawn["root"] = int(torch.randint(V, (1,), generator=gen))
        drawn["guesses"] = torch.randn(K, V, generator=gen).to(device) if heads is None else None  # [K, V]
        cache.length = prefix_len  # every repetition verifies after the same prefix

    def step(n: int) -> None:
        head_logits = drawn["guesses"] if heads is None else heads_input(heads, hidden, model)  # [K, V] or per node
        medusa_step(model, cache, trees[n], drawn["root"], head_logits, sampling=sampling, generator=rule_gen)

    # Budgets take turns, one step each per round: a burst of load on a shared machine then slows
    # every budget alike instead of ruining the few measured while it lasted. The first round warms
    # up kernels and allocators.
    ms, _ = time_in_turns({n: partial(step, n) for n in node_counts}, reset=reset, device=device,
                          repeat=repeat, warmup=1)
    return ms


def auto_tree(acc: torch.Tensor, step_ms: dict[int, float], *, ranks: list[str] | None = None) -> tuple[Tree, str]:
    """The tree whose budget N (candidates, root excluded) maximises expected tokens per second.

    For each N in step_ms: build_tree(acc, N); its tokens per step replayed on measured greedy
    continuations when `ranks` are given (acceptance_tables.replay_greedy: exact there), else the product
    rule's; expected tokens/s = tokens per step / step_ms[N].
    Ties go to the smaller budget. Returns the tree and a short table explaining the choice.
    """
    if not step_ms:
        raise ValueError("step_ms is empty: measure at least one node budget")
    rows = []
    for n in sorted(step_ms):
        if step_ms[n] <= 0:
            raise ValueError(f"step time for {n} nodes must be positive, got {step_ms[n]}")
        tree, expected = build_tree(acc, n)
        if ranks is not None:
            expected = replay_greedy(ranks, tree)
        rows.append((n, tree, expected, float(step_ms[n]), 1000 * expected / step_ms[n]))
    best = max(rows, key=lambda row: (row[4], -row[0]))
    how = "replayed" if ranks is not None else "expected"
    lines = [f"nodes  tokens/step  ms/step  tokens/s   ({how}; nodes exclude the root, bonus token counted)"]
    for n, _, expected, ms, rate in rows:
        lines.append(f"{n:>5}  {expected:>11.2f}  {ms:>7.2f}  {rate:>8.1f}" + ("   <- chosen" if n == best[0] else ""))
    n, tree, expected, ms, rate = best
    why = f"chose {n} nodes: {expected:.2f} tokens/step at {ms:.2f} ms/step = {rate:.1f} tokens/s"
    bigger = [row for row in rows if row[0] > n]
    if bigger:
        b = bigger[0]
        why += f"; {b[0]} nodes: {b[2] - expected:+.2f} tokens/step for {b[3] - ms:+.2f} ms/step = {b[4]:.1f} tokens/s"
    return tree, "\n".join(lines + [why])
