"""How often rejection sampling accepts a drawn candidate, in expectation: the sampled table's estimator.

With sampled drafts (reference.propose), a node's children are distinct draws from q and are tried in
draw order, each accepted with min(1, p / q_r), q_r being q without the earlier draws. Averaging the
acceptance probability over many positions, rather than running the tries with coins, gives the
rate at which rank r is the accepted child: acc[k][r] of the sampled table (acceptance_tables.py).

Shapes: M positions, V vocabulary, R draws.
"""

from __future__ import annotations

import torch

from ..reference import draw_without_replacement


def without(log_q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log q [..., V] with `tokens` [..., n] removed and renormalised: the next draw without replacement."""
    log_q = log_q.scatter(-1, tokens, float("-inf"))
    return log_q - torch.logsumexp(log_q, dim=-1, keepdim=True)


def draft_acceptance(
    p: torch.Tensor, log_q: torch.Tensor, *, width: int, generator: torch.Generator | None
) -> torch.Tensor:
    """P(the r-th draw from q is the candidate rejection sampling accepts), for r < width.

    p, log_q: [..., V] target and draft at many positions -> [..., width]. Draws once per position
    (as decoding does), then runs the tries of `reference.try_children` in expectation over the coins:
    try r is reached with prob. Π_{j<r} (1 - a_j) and accepts with a_r = min(1, p_r(x_r) / q_r(x_r)).
    So a row is a one-draw estimate; its average over many positions is the probability. A row sums to
    the chance that one of `width` children is accepted (1 when width = V: the last try has p = q). It
    assumes the children hold ranks 0, 1, 2, ... with none skipped, as `build_tree` makes them.
    """
    lead, V = log_q.shape[:-1], log_q.shape[-1]
    p, log_q = p.reshape(-1, V).float(), log_q.reshape(-1, V).float()  # [M, V]
    draws = draw_without_replacement(log_q, width, generator)  # [M, R]
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
