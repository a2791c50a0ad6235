"""The engine's Medusa step (paper §2) for B rows: propose -> verify -> accept -> keep the accepted path.

The reference's loop body (reference.py), for B rows on the device: a `Proposer` fills every row's tree;
`verify` scores every node in one tree-masked forward over the static KV cache; `acceptance.accept`
judges every node at once; `keep_path` compacts each row's cache; `read_step` is the step's one host read.
`Steps` names the two steps a decoding loop repeats: these, or cli/compiled.py's, with the same decisions.

Shapes: B rows, N tree nodes, D tree depth, V vocabulary, C n_embd.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .acceptance import Accepted, accept, acceptance_uniforms
from .model import GPT, KVCache, at_each_row, compact_kv_cache
from .proposal import Proposal, Proposer
from .sampling import Sampling
from .tree import TreeTensors


def plain_step(model: GPT, cache: KVCache, tokens: torch.Tensor, *, sampling: Sampling = Sampling(),
               u: torch.Tensor | None = None, attended: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, tokens [B, 1], through the cache, and the next token chosen from its logits:
    (next tokens [B], logits [B, 1, V], hidden [B, 1, C]); u: [B] from `Sampling.uniforms`, None when greedy."""
    if not sampling.greedy and (u is None or u.shape != tokens.shape[:1]):  # before the forward writes the cache
        raise ValueError("a sampled plain step draws from u: pass sampling.uniforms((B,), generator, device=...)")
    logits, hidden = model(tokens, cache=cache, attended=attended)
    return sampling.next_token(logits[:, -1], u), logits, hidden


def place_tree(cache: KVCache, tree: TreeTensors) -> torch.Tensor:
    """[B, N, 2D + 5]: the tree placed after each row's length L_b, in one add (`TreeTensors.offsets`): node i's
    cache slot L_b + i, its position L_b + depth_i, the D + 1 slots its path lies in, the D + 1 slots it would move
    to (L_b + 0..D), and the row's length once it is kept (L_b + depth_i + 1)."""
    return cache.length_buffer[:, None, None] + tree.offsets


def verify(model: GPT, cache: KVCache, tokens: torch.Tensor, *, tree: TreeTensors, placed: torch.Tensor | None = None,
           attended: int | None = None, clamp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked forward over all N nodes of B rows (§2.1.2): tokens [B, N] -> logits [B, N, V], hidden [B, N, C].

    Row b's nodes occupy cache slots [L_b, L_b + N) past its length L_b, which stays put (they are tentative until
    `keep_path`), but sit at positions L_b + depth (placed: `place_tree(cache, tree)`, if the caller has it), clamped to
    the context (a node past it is never usable; clamp=False where every row has room for the tree, so no node is past
    it); each sees its row's whole prefix, itself and its ancestors (the tree's ancestor mask).
    """
    placed = place_tree(cache, tree) if placed is None else placed  # [B, N, 2D + 5]
    pos = placed[..., 1].clamp(max=model.config.block_size - 1) if clamp else placed[..., 1]  # [B, N]
    return model(tokens, pos=pos, cache=cache, mask_table=tree.mask_table, attended=attended, advance=False,
                 slots=placed[..., 0])


def has_room(start: int | torch.Tensor, depth: int | torch.Tensor, stop_at: int | torch.Tensor) -> bool | torch.Tensor:
    """Does a path to `depth` fit: start (cached tokens) + the root (not yet cached) + depth + the bonus <= stop_at?"""
    return start + depth + 2 <= stop_at


def usable_nodes(tree: TreeTensors, start: torch.Tensor, stop_at: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the nodes row b may accept (`has_room`); a finished row (stop_at 0) has none, not even its root."""
    return has_room(start[:, None], tree.depths, stop_at[:, None])


