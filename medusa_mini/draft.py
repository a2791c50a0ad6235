"""Sampled drafts: tree candidates drawn from the heads' distributions q instead of their top-k.

Speculative sampling (Leviathan et al. 2023; on a tree, SpecInfer) accepts a candidate x drawn from q
with probability min(1, p(x) / q(x)) and, after a rejection, moves the target to norm(max(0, p - q)).
Each try then emits exactly p, whatever q is, so this is as lossless as the top-k rule of
`acceptance.rejection_accept`; but a node now accepts Σ min(p, q) on average instead of p(x) — far
more when p is flat (sampling at T > 0) and the heads' q resembles it.

A node's siblings are drawn from one head without replacement (Gumbel-top-k), so no node is wasted on
a repeated token; the i-th try then uses q_i = q without the earlier draws, renormalised. Draws and
ratios are computed from log q, so a sharp q (low temperature) never yields an invalid draft.

Shapes: D depths (heads used), R draws per depth, V vocabulary, M positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Draft:
    """One step's sampled candidates. log_q: [D, V] log of head d+1's draft distribution;
    samples: [D, R] distinct tokens drawn from it, in draw order (a node of rank r at depth d+1
    holds samples[d, r]).

    rows: None for Medusa's heads, whose q depends only on the depth. Dependent heads (hydra.py) give
    every parent node its own q: then log_q and samples have one row per parent node, and rows[node]
    is the row of that node's children (-1 for a leaf)."""

    log_q: torch.Tensor
    samples: torch.Tensor
    rows: tuple[int, ...] | None = None

    def for_children_of(self, node: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log q [V], samples [R]) that the children of `node` (at `depth`) were drawn from."""
        row = depth if self.rows is None else self.rows[node]
        return self.log_q[row], self.samples[row]


def draft_log_probs(head_logits: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """log q: head logits [..., V] -> [..., V], at the temperature p is sampled at."""
    return F.log_softmax(head_logits.float() / temperature, dim=-1)


def gumbel_top_k(log_q: torch.Tensor, width: int, generator: torch.Generator | None) -> torch.Tensor:
    """`width` draws without replacement from q, in draw order: log_q [..., V] -> [..., width].

    Adding independent Gumbel noise to log q and taking the top `width` is exactly sequential
    sampling without replacement (the Gumbel-top-k trick); it needs no positive probability to survive
    the float32 exp. One approximation remains: float32 uniforms bound the noise to about
    [-2.8, 16.6], so a token more than ~19 nats below the most likely one is never drawn first (its q
    is below 4e-9); float64 uniforms would lift that bound.
    """
    u = torch.rand(log_q.shape, generator=generator, device=log_q.device)
    gumbel = -torch.log(-torch.log(u))  # u = 0 gives -inf: that token simply comes last
    return (log_q + gumbel).topk(width, dim=-1).indices


def sample_draft(
    head_logits: torch.Tensor, *, depth: int, width: int, temperature: float, generator: torch.Generator | None
) -> Draft:
    """head_logits [K, V] -> Draft(log_q [depth, V], samples [depth, width])."""
    log_q = draft_log_probs(head_logits[:depth], temperature=temperature)  # [D, V]
    return Draft(log_q=log_q, samples=gumbel_top_k(log_q, width, generator))


def without(log_q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log q [..., V] with `tokens` [..., n] removed and renormalised: the distribution of the next
    draw without replacement."""
    log_q = log_q.scatter(-1, tokens, float("-inf"))
    return log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)


def _np_without(log_q: np.ndarray, tokens: list[int]) -> np.ndarray:
    """`without` for one float64 row, as `try_candidates` needs it."""
    if not tokens:
        return log_q
    log_q = log_q.copy()
    log_q[tokens] = -np.inf
    top = log_q.max()
    return log_q - (top + np.log(np.exp(log_q - top).sum()))


def try_candidates(
    p: torch.Tensor, log_q: torch.Tensor, samples: list[int], ranks: list[int], generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor | None]:
    """The tries at one tree node: candidates samples[r] for r in `ranks` (increasing), against target p [V].

    Try i accepts x = samples[r] with probability min(1, p(x) / q_r(x)), q_r = q without samples[:r]
    (draws skipped by the tree still count as removed: x was drawn after them). After a rejection
    p <- norm(max(0, p - q_r)). Returns (index into `ranks` of the accepted candidate, None) or
    (None, the residual p, from which the bonus token must be drawn).

    A sequential walk over scalars: it runs in float64 numpy on the host, where each small
    operation costs a microsecond rather than a torch dispatch (one uniform per try, drawn at once).
    """
    u = torch.rand(len(ranks), generator=generator, device=p.device).tolist()
    pn = p.double().cpu().numpy()  # [V]
    lq = log_q.double().cpu().numpy()  # [V]; log q without samples[:removed]
    removed = 0
    for i, r in enumerate(ranks):
        lq, removed = _np_without(lq, samples[removed:r]), r  # removes earlier tries and skipped draws
        x = samples[r]
        # u < p(x) / q(x), compared without dividing (q(x) may underflow to 0: then p(x) > 0 accepts).
        if u[i] * np.exp(lq[x]) < pn[x]:
            return i, None
        residual = np.maximum(pn - np.exp(lq), 0.0)  # [V]
        mass = residual.sum()
        if mass <= 0.0:  # p <= q_r everywhere, i.e. p = q_r up to rounding: every x with p(x) > 0 passes
            return (i, None) if pn[x] > 0 else (None, torch.from_numpy(pn).to(p))
        pn = residual / mass
    return None, torch.from_numpy(pn).to(p)


def draft_acceptance(
    p: torch.Tensor, log_q: torch.Tensor, *, width: int, generator: torch.Generator | None
) -> torch.Tensor:
    """P(the r-th draw from q is the candidate rejection sampling accepts), for r < width.

    p, log_q: [..., V] target and draft at many positions -> [..., width]. Draws once per position
    (as `sample_draft`), then runs the tries of `try_candidates` in expectation over the coins: try r
    is reached with prob. Π_{j<r} (1 - a_j) and accepts with a_r = min(1, p_r(x_r) / q_r(x_r)). So a
    row is a one-draw estimate; its average over many positions is the probability. A row sums to the
    chance that one of `width` children is accepted (1 when width = V: the last try has p = q). It
    assumes the children hold ranks 0, 1, 2, ... with none skipped, as `build_tree` makes them.
    """
    lead, V = log_q.shape[:-1], log_q.shape[-1]
    p, log_q = p.reshape(-1, V).float(), log_q.reshape(-1, V).float()  # [M, V]
    draws = gumbel_top_k(log_q, width, generator)  # [M, R]
    reach = torch.ones(p.shape[0], device=p.device)  # [M]
    out = []
    for r in range(width):
        x = draws[:, r : r + 1]  # [M, 1]
        a = (p.gather(-1, x).log() - log_q.gather(-1, x)).exp().clamp(max=1.0)[:, 0]  # [M]
        out.append(reach * a)
        reach = reach * (1 - a)
        residual = (p - log_q.exp()).clamp_min(0.0)  # [M, V]
        p = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
        log_q = without(log_q, x)
    return torch.stack(out, dim=-1).reshape(*lead, width)  # [..., R]
