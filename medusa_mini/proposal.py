"""The engine's proposals: what one step verifies, and the proposers that make them (the reference's `propose`).

A `Proposal` is B rows of candidate tokens [B, N] on one tree, plus, for drawn candidates, the q each
node's children were drawn from (`Drawn`). Three `Proposer`s make them, and the step treats them alike:

- `MedusaProposer`: a fixed tree filled with Medusa heads' top-k guesses (paper §2.1.1-2.1.2), or, beyond
  the paper, with tokens drawn from their q without replacement (recursive speculative decoding's);
- `HydraProposer`: dependent heads, which fill the tree depth by depth, each node's children from its q;
- `PromptLookupProposer`: no heads at all: the tokens that followed the first earlier occurrence of the
  row's last n tokens in its own text (prompt lookup decoding), a chain of point masses.

Heads make their proposer (`heads.proposer(model, tree)`), and so does `PromptLookup`: a decoding loop
takes any such *drafter*. Shapes: B rows, N nodes, D depth, R ranks, V vocabulary, M draft vocabulary, C
n_embd, Q the q a drawn tree draws from (Medusa heads: one per head, D; Hydra's: one per node above the deepest depth).
"""

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from .sampling import Sampling, gumbel_top_k, q_log_probs
from .tree import MAX_NODES, Tree, TreeTensors, chain


@dataclass(frozen=True)
class Drawn:
    """Drawn candidates: the q each node's children were drawn from, and the draws in order.

    log_q: [B, Q, V], one q per index of its Q axis; draws: [B, Q, R] distinct tokens drawn from each.
    q_index: [N] long, which q node i's children were drawn from (-1 for a leaf): its depth for Medusa
    heads, whose q depends only on it; the node itself for dependent heads, whose q depends on the path.
    """

    log_q: torch.Tensor
    draws: torch.Tensor
    q_index: torch.Tensor

    def at(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What inner nodes [n] drew their children from, in every row: log q [B, n, V], the draws [B, n, R] (never
        ask for a leaf's: its q_index, -1, reads the last q)."""
        which = self.q_index[nodes]  # [n]
        return self.log_q[:, which], self.draws[:, which]

    def per_node(self, b: int) -> list[tuple[torch.Tensor, list[int]] | None]:
        """Row b as `reference.rejection_accept` takes it: per node, (log q [V], draws) of its children, or None."""
        draws = self.draws[b].tolist()  # [Q][R]
        return [(self.log_q[b, i], draws[i]) if i >= 0 else None for i in self.q_index.tolist()]


@dataclass(frozen=True)
class Proposal:
    """What one step verifies: tokens [B, N] (node 0 = each row's root) on `tree`, and how they were drawn."""

    tokens: torch.Tensor
    tree: Tree
    drawn: Drawn | None = None


class Proposer(Protocol):
    """Makes each step's proposal from roots [B], the hidden states [B, C] that produced them and each
    row's tokens so far (prompt and output, ending with the root). Siblings hold distinct tokens."""

    tree: Tree  # the full tree; prompt lookup's proposals hold its first nodes, a shorter chain
    heads: nn.Module | None  # the heads that fill the tree, or None (prompt lookup)

    def trees(self) -> list[Tree]:
        """Every tree a proposal may hold."""

    def uniforms(self, sampling: Sampling, rows: int, generator: torch.Generator | None, *,
                 device: torch.device | str) -> torch.Tensor | None:
        """The uniforms `propose` turns into drawn candidates, or None (its candidates are no draws)."""

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, history: list[list[int]], sampling: Sampling,
                u: torch.Tensor | None) -> Proposal:
        ...


class Drafter(Protocol):
    """What a decoding loop drafts with: heads (`heads.DraftHeads`) or `PromptLookup`. Makes a generation's proposer."""

    def proposer(self, model: nn.Module, tree: Tree) -> Proposer:
        ...


class HeadsProposer:
    """Proposes from draft heads on a fixed tree: logits_of is the kind's logits function
    (`DraftHeads.logits_of`) over the draft vocabulary draft_ids [M]; `heads`, the module itself. Each kind
    fills the tree with its own `fill_tree`, the one function that makes its trees."""

    fill_tree: Callable  # (TreeTensors, roots, hidden, logits_of, *, draft_ids, vocab_size, temperature, u)
    q_count: Callable[[Tree], int]  # Q, how many q a drawn tree draws from

    def __init__(self, tree: Tree, logits_of: Callable, *, draft_ids: torch.Tensor, vocab_size: int,
                 num_heads: int, heads: nn.Module | None = None) -> None:
        tree.check_heads(num_heads)
        if tree.max_rank >= draft_ids.numel():
            raise ValueError(f"the tree asks for rank {tree.max_rank}; the draft vocabulary has {len(draft_ids)}")
        self.tree, self.logits_of, self.heads = tree, logits_of, heads
        self.draft_ids, self.vocab_size = draft_ids, vocab_size

    def trees(self) -> list[Tree]:
        return [self.tree]  # the whole tree, always: near the end of a row the step masks what it cannot use

    def uniforms(self, sampling: Sampling, rows: int, generator: torch.Generator | None, *,
                 device: torch.device | str) -> torch.Tensor | None:
        """[B, Q, V] for drawn candidates, one per token of each q (Gumbel noise); None for the top-k."""
        if not sampling.draws_candidates:  # nothing to draw: no shape worked out, every step
            return None
        return torch.rand((rows, self.q_count(self.tree), self.vocab_size), generator=generator, device=device)

    @torch.no_grad()
    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, sampling: Sampling, u: torch.Tensor | None,
                history: list[list[int]] | None = None) -> Proposal:
        if self.tree.depth == 0:  # the root alone: no guess to make
            return Proposal(roots[:, None], self.tree)
        tokens, drawn = self.fill_tree(self.tree.tensors(roots.device), roots, hidden, self.logits_of,
                                       draft_ids=self.draft_ids, vocab_size=self.vocab_size,
                                       temperature=sampling.temperature, u=u)
        return Proposal(tokens, self.tree, drawn)