def keep_path(cache: KVCache, accepted: Accepted, *, placed: torch.Tensor, active: torch.Tensor | None = None) -> None:
    """Keep the K/V of each row's root and accepted nodes in consecutive slots from its length (the root's slot,
    where `verify` left it); the length advances past them only for `active` [B] rows (None: all). Always
    D + 1 slots move per row (a fixed shape: past the path's end its last node is copied again, beyond the new
    length). placed: `place_tree`'s, from the lengths the verify saw."""
    slots = at_each_row(placed[..., 2:], accepted.last)  # [B, 2D + 3]: the path's slots, those it moves to, the length
    D1 = (slots.shape[1] - 1) // 2  # slots: [the path's D + 1 | where they move | the length]
    length = slots[:, -1] if active is None else torch.where(active, slots[:, -1], cache.length_buffer)  # [B]
    compact_kv_cache(cache, slots[:, :D1], to=slots[:, D1:-1], length=length)


@dataclass
class StepResult:
    """What one Medusa step decided for B rows. The KV cache already holds each root and accepted path."""

    paths: list[list[int]]  # per row, accepted nodes, root first: [0, a1, ..., ad]
    new_tokens: list[list[int]]  # per row, the accepted candidates then the bonus (the root came before)
    next_roots: torch.Tensor  # [B] the bonus tokens, on the device: the next step's roots
    next_hidden: torch.Tensor  # [B, C] the hidden state at each row's last accepted node


def read_step(proposal: Proposal, accepted: Accepted) -> tuple[list[list[int]], list[list[int]]]:
    """The step's one host read: per row, the accepted path (root first) and its tokens (candidates, then the bonus)."""
    read = torch.cat([accepted.last[:, None], accepted.bonus[:, None], proposal.tokens], dim=1).tolist()  # [B][2 + N]
    paths = [proposal.tree.path(row[0]) for row in read]  # row = [last | bonus | node tokens]
    return paths, [[row[2 + node] for node in path[1:]] + [row[1]] for row, path in zip(read, paths)]


@torch.no_grad()
def medusa_step(model: GPT, cache: KVCache, proposer: Proposer, roots: torch.Tensor, hidden: torch.Tensor, *,
                history: list[list[int]], stop_at: torch.Tensor | None, sampling: Sampling = Sampling(),
                generator: torch.Generator | None = None, attended: int | None = None) -> StepResult:
    """One Medusa step for B rows: propose -> verify -> accept -> keep the path, then one host read.

    roots: [B] each row's last emitted token, whose K/V are not in `cache` yet; hidden: [B, C] the hidden states that
    produced them. history: each row's tokens so far (prompt lookup reads them). stop_at: [B] the total length at which
    each row stops, the nodes a row cannot use masked (`usable_nodes`); None when every row has room for the whole tree.
    The random numbers, those of drawn candidates and then the acceptance's (per node of the proposer's whole tree;
    typical: one per row), are drawn in the reference's order. attended: the cache slots read (default all).
    """
    B, device = len(roots), roots.device
    u_draw = proposer.uniforms(sampling, B, generator, device=device)
    proposal = proposer.propose(roots, hidden, history=history, sampling=sampling, u=u_draw)
    u = acceptance_uniforms(sampling, B, proposer.tree.num_nodes, generator, device=device)
    tree = proposal.tree.tensors(device)
    usable = None if stop_at is None else usable_nodes(tree, cache.length_buffer, stop_at)  # [B, N]
    placed = place_tree(cache, tree)  # [B, N, 2D + 5]
    logits, hiddens = verify(model, cache, proposal.tokens, tree=tree, placed=placed, attended=attended,
                             clamp=usable is not None)
    accepted = accept(tree, proposal.tokens, logits, sampling=sampling, u=u, drawn=proposal.drawn, usable=usable)
    keep_path(cache, accepted, placed=placed, active=None if usable is None else usable[:, 0])
    paths, new_tokens = read_step(proposal, accepted)
    return StepResult(paths, new_tokens, next_roots=accepted.bonus, next_hidden=at_each_row(hiddens, accepted.last))


@dataclass(frozen=True)
class Steps:
    """The two steps the decoding loops repeat: `plain_step` and `medusa_step`, eager (the default), or
    others with their signatures that make the same decisions (cli/compiled.py's)."""

    plain: Callable = plain_step
    medusa: Callable = medusa_step
