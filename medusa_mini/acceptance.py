"""The engine's acceptance: the reference's three rules (reference.py), decided for B rows at once.

Every rule judges each node on its own, on the device and all at once: does the candidate pass at its
parent (greedy: it is the backbone's token there; typical: p(candidate) clears the bar)? A node is
accepted when it and all its ancestors pass (`whole_path_passes`, one product with the ancestor mask),
and the step keeps the accepted node the rule prefers: the deepest (typical: then the most likely),
whose path from the root (`TreeTensors.node_paths`) is the accepted path. A step thus reads its result
with a single host sync. Greedy and top-k rejection sampling are one rule with two sources of y, the
backbone's token at every node: its argmax, or one draw from p (`reference.rejection_accept` says why
that is exact). Only drawn candidates need speculative sampling's sequential tries, which walk each row
on the host. Tests hold every rule to the reference, decision for decision and draw for draw.

`usable` [B, N] marks the nodes a row may accept this step: near the end of a row's token budget or
of the context, deeper nodes could not be used; a finished row in a batch has none, not even its root.

Shapes: B rows, N nodes, V vocabulary, D tree depth.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .proposal import Proposal
from .sampling import Sampling, draw, inverse_cdf, try_children, typical_threshold
from .tree import TreeTensors


class Accepted(NamedTuple):
    """An acceptance decision for B rows, as device tensors of fixed shape.

    nodes: [B, D + 1] long: the root, then the accepted nodes; past them the last accepted node repeats,
        so nodes[:, -1] is the node whose hidden state proposes the next tree.
    count: [B] long, accepted candidates per row (the path's length minus the root).
    bonus: [B] long, the backbone's token after the last accepted node.
    """

    nodes: torch.Tensor
    count: torch.Tensor
    bonus: torch.Tensor


def whole_path_passes(tree: TreeTensors, passes: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: every node on node i's path passes (the root, never judged, always does).

    passes: [B, N] bool, each node's own test at its parent."""
    passes = passes | (tree.depths == 0)  # [B, N]
    return ~(tree.ancestor_mask & ~passes[:, None, :]).any(dim=-1)  # no ancestor of i (or i) fails


def path_accept(tree: TreeTensors, tokens: torch.Tensor, y: torch.Tensor, *,
                usable: torch.Tensor | None = None) -> Accepted:
    """`reference.walk` for B rows, on the device: tokens [B, N], y [B, N] the backbone's token at every node.

    A candidate passes when it is y at its parent. Siblings hold distinct tokens (a proposer's promise: a
    top-k, or draws without replacement), so at most one child of a node passes, the accepted nodes form
    one chain from the root, and its deepest node ends the walk's path.
    """
    match = tokens == y[:, tree.parents.clamp(min=0)]  # [B, N]
    if usable is not None:
        match &= usable
    ok = whole_path_passes(tree, match)  # [B, N]
    last = torch.where(ok, tree.depths, -1).argmax(dim=-1)  # [B] the deepest accepted node
    return Accepted(nodes=tree.node_paths[last], count=tree.depths[last], bonus=y.gather(1, last[:, None])[:, 0])


def greedy_accept_paths(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *,
                        usable: torch.Tensor | None = None) -> Accepted:
    """`reference.greedy_accept` for B rows: `path_accept` with y = the argmax of logits [B, N, V]
    (ties go to the lowest token id, as in the reference), taken in float32: the same for any half
    precision, whose argmax a CPU computes slowly (BENCHMARKS.md)."""
    return path_accept(tree, tokens, logits.float().argmax(dim=-1), usable=usable)


def typical_accept_paths(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                         u: torch.Tensor, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.typical_accept` for B rows, on the device, with the same draws: u [B] are the uniforms
    of the bonus draws (`typical_uniforms`), drawn before, so the rule holds no generator and a compiler
    captures it whole (`step.verify_and_accept`).

    Among the accepted nodes the winner is the walk's: the deepest, then the larger sum of log p along
    its path (added parent first in float64, in the walk's order, so equal sums are equal here too),
    then the smallest node index (the walk keeps the first it meets).
    """
    B, N, V = logits.shape
    p = sampling.probs(logits)  # [B, N, V], top-p included: outside the nucleus p = 0, which never passes
    bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta)  # [B, N]
    parent = tree.parents.clamp(min=0)  # [N], the root's own entry unused
    p_x = p.view(B, N * V).gather(1, parent[None] * V + tokens)  # [B, N] p(candidate | its parent's path)
    passes = p_x > bar[:, parent]  # [B, N]
    if usable is not None:
        passes &= usable
    ok = whole_path_passes(tree, passes)  # [B, N]
    log_p = torch.log(p_x.clamp_min(1e-30)).double()  # [B, N]
    score = torch.zeros_like(log_p)  # [B, N] sum of log p along each node's path
    for d in range(1, tree.node_paths.shape[1]):  # D steps, parents first
        score = torch.where(tree.depths == d, score[:, parent] + log_p, score)
    depth = torch.where(ok, tree.depths, -1)  # [B, N]
    top = depth == depth.max(dim=-1, keepdim=True).values
    best_score = torch.where(top, score, float("-inf"))
    top &= best_score == best_score.max(dim=-1, keepdim=True).values
    last = torch.where(top, torch.arange(N, device=logits.device), N).min(dim=-1).values  # [B]
    at_last = p.gather(1, last[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    return Accepted(nodes=tree.node_paths[last], count=tree.depths[last], bonus=inverse_cdf(at_last, u))


def typical_uniforms(rows: int, generator: torch.Generator | None, *, device: torch.device | str) -> torch.Tensor:
    """The uniforms [rows] of a typical step's bonus draws: what `draw` would take from the generator."""
    return torch.rand(rows, generator=generator, device=device)


# The rules decided with no generator in hand, on the device and in fixed shapes, so that a compiled step
# captures them whole (`step.verify_and_accept`); rejection sampling draws as it goes.
ON_DEVICE = ("greedy", "typical")


def check_on_device(sampling: Sampling, u: torch.Tensor | None) -> None:
    """A ValueError unless `accept_on_device` can decide `sampling`'s rule with the uniforms u."""
    if sampling.acceptance not in ON_DEVICE:
        raise ValueError(f"{sampling.acceptance} acceptance is not decided on the device: verify, then accept_paths")
    if not sampling.greedy and u is None:
        raise ValueError("typical acceptance draws its bonus tokens from u: pass typical_uniforms(B, generator)")


def accept_on_device(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                     u: torch.Tensor | None, usable: torch.Tensor | None = None) -> Accepted:
    """Greedy or typical acceptance for B rows (`check_on_device`); u [B]: typical's bonus uniforms
    (`typical_uniforms`), None for greedy, which draws nothing."""
    if sampling.greedy:
        return greedy_accept_paths(tree, tokens, logits, usable=usable)
    return typical_accept_paths(tree, tokens, logits, sampling=sampling, u=u, usable=usable)


def rejection_accept_topk(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                          generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.rejection_accept` with top-k candidates, for B rows on the device: one draw from p at
    every node of every row, then `path_accept` (the same draws as the reference's, row by row)."""
    return path_accept(tree, tokens, draw(sampling.probs(logits), generator), usable=usable)


def rejection_accept_drawn(proposal: Proposal, logits: torch.Tensor, *, sampling: Sampling,
                           generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """Rejection sampling of drawn candidates, row by row on the host: the tries are sequential (each
    depends on the residual the previous rejection left; `sampling.try_children`), a few scalar
    operations each. Unusable nodes are left out; a row without a usable root accepts and draws nothing.
    Each row walks and draws as `reference.rejection_accept` (a row near its end draws fewer uniforms,
    so in a batch the rows after it see other numbers, from the same distributions). p is computed for
    every node at once on the device; only the p and q of the nodes the walk reaches come to the host,
    once each."""
    tree, draft, B = proposal.tree, proposal.draft, logits.shape[0]
    p_all = sampling.probs(logits)  # [B, N, V]
    tokens, samples = proposal.tokens.tolist(), draft.samples.tolist()
    ok = usable.tolist() if usable is not None else [[True] * tree.num_nodes] * B
    D1 = tree.depth + 1
    rows = []  # per row: the path's D + 1 nodes (the last repeated), the count, the bonus
    for b in range(B):
        path, bonus = [0], 0
        if ok[b][0]:
            drafts = draft.per_node(b, samples)
            while True:
                node = path[-1]
                kids = [c for c in tree.children[node] if ok[b][c]]
                u = torch.rand(len(kids), generator=generator, device=logits.device).tolist()
                q = drafts[node] and (drafts[node][0].cpu().double(), drafts[node][1])  # (log q [V], draws)
                i, p = try_children(p_all[b, node].cpu().double(), [tokens[b][c] for c in kids], q, u)
                if i is None:
                    bonus = int(draw(p.to(logits.device), generator))
                    break
                path.append(kids[i])
        rows.append(path + [path[-1]] * (D1 - len(path)) + [len(path) - 1, bonus])
    back = torch.tensor(rows, device=logits.device)  # [B, D + 3]: one copy to the device, not three
    return Accepted(nodes=back[:, :D1], count=back[:, D1], bonus=back[:, D1 + 1])


def accept_paths(proposal: Proposal, logits: torch.Tensor, *, sampling: Sampling,
                 generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """The acceptance rule `sampling` names, for B rows: logits [B, N, V] at every node of the proposal."""
    tree, tokens = proposal.tree.tensors(logits.device), proposal.tokens
    if sampling.acceptance in ON_DEVICE:
        u = None if sampling.greedy else typical_uniforms(logits.shape[0], generator, device=logits.device)
        return accept_on_device(tree, tokens, logits, sampling=sampling, u=u, usable=usable)
    if proposal.draft is None:
        return rejection_accept_topk(tree, tokens, logits, sampling=sampling, generator=generator, usable=usable)
    return rejection_accept_drawn(proposal, logits, sampling=sampling, generator=generator, usable=usable)
