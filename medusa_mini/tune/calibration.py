"""How often a head's guess is right, given the probability the head gave it: dynamic trees' calibration.

A dynamic tree (dynamic.py) ranks candidate paths by the heads' confidence. Cross-entropy leaves small
heads badly calibrated, so the confidence is read through a table measured here: on the backbone's
own greedy continuations, every top-k guess of head k is put in a bin by its probability q and counted
right when it is the token greedy decoding writes there. Each head's rates are then made
non-decreasing in q (pool-adjacent-violators: a more confident guess is never rated lower), and an
empty bin takes its neighbours' rate. A path's score multiplies its nodes' rates, so each rate is the
conditional one: head k's guesses count only where the true tokens before its target were among the
guesses of heads 1..k-1 (the heads' errors are correlated: after right guesses, more follow).

Two tables, one per kind of acceptance, stored together as heads_calibration.json next to the checkpoint:
- on greedy continuations, for greedy (and typical) acceptance: a guess is right when it is the argmax;
- on sampled continuations at temperature T, for rejection sampling with top-k drafts: there a node is
  accepted exactly when a draw x ~ p would be its token (accepting a point-mass draft c with
  probability p(c), then the next sibling under the residual, p with c removed, is drawing x ~ p and
  keeping the sibling equal to x), so the rate of "the sampled token is this guess" is its acceptance.

Shapes: K heads, m positions, R ranks, V vocabulary.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from ..dynamic import Calibration
from ..hydra import heads_logits
from ..io.safetensors import atomic_write_text, read_json
from ..model import GPT
from .acceptance_tables import HeadsFn, _following, _with_prompt_lens

CALIBRATION_FILE = "heads_calibration.json"
EDGES = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def monotone(rates: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `rates` in weighted squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for r, w in zip(rates, weights):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            total = w1 + w2
            blocks[-1] = [(m1 * w1 + m2 * w2) / total if total else (m1 + m2) / 2, total, n1 + n2]
    return [m for m, _, n in blocks for _ in range(n)]


@torch.no_grad()
def measure_calibration(model: GPT, heads: HeadsFn, sequences: list[list[int]], *, prompt_lens: int | Sequence[int],
                        top_k: int = 4, edges: Sequence[float] = EDGES) -> Calibration:
    """Each head's acceptance rate per confidence bin, on greedy continuations (prompt + continuation)."""
    seqs, plens = _with_prompt_lens(sequences, prompt_lens)
    edge_t = torch.tensor(edges)
    hits = counts = None  # [K, 2, bins] right guesses and guesses, per head, line and bin
    for s, P in zip(seqs, plens):
        idx = torch.tensor([s], dtype=torch.long, device=model.device)  # [1, L]
        _, hidden = model(idx, logits_at=slice(0, 0))  # [1, L, C]
        t = torch.arange(max(P - 1, 0), len(s) - 2, device=model.device)  # [m] positions with a next-but-one token
        following = _following(heads, idx)
        tokens = None if following is None else following[0, t]  # [m, K]
        q = heads_logits(heads, hidden[0, t], model, tokens=tokens).float().softmax(dim=-1)  # [K, m, V]
        top = q.topk(min(top_k, q.shape[-1]), dim=-1)  # [K, m, R]
        K = q.shape[0]
        ahead = t[None] + torch.arange(2, K + 2, device=model.device)[:, None]  # [K, m]
        exists = (ahead < len(s))[..., None].expand_as(top.indices).cpu()  # [K, m, R]
        right = (top.indices == idx[0, ahead.clamp(max=len(s) - 1)][..., None]).cpu()  # [K, m, R]
        R = right.shape[-1]
        rank = torch.where(right.any(-1), right.int().argmax(-1), R)  # [K, m] the true token's rank (R: none)
        bins = (torch.bucketize(top.values.cpu(), edge_t, right=True) - 1).clamp(0, len(edges) - 2)  # [K, m, R]
        if hits is None:
            hits, counts = torch.zeros(K, 2, len(edges) - 1), torch.zeros(K, 2, len(edges) - 1)
        for k in range(K):
            # A path's score multiplies its nodes' rates, each given that the nodes above were right:
            # head k counts where the true tokens before its target were among heads 1..k-1's guesses,
            # on line 0 when they were all top guesses, on line 1 otherwise.
            above = rank[:k]
            main = (above == 0).all(dim=0)  # [m] (True for head 1: nothing above it)
            found = (above < R).all(dim=0)
            for line, where in ((0, main), (1, found & ~main)):
                keep = (where & exists[k, :, 0])[:, None].expand(-1, R)  # [m, R]
                hits[k, line].index_add_(0, bins[k][keep], right[k][keep].float())
                counts[k, line].index_add_(0, bins[k][keep], torch.ones(int(keep.sum())))
    if counts is None:
        raise ValueError("no sequence to measure the heads' calibration on")
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]  # an empty bin starts at its own q
    rates = []
    for k in range(hits.shape[0]):
        lines = []
        for line in range(2):
            h, c = hits[k, line], counts[k, line]
            raw = [float(x / n) if n else m for x, n, m in zip(h, c, mids)]
            lines.append(tuple(round(r, 6) for r in monotone(raw, c.tolist())))
        rates.append(tuple(lines))
    return Calibration(edges=tuple(edges), rates=tuple(rates))


