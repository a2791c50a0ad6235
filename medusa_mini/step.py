"""The engine's Medusa step (paper §2) for B rows: propose -> verify -> accept -> keep the accepted path.

The same stages as the reference's loop body (reference.py), made fast: a `Proposer` (proposal.py)
fills the tree for every row on the device; `verify` scores every node of every row in one tree-masked
forward over the static KV cache (written at slot tensors; read whole when compiled, up to the slots in
use when eager); `accept_paths` (acceptance.py) applies the rule to every node of every row at once;
`keep_path` compacts each row's cache. Nothing waits for the host until the end, where one `.tolist()`
reads the emitted tokens of every row: one host sync per step (drawn candidates are the exception:
rejection sampling tries them on the host). `decoding.medusa_generate` loops over `medusa_step`.

Shapes: B rows, N tree nodes, D tree depth, V vocabulary, C n_embd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import Accepted, accept_paths
from .model import GPT, KVCache, compact_kv_cache
from .proposal import Proposer
from .sampling import Sampling
from .tree import Tree


@torch.no_grad()
def verify(model: GPT, cache: KVCache, tree: Tree, tokens: torch.Tensor, *,
           span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked forward over all N nodes of B rows (§2.1.2): logits [B, N, V], hidden [B, N, C].

    Row b's nodes occupy cache slots [L_b, L_b + N) but sit at positions L_b + depth, clamped to the
    context (a node past it is never usable); each sees its row's whole prefix, itself and its
    ancestors (`model.cache_attention_mask`). Shapes depend on the tree alone, so one captured graph
    per tree serves every step. span: the cache slots in use after the nodes (see `GPT.forward`).
    """
    t = tree.tensors(tokens.device)
    pos = (cache.lengths[:, None] + t.depths).clamp(max=model.config.block_size - 1)  # [B, N]
    return model(tokens, pos=pos, cache=cache, attn_mask=t.ancestor_mask, span=span)


def usable_nodes(tree: Tree, start: torch.Tensor, stop_at: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the nodes row b may accept. A node at depth d emits d + 1 tokens, and row b stops
    when prompt and output reach stop_at[b] tokens: its cache holds start[b] of them, the root one more.
    A row with no room (finished, in a batch that goes on) has no usable node, not even its root."""
    room = stop_at - 2 - start  # [B] the deepest usable depth; negative: the row is done
    return tree.tensors(start.device).depths <= room[:, None]


def keep_path(cache: KVCache, accepted: Accepted, *, start: torch.Tensor, active: torch.Tensor | None = None) -> None:
    """Keep the K/V of each row's root and accepted nodes in consecutive slots from start [B], the root's slot.

    Always D + 1 slots move per row (a fixed shape; a top-ranked chain simply moves onto itself); the
    length counts only the accepted ones, and stays put for a row that is not `active` [B].
    """
    count = accepted.count + 1
    if active is not None:
        count = torch.where(active, count, 0)
    compact_kv_cache(cache, start[:, None] + accepted.nodes, start=start, count=count)


@dataclass
class StepResult:
    """What one Medusa step decided for B rows. The KV cache already holds each root and accepted path."""

    paths: list[list[int]]  # per row, accepted nodes, root first: [0, a1, ..., ad]
    new_tokens: list[list[int]]  # per row, the accepted candidates then the bonus (the root came before)
    next_roots: torch.Tensor  # [B] the bonus tokens, on the device: the next step's roots
    next_hidden: torch.Tensor  # [B, C] the hidden state at each row's last accepted node


@torch.no_grad()
def medusa_step(
    model: GPT,
    cache: KVCache,
    proposer: Proposer,
    roots: torch.Tensor,
    hidden: torch.Tensor,
    *,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    stop_at: torch.Tensor | None = None,
    max_depth: int | None = None,
    span: int | None = None,
) -> StepResult:
    """One Medusa step for B rows: candidates -> verify -> accept -> compact, then one host sync.

    roots: [B] each row's last emitted token, whose K/V are not in `cache` yet; hidden: [B, C] the
    hidden states that produced them (the heads read them). stop_at: [B] the total length (prompt +
    output) at which each row stops (default: the context), so nodes that could not be used are never
    accepted; max_depth: the deepest node any row can use (the host's count; default: the proposer's);
    span: an upper bound of every row's cache length once the nodes are in (the host's count; default:
    the whole cache).
    """
    start = cache.lengths  # [B] the roots' slots
    depth = proposer.tree.depth if max_depth is None else max_depth
    proposal = proposer.propose(roots, hidden, max_depth=depth, sampling=sampling, generator=generator)
    logits, hiddens = verify(model, cache, proposal.tree, proposal.tokens, span=span)  # [B, N, V], [B, N, C]
    if stop_at is None:
        stop_at = torch.full_like(start, model.config.block_size)
    usable = usable_nodes(proposal.tree, start, stop_at)  # [B, N]
    accepted = accept_paths(proposal, logits, sampling=sampling, generator=generator, usable=usable)
    keep_path(cache, accepted, start=start, active=usable[:, 0])
    # The step's one host sync: per row, the path, the tokens along it, the bonus and the count.
    D1 = accepted.nodes.shape[1]
    read = torch.cat([accepted.nodes, proposal.tokens.gather(1, accepted.nodes), accepted.bonus[:, None],
                      accepted.count[:, None]], dim=1).tolist()  # [B][2 (D + 1) + 2]
    paths, new_tokens = [], []
    for row in read:
        count = row[-1]
        paths.append(row[: count + 1])
        new_tokens.append(row[D1 + 1 : D1 + 1 + count] + [row[-2]])
    last = accepted.nodes[:, -1]  # [B]
    next_hidden = hiddens.gather(1, last[:, None, None].expand(-1, 1, hiddens.shape[-1]))[:, 0]  # [B, C]
    return StepResult(paths=paths, new_tokens=new_tokens, next_roots=accepted.bonus,
                      next_hidden=next_hidden)
