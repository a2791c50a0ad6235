"""Trees from measured head accuracies, and the tree size from measured step cost.

acc[k][r] is the probability that head k+1's rank-r guess is accepted once its parent is (measured by
head_accuracy.py: one table for greedy acceptance, one for rejection sampling). Treating heads as
independent, a node with path (r1..rd) is accepted with probability Π_i acc[i][r_i]; the sum of these
over a tree, plus the bonus token, is the expected tokens per step. `build_tree` grows the best tree
for a node budget; `auto_tree` picks the budget with the most expected tokens per second from measured
step times (EAGLE-2's idea: size the draft by what a forward pass costs on this device).

A budget N always counts candidate nodes, the root excluded: the verify pass feeds N + 1 tokens and
`Tree.num_nodes == N + 1`.

    python -m medusa_mini.tree_search --ckpt out/tiny [--prompts 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import heapq
import math
import os
import statistics
import sys
import time
from typing import Sequence

import torch

from .acceptance import SAMPLING_TEMPERATURE
from .cli_common import PROMPTS_FILE, OneLineParser, load_for_decoding, load_prompts, pick_device
from .decoding import prefill, sync_device
from .step import medusa_step
from .head_accuracy import (
    ACCURACY_FILE, HeadsFn, check_acc, continuations, format_accuracy, greedy_ranks,
    measure_head_accuracy, replay_greedy, save_accuracy,
)
from .model import GPT, KVCache
from .tree import Tree

REPORT_BUDGETS = (4, 8, 16, 32, 64)


# ---- trees from accuracies -------------------------------------------------------------------


def build_tree(acc: torch.Tensor, num_nodes: int) -> tuple[Tree, float]:
    """The tree of `num_nodes` candidates (root excluded) grown greedily by expected acceptance.

    Candidates are the next sibling and the first child of every chosen node; the one with the
    largest value Π_i acc[i][r_i] joins next (ties: shallower, then smaller ranks). A child is offered
    only after its parent and rank r+1 only after rank r, so every prefix is present. When each row
    of acc decreases with rank, values decrease along these offers and the greedy tree is the optimum.
    Nodes of value 0 are never added, so a table with few nonzero entries gives a smaller tree.
    Returns (tree, expected tokens per step = 1 + Σ values, the bonus token counted).
    """
    a = check_acc(acc).tolist()
    K, R = len(a), len(a[0])
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    heap = [(-a[0][0], 1, (0,), 1.0)]  # (-value, depth, choice, parent's value)
    chosen, total = [], 0.0
    while heap and len(chosen) < num_nodes:
        neg, depth, choice, parent_value = heapq.heappop(heap)
        if neg == 0:  # never accepted: such a node would only cost verify time
            break
        chosen.append(choice)
        total -= neg
        if choice[-1] + 1 < R:
            sibling = choice[:-1] + (choice[-1] + 1,)
            heapq.heappush(heap, (-parent_value * a[depth - 1][choice[-1] + 1], depth, sibling, parent_value))
        if depth < K:
            heapq.heappush(heap, (neg * a[depth][0], depth + 1, choice + (0,), -neg))
    return Tree.from_choices(chosen), 1.0 + total


def expected_tokens_per_step(acc: torch.Tensor, tree: Tree) -> float:
    """1 + Σ over the tree's nodes of Π_i acc[i][r_i]: the product rule for any tree (presets too)."""
    a = check_acc(acc).tolist()
    total = 0.0
    for choice in tree.choices:
        if len(choice) > len(a) or max(choice) >= len(a[0]):
            raise ValueError(f"tree node {list(choice)} needs more heads or ranks than acc {len(a)}x{len(a[0])}")
        total += math.prod(a[i][r] for i, r in enumerate(choice))
    return 1.0 + total


# ---- choosing the budget from measured cost --------------------------------------------------


@torch.no_grad()
def measure_verify_cost(
    model: GPT, *, heads: HeadsFn | None = None, num_heads: int = 4,
    node_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), prefix_len: int | None = None,
    repeat: int = 5, device: torch.device | str | None = None, acceptance: str = "greedy",
    temperature: float = 0.0,
) -> dict[int, float]:
    """{N: median ms of one Medusa step with N candidate nodes} after a random prefix.

    A step as medusa_generate runs it: the heads at one hidden state (when `heads` is given; else
    random logits stand in for theirs), then `step.medusa_step` with the `acceptance` rule at
    `temperature`: candidates (drawn from the heads for rejection sampling), the tree-masked verify
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
    times: dict[int, list[float]] = {n: [] for n in node_counts}
    # Budgets take turns, one step each per round: a burst of load on a shared machine then slows
    # every budget alike instead of ruining the few measured while it lasted.
    for rep in range(repeat + 1):  # the first round warms up kernels and allocators
        for n in node_counts:
            root = int(torch.randint(V, (1,), generator=gen))
            guesses = torch.randn(K, V, generator=gen).to(device) if heads is None else None  # [K, V]
            cache.length = prefix_len  # every repetition verifies after the same prefix
            sync_device(device)
            t0 = time.perf_counter()
            head_logits = guesses if heads is None else heads(hidden[None], model.lm_head)[:, 0]  # [K, V]
            medusa_step(model, cache, trees[n], root, head_logits, acceptance=acceptance, temperature=temperature,
                        generator=rule_gen)
            sync_device(device)
            if rep:
                times[n].append(1000 * (time.perf_counter() - t0))
    return {n: statistics.median(t) for n, t in times.items()}


def auto_tree(acc: torch.Tensor, step_ms: dict[int, float], *, ranks: list[str] | None = None) -> tuple[Tree, str]:
    """The tree whose budget N (candidates, root excluded) maximises expected tokens per second.

    For each N in step_ms: build_tree(acc, N); its tokens per step replayed on measured greedy
    continuations when `ranks` are given (head_accuracy.replay_greedy: exact there), else the product
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


