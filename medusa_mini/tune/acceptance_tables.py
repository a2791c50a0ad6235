"""How often each Medusa head's guesses are accepted: the table acc[k][r] that trees are built from.

acc[k][r] = P(head k+1's rank-r guess is the backbone's own greedy token k+2 places ahead), counted on
greedy continuations of held-out prompts: the chance that greedy acceptance takes the guess once the
node above it was taken. `tree.build_tree` multiplies these along paths; heads_accuracy.json stores it.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

from ..hydra import heads_logits, next_tokens
from ..io.safetensors import atomic_write_text, read_json
from ..model import GPT
from ..training import sample_continuations
from ..tree import check_acc

HeadsFn = Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]  # hidden [..., C] -> [K, ..., V]
ACCURACY_FILE = "heads_accuracy.json"
SAMPLING_TEMPERATURE = 0.8  # the command lines' sampling default


@torch.no_grad()
def continuations(
    model: GPT, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
    batch_size: int = 16,
) -> list[list[int]]:
    """Each prompt + the backbone's continuation: greedy at temperature 0 (token for token what
    `generate` writes), else sampled from a generator seeded with `seed`. Prompts of equal length run
    together (no padding), `batch_size` at a time."""
    block, device = model.config.block_size, model.device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not 0 < len(p) < block:
            raise ValueError(f"prompt {i} has {len(p)} tokens; it needs 1 to {block - 1}")
        by_length.setdefault(len(p), []).append(i)
    out = [list(p) for p in prompts]
    if max_new_tokens < 1:
        return out
    gen = torch.Generator(device=device).manual_seed(seed)
    for members in by_length.values():
        for b in range(0, len(members), batch_size):
            part = members[b : b + batch_size]
            idx = torch.tensor([prompts[i] for i in part], dtype=torch.long, device=device)  # [B, P]
            rows = sample_continuations(model, idx, max_new_tokens=max_new_tokens, temperature=temperature,
                                        generator=gen)  # [B, P + n]
            for i, row in zip(part, rows.tolist()):
                out[i] = row
    return out


@torch.no_grad()
def measure_head_accuracy(
    model: GPT, heads: HeadsFn, sequences: list[list[int]] | torch.Tensor, *,
    prompt_lens: int | Sequence[int] = 0, top_k: int = 10, batch_size: int = 8, chunk: int = 256,
) -> torch.Tensor:
    """acc [K, top_k] float64: how often head k+1's rank-r guess is accepted (see the module docstring).

    sequences: prompt + greedy continuation (see `continuations`); prompt_lens: the prompt part of each.
    Head k+1 at position t guesses token t + k + 2; as in decoding, heads read positions from the
    prompt's last token on, and a position counts only where its target exists.
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
    hits = counts = None  # [K, R] accepted guesses per rank; [K] positions where head k's target exists
    for b in range(0, len(seqs), batch_size):
        batch, P = seqs[b : b + batch_size], plens[b : b + batch_size]
        T = max(len(s) for s in batch)
        # Right padding is harmless: causal attention keeps it out of every real position.
        idx = torch.tensor([s + [0] * (T - len(s)) for s in batch], dtype=torch.long, device=device)
        lengths = torch.tensor([len(s) for s in batch], device=device)[:, None]  # [B, 1]
        starts = torch.tensor([max(p - 1, 0) for p in P], device=device)[:, None]
        t = torch.arange(T, device=device)[None]  # [1, T]
        _, hidden = model(idx, logits_at=slice(0, 0))  # [B, T, C]: only the heads' logits are needed
        rows, cols = ((t >= starts) & (t + 2 < lengths)).nonzero(as_tuple=True)  # [M] each
        following = _following(heads, idx)  # [B, T, K] dependent heads read the true tokens (or None)
        for c in range(0, rows.numel(), chunk):  # chunks bound the [K, m, V] head logits
            r, tt = rows[c : c + chunk], cols[c : c + chunk]
            tokens = None if following is None else following[r, tt]  # [m, K]
            head_logits = heads_logits(heads, hidden[r, tt], model, tokens=tokens)  # [K, m, V]
            K = head_logits.shape[0]
            ahead = tt[None] + torch.arange(2, K + 2, device=device)[:, None]  # [K, m]
            exists = ahead < lengths[r, 0][None]
            rr = r[None].expand(K, -1)  # [K, m]
            guesses = head_logits.topk(top_k, dim=-1).indices  # [K, m, R]
            target = idx[rr, ahead.clamp(max=T - 1)]  # [K, m]
            score = ((guesses == target[..., None]) & exists[..., None]).double()
            if hits is None:
                hits, counts = torch.zeros(K, top_k, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
            hits += score.sum(1).double().cpu()
            counts += exists.sum(1).double().cpu()
    if counts is None or counts.sum() == 0:
        raise ValueError("no position has a target: the sequences are too short (need 3+ tokens)")
    return hits / counts.clamp(min=1)[:, None]


def _following(heads: HeadsFn, idx: torch.Tensor) -> torch.Tensor | None:
    """For dependent (hydra) heads, the true tokens after each position, idx [B, T] -> [B, T, K] (0 past
    the end): along a greedy continuation, the path greedy decoding accepts. None for Medusa's heads."""
    if heads.config.kind != "hydra":
        return None
    y = torch.cat([idx[:, 1:], torch.zeros_like(idx[:, :1])], dim=1)  # [B, T]: token t+1 at column t
    return next_tokens(y, heads.num_heads)


def save_accuracy(directory: str | os.PathLike, acc: torch.Tensor, *, meta: dict | None = None) -> str:
    """Write heads_accuracy.json atomically (a reader never sees half a file), one line per head; return its path."""
    acc = check_acc(acc)
    obj = {"top_k": acc.shape[1], "num_heads": acc.shape[0], "measured_on": "unspecified", **(meta or {})}
    rows = ",\n    ".join(json.dumps([round(x, 6) for x in row]) for row in acc.tolist())
    text = '{\n  "acc": [\n    ' + rows + "\n  ]," + json.dumps(obj, indent=2)[1:]
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    atomic_write_text(path, text + "\n")
    return path


def load_accuracy(directory: str | os.PathLike) -> torch.Tensor:
    """acc [K, R] float64 from heads_accuracy.json; a one-line ValueError for a missing or bad file."""
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    obj = read_json(path, hint=f"measure it with python -m medusa_mini.cli.measure --ckpt {directory}")
    acc = obj.get("acc") if isinstance(obj, dict) else None
    rows = acc if isinstance(acc, list) and acc and all(isinstance(row, list) for row in acc) else [[]]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in rows for x in row)
    if not numbers or len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(f'{path} must hold {{"acc": [[...], ...]}}: one equal-length row of numbers per head')
    if obj.get("top_k", len(rows[0])) != len(rows[0]) or not all(0 <= x <= 1 for row in rows for x in row):
        raise ValueError(f"{path}: top_k must equal the row length and every accuracy must lie in [0, 1]")
    return torch.tensor(rows, dtype=torch.float64)


def format_accuracy(acc: torch.Tensor) -> str:
    """Per head: top-1 and top-5 cumulative acceptance (summed over the first 1 or 5 ranks)."""
    cum = check_acc(acc).cumsum(dim=1)
    lines = ["head  top-1  top-5   (cumulative: accepted among the first r guesses)"]
    lines += [f"{k + 1:>4}  {cum[k, 0]:.3f}  {cum[k, min(4, cum.shape[1] - 1)]:.3f}" for k in range(len(cum))]
    return "\n".join(lines)
