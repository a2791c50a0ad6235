"""One Medusa step (paper §2): propose -> verify -> accept -> keep the accepted path.

Small named pieces, each a stage of the paper: `propose` fills the tree with candidates (the heads'
top-k, or draws from them for rejection sampling), `verify` scores every node in one tree-masked
forward, `accept` applies an acceptance rule (acceptance.py), `keep_path` compacts the KV cache.
`medusa_step` runs them in order; decoding.medusa_generate loops over it and explain.py prints it.

The step stays on the device until its end: candidates, verification (static shapes: the KV cache
is written at a slot tensor and read whole), the vectorised acceptance rules and the cache
compaction need no host decision. Then one `.tolist()` reads the emitted tokens: one host sync per
step. (Rejection sampling's tries are the exception; see `choose_path`.)

Shapes: N tree nodes, D tree depth, K heads, V vocabulary, C n_embd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import (
    PathChoice,
    at,
    greedy_accept_paths,
    rejection_accept,
    typical_accept_paths,
)
from .draft import Draft, sample_draft
from .hydra import HydraContext, fill_tree
from .model import GPT, KVCache, compact_kv_cache
from .sampling import Sampling
from .tree import Tree


def tree_candidates(
    tree: Tree, root: int | torch.Tensor, head_logits: torch.Tensor, *, draft: Draft | None = None
) -> torch.Tensor:
    """Fill the tree: node i gets head `head(i)`'s rank-`rank(i)` token. head_logits [K, V] -> [N].

    root: the last committed token, an int or a [] tensor (a step's bonus stays on the device).
    With a `draft`, "rank r" means the r-th token drawn from head(i)'s q (`draft.sample_draft`).
    """
    t = tree.tensors(head_logits.device)
    if draft is None:
        guesses = head_logits[: max(tree.depth, 1)].topk(tree.max_rank + 1, dim=-1).indices  # [D, R]
    else:
        guesses = draft.samples  # [D, R]
    root_t = torch.as_tensor(root, device=head_logits.device).reshape(1)  # [1]
    return torch.cat([root_t, guesses[t.head, t.rank]])  # [N]


def propose(
    tree: Tree, root: int | torch.Tensor, head_logits: torch.Tensor | HydraContext, *, sampling: Sampling,
    generator: torch.Generator | None,
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
    itself and its ancestors (`model.cache_attention_mask`). Shapes depend on the tree alone, so one
    captured graph per tree serves every step.
    """
    t = tree.tensors(tokens.device)
    pos = cache.length + t.depths  # [N]
    logits, hidden = model(tokens[None], pos=pos, cache=cache, attn_mask=t.ancestor_mask)
    return logits[0], hidden[0]


def choose_path(
    tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
    generator: torch.Generator | None, draft: Draft | None = None,
) -> PathChoice:
    """Apply `sampling.rule` (acceptance.py) on the device; `draft` only for sampled rejection candidates.

    Rejection sampling runs its node-by-node walk on the host: its tries are sequential by nature
    (each depends on the residual the previous rejection left), each a few scalar operations that
    cost less in float64 numpy than as device kernels at batch 1; their result is moved back here.
    """
    if sampling.rule == "greedy":
        return greedy_accept_paths(tree, tokens, logits)
    if sampling.rule == "typical":
        return typical_accept_paths(tree, tokens, logits, temperature=sampling.temperature, top_p=sampling.top_p,
                                    epsilon=sampling.epsilon, delta=sampling.delta, generator=generator)
    path, bonus = rejection_accept(tree, tokens, logits, temperature=sampling.temperature, top_p=sampling.top_p,
                                   generator=generator, draft=draft)
    nodes = torch.tensor(path + [path[-1]] * (tree.depth + 1 - len(path)), device=logits.device)  # [D + 1]
    accepted, bonus_t = torch.tensor([len(path) - 1, bonus], device=logits.device)
    return PathChoice(nodes=nodes, accepted=accepted, bonus=bonus_t)


def accept(
    tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
    generator: torch.Generator | None, draft: Draft | None = None,
) -> tuple[list[int], int]:
    """`choose_path`, read on the host: (accepted path, root first; bonus token)."""
    return choose_path(tree, tokens, logits, sampling=sampling, generator=generator, draft=draft).to_host()


@dataclass
class StepResult:
    """What one Medusa step decided. The KV cache already holds the root and the accepted nodes."""

    tokens: torch.Tensor  # [N] the tree's candidate tokens, node 0 being the root
    path: list[int]  # accepted nodes, root first: [0, a1, ..., ad]
    bonus: int  # the backbone's own token after the last accepted node
    hidden: torch.Tensor  # [N, C] verify's hidden states
    next_root: torch.Tensor  # [] the bonus, on the device: the next step's root
    next_hidden: torch.Tensor  # [C] hidden[path[-1]]: the heads read it to propose the next tree
    new_tokens: list[int]  # the step's emitted tokens, read on the host

    def emitted(self) -> list[int]:
        """The step's new tokens: the accepted candidates, then the bonus (the root was emitted earlier)."""
        return list(self.new_tokens)


def keep_path(cache: KVCache, choice: PathChoice, *, start: int | torch.Tensor) -> None:
    """Keep the K/V of the accepted nodes in consecutive slots from `start`, the root's slot.

    Always D + 1 slots move (a fixed shape; a top-ranked chain simply moves onto itself); the length
    counts only the accepted ones.
    """
    compact_kv_cache(cache, start + choice.nodes, start=start, count=choice.accepted + 1)


@torch.no_grad()
def medusa_step(
    model: GPT,
    cache: KVCache,
    tree: Tree,
    root: int | torch.Tensor,
    head_logits: torch.Tensor | HydraContext,
    *,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> StepResult:
    """One Medusa step: candidates -> verify -> accept -> compact, then one host sync.

    root: the last committed token (int or [] tensor), whose K/V are not in `cache` yet; head_logits
    [K, V]: the heads' guesses from the hidden state that produced the root. The tree's N nodes take
    the heads' top-k tokens, or for sampled rejection drafts (`Sampling.draws_candidates`) tokens
    drawn from them (`propose`, [N]); one forward under the tree attention mask scores them all
    (paper §2.1.2, `verify`: logits [N, V], hidden [N, C]); the acceptance rule keeps the longest
    valid path and picks the bonus token (§2.3, `choose_path`); the cache keeps only that path
    (`keep_path`). The caller emits `emitted()` and runs the heads at `next_hidden`.
    """
    start = cache.length  # [] the root's slot
    tokens, sampled = propose(tree, root, head_logits, sampling=sampling, generator=generator)  # [N]
    logits, hidden = verify(model, cache, tree, tokens)  # [N, V], [N, C]
    choice = choose_path(tree, tokens, logits, sampling=sampling, generator=generator, draft=sampled)
    keep_path(cache, choice, start=start)
    # The step's one host sync: the path, the tokens along it, the bonus and the count, read together.
    D = tree.depth
    *read, accepted = torch.cat([choice.nodes, tokens[choice.nodes], choice.bonus[None], choice.accepted[None]]).tolist()
    path, path_tokens, bonus = read[: accepted + 1], read[D + 1 : D + 2 + accepted], read[-1]
    return StepResult(tokens=tokens, path=path, bonus=bonus, hidden=hidden, next_root=choice.bonus,
                      next_hidden=at(hidden, choice.nodes[-1]), new_tokens=path_tokens[1:] + [bonus])