# ---- the recompute_accuracy command ----------------------------------------------------------


def encode_prompts(enc, texts: list[str], *, block_size: int, max_new_tokens: int) -> list[list[int]]:
    """Token ids of each non-empty prompt, cut so the continuation still fits in the context."""
    room = block_size - max_new_tokens
    if room < 1:
        raise ValueError(f"max-new-tokens {max_new_tokens} leaves no room for a prompt in {block_size} positions")
    return [ids[:room] for ids in (enc.encode_ordinary(t) for t in texts) if ids]


def recompute_accuracy(
    directory: str, *, num_prompts: int = 32, max_new_tokens: int = 64, top_k: int = 10,
    temperature: float = SAMPLING_TEMPERATURE, device: torch.device | str = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Measure both tables (greedy; sampled at `temperature`) and the greedy rank strings on a
    checkpoint's prompts.json, save heads_accuracy.json, return (acc, sampled, ranks)."""
    ckpt = load_for_decoding(directory, device=torch.device(device))  # model, heads, tokenizer
    if ckpt.heads is None:
        raise ValueError(f"checkpoint {directory} has no Medusa heads; train heads first")
    prompts = encode_prompts(ckpt.enc, load_prompts(directory)[:num_prompts],
                             block_size=ckpt.block_size, max_new_tokens=max_new_tokens)
    if not prompts:
        raise ValueError(f"every prompt in {os.path.join(directory, PROMPTS_FILE)} encodes to no tokens")
    top_k = min(top_k, ckpt.model.config.vocab_size)
    lens = [len(p) for p in prompts]
    greedy = continuations(ckpt.model, prompts, max_new_tokens=max_new_tokens)
    acc = measure_head_accuracy(ckpt.model, ckpt.heads, greedy, prompt_lens=lens, top_k=top_k)
    ranks = greedy_ranks(ckpt.model, ckpt.heads, greedy, prompt_lens=lens, top_k=top_k)
    seqs = continuations(ckpt.model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    sampled = measure_head_accuracy(ckpt.model, ckpt.heads, seqs, prompt_lens=lens, top_k=top_k,
                                    temperature=temperature, seed=seed)
    meta = {"measured_on": f"continuations ({max_new_tokens} new tokens, greedy and sampled) of the first "
            f"{len(prompts)} prompts of {PROMPTS_FILE}", "num_prompts": len(prompts), "max_new_tokens": max_new_tokens}
    save_accuracy(directory, acc, sampled=sampled, temperature=temperature, ranks=ranks, meta=meta)
    return acc, sampled, ranks


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.tree_search", description="Measure how often a "
                                "checkpoint's Medusa heads are accepted, on greedy and on sampled "
                                "continuations of its prompts.json; save heads_accuracy.json.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (with prompts.json and a tokenizer)")
    p.add_argument("--prompts", type=int, default=32, help="how many prompts of prompts.json to use (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="continuation length per prompt (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=10, help="ranks measured per head (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE,
                   help="temperature of the sampled table, the one rejection sampling uses (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled continuations and draws (default: %(default)s)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    ns = p.parse_args(argv)
    try:
        if ns.prompts < 1 or ns.max_new_tokens < 3 or ns.top_k < 1:
            raise ValueError("--prompts and --top-k must be >= 1 and --max-new-tokens >= 3")
        if not ns.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {ns.temperature}")
        tables = recompute_accuracy(ns.ckpt, num_prompts=ns.prompts, max_new_tokens=ns.max_new_tokens,
                                    top_k=ns.top_k, temperature=ns.temperature, device=pick_device(ns.device),
                                    seed=ns.seed)
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"saved {os.path.join(ns.ckpt, ACCURACY_FILE)}")
    acc, sampled, ranks = tables
    print(f"-- greedy acceptance\n{format_accuracy(acc)}")
    print("tokens/step of build_tree replayed on these greedy continuations (bonus token counted) by node budget:")
    print("  ".join(f"{n} nodes: {replay_greedy(ranks, build_tree(acc, n)[0]):.2f}" for n in REPORT_BUDGETS))
    print(f"-- rejection sampling at T={ns.temperature:g}: candidates drawn from the heads\n{format_accuracy(sampled)}")
    print("expected tokens/step of build_tree (product rule, bonus token counted) by node budget:")
    print("  ".join(f"{n} nodes: {build_tree(sampled, n)[1]:.2f}" for n in REPORT_BUDGETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
