"""One Medusa step (paper §2): propose -> verify -> accept -> keep the accepted path.

Small named pieces, each a stage of the paper: `propose` fills the tree with candidates (the heads'
top-k, or draws from them for rejection sampling), `verify` scores every node in one tree-masked
forward, `accept` applies an acceptance rule (acceptance.py), `keep_path` compacts the KV cache.
`medusa_step` runs them in order; decoding.medusa_generate loops over it and explain.py prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import greedy_accept, rejection_accept, typical_accept
from .draft import Draft, sample_draft
from .hydra import HydraContext, fill_tree
from .model import GPT, KVCache, compact_kv_cache
from .sampling import Sampling
from .tree import Tree


def tree_candidates(tree: Tree, root: int, head_logits: torch.Tensor, *, draft: Draft | None = None) -> torch.Tensor:
    """Fill the tree: node i gets head `head(i)`'s rank-`rank(i)` token. head_logits [K, V] -> [N].

    With a `draft`, "rank r" means the r-th token drawn from head(i)'s q (`draft.sample_draft`).
    """
    head, rank = tree.cached("head", head_logits.device), tree.cached("rank", head_logits.device)  # [N - 1]
    if draft is None:
        guesses = head_logits[: max(tree.depth, 1)].topk(tree.max_rank + 1, dim=-1).indices  # [D, R]
    else:
        guesses = draft.samples  # [D, R]
    root_t = torch.tensor([root], device=head_logits.device)
    return torch.cat([root_t, guesses[head, rank]])  # [N]


def propose(
    tree: Tree, root: int, head_logits: torch.Tensor | HydraContext, *, sampling: Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, Draft | None]:
    """The tree's candidate tokens [N]: the heads' top-k, or, for rejection sampling with
    draft="sampled", tokens drawn from the heads' distributions (returned too: acceptance needs q).
    A HydraContext instead of head_logits [K, V]: dependent heads, read per node (hydra.fill_tree)."""
    if isinstance(head_logits, HydraContext):  # dependent heads: the tree is filled depth by depth
        return fill_tree(tree, root, head_logits, sampling=sampling, generator=generator)
    sampled = None
    if sampling.draws_candidates and tree.num_nodes > 1:
        sampled = sample_draft(head_logits, depth=tree.depth, width=tree.max_rank + 1,
                               temperature=sampling.temperature, generator=generator)
    return tree_candidates(tree, root, head_logits, draft=sampled), sampled


@torch.no_grad()
def verify(model: GPT, cache: KVCache, tree: Tree, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked forward over all N nodes (paper §2.1.2): logits [N, V], hidden [N, C].

    Nodes occupy cache slots [L, L + N) but sit at positions L + depth; each sees the whole prefix,
    itself and its ancestors.
    """
    L, N, device = cache.length, tree.num_nodes, tokens.device
    mask = torch.ones(N, L + N, dtype=torch.bool, device=device)  # [N, L + N]
    mask[:, L:] = tree.cached("ancestor_mask", device)
    pos = L + tree.cached("depths", device)  # [N]
    logits, hidden = model(tokens[None], pos=pos, cache=cache, attn_mask=mask)
    return logits[0], hidden[0]


def accept(
    tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
    generator: torch.Generator | None, draft: Draft | None = None,
) -> tuple[list[int], int]:
    """Apply `sampling.rule` (see acceptance.py); `draft` only for sampled rejection candidates."""
    if sampling.rule == "greedy":
        return greedy_accept(tree, tokens, logits)
    if sampling.rule == "rejection":
        return rejection_accept(tree, tokens, logits, temperature=sampling.temperature, top_p=sampling.top_p,
                                generator=generator, draft=draft)
    return typical_accept(tree, tokens, logits, temperature=sampling.temperature, top_p=sampling.top_p,
                          epsilon=sampling.epsilon, delta=sampling.delta, generator=generator)


@dataclass
class StepResult:
    """What one Medusa step decided. The KV cache already holds the root and the accepted nodes."""

    tokens: torch.Tensor  # [N] the tree's candidate tokens, node 0 being the root
    path: list[int]  # accepted nodes, root first: [0, a1, ..., ad]
    bonus: int  # the backbone's own token after the last accepted node
    hidden: torch.Tensor  # [N, C] verify's hidden states; hidden[path[-1]] feeds the next proposals

    def emitted(self) -> list[int]:
        """The step's new tokens: the accepted candidates, then the bonus (the root was emitted earlier)."""
        return self.tokens[self.path[1:]].tolist() + [self.bonus]


def keep_path(cache: KVCache, path: list[int], *, start: int) -> None:
    """Keep the K/V of the accepted nodes `path` in consecutive slots from `start`, the root's slot."""
    if path == list(range(len(path))):  # a top-ranked chain already sits in consecutive slots
        cache.length = start + len(path)
    else:
        compact_kv_cache(cache, start + torch.tensor(path, device=cache.kv.device), start=start)


@torch.no_grad()
def medusa_step(
    model: GPT,
    cache: KVCache,
    tree: Tree,
    root: int,
    head_logits: torch.Tensor | HydraContext,
    *,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> StepResult:
    """One Medusa step: candidates -> verify -> accept -> compact.

    root: the last committed token, whose K/V are not in `cache` yet; head_logits [K, V]: the heads'
    guesses from the hidden state that produced the root. The tree's N nodes take the heads' top-k
    tokens, or for sampled rejection drafts (`Sampling.draws_candidates`) tokens drawn from them (`propose`, [N]);
    one forward under the tree attention mask scores them all (paper §2.1.2, `verify`: logits
    [N, V], hidden [N, C]); the acceptance rule keeps the longest
    valid path and picks the bonus token (§2.3, `accept`); the cache keeps only that path (`keep_path`).
    The caller emits `emitted()` and runs the heads at `hidden[path[-1]]` to propose the next tree.
    """
    L = cache.length
    tokens, sampled = propose(tree, root, head_logits, sampling=sampling, generator=generator)  # [N]
    logits, hidden = verify(model, cache, tree, tokens)  # [N, V], [N, C]
    path, bonus = accept(tree, tokens, logits, sampling=sampling, generator=generator, draft=sampled)
    keep_path(cache, path, start=L)
    return StepResult(tokens=tokens, path=path, bonus=bonus, hidden=hidden)
