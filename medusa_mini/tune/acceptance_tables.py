"""How often each Medusa head's guesses are accepted: the table acc[k][r] that trees are built from.

acc[k][r] is the probability that head k+1's rank-r guess is accepted, given that the node above it
was. Acceptance depends on the rule, so there are two tables:

- greedy (temperature 0): acc[k][r] = P(the guess is the backbone's own greedy token k+2 places
  ahead), counted on the backbone's greedy continuations of held-out prompts;
- sampled (temperature T > 0): acc[k][r] = P(rejection sampling accepts the r-th candidate drawn
  from head k+1's q), its parent accepted (drafts.draft_acceptance: candidates drawn without
  replacement, accepted with min(1, p/q)), averaged over continuations sampled at T (the text that
  sampling actually meets). p is the backbone's distribution at T (without top-p: decoding with
  top-p < 1 meets a somewhat different target).

As T -> 0, p and q become one-hot on the greedy token and the head's top guess, and the second table
becomes the first. Both are
stored in heads_accuracy.json, which `train_tiny.py` and `python -m medusa_mini.cli.measure` write
and the tree builders read.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

from ..hydra import heads_logits, next_tokens
from ..io.safetensors import atomic_write_text, read_json
from ..model import GPT
from ..proposal import draft_log_probs
from ..sampling import sampling_probs
from ..training import sample_continuations
from ..tree import check_acc
from .drafts import draft_acceptance

HeadsFn = Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]  # hidden [..., C] -> [K, ..., V]
ACCURACY_FILE = "heads_accuracy.json"
SAMPLING_TEMPERATURE = 0.8  # the sampled table's temperature, and the command lines' sampling default
MISS = "-"  # in a stored rank string: the target is not among the head's top-k guesses (replay.py)


@torch.no_grad()
def continuations(
    model: GPT, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
    batch_size: int = 16,
) -> list[list[int]]:
    """Each prompt + the backbone's continuation: greedy at temperature 0 (token for token what
    `generate` writes), else sampled at `temperature` from a generator seeded with `seed`.

    Prompts of equal length need no padding, so they run together, up to `batch_size` at a time,
    through `training.sample_continuations`.
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