def save_calibration(directory: str | os.PathLike, cal: Calibration, *, sampled: Calibration | None = None,
                     temperature: float | None = None) -> str:
    """Write heads_calibration.json atomically: the greedy table `cal` and, when given, the one measured
    on continuations sampled at `temperature` (same edges); return its path."""
    if (sampled is None) != (temperature is None) or (sampled is not None and sampled.edges != cal.edges):
        raise ValueError("a sampled calibration needs its temperature and the greedy table's edges")

    def rows(c: Calibration) -> str:
        return ",\n    ".join(json.dumps([list(line) for line in r]) for r in c.rates)

    text = f'{{\n  "edges": {json.dumps(list(cal.edges))},\n  "rates": [\n    {rows(cal)}\n  ]'
    if sampled is not None:
        text += f',\n  "sampled_temperature": {temperature},\n  "sampled_rates": [\n    {rows(sampled)}\n  ]'
    path = os.path.join(os.fspath(directory), CALIBRATION_FILE)
    atomic_write_text(path, text + "\n}\n")
    return path


def format_calibration(cal: Calibration) -> str:
    """The table as text: one row per head and line, one column per confidence bin (its lower edge)."""
    head = f"{'a guess of confidence q is right (q from)':<44}" + "".join(f"{e:>5.2f}" for e in cal.edges[:-1])
    rows = [head]
    for k, lines in enumerate(cal.rates):
        names = ("",) if k == 0 else (", below top guesses only", ", below any other guess")
        for name, line in zip(names, lines):  # head 1 has nothing above it: one line
            rows.append(f"{f'head {k + 1}{name}':<44}" + "".join(f"{r:>5.2f}" for r in line))
    return "\n".join(rows)


def load_calibration(directory: str | os.PathLike, *, sampled: bool = False) -> Calibration | None:
    """The stored greedy calibration, or with `sampled` the one measured under sampling; None when the
    checkpoint has none (dynamic trees then use raw q; a file from before sampled tables has no sampled one)."""
    path = os.path.join(os.fspath(directory), CALIBRATION_FILE)
    if not os.path.isfile(path):
        return None
    obj = read_json(path, hint="measure it again with python -m medusa_mini.cli.measure")
    key = "sampled_rates" if sampled else "rates"
    if sampled and isinstance(obj, dict) and key not in obj:
        return None
    try:
        edges = tuple(float(e) for e in obj["edges"])
        rates = tuple(tuple(tuple(float(r) for r in line) for line in head) for head in obj[key])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f'{path} must hold {{"edges": [...], "{key}": [[[...], [...]], ...]}}') from None
    if not rates or any(len(head) != 2 or any(len(line) != len(edges) - 1 for line in head) for head in rates):
        raise ValueError(f"{path}: every head needs two lines of one rate per bin ({len(edges) - 1})")
    return Calibration(edges=edges, rates=rates)
