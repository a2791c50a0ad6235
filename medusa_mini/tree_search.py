"""Trees from measured head accuracies, and the tree size from measured step cost.

acc[k][r] is the probability that head k+1's rank-r guess is the backbone's own greedy token, measured
on the backbone's greedy continuations of held-out prompts. Treating heads as independent, a node with
path (r1..rd) is accepted with probability Π_i acc[i][r_i]; the sum of these over a tree, plus the bonus
token, is the expected tokens per step. `build_tree` grows the best tree for a node budget; `auto_tree`
picks the budget with the most expected tokens per second from measured step times (EAGLE-2's idea:
size the draft by what a forward pass costs on this device).

A budget N always counts candidate nodes, the root excluded: the verify pass feeds N + 1 tokens and
`Tree.num_nodes == N + 1`.

    python -m medusa_mini.tree_search --ckpt out/tiny [--prompts 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import heapq
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from .cli_common import PROMPTS_FILE, OneLineParser, load_for_decoding, load_prompts, pick_device
from .decoding import medusa_step, prefill, sync_device
from .model import GPT, KVCache
from .safetensors_io import atomic_write_text, read_json
from .training import sample_continuations
from .tree import Tree

HeadsFn = Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]  # hidden [..., C] -> [K, ..., V]
ACCURACY_FILE = "heads_accuracy.json"
REPORT_BUDGETS = (4, 8, 16, 32, 64)


# ---- measuring accuracy ----------------------------------------------------------------------


@torch.no_grad()
def greedy_continuations(
    model: GPT, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """Each prompt + the backbone's greedy continuation, token for token what `generate` writes.

    Prompts of equal length need no padding, so they run together, up to `batch_size` at a time,
    through `training.sample_continuations` at temperature 0.
    """
    block, device = model.config.block_size, model.device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not 0 < len(p) < block:
            raise ValueError(f"prompt {i} has {len(p)} tokens; it needs 1 to {block - 1}")
        by_length.setdefault(len(p), []).append(i)
    out = [list(p) for p in prompts]
    if max_new_tokens < 1:
        return out
    for members in by_length.values():
        for b in range(0, len(members), batch_size):
            part = members[b : b + batch_size]
            idx = torch.tensor([prompts[i] for i in part], dtype=torch.long, device=device)  # [B, P]
            rows = sample_continuations(model, idx, max_new_tokens=max_new_tokens, temperature=0.0)  # [B, P + n]
            for i, row in zip(part, rows.tolist()):
                out[i] = row
    return out


@torch.no_grad()
def measure_head_accuracy(
    model: GPT, heads: HeadsFn, sequences: list[list[int]] | torch.Tensor, *,
    prompt_lens: int | Sequence[int] = 0, top_k: int = 10, batch_size: int = 8, chunk: int = 256,
) -> torch.Tensor:
    """acc [K, top_k] float64: acc[k][r] = P(head k+1's rank-r guess is the token k+2 places ahead).

    sequences: prompt + greedy continuation (see `greedy_continuations`); prompt_lens: the prompt part
    of each. Head k+1 reading the hidden state at position t guesses sequence[t + k + 2]. As in
    decoding, heads read positions from the prompt's last token on, and a position counts for a head
    only where its target exists. Rows need not sum to 1: ranks beyond top_k may hold the token.
    """
    seqs = sequences.tolist() if isinstance(sequences, torch.Tensor) else [list(s) for s in sequences]
    plens = [prompt_lens] * len(seqs) if isinstance(prompt_lens, int) else list(prompt_lens)
    if not seqs or len(plens) != len(seqs):
        raise ValueError("give at least one sequence and one prompt length per sequence")
    V, block, device = model.config.vocab_size, model.config.block_size, model.device
    if not 0 < top_k <= V:
        raise ValueError(f"top_k={top_k} must be between 1 and the vocabulary size {V}")
    if max(len(s) for s in seqs) > block:
        raise ValueError(f"a sequence is longer than the context ({block} tokens)")
    hits = counts = None  # [K, R] right guesses per rank; [K] positions where head k's target exists
    for b in range(0, len(seqs), batch_size):
        batch, P = seqs[b : b + batch_size], plens[b : b + batch_size]
        T = max(len(s) for s in batch)
        # Right padding is harmless: causal attention keeps it out of every real position.
        idx = torch.tensor([s + [0] * (T - len(s)) for s in batch], dtype=torch.long, device=device)
        lengths = torch.tensor([len(s) for s in batch], device=device)[:, None]  # [B, 1]
        starts = torch.tensor([max(p - 1, 0) for p in P], device=device)[:, None]
        t = torch.arange(T, device=device)[None]  # [1, T]
        _, hidden = model(idx, logits_at=slice(0, 0))  # the backbone's own logits are not needed
        rows, cols = ((t >= starts) & (t + 2 < lengths)).nonzero(as_tuple=True)  # [M] each
        for c in range(0, rows.numel(), chunk):  # chunks bound the [K, m, V] head logits
            r, tt = rows[c : c + chunk], cols[c : c + chunk]
            guesses = heads(hidden[r, tt], model.lm_head).topk(top_k, dim=-1).indices  # [K, m, R]
            K = guesses.shape[0]
            ahead = tt[None] + torch.arange(2, K + 2, device=device)[:, None]  # [K, m]
            exists = ahead < lengths[r, 0][None]
            target = idx[r[None].expand(K, -1), ahead.clamp(max=T - 1)]  # [K, m]
            right = (guesses == target[..., None]) & exists[..., None]
            if hits is None:
                hits, counts = torch.zeros(K, top_k, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
            hits += right.sum(1).double().cpu()
            counts += exists.sum(1).double().cpu()
    if counts is None or counts.sum() == 0:
        raise ValueError("no position has a target: the sequences are too short (need 3+ tokens)")
    return hits / counts.clamp(min=1)[:, None]


def save_accuracy(directory: str | os.PathLike, acc: torch.Tensor, *, meta: dict | None = None) -> str:
    """Write heads_accuracy.json atomically (a reader never sees half a file); return its path."""
    acc = _check_acc(acc)
    obj = {"top_k": acc.shape[1], "num_heads": acc.shape[0], "measured_on": "unspecified", **(meta or {})}
    rows = ",\n    ".join(json.dumps([round(x, 6) for x in row]) for row in acc.tolist())
    # One line per head keeps the table readable; the rest is ordinary indented JSON.
    text = '{\n  "acc": [\n    ' + rows + "\n  ]," + json.dumps(obj, indent=2)[1:] + "\n"
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    atomic_write_text(path, text)
    return path


def load_accuracy(directory: str | os.PathLike) -> torch.Tensor:
    """acc [K, R] float64 from heads_accuracy.json; a one-line ValueError for a missing or bad file."""
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    obj = read_json(path, hint=f"measure it with python -m medusa_mini.tree_search --ckpt {directory}")
    acc = obj.get("acc") if isinstance(obj, dict) else None
    rows = acc if isinstance(acc, list) and acc and all(isinstance(row, list) for row in acc) else [[]]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in rows for x in row)
    if not numbers or len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(f'{path} must hold {{"acc": [[...], ...]}}: one equal-length row of numbers per head')
    if obj.get("top_k", len(rows[0])) != len(rows[0]) or not all(0 <= x <= 1 for row in rows for x in row):
        raise ValueError(f"{path}: top_k must equal the row length and every accuracy must lie in [0, 1]")
    return torch.tensor(rows, dtype=torch.float64)


# ---- trees from accuracies -------------------------------------------------------------------


def _check_acc(acc: torch.Tensor) -> torch.Tensor:
    acc = torch.as_tensor(acc, dtype=torch.float64).cpu()
    if acc.dim() != 2 or 0 in acc.shape:
        raise ValueError(f"accuracies must be a [heads, ranks] table, got shape {list(acc.shape)}")
    if not bool(((acc >= 0) & (acc <= 1)).all()):
        raise ValueError("accuracies must be probabilities in [0, 1]")
    return acc


def build_tree(acc: torch.Tensor, num_nodes: int) -> tuple[Tree, float]:
    """The tree of `num_nodes` candidates (root excluded) grown greedily by expected acceptance.

    Candidates are the next sibling and the first child of every chosen node; the one with the
    largest value Π_i acc[i][r_i] joins next (ties: shallower, then smaller ranks). A child is offered
    only after its parent and rank r+1 only after rank r, so every prefix is present. When each row
    of acc decreases with rank, values decrease along these offers and the greedy tree is the optimum.
    Returns (tree, expected tokens per step = 1 + Σ values, the bonus token counted).
    """
    a = _check_acc(acc).tolist()
    K, R = len(a), len(a[0])
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    heap = [(-a[0][0], 1, (0,), 1.0)]  # (-value, depth, choice, parent's value)
    chosen, total = [], 0.0
    while heap and len(chosen) < num_nodes:
        neg, depth, choice, parent_value = heapq.heappop(heap)
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
    a = _check_acc(acc).tolist()
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
    repeat: int = 5, device: torch.device | str | None = None,
) -> dict[int, float]:
    """{N: median ms of one Medusa step with N candidate nodes} after a random prefix.

    A step as medusa_generate runs it: the heads at one hidden state (when `heads` is given; else
    random logits stand in for theirs), then `decoding.medusa_step` with greedy acceptance: their top-k
    as candidates, the tree-masked verify of N + 1 tokens, acceptance, KV compaction. Trees come from
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
    cache = KVCache(model.config, max_len=prefix_len + max(node_counts) + 1, device=device,
                    dtype=model.lm_head.weight.dtype)
    _, hidden = prefill(model, torch.randint(V, (prefix_len,), generator=gen).to(device), cache)
    out: dict[int, float] = {}
    for n in node_counts:
        tree, times = build_tree(shape_acc, n)[0], []
        for rep in range(repeat + 1):  # the first run warms up kernels and allocators
            root = int(torch.randint(V, (1,), generator=gen))
            guesses = torch.randn(K, V, generator=gen).to(device) if heads is None else None  # [K, V]
            cache.length = prefix_len  # every repetition verifies after the same prefix
            sync_device(device)
            t0 = time.perf_counter()
            head_logits = guesses if heads is None else heads(hidden[None], model.lm_head)[:, 0]  # [K, V]
            medusa_step(model, cache, tree, root, head_logits)
            sync_device(device)
            if rep:
                times.append(1000 * (time.perf_counter() - t0))
        out[n] = statistics.median(times)
    return out


def auto_tree(acc: torch.Tensor, step_ms: dict[int, float]) -> tuple[Tree, str]:
    """The tree whose budget N (candidates, root excluded) maximises expected tokens per second.

    For each N in step_ms: build_tree(acc, N); expected tokens/s = its tokens per step / step_ms[N].
    Ties go to the smaller budget. Returns the tree and a short table explaining the choice.
    """
    if not step_ms:
        raise ValueError("step_ms is empty: measure at least one node budget")
    rows = []
    for n in sorted(step_ms):
        if step_ms[n] <= 0:
            raise ValueError(f"step time for {n} nodes must be positive, got {step_ms[n]}")
        tree, expected = build_tree(acc, n)
        rows.append((n, tree, expected, float(step_ms[n]), 1000 * expected / step_ms[n]))
    best = max(rows, key=lambda row: (row[4], -row[0]))
    lines = ["nodes  tokens/step  ms/step  tokens/s   (expected; nodes exclude the root, bonus token counted)"]
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


def accuracy_on_prompts(
    model: GPT, heads: HeadsFn, prompts: list[list[int]], *, max_new_tokens: int, top_k: int = 10
) -> torch.Tensor:
    """acc measured on the backbone's greedy continuations of `prompts` (token ids)."""
    seqs = greedy_continuations(model, prompts, max_new_tokens=max_new_tokens)
    return measure_head_accuracy(model, heads, seqs, prompt_lens=[len(p) for p in prompts],
                                 top_k=min(top_k, model.config.vocab_size))


def recompute_accuracy(
    directory: str, *, num_prompts: int = 32, max_new_tokens: int = 64, top_k: int = 10,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Measure acc for a checkpoint on its prompts.json, save heads_accuracy.json, return acc."""
    ckpt = load_for_decoding(directory, device=torch.device(device))  # model, heads, tokenizer
    if ckpt.heads is None:
        raise ValueError(f"checkpoint {directory} has no Medusa heads; train heads first")
    prompts = encode_prompts(ckpt.enc, load_prompts(directory)[:num_prompts],
                             block_size=ckpt.block_size, max_new_tokens=max_new_tokens)
    if not prompts:
        raise ValueError(f"every prompt in {os.path.join(directory, PROMPTS_FILE)} encodes to no tokens")
    acc = accuracy_on_prompts(ckpt.model, ckpt.heads, prompts, max_new_tokens=max_new_tokens, top_k=top_k)
    meta = {"measured_on": f"greedy continuations ({max_new_tokens} new tokens) of the first "
            f"{len(prompts)} prompts of {PROMPTS_FILE}", "num_prompts": len(prompts), "max_new_tokens": max_new_tokens}
    save_accuracy(directory, acc, meta=meta)
    return acc


def format_accuracy(acc: torch.Tensor) -> str:
    """Per head: top-1 and top-5 cumulative accuracy (the right token among the first r guesses)."""
    cum = _check_acc(acc).cumsum(dim=1)
    lines = ["head  top-1  top-5   (cumulative: the right token among the first r guesses)"]
    lines += [f"{k + 1:>4}  {cum[k, 0]:.3f}  {cum[k, min(4, cum.shape[1] - 1)]:.3f}" for k in range(len(cum))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.tree_search", description="Measure a "
                                "checkpoint's Medusa head accuracies on greedy continuations of its "
                                "prompts.json; save heads_accuracy.json.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (with prompts.json and a tokenizer)")
    p.add_argument("--prompts", type=int, default=32, help="how many prompts of prompts.json to use (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy continuation length per prompt (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=10, help="ranks measured per head (default: %(default)s)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    ns = p.parse_args(argv)
    try:
        if ns.prompts < 1 or ns.max_new_tokens < 3 or ns.top_k < 1:
            raise ValueError("--prompts and --top-k must be >= 1 and --max-new-tokens >= 3")
        acc = recompute_accuracy(ns.ckpt, num_prompts=ns.prompts, max_new_tokens=ns.max_new_tokens,
                                 top_k=ns.top_k, device=pick_device(ns.device))
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"saved {os.path.join(ns.ckpt, ACCURACY_FILE)}")
    print(format_accuracy(acc))
    print("expected tokens/step of build_tree (bonus token counted) by node budget (root excluded):")
    print("  ".join(f"{n} nodes: {build_tree(acc, n)[1]:.2f}" for n in REPORT_BUDGETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
