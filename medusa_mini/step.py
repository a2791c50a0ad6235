"""The engine's Medusa step (paper §2) for B rows: propose -> verify -> accept -> keep the accepted path.

The same stages as the reference's loop body (reference.py), made fast: a `Proposer` (proposal.py)
fills the tree for every row on the device; `verify` scores every node of every row in one tree-masked
forward over the static KV cache; `accept_on_device` (acceptance.py) applies the rule to every node of
every row at once, with uniform numbers drawn before it; `keep_path` compacts each row's cache. Nothing
waits for the host until the end, where `read_step` reads the emitted tokens of every row at once: one
host sync per step.

Plain decoding repeats `plain_step`. Medusa, eager: `verify`, then `acceptance.accept_on_device`, then
`finish_step`. Compiled: `verify_and_accept` is all of that as one graph, which also drafts the next tree
with the heads (top-k, or drawn in a static step); `draft_drawn` drafts only a generation's first drawn
tree. `Steps` names what a loop runs, eager by default or compiled (cli/compiled.py), as gpt-fast
compiles its `decode_one_token`.

Shapes: B rows, N tree nodes, D tree depth, V vocabulary, C n_embd, Q the q a drawn tree draws from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .acceptance import Accepted, accept_on_device, acceptance_uniforms, check_uniforms
from .model import GPT, KVCache, compact_kv_cache
from .proposal import Draft, Proposal, Proposer, cut_uniforms
from .sampling import Sampling
from .tree import Tree, TreeTensors

if TYPE_CHECKING:
    from .heads import DraftHeads


def plain_step(model: GPT, cache: KVCache, tokens: torch.Tensor, *, sampling: Sampling = Sampling(),
               u: torch.Tensor | None = None, attended: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, tokens [B, 1], through the cache, and the next token chosen in the same call:
    (next tokens [B], logits [B, 1, V], hidden [B, 1, C]). A compiled plain step so chooses its token
    inside its graph, as Medusa's `verify_and_accept` accepts inside its own: the baseline pays for no
    launch that Medusa's step does not. u: [B] from `Sampling.uniforms`, None when greedy."""
    if not sampling.greedy and (u is None or u.shape != tokens.shape[:1]):  # before the forward writes the cache
        raise ValueError("a sampled plain step draws from u: pass sampling.uniforms((B,), generator, device=...)")
    logits, hidden = model(tokens, cache=cache, attended=attended)
    return sampling.choose(logits[:, -1], u), logits, hidden