def _with_prompt_lens(
    sequences: list[list[int]] | torch.Tensor, prompt_lens: int | Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """Sequences as lists of ids, and one prompt length per sequence."""
    seqs = sequences.tolist() if isinstance(sequences, torch.Tensor) else [list(s) for s in sequences]
    return seqs, [prompt_lens] * len(seqs) if isinstance(prompt_lens, int) else list(prompt_lens)


@torch.no_grad()
def measure_head_accuracy(
    model: GPT, heads: HeadsFn, sequences: list[list[int]] | torch.Tensor, *,
    prompt_lens: int | Sequence[int] = 0, top_k: int = 10, temperature: float = 0.0, batch_size: int = 8,
    chunk: int = 256, seed: int = 0,
) -> torch.Tensor:
    """acc [K, top_k] float64: how often head k+1's rank-r guess is accepted (see the module docstring).

    sequences: prompt + continuation (see `continuations`, at the same temperature); prompt_lens: the
    prompt part of each. Head k+1 reading the hidden state at position t guesses token t + k + 2. At
    temperature 0 a guess counts 1 when it equals that token; at T > 0 the r-th draw from the head's q
    counts its chance of being accepted against p, the backbone's distribution at position t + k + 1
    (which predicts token t + k + 2); the draws come from a generator seeded with `seed`. As in decoding,
    heads read positions from the prompt's last token on, and a position counts for a head only where
    its target exists. Rows need not sum to 1: ranks beyond top_k may hold the token.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    seqs, plens = _with_prompt_lens(sequences, prompt_lens)
    if not seqs or len(plens) != len(seqs):
        raise ValueError("give at least one sequence and one prompt length per sequence")
    V, block, device = model.config.vocab_size, model.config.block_size, model.device
    if not 0 < top_k <= V:
        raise ValueError(f"top_k={top_k} must be between 1 and the vocabulary size {V}")
    if max(len(s) for s in seqs) > block:
        raise ValueError(f"a sequence is longer than the context ({block} tokens)")
    hits = counts = None  # [K, R] accepted guesses per rank; [K] positions where head k's target exists
    gen = torch.Generator(device=device).manual_seed(seed)
    for b in range(0, len(seqs), batch_size):
        batch, P = seqs[b : b + batch_size], plens[b : b + batch_size]
        T = max(len(s) for s in batch)
        # Right padding is harmless: causal attention keeps it out of every real position.
        idx = torch.tensor([s + [0] * (T - len(s)) for s in batch], dtype=torch.long, device=device)
        lengths = torch.tensor([len(s) for s in batch], device=device)[:, None]  # [B, 1]
        starts = torch.tensor([max(p - 1, 0) for p in P], device=device)[:, None]
        t = torch.arange(T, device=device)[None]  # [1, T]
        # The backbone's own logits are needed only to score guesses by p.
        logits, hidden = model(idx, logits_at=slice(None) if temperature > 0 else slice(0, 0))  # [B, T, V], [B, T, C]
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
            if temperature > 0:
                p = sampling_probs(logits[rr, (ahead - 1).clamp(max=T - 1)], temperature=temperature)  # [K, m, V]
                log_q = draft_log_probs(head_logits, temperature=temperature)  # [K, m, V]
                score = draft_acceptance(p, log_q, width=top_k, generator=gen) * exists[..., None]  # [K, m, R]
            else:
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
    """For dependent (hydra) heads, the true tokens after each position: idx [B, T] -> [B, T, K]
    (x_{t+1..t+K}, 0 past the end, where no target exists); None for Medusa's heads.

    Along a greedy continuation these are exactly the tokens of the tree path that greedy decoding
    accepts, so acc[k][r] (and the rank strings) are those decoding meets."""
    if not getattr(heads, "reads_drafted_tokens", False):
        return None
    y = torch.cat([idx[:, 1:], torch.zeros_like(idx[:, :1])], dim=1)  # [B, T]: token t+1 at column t
    return next_tokens(y, heads.num_heads)


def accuracy_on_prompts(
    model: GPT, heads: HeadsFn, prompts: list[list[int]], *, max_new_tokens: int, top_k: int = 10,
    temperature: float = 0.0, seed: int = 0,
) -> torch.Tensor:
    """acc measured on the backbone's continuations of `prompts` (token ids) at `temperature`."""
    seqs = continuations(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return measure_head_accuracy(model, heads, seqs, prompt_lens=[len(p) for p in prompts],
                                 top_k=min(top_k, model.config.vocab_size), temperature=temperature)


def save_accuracy(
    directory: str | os.PathLike, acc: torch.Tensor, *, sampled: torch.Tensor | None = None,
    temperature: float | None = None, ranks: list[str] | None = None, meta: dict | None = None,
) -> str:
    """Write heads_accuracy.json atomically (a reader never sees half a file); return its path.

    acc: the greedy table; sampled: the table measured at `temperature` (optional, same shape);
    ranks: the greedy rank strings (optional, see `replay.greedy_ranks`), one line each at the end.
    """
    acc = check_acc(acc)
    obj = {"top_k": acc.shape[1], "num_heads": acc.shape[0], "measured_on": "unspecified", **(meta or {})}
    table = lambda t: ",\n    ".join(json.dumps([round(x, 6) for x in row]) for row in t.tolist())  # noqa: E731
    # One line per head keeps the tables readable; the rest is ordinary indented JSON.
    text = '{\n  "acc": [\n    ' + table(acc) + "\n  ],"
    if sampled is not None:
        sampled = check_acc(sampled)
        if sampled.shape != acc.shape or temperature is None or temperature <= 0:
            raise ValueError("the sampled table needs the greedy table's shape and a temperature > 0")
        text += '\n  "sampled_acc": [\n    ' + table(sampled) + "\n  ],"
        obj["sampled_temperature"] = temperature
    body = json.dumps(obj, indent=2)[1:-2]  # the fields, without the closing brace
    if ranks is not None:
        body += ',\n  "greedy_ranks": [\n    ' + ",\n    ".join(json.dumps(r) for r in ranks) + "\n  ]"
    text += body + "\n}\n"
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    atomic_write_text(path, text)
    return path


def _read_accuracy_file(directory: str | os.PathLike, *, hint: str = "") -> tuple[str, object]:
    """(path, parsed JSON) of a checkpoint's heads_accuracy.json; a one-line ValueError if unreadable."""
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    return path, read_json(path, hint=hint)


def load_accuracy(directory: str | os.PathLike, *, sampled: bool = False) -> torch.Tensor:
    """acc [K, R] float64 from heads_accuracy.json: the greedy table, or with `sampled=True` the table
    measured at `sampled_temperature` (see `sampled_temperature`). A one-line ValueError for a missing
    or bad file, or a missing sampled table."""
    hint = f"measure it with python -m medusa_mini.cli.measure --ckpt {directory}"
    path, obj = _read_accuracy_file(directory, hint=hint)
    key = "sampled_acc" if sampled else "acc"
    if sampled and isinstance(obj, dict) and key not in obj:
        raise ValueError(f"{path} has no sampled table; re-measure with python -m medusa_mini.cli.measure "
                         f"--ckpt {directory}")
    acc = obj.get(key) if isinstance(obj, dict) else None
    rows = acc if isinstance(acc, list) and acc and all(isinstance(row, list) for row in acc) else [[]]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in rows for x in row)
    if not numbers or len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(f'{path} must hold {{"{key}": [[...], ...]}}: one equal-length row of numbers per head')
    if obj.get("top_k", len(rows[0])) != len(rows[0]) or not all(0 <= x <= 1 for row in rows for x in row):
        raise ValueError(f"{path}: top_k must equal the row length and every accuracy must lie in [0, 1]")
    return torch.tensor(rows, dtype=torch.float64)


def load_greedy_ranks(directory: str | os.PathLike) -> list[str] | None:
    """The greedy rank strings stored in heads_accuracy.json, or None when the file has none."""
    path, obj = _read_accuracy_file(directory)
    ranks = obj.get("greedy_ranks") if isinstance(obj, dict) else None
    if ranks is None:
        return None
    allowed = set("0123456789 " + MISS)
    if not isinstance(ranks, list) or not all(isinstance(r, str) and set(r) <= allowed for r in ranks):
        raise ValueError(f'{path}: "greedy_ranks" must be strings of ranks 0-9, "{MISS}" and spaces')
    return ranks


def sampled_temperature(directory: str | os.PathLike) -> float | None:
    """The temperature of the stored sampled table, or None when the file has none."""
    _, obj = _read_accuracy_file(directory)
    t = obj.get("sampled_temperature") if isinstance(obj, dict) and "sampled_acc" in obj else None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 else None


def format_accuracy(acc: torch.Tensor) -> str:
    """Per head: top-1 and top-5 cumulative acceptance (summed over the first 1 or 5 ranks)."""
    cum = check_acc(acc).cumsum(dim=1)
    lines = ["head  top-1  top-5   (cumulative: accepted among the first r guesses)"]
    lines += [f"{k + 1:>4}  {cum[k, 0]:.3f}  {cum[k, min(4, cum.shape[1] - 1)]:.3f}" for k in range(len(cum))]
    return "\n".join(lines)
