"""The engine's proposals: what one step verifies, and the one interface every kind of heads fills it through.

A `Proposal` is B rows of candidate tokens [B, N] on one tree shared by every row, plus, for rejection
sampling's sampled drafts, the q each node's children were drawn from (`Draft`). A `Proposer` makes
one from the roots and the hidden states that produced them. Two exist, and the step (step.py) treats
them alike:

- `MedusaProposer` (here): a fixed tree filled with Medusa heads' top-k guesses, or with tokens drawn
  from their q without replacement (paper §2.1.1-2.1.2; the reference's `propose`, for B rows);
- `hydra.HydraProposer`: dependent heads, which fill the tree depth by depth.

Shapes: B rows, N nodes, D depth, K heads, R ranks, V vocabulary, C n_embd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .heads import MedusaHeads
from .sampling import Sampling, draw_without_replacement
from .tree import Tree


@dataclass(frozen=True)
class Draft:
    """Sampled candidates: the q each node's children were drawn from, and the draws in order.

    log_q: [B, Q, V], one row per q; samples: [B, Q, R] distinct tokens drawn from it. rows[node] is the
    row the node's children were drawn from (-1 for a leaf): the depth for Medusa heads, whose q
    depends only on it; the node itself for dependent heads, whose q depends on the path.
    """

    log_q: torch.Tensor
    samples: torch.Tensor
    rows: tuple[int, ...]

    def per_node(self, b: int, samples: list) -> list[tuple[torch.Tensor, list[int]] | None]:
        """Row b as the acceptance walk takes it: per node, (log q [V], draws) of its children, or None.
        samples: `self.samples.tolist()`, read once per step for all rows."""
        return [(self.log_q[b, r], samples[b][r]) if r >= 0 else None for r in self.rows]


@dataclass(frozen=True)
class Proposal:
    """What one step verifies: tokens [B, N] (node 0 = each row's root) on `tree`, and their draft."""

    tokens: torch.Tensor
    tree: Tree
    draft: Draft | None = None


class Proposer(Protocol):
    """Makes each step's proposal from roots [B] and the hidden states [B, C] that produced them."""

    tree: Tree  # the full tree; a proposal may hold a truncated one near the end of a generation

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        """max_depth: deeper nodes could not be used this step (the end of a budget or of the context)."""
        ...


def tree_candidates(tree: Tree, roots: torch.Tensor, guesses: torch.Tensor) -> torch.Tensor:
    """Fill the tree: node i gets head(i)'s rank(i) guess. roots [B], guesses [B, D, R] -> tokens [B, N]."""
    t = tree.tensors(guesses.device)
    return torch.cat([roots[:, None], guesses[:, t.head, t.rank]], dim=1)  # [B, N]


def draft_log_probs(head_logits: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """log q: head logits [..., V] -> [..., V], at the temperature p is sampled at."""
    return F.log_softmax(head_logits.float() / temperature, dim=-1)


class MedusaProposer:
    """A fixed tree filled with Medusa heads' guesses (§2.1): each head's top-k, or, for rejection
    sampling's sampled drafts, distinct draws from each head's q (`Sampling.draws_candidates`)."""

    def __init__(self, model: nn.Module, heads: MedusaHeads, tree: Tree) -> None:
        tree.check_heads(heads.config.num_heads)
        self.model, self.heads, self.tree = model, heads, tree

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        tree = self.tree.truncated(max(max_depth, 0))
        D, R = tree.depth, tree.max_rank + 1
        if D == 0:  # the root alone: the last token of a generation needs no guess, and draws none
            return Proposal(roots[:, None], tree)
        # Only the heads the tree reaches: all of them in one batched lm_head matmul.
        head_logits = self.heads(hidden, self.model.lm_head, num=D).transpose(0, 1)  # [B, D, V]
        if not sampling.draws_candidates:
            return Proposal(tree_candidates(tree, roots, head_logits.topk(R, dim=-1).indices), tree)
        log_q = draft_log_probs(head_logits, temperature=sampling.temperature)  # [B, D, V]
        samples = draw_without_replacement(log_q, R, generator)  # [B, D, R]
        rows = tuple(d if kids else -1 for d, kids in zip(tree.depth_list, tree.children))
        return Proposal(tree_candidates(tree, roots, samples), tree, Draft(log_q=log_q, samples=samples, rows=rows))
