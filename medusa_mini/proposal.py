"""The engine's proposals: what one step verifies, and the one interface every kind of heads fills it through.

A `Proposal` is B rows of candidate tokens [B, N] on a tree whose index tensors already sit on the
device (`StepTree`), plus, for rejection sampling's sampled drafts, the q each node's children were
drawn from (`Draft`). A `Proposer` makes one from the roots and the hidden states that produced
them. Three exist, and the step (step.py) treats them alike:

- `MedusaProposer` (here): a fixed tree filled with Medusa heads' top-k guesses, or with tokens drawn
  from their q without replacement (paper §2.1.1-2.1.2; the reference's `propose`, for B rows);
- `hydra.HydraProposer`: dependent heads, which fill the tree depth by depth;
- `dynamic.DynamicProposer`: each step's own top-N nodes by the heads' confidence along the path.

Shapes: B rows, N nodes, P root-to-leaf paths, D depth, K heads, R ranks, V vocabulary, C n_embd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .reference import draw_without_replacement
from .sampling import Sampling
from .tree import Tree


@dataclass(frozen=True)
class StepTree:
    """One step's tree for B rows, as index tensors on the device (every row may have its own tree).

    host_parents: the parents on the host when every row shares one fixed tree (so rejection
    sampling's walk needs no read); None when the tree changes per step (then it is read with the rest).
    """

    parents: torch.Tensor  # [B, N] long: each node's parent, -1 for the root
    depths: torch.Tensor  # [B, N] long: position offset from the root (positions = prefix + depth)
    ancestor_mask: torch.Tensor  # [B, N, N] bool: the tree attention mask among the nodes
    paths: torch.Tensor  # [B, P, D + 1] long: root-to-leaf node indices, node 0 past a leaf
    path_valid: torch.Tensor  # [B, P, D + 1] bool: False past a leaf (or past a node a row lacks)
    earlier_siblings: torch.Tensor  # [B, N, N] bool: j is a sibling of i with a smaller rank
    host_parents: tuple[int, ...] | None = None

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    @staticmethod
    def of(tree: Tree, batch_size: int, device: torch.device | str) -> "StepTree":
        """A fixed tree's tensors (`Tree.tensors`) shared by B rows: expanded views, built once."""
        key = ("step", str(device), batch_size)
        if key not in tree._memo:
            t = tree.tensors(device)

            def rows(x: torch.Tensor) -> torch.Tensor:
                return x.expand(batch_size, *x.shape)

            tree._memo[key] = StepTree(
                parents=rows(t.parents), depths=rows(t.depths), ancestor_mask=rows(t.ancestor_mask),
                paths=rows(t.paths), path_valid=rows(t.path_valid), earlier_siblings=rows(t.earlier_siblings),
                host_parents=tuple(tree.parents))
        return tree._memo[key]


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
        """Row b as the reference's walk takes it: per node, (log q [V], draws) of its children.
        samples: `self.samples.tolist()`, read once per step for all rows."""
        return [(self.log_q[b, r], samples[b][r]) if r >= 0 else None for r in self.rows]


@dataclass(frozen=True)
class Proposal:
    """What one step verifies: tokens [B, N] (node 0 = each row's root) on `tree`, and their draft."""

    tokens: torch.Tensor
    tree: StepTree
    draft: Draft | None = None
    confidence: torch.Tensor | None = None  # [B, N] log of the heads' confidence in each node's path (dynamic trees)


class Proposer(Protocol):
    """Makes each step's proposal from roots [B] and the hidden states [B, C] that produced them."""

    num_nodes: int  # N, the most nodes a proposal has (the KV cache keeps room for them)
    depth: int  # the deepest node a proposal may have
    num_heads: int

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


def sample_draft(head_logits: torch.Tensor, tree: Tree, *, temperature: float,
                 generator: torch.Generator | None) -> Draft:
    """head_logits [B, K, V] -> a Draft whose row d holds head d+1's q [B, D, V] and its draws [B, D, R]."""
    log_q = draft_log_probs(head_logits[:, : tree.depth], temperature=temperature)  # [B, D, V]
    samples = draw_without_replacement(log_q, tree.max_rank + 1, generator)  # [B, D, R]
    rows = tuple(d if kids else -1 for d, kids in zip(tree.depth_list, tree.children))
    return Draft(log_q=log_q, samples=samples, rows=rows)


class MedusaProposer:
    """A fixed tree filled with Medusa heads' guesses (§2.1): each head's top-k, or, for rejection
    sampling's sampled drafts, distinct draws from each head's q (`Sampling.draws_candidates`)."""

    def __init__(self, model: nn.Module, heads, tree: Tree) -> None:
        num_heads = getattr(heads, "num_heads", None)
        if num_heads is not None:
            tree.check_heads(num_heads)
        self.model, self.heads, self.tree = model, heads, tree
        self.num_nodes, self.depth = tree.num_nodes, tree.depth
        self.num_heads = num_heads if num_heads is not None else tree.depth

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """All K heads at once (one batched lm_head matmul): hidden [B, C] -> [B, K, V]."""
        return self.heads(hidden, self.model.lm_head).transpose(0, 1)

    def scored(self, roots: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tree filled with top-k guesses, and each node's log q (its head's log-probability
        of its token, 0 at the root): roots [B], hidden [B, C] -> tokens [B, N], log q [B, N]."""
        t = self.tree.tensors(hidden.device)
        log_q = F.log_softmax(self.head_logits(hidden)[:, : max(self.tree.depth, 1)].float(), dim=-1)  # [B, D, V]
        top = log_q.topk(self.tree.max_rank + 1, dim=-1)  # [B, D, R]
        root_log_q = torch.zeros_like(top.values[:, :1, 0])  # [B, 1]
        return tree_candidates(self.tree, roots, top.indices), torch.cat([root_log_q, top.values[:, t.head, t.rank]], 1)

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        tree = self.tree if self.tree.depth <= max_depth else self.tree.truncated(max(max_depth, 0))
        step_tree = StepTree.of(tree, roots.shape[0], roots.device)
        head_logits = self.head_logits(hidden)  # [B, K, V]
        if sampling.draws_candidates:
            draft = sample_draft(head_logits, tree, temperature=sampling.temperature, generator=generator)
            return Proposal(tree_candidates(tree, roots, draft.samples), step_tree, draft)
        guesses = head_logits[:, : max(tree.depth, 1)].topk(tree.max_rank + 1, dim=-1).indices  # [B, D, R]
        return Proposal(tree_candidates(tree, roots, guesses), step_tree)