def top_k(logits: torch.Tensor, draft_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The k most likely tokens, most likely first: logits [..., M] over draft_ids [M] -> token ids [..., k]."""
    return draft_ids[logits.topk(k, dim=-1).indices]


def fill(tree: TreeTensors, roots: torch.Tensor, guesses: torch.Tensor) -> torch.Tensor:
    """Node i gets its depth's rank(i) guess: roots [B], guesses [B, D, R] -> tokens [B, N]."""
    every = torch.cat([roots[:, None], guesses.flatten(1)], dim=1)  # [B, 1 + D R]: the root, then each head's
    return every.index_select(1, tree.guess_index)  # [B, N]


def fill_depth_by_depth(tree: TreeTensors, roots: torch.Tensor, hidden: torch.Tensor, logits_of: Callable,
                        pick: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Dependent heads' tree, roots [B] and hidden [B, C] -> tokens [B, N]: each node's children are
    pick(logits [B, n, M] of q(. | the node's path)) [B, n, R], nodes of depth d - 1 all at once.
    logits_of(k, hidden [B, n, C], tokens [B, n, k]) -> [B, n, M]: head k given each node's path."""
    (B, C), first = hidden.shape, tree.first
    tokens = roots[:, None].expand(B, tree.parent_index.numel()).clone()  # [B, N], filled depth by depth below
    for d in range(1, tree.depth + 1):
        lo, hi, kids = first[d - 1], first[d], slice(first[d], first[d + 1])
        paths = tokens[:, tree.node_paths[lo:hi, :d]]  # [B, n, d]: the tokens on each node's path, root first
        picks = pick(logits_of(d, hidden[:, None].expand(B, hi - lo, C), paths))  # [B, n, R]
        # [B, n_d]: each node of depth d takes its parent's pick (parents counted from lo) at its rank
        tokens[:, kids] = picks[:, tree.parent_index[kids] - lo, tree.ranks[kids]]
    return tokens


def fill_medusa_tree(tree: TreeTensors, roots: torch.Tensor, hidden: torch.Tensor, logits_of: Callable, *,
                draft_ids: torch.Tensor, vocab_size: int, temperature: float = 0.0, u: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Drawn | None]:
    """Medusa heads' tree from roots [B] and hidden [B, C]: each head's top-k (u None), or its distinct draws
    from q at `temperature`, the node of depth d and rank r holding head d's r-th (`gumbel_top_k` of the
    uniforms u [B, D, V]). Returns tokens [B, N] and how they were drawn (None for the top-k).
    logits_of(hidden [B, C], num) -> [B, num, M]."""
    logits = logits_of(hidden, tree.depth)  # [B, D, M]: only the heads the tree reaches
    if u is None:
        return fill(tree, roots, top_k(logits, draft_ids, tree.num_ranks)), None
    log_q = q_log_probs(logits, draft_ids, temperature=temperature, vocab_size=vocab_size)  # [B, D, V]
    draws = gumbel_top_k(log_q, tree.num_ranks, u)  # [B, D, R]
    return fill(tree, roots, draws), Drawn(log_q=log_q, draws=draws, q_index=tree.q_by_depth)


def fill_hydra_tree(tree: TreeTensors, roots: torch.Tensor, hidden: torch.Tensor, logits_of: Callable, *,
               draft_ids: torch.Tensor, vocab_size: int, temperature: float = 0.0, u: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, Drawn | None]:
    """Dependent heads' tree from roots [B] and hidden [B, C], depth by depth (`fill_depth_by_depth`): each
    node's top-k (u None), or its distinct draws from q(. | the node's path), node i's from the uniforms
    u[:, i] ([B, Q, V], Q the nodes above the deepest depth). Returns tokens [B, N] and how they were
    drawn, one q per node (None for the top-k). logits_of(k, hidden [B, n, C], tokens [B, n, k]) -> [B, n, M]."""
    if u is None:
        return fill_depth_by_depth(tree, roots, hidden, logits_of,
                                   lambda logits: top_k(logits, draft_ids, tree.num_ranks)), None  # [B, n, R]
    log_qs, draws = [], []

    def draw_children(logits: torch.Tensor) -> torch.Tensor:  # [B, n, M] -> [B, n, R], q kept for the tries
        lo = sum(log_q.shape[1] for log_q in log_qs)  # the nodes drawn for so far
        log_qs.append(q_log_probs(logits, draft_ids, temperature=temperature, vocab_size=vocab_size))
        draws.append(gumbel_top_k(log_qs[-1], tree.num_ranks, u[:, lo : lo + logits.shape[1]]))
        return draws[-1]

    tokens = fill_depth_by_depth(tree, roots, hidden, logits_of, draw_children)
    return tokens, Drawn(log_q=torch.cat(log_qs, 1), draws=torch.cat(draws, 1), q_index=tree.q_by_node)


class MedusaProposer(HeadsProposer):
    """A fixed tree filled with Medusa heads' guesses (§2.1): each head's top-k, or, for rejection sampling of drawn
    candidates, distinct draws from each head's q (`Sampling.draws_candidates`).
    logits_of(hidden [B, C], num) -> [B, num, M]: the first `num` heads' logits."""

    fill_tree = staticmethod(fill_medusa_tree)
    q_count = staticmethod(lambda tree: tree.depth)  # one q per head


class HydraProposer(HeadsProposer):
    """A fixed tree filled by dependent heads, depth by depth (`fill_depth_by_depth`): a node's children are the
    top-k of q(. | the node's path), or, drawn, distinct draws from it (one q per node).
    logits_of(k, hidden [B, n, C], tokens [B, n, k]) -> [B, n, M]: head k given each node's path."""

    fill_tree = staticmethod(fill_hydra_tree)
    q_count = staticmethod(lambda tree: tree.first[tree.depth])  # one q per node above the deepest depth


class PromptLookup:
    """Prompt lookup decoding, the training-free baseline (Saxena 2023; HF's prompt_lookup_num_tokens,
    vLLM's ngram): the draft is what followed an earlier occurrence of the text's last n tokens. A drafter like
    heads: `PromptLookup().proposer(model, tree)` drafts a chain of the tree's nodes below the root (1 to MAX_NODES)."""

    def __init__(self, *, max_ngram: int = 3) -> None:
        if not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_ngram must be an integer of at least 1, not {max_ngram!r}")
        self.max_ngram = max_ngram

    def proposer(self, model: nn.Module, tree: Tree) -> "PromptLookupProposer":
        return PromptLookupProposer(chain(min(max(tree.num_nodes - 1, 1), MAX_NODES)), max_ngram=self.max_ngram)


def lookup(text: list[int], *, max_ngram: int, length: int) -> list[int]:
    """Up to `length` tokens that followed the first earlier occurrence of text's last n tokens, for the
    largest n <= max_ngram that occurs earlier with something after it; [] when none does."""
    for n in range(min(max_ngram, len(text) - 1), 0, -1):
        tail = text[-n:]
        for start in range(len(text) - n):
            if text[start : start + n] == tail:
                return text[start + n : start + n + length]
    return []


def chain_length(longest: int, depth: int) -> int:
    """The chain that holds a continuation of `longest` tokens: the next power of two, at most `depth`
    (0 stays 0): lengths 0, 1, 2, 4, ..., depth, few trees for any text (each one's tensors made once)."""
    return 0 if longest <= 0 else min(1 << (longest - 1).bit_length(), depth)


class PromptLookupProposer:
    """Each row's continuation from `lookup` fills a chain, cut to `chain_length` of the longest
    continuation of any row (a step in which no row finds one verifies the root alone: a plain step).
    Nodes past a row's continuation repeat its last token: candidates like any other, accepted only where
    the backbone agrees; nodes past what a row may still emit are not usable (`step.usable_nodes`)."""

    def __init__(self, tree: Tree, *, max_ngram: int) -> None:
        self.tree, self.max_ngram, self.heads = tree, max_ngram, None

    def trees(self) -> list[Tree]:
        D = self.tree.depth
        return [self.tree.truncated(n) for n in sorted({chain_length(n, D) for n in range(D + 1)})]

    def uniforms(self, sampling: Sampling, rows: int, generator: torch.Generator | None, *,
                 device: torch.device | str) -> None:
        return None  # a continuation is no draw

    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, history: list[list[int]], sampling: Sampling,
                u: torch.Tensor | None = None) -> Proposal:
        found = [lookup(text, max_ngram=self.max_ngram, length=self.tree.depth) for text in history]
        tree = self.tree.truncated(chain_length(max(map(len, found)), self.tree.depth))
        D = tree.depth
        rest = torch.tensor([c + c[-1:] * (D - len(c)) if c else text[-1:] * D for c, text in zip(found, history)],
                            dtype=torch.long).view(len(found), D)  # [B, D]
        return Proposal(torch.cat([roots[:, None], rest.to(roots.device)], dim=1), tree)  # [B, N]
