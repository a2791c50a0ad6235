"""How the next token is chosen: one frozen `Sampling` object, and the target distribution p it defines.

Every decoding layer takes a single `Sampling`, so the settings are checked once, where they are made,
and "temperature 0 means greedy" is decided in one place. p is the backbone's (target) distribution
after temperature and top-p: plain sampling draws from it, and rejection sampling reproduces it exactly.

Randomness enters one way: uniform numbers in [0, 1), drawn from a generator before they are used. A draw from a
distribution is the inverse of its cumulative distribution at one uniform (`inverse_cdf`); distinct draws without
replacement are the top of log q plus Gumbel noise made from uniforms (`gumbel_top_k`). So a rule is a function of its
uniforms, and whoever draws them in the same order makes the same decisions: the reference (reference.py) and the engine
share these functions and neither imports the other.
"""

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACCEPTANCE_RULES = ("greedy", "typical", "rejection")  # exact, §2.3.1's, lossless; decode.py's --method adds plain
SAMPLING_TEMPERATURE = 0.8  # the commands' and reports' temperature when they sample (Sampling's default is greedy)
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Sampling:
    """Decoding settings, checked at construction (ValueError with a one-line fix).

    acceptance: Medusa's rule: "greedy" (exact), "typical" (paper §2.3.1, ε and δ) or "rejection"
        (lossless speculative sampling). At temperature 0 every rule is greedy, and it is stored so;
        None picks rejection when sampling, the rule whose output has plain sampling's distribution.
    temperature: 0 = argmax; > 0 samples from p. top_p: nucleus mass kept in p.
    candidates: for rejection sampling, "drawn" draws the tree's candidates from the heads' q, "topk"
        takes their top-k (both lossless). Plain decoding reads only temperature and top_p.
    """

    acceptance: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    epsilon: float = 0.09
    delta: float = 0.3
    candidates: str = "drawn"

    def __post_init__(self) -> None:
        T = self.temperature
        if isinstance(T, bool) or not (isinstance(T, numbers.Real) and math.isfinite(T) and 0 <= T <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a number from 0 (greedy) to {FLOAT32_MAX:.3g} (float32's "
                             f"largest), not {T!r}")
        if self.acceptance not in (None, *ACCEPTANCE_RULES):
            raise ValueError(f"unknown acceptance rule {self.acceptance!r}: use greedy, typical or rejection")
        if self.acceptance == "greedy" and T > 0:
            raise ValueError("greedy acceptance is for temperature 0; to sample with Medusa use rejection "
                             "(lossless) or typical acceptance")
        if self.candidates not in ("drawn", "topk"):
            raise ValueError(f"unknown candidates {self.candidates!r}: use drawn or topk")
        if isinstance(self.top_p, bool) or not (isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], not {self.top_p!r}")
        if not all(isinstance(x, numbers.Real) and x > 0 for x in (self.epsilon, self.delta)):
            raise ValueError(f"typical acceptance's epsilon, delta must be > 0, not {self.epsilon!r}, {self.delta!r}")
        for name in ("temperature", "top_p", "epsilon", "delta"):  # a numpy number or a Fraction: one torch takes
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "acceptance", "greedy" if T == 0 else (self.acceptance or "rejection"))

    @property
    def greedy(self) -> bool:
        return self.acceptance == "greedy"

    @property
    def draws_candidates(self) -> bool:
        """True when the tree's candidates are drawn from the heads' q (rejection sampling, drawn candidates)."""
        return self.acceptance == "rejection" and self.candidates == "drawn"

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """p: logits [..., V] -> [..., V] (see `sampling_probs`)."""
        return sampling_probs(logits, temperature=self.temperature, top_p=self.top_p)

    def uniforms(self, shape: tuple[int, ...], generator: torch.Generator | None, *,
                 device: torch.device | str) -> torch.Tensor | None:
        """What choosing tokens of `shape` draws: one uniform each, or None when greedy."""
        return None if self.greedy else torch.rand(shape, generator=generator, device=device)

    def next_token(self, logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """The backbone's own next token from logits [..., V] and the uniforms u [...] from `uniforms`: long [...] on
        their device, the argmax when greedy (`greedy_token`), else the draw u makes from p."""
        return greedy_token(logits) if self.greedy else inverse_cdf(self.probs(logits), u)


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of logits [..., V] -> long [...], in float32 (the same for any half precision), ties to the lowest
    id: as `max`'s indices, which a CPU finds in a third of torch.argmax's time."""
    return logits.float().max(dim=-1).indices


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - their maximum) / T in float32, [..., V]: the maximum becomes 0, so no temperature, however
    small, overflows into NaN; a T below float32's smallest normal number acts as that number (p is then
    the argmax's, shared among exact ties)."""
    if not 0 < temperature <= FLOAT32_MAX:
        raise ValueError(f"temperature must be in (0, {FLOAT32_MAX:.3g}] to sample; use greedy for temperature 0")
    z = logits.float()
    return (z - z.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)


def sampling_probs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """p: logits [..., V] -> probabilities [..., V] after temperature and nucleus (top-p) filtering. Plain sampling
    and rejection sampling both call this, which is what makes the latter lossless."""
    probs = F.softmax(scaled(logits, temperature), dim=-1)
    if top_p < 1.0:
        # A stable sort puts equal probabilities in token order, so a tie at the cut keeps the same
        # tokens in a batch as alone, on any device: the lower token ids.
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does (the top
        # token's is 0: a top_p that float32 rounds to 0 would drop it too, so it counts as float32's tiny).
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= max(top_p, torch.finfo(torch.float32).tiny)
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def q_log_probs(head_logits: torch.Tensor, draft_ids: torch.Tensor, *, temperature: float,
                vocab_size: int) -> torch.Tensor:
    """log q over the whole vocabulary: head logits [..., M] over the draft vocabulary draft_ids [M], at
    the temperature p is sampled at -> [..., V], with q = 0 (log q = -inf) outside the draft vocabulary."""
    log_q = F.log_softmax(scaled(head_logits, temperature), dim=-1)  # [..., M]
    full = log_q.new_full((*log_q.shape[:-1], vocab_size), float("-inf"))
    return full.scatter_(-1, draft_ids.expand(log_q.shape), log_q)  # [..., V]: draft_ids [M] as [..., M]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw that uniforms u [...] in [0, 1) make from probs [..., V] (rows need not sum to 1): long
    [...]. A token of probability 0 owns an empty interval of the cumulative distribution: never drawn."""
    cdf = probs.cumsum(dim=-1)  # [..., V]
    return torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True)[..., 0].clamp_(max=probs.shape[-1] - 1)


def gumbel_top_k(log_q: torch.Tensor, width: int, u: torch.Tensor) -> torch.Tensor:
    """The `width` distinct tokens that uniforms u [..., V] draw from q, in order: log_q [..., V] -> [..., width].
    Adding Gumbel noise, -log(-log u), to log q and keeping the top `width` draws without replacement."""
    u = u.clamp_min(torch.finfo(u.dtype).tiny)  # a 0 would rule its token out
    return (log_q - torch.log(-torch.log(u))).topk(width, dim=-1).indices


def typical_threshold(p: torch.Tensor, *, epsilon: float, delta: float) -> torch.Tensor:
    """§2.3.1's bar: min(ε, δ·exp(−H(p))) for p [..., V] -> [...]. A flat p (high entropy) lowers it."""
    minus_entropy = (p * torch.log(p.clamp_min(1e-30))).sum(dim=-1)  # Σ p log p = −H(p)
    return (delta * torch.exp(minus_entropy)).clamp_max(epsilon)


def draw_bounds(rank: torch.Tensor, width: int) -> torch.Tensor:
    """[..., 2, width] float: the bounds `without_earlier_draws` puts on log q at `width` draws in order, for the draw
    of rank `rank` [...]: a floor (-FLOAT32_MAX at that draw, else -inf) and a ceiling (-inf before it, else inf)."""
    r, x = torch.arange(width, device=rank.device), rank[..., None]  # [width], [..., 1]
    return torch.stack([torch.where(r == x, -FLOAT32_MAX, -math.inf), torch.where(r < x, -math.inf, math.inf)], -2)


def without_earlier_draws(log_q: torch.Tensor, draws: torch.Tensor, *, rank: int | torch.Tensor | None = None,
                          bounds: torch.Tensor | None = None) -> torch.Tensor:
    """q_r, what the rank-r draw x was drawn from: log_q [..., V] without the draws before it (draws [..., R] in
    order; bounds: `draw_bounds(rank)`, given or made), as it was drawn without replacement, renormalised (in log
    space, so a remainder too small for exp survives) -> probabilities [..., V]. The earlier draws' log q is capped
    at -inf, x's raised to at least -FLOAT32_MAX: that floor acts only where q had no mass left for x (a tiny T, a
    small draft vocabulary): Gumbel-top-k then ranks every token of q before x, all are removed, and x, picked
    rather than drawn, is tried as a point mass."""
    bounds = draw_bounds(torch.as_tensor(rank, device=draws.device), draws.shape[-1]) if bounds is None else bounds
    floor, ceiling = bounds.unbind(-2)  # [..., R] each
    log_q = log_q.scatter_reduce(-1, draws, ceiling.expand_as(draws), "amin")
    return log_q.scatter_reduce_(-1, draws, floor.expand_as(draws), "amax").softmax(dim=-1)


def residual_after_miss(r: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What speculative sampling's target r [..., V] (p at a node's first try) becomes after a candidate drawn from q
    [..., V] misses: norm(max(0, r - q)) [..., V], and its mass before norm [...]. That is what makes a try emit
    exactly r: min(r, q) + (1 - Σ min(r, q)) · norm(max(0, r - q)) = r. Where the mass is 0 (r = q up to rounding)
    nothing is left to try another candidate against, and the residual is 0 / 0, NaN."""
    residual = (r - q).clamp_min(0.0)  # [..., V]
    mass = residual.sum(dim=-1)  # [...]
    return residual / mass[..., None], mass


def try_accepts(r_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor, *, live: torch.Tensor) -> torch.Tensor:
    """One try of speculative sampling [...] bool: candidate x, drawn from q, is accepted against the target r (p at a
    first try) with probability min(1, r(x) / q(x)), with the uniform u [...]: u < r/q without dividing (q(x) may
    underflow). Where r's residual would have no mass (not live), r = q up to rounding: any r(x) > 0 passes."""
    return u * q_x * live < r_x