def verify(model: GPT, cache: KVCache, tokens: torch.Tensor, *, depths: torch.Tensor, ancestor_mask: torch.Tensor,
           attended: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked forward over all N nodes of B rows (§2.1.2), tokens [B, N] -> logits [B, N, V],
    hidden [B, N, C]; depths [N] and ancestor_mask [N, N] are the tree's (`Tree.tensors`).

    Row b's nodes occupy cache slots [L_b, L_b + N) but sit at positions L_b + depth, clamped to the
    context (a node past it is never usable); each sees its row's whole prefix, itself and its
    ancestors. Shapes depend on the tree alone, so one captured graph per tree serves every step.
    """
    pos = (cache.lengths[:, None] + depths).clamp(max=model.config.block_size - 1)  # [B, N]
    return model(tokens, pos=pos, cache=cache, attn_mask=ancestor_mask, attended=attended)


def deepest_usable_depth(stop_at: int | torch.Tensor, start: int | torch.Tensor) -> int | torch.Tensor:
    """The deepest node a row can use this step (negative: the row is done). A node at depth d emits d + 1
    tokens, and the row stops when prompt and output reach stop_at tokens: its cache holds start of them,
    the root one more. Ints or [B] tensors alike."""
    return stop_at - 2 - start


def heads_in_graph(proposer: Proposer, tree: Tree, sampling: Sampling, *, static: bool) -> DraftHeads | None:
    """The heads a `verify_and_accept` on `tree` drafts the next tree with, or None: not on a tree cut short
    (the next is another); drawn candidates only in a static step, whose next tree is never cut (an eager
    one cut next would draw its own uniforms, spending those drawn for the graph), and not after the root
    alone, which has no tree to draw."""
    if tree is not proposer.tree or (sampling.draws_candidates and not (static and tree.depth)):
        return None
    return proposer.heads


def usable_nodes(tree: Tree, start: torch.Tensor, stop_at: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the nodes row b may accept (`deepest_usable_depth`). A row with no room (finished, in a
    batch that goes on) has no usable node, not even its root."""
    return tree.tensors(start.device).depths <= deepest_usable_depth(stop_at, start)[:, None]


def keep_path(cache: KVCache, accepted: Accepted, *, start: torch.Tensor, active: torch.Tensor) -> None:
    """Keep the K/V of each row's root and accepted nodes in consecutive slots from start [B], the root's
    slot. Always D + 1 slots move per row (a fixed shape; a chain tree's accepted path moves onto itself);
    the length counts only the accepted ones, and stays put for a row that is not `active` [B]."""
    count = torch.where(active, accepted.count + 1, 0)
    compact_kv_cache(cache, start[:, None] + accepted.nodes, start=start, count=count)


def finish_step(cache: KVCache, accepted: Accepted, hiddens: torch.Tensor, *, start: torch.Tensor,
                active: torch.Tensor) -> torch.Tensor:
    """`keep_path`, then the hidden state [B, C] at each row's last accepted node (hiddens [B, N, C] from
    the verify), which proposes the next tree."""
    keep_path(cache, accepted, start=start, active=active)
    last = accepted.nodes[:, -1]  # [B]
    return hiddens.gather(1, last[:, None, None].expand(-1, 1, hiddens.shape[-1]))[:, 0]  # [B, C]


def verify_and_accept(model: GPT, cache: KVCache, tokens: torch.Tensor, *, tree: TreeTensors, usable: torch.Tensor,
                      sampling: Sampling = Sampling(), u: torch.Tensor | None = None, draft: Draft | None = None,
                      attended: int | None = None, heads: DraftHeads | None = None, u_next: torch.Tensor | None = None
                      ) -> tuple[Accepted, torch.Tensor, torch.Tensor | None, Draft | None]:
    """All of a step after its proposal (tokens [B, N]), as one function, so a compiler captures it as one
    graph (two would hand the verify's logits across, which CUDA graphs free between calls): `verify`,
    the acceptance (`accept_on_device`: any rule, its uniforms u drawn before, as a graph holds no
    generator; draft: drawn candidates' q), `finish_step`; with `heads`, also the next step's candidates
    [B, N] on the same tree, from the bonus tokens and the hidden states `finish_step` returns: the heads'
    top-k, or, given the next step's uniforms u_next [B, Q, V], their draws and the draft they came from
    (`heads.draft`), which the heads would otherwise compute in a few dozen launches of their own.
    Returns (accepted, next hidden [B, C], next tokens or None, next draft or None)."""
    check_uniforms(sampling, u)  # before the verify writes the cache
    start = cache.lengths  # [B]
    logits, hiddens = verify(model, cache, tokens, depths=tree.depths, ancestor_mask=tree.ancestor_mask,
                             attended=attended)  # [B, N, V], [B, N, C]
    accepted = accept_on_device(tree, tokens, logits, sampling=sampling, u=u, draft=draft, usable=usable)
    hidden = finish_step(cache, accepted, hiddens, start=start, active=usable[:, 0])  # [B, C]
    if heads is None:
        return accepted, hidden, None, None
    return accepted, hidden, *heads.draft(model, accepted.bonus, hidden, tree, temperature=sampling.temperature,
                                          u=u_next)


def draft_drawn(model: GPT, heads: DraftHeads, roots: torch.Tensor, hidden: torch.Tensor, *, tree: TreeTensors,
                temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, Draft]:
    """The heads' drawn candidates on `tree` from roots [B] and hidden [B, C], the Gumbel noise's uniforms u
    [B, Q, V] drawn before (`HeadsProposer.draw_uniforms`), as one function a compiler captures whole:
    tokens [B, N] and their draft, what the eager proposer makes from the same uniforms."""
    return heads.draft(model, roots, hidden, tree, temperature=temperature, u=u)


@dataclass(frozen=True)
class Steps:
    """What decoding repeats, as a compiler may capture it: the plain step (its forward and the token it chooses),
    the verify and `verify_and_accept` (None: `verify`, then acceptance and `finish_step`, eagerly; on a GPU at
    batch 1 those stages are a few dozen small kernels, or a few hundred for rejection sampling's tries, whose
    launches cost more than their work), and `draft_drawn` for candidates drawn from the heads' q (None: the
    proposer draws them, eagerly). Compiled ones keep static shapes (`static`): they read the whole cache and
    verify the whole tree every step, where eager ones read only the slots in use and cut the tree near the end; a
    static `verify_and_accept` also draws the next tree of drawn candidates, `draft_drawn` only the first."""

    plain: Callable = plain_step
    verify: Callable = verify
    verify_and_accept: Callable | None = None
    draft_drawn: Callable | None = None
    static: bool = False

    def attended(self, slots: int) -> int | None:
        """The cache slots a forward reads: eager, only `slots`, those in use; static, None (all max_len), so
        every step has one shape."""
        return None if self.static else slots


EAGER = Steps()


@dataclass
class StepResult:
    """What one Medusa step decided for B rows. The KV cache already holds each root and accepted path."""

    paths: list[list[int]]  # per row, accepted nodes, root first: [0, a1, ..., ad]
    new_tokens: list[list[int]]  # per row, the accepted candidates then the bonus (the root came before)
    next_roots: torch.Tensor  # [B] the bonus tokens, on the device: the next step's roots
    next_hidden: torch.Tensor  # [B, C] the hidden state at each row's last accepted node
    next_proposal: Proposal | None = None  # the next step's, on the whole tree, when this step drafted it


def read_step(proposal: Proposal, accepted: Accepted) -> tuple[list[list[int]], list[list[int]]]:
    """The step's one host sync: per row, the accepted path (root first) and the tokens it emits (the
    accepted candidates, then the bonus)."""
    D1 = accepted.nodes.shape[1]
    read = torch.cat([accepted.nodes, proposal.tokens.gather(1, accepted.nodes), accepted.bonus[:, None],
                      accepted.count[:, None]], dim=1).tolist()  # [B][2 (D + 1) + 2]
    # row = [nodes (D + 1) | their tokens (D + 1) | bonus | count]; the tokens emitted skip the root's
    paths = [row[: row[-1] + 1] for row in read]
    return paths, [row[D1 + 1 : D1 + 1 + row[-1]] + [row[-2]] for row in read]


@torch.no_grad()
def medusa_step(
    model: GPT,
    cache: KVCache,
    proposer: Proposer,
    roots: torch.Tensor,
    hidden: torch.Tensor,
    *,
    history: list[list[int]] | None = None,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    stop_at: torch.Tensor | None = None,
    max_depth: int | None = None,
    attended: int | None = None,
    steps: Steps = EAGER,
    drafted: Proposal | None = None,
) -> StepResult:
    """One Medusa step for B rows: candidates -> verify -> accept -> compact, then one host sync.

    roots: [B] each row's last emitted token, whose K/V are not in `cache` yet; hidden: [B, C] the
    hidden states that produced them. history: each row's tokens so far (prompt lookup reads them).
    stop_at: [B] the total length at which each row stops (default: the context); max_depth: the
    deepest node any row can use (default: the proposer's): eager steps cut the tree there, less to
    verify, static ones (`Steps.static`) verify it whole, one graph for every step, and either way
    `usable` masks the nodes a row cannot use (prompt lookup's rounded-up chain has some too). The random
    numbers are drawn for the whole tree and cut with it, so both make the same draws. attended: the cache
    slots any row reads once the nodes are in (default: all). drafted: the proposal on the whole tree the step
    before drafted in its graph (`verify_and_accept`, `StepResult.next_proposal`); used unless this tree is
    cut short. A static step of drawn candidates draws the next step's uniforms after its own, in the
    order an eager loop draws them, and the next tree in its graph: the same draws, and one set more at a
    generation's last step, which a generator reused for another generation would then go on from.
    """
    if drafted is not None and sampling.draws_candidates != (drafted.draft is not None):
        raise ValueError("the drafted proposal's candidates do not match the rule: top-k guesses for greedy and "
                         "typical acceptance, draws with their draft for rejection sampling of drawn candidates")
    start = cache.lengths  # [B] the roots' slots
    depth = proposer.tree.depth if max_depth is None or steps.static else max_depth
    tree = proposer.tree.truncated(max(depth, 0))
    if drafted is not None and depth >= proposer.tree.depth:
        proposal = drafted
    elif sampling.draws_candidates and steps.draft_drawn is not None and proposer.heads is not None and tree.depth:
        u = proposer.cut(proposer.draw_uniforms(len(roots), generator, device=roots.device), tree)  # as it would
        # Copies in and out: roots and hidden may be the last step's graph outputs, which no replay outlives.
        tokens, draft = steps.draft_drawn(model, proposer.heads, roots.clone(), hidden.clone(),
                                          tree=tree.tensors(roots.device), temperature=sampling.temperature, u=u)
        proposal = Proposal(tokens.clone(), tree, draft.clone())
    else:
        proposal = proposer.propose(roots, hidden, history=history or [[]] * len(roots), max_depth=depth,
                                    sampling=sampling, generator=generator)
    t = proposal.tree.tensors(roots.device)
    if stop_at is None:
        stop_at = torch.full_like(start, model.config.block_size)
    usable = usable_nodes(proposal.tree, start, stop_at)  # [B, N]
    next_proposal, draft = None, proposal.draft
    u = acceptance_uniforms(sampling, len(roots), proposer.tree.num_nodes, generator, device=roots.device)
    if u is not None and u.dim() == 2:  # one per node of the whole tree: a cut tree's nodes come first
        u = cut_uniforms(u, proposal.tree.num_nodes)
    if steps.verify_and_accept is not None:
        heads = heads_in_graph(proposer, proposal.tree, sampling, static=steps.static)
        draws_next = heads is not None and sampling.draws_candidates
        u_next = proposer.draw_uniforms(len(roots), generator, device=roots.device) if draws_next else None
        accepted, next_hidden, next_tokens, next_draft = steps.verify_and_accept(
            model, cache, proposal.tokens, tree=t, usable=usable, sampling=sampling, u=u, draft=draft,
            attended=attended, heads=heads, u_next=u_next)
        if next_tokens is not None:  # the next step's input: copies, as a CUDA graph overwrites its outputs
            next_proposal = Proposal(next_tokens.clone(), proposer.tree, None if next_draft is None else next_draft.clone())
    else:
        logits, hiddens = steps.verify(model, cache, proposal.tokens, depths=t.depths, ancestor_mask=t.ancestor_mask,
                                       attended=attended)  # [B, N, V], [B, N, C]
        accepted = accept_on_device(t, proposal.tokens, logits, sampling=sampling, u=u, draft=draft, usable=usable)
        next_hidden = finish_step(cache, accepted, hiddens, start=start, active=usable[:, 0])
    paths, new_tokens = read_step(proposal, accepted)
    return StepResult(paths=paths, new_tokens=new_tokens, next_roots=accepted.bonus, next_hidden=next_hidden,
                      next_proposal=next_proposal)
