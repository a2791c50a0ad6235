"""Dynamic trees: each step, spend the N nodes where this step's heads are confident (EAGLE-2's idea,
arXiv 2406.16858, for Medusa and dependent heads).

A fixed tree is sized from the heads' average accuracy, whether this step's heads are sure of one
continuation or torn between five. Here a larger fixed set of candidates (M nodes: the tree
`build_tree` grows for a bigger budget) is filled every step, each candidate is scored by the heads'
confidence in its whole path, and the top N are verified:

- Medusa heads: the product, along the path, of each head's probability of its token;
- dependent (hydra) heads: the product of the conditional probabilities q(token | path) they give;
- with a `Calibration`, each probability is first read as the rate at which a guess of that
  confidence was accepted, so the product estimates the path's chance of being accepted.

A node's score never exceeds its parent's (a product of probabilities at most 1, summed in log space
one depth at a time, so rounding cannot break it), and ties keep the earlier node, which is the parent:
the kept nodes always form a tree. N is fixed, so every shape is static: the kept tree's parents,
depths, attention mask and paths are gathered on the device from the candidates' fixed tables, with no
host read (`select_nodes`, `kept_tree`).

Exactness is untouched. Greedy acceptance writes plain greedy's tokens on any tree; rejection
sampling with top-k candidates stays lossless, since the tree depends only on the heads, never on
the backbone's draws. Sampled drafts keep a fixed tree (`DynamicTree.fixed`): which drawn tokens a
confidence ranking keeps would depend on the draws themselves, so a kept candidate would no longer be
distributed as the q that acceptance divides by.

Shapes: B rows, M + 1 candidates (root included), N kept nodes (root included), D depth, P paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn

from .hydra import HydraProposer
from .proposal import MedusaProposer, Proposal, StepTree
from .sampling import Sampling
from .tree import Tree


@dataclass(frozen=True)
class Calibration:
    """How often a head's guess is accepted, given the probability q the head gave it and whether the
    nodes above it are each head's top guess: rates[k][line][b] for q in [edges[b], edges[b + 1]),
    line 0 below top guesses only (the heads' main line), 1 below any other; measured on the backbone's
    own greedy continuations (tune/calibration.py).

    Heads trained by cross-entropy on a small model are far from calibrated (a head that gives its guess
    probability 0.4 may be right nearly always), and their errors are correlated (below right top guesses
    the next top guess is right far more often than below a right lower-ranked one): BENCHMARKS.md shows
    the cpu preset's table. Through it, a path's score estimates its chance of being accepted.
    """

    edges: tuple[float, ...]
    rates: tuple[tuple[tuple[float, ...], ...], ...]  # [K][2][bins], each in [0, 1]

    def log_accept(self, node_log_q: torch.Tensor, tree: Tree) -> torch.Tensor:
        """log P(accepted | q, line) for the nodes of `tree`: node_log_q [B, N] (log q) -> [B, N], 0 at the root."""
        edges, log_rates = _calibration_tensors(self, str(node_log_q.device))
        head, line = _node_features(tree, str(node_log_q.device))  # [N] each
        bins = (torch.bucketize(node_log_q.exp(), edges, right=True) - 1).clamp(0, log_rates.shape[2] - 1)  # [B, N]
        rates = log_rates[head, line].gather(1, bins.t()).t()  # [B, N]
        return torch.where(head < 0, 0.0, rates)


@lru_cache(maxsize=16)
def _calibration_tensors(cal: Calibration, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The table on `device`, built once (a copy from the host in every step would wait for the device)."""
    log_rates = torch.tensor(cal.rates, dtype=torch.float32).clamp_min(1e-6).log()  # [K, 2, bins]
    return torch.tensor(cal.edges, dtype=torch.float32, device=device), log_rates.to(device)


@lru_cache(maxsize=16)
def _node_features(tree: Tree, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node, its head (depth - 1; -1 at the root) and its line (0: every node above it is rank 0)."""
    head = [-1] + [len(c) - 1 for c in tree.choices]
    line = [0] + [int(any(r > 0 for r in c[:-1])) for c in tree.choices]
    return torch.tensor(head, device=device), torch.tensor(line, device=device)


@dataclass(frozen=True)
class DynamicTree:
    """A node budget chosen per step: `budget` candidates (root excluded) out of `candidates`;
    `fixed`: the tree rejection sampling's sampled drafts use instead; `calibration`: how each head's
    confidence translates into acceptance (None: the heads' own probabilities)."""

    budget: int
    candidates: Tree
    fixed: Tree
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.budget <= self.candidates.num_nodes - 1:
            raise ValueError(f"a dynamic tree keeps 1 to {self.candidates.num_nodes - 1} of its candidates, "
                             f"not {self.budget}")

    @property
    def num_nodes(self) -> int:
        """N, the nodes each step verifies, the root included."""
        return self.budget + 1

    @property
    def depth(self) -> int:
        return max(self.candidates.depth, self.fixed.depth)

    def check_heads(self, num_heads: int) -> None:
        self.candidates.check_heads(num_heads)
        self.fixed.check_heads(num_heads)


def path_scores(tree: Tree, node_log_q: torch.Tensor) -> torch.Tensor:
    """log confidence of each node's path: node_log_q [B, M + 1] -> [B, M + 1] (the root's is 0).

    Summed one depth at a time, parent first, so a child's score is fl(parent's + its own log q): never
    above its parent's, whatever the rounding."""
    t = tree.tensors(node_log_q.device)
    parents, by_depth = t.parents.clamp(min=0), t.depths  # [M + 1] each
    score = torch.zeros_like(node_log_q)
    for d in range(1, tree.depth + 1):
        at_d = by_depth == d  # [M + 1]
        score = torch.where(at_d, score[:, parents] + node_log_q, score)
    return score


def select_nodes(tree: Tree, score: torch.Tensor, n: int, *, max_depth: int | None = None) -> torch.Tensor:
    """The root and the n best candidates of each row, in candidate order (parents before children):
    score [B, M + 1] -> node indices [B, n + 1].

    A stable sort keeps equal scores in candidate order, and a parent precedes its children, so a kept
    child always comes with its parent. Candidates deeper than `max_depth` rank last: near the end of a
    generation they could not be used."""
    candidates = score[:, 1:]  # [B, M]
    if max_depth is not None:
        too_deep = tree.tensors(score.device).depths[1:] > max_depth  # [M]
        candidates = torch.where(too_deep, float("-inf"), candidates)
    order = candidates.sort(dim=-1, descending=True, stable=True).indices[:, :n] + 1  # [B, n]
    root = torch.zeros_like(order[:, :1])
    return torch.cat([root, order.sort(dim=-1).values], dim=1)  # [B, n + 1]


def kept_tree(tree: Tree, nodes: torch.Tensor) -> StepTree:
    """The subtree on `nodes` [B, N] (candidate indices, parents first) as one step's device tensors."""
    t = tree.tensors(nodes.device)
    B, N = nodes.shape
    position = torch.full((B, tree.num_nodes), -1, dtype=torch.long, device=nodes.device)  # [B, M + 1]
    position.scatter_(1, nodes, torch.arange(N, device=nodes.device).expand(B, N))  # candidate -> kept index
    parents = torch.where(nodes == 0, -1, position.gather(1, t.parents.clamp(min=0)[nodes]))  # [B, N]
    pairs = (nodes[:, :, None], nodes[:, None, :])  # [B, N, 1], [B, 1, N]
    on_path = position[torch.arange(B, device=nodes.device)[:, None, None], t.paths[None]]  # [B, P, D + 1]
    valid = (t.path_valid[None] & (on_path >= 0)).long().cumprod(dim=-1).bool()  # a path ends at its first unkept node
    return StepTree(parents=parents, depths=t.depths[nodes], ancestor_mask=t.ancestor_mask[pairs],
                    paths=torch.where(valid, on_path, 0), path_valid=valid,
                    earlier_siblings=t.earlier_siblings[pairs])


class DynamicProposer:
    """Each step, the `budget` most confident candidates of `tree.candidates`, for Medusa or dependent heads."""

    def __init__(self, model: nn.Module, heads, tree: DynamicTree) -> None:
        dependent = getattr(heads, "reads_drafted_tokens", False)
        make = HydraProposer if dependent else MedusaProposer
        self.scorer = make(model, heads, tree.candidates)  # fills and scores every candidate
        self.fixed = make(model, heads, tree.fixed)  # for sampled drafts
        self.tree = tree
        self.num_nodes = max(tree.budget + 1, tree.fixed.num_nodes)
        self.depth = tree.depth
        self.num_heads = self.scorer.num_heads

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        if sampling.draws_candidates:
            return self.fixed.propose(roots, hidden, max_depth=max_depth, sampling=sampling, generator=generator)
        tokens, score, nodes = self.choose(roots, hidden, max_depth=max_depth)
        return Proposal(tokens.gather(1, nodes), kept_tree(self.tree.candidates, nodes),
                        confidence=score.gather(1, nodes))

    def choose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every candidate's token [B, M + 1] and path score [B, M + 1] (log confidence), and the
        candidates kept [B, N] (`select_nodes`)."""
        tokens, node_log_q = self.scorer.scored(roots, hidden)  # [B, M + 1] each
        if self.tree.calibration is not None:
            node_log_q = self.tree.calibration.log_accept(node_log_q, self.tree.candidates)
        score = path_scores(self.tree.candidates, node_log_q)  # [B, M + 1]
        return tokens, score, select_nodes(self.tree.candidates, score, self.tree.budget, max_depth=max_depth)
