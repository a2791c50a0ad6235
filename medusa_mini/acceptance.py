"""The engine's acceptance: the reference's three rules (reference.py), decided for B rows at once.

Greedy acceptance, typical acceptance and rejection sampling with top-k candidates run on the device
over the tree's root-to-leaf paths (official Medusa's evaluate_posterior idea: candidates as a [P, D]
matrix, a cumulative product of per-depth matches gives each path's accepted length), so a decoding
step reads its result with a single host sync. Paths shorter than D are masked by `path_valid`, never
padded with a token (GPT-2's token 0 is a real token, "!"). Greedy and top-k rejection sampling are
one rule with two sources of y, the backbone's token at every node: its argmax, or one draw from p
(`reference.rejection_accept` says why that is exact). Only drawn candidates need speculative
sampling's sequential tries, which walk each row on the host. Tests hold every rule to the reference,
decision for decision and draw for draw.

`usable` [B, N] marks the nodes a row may accept this step: near the end of a row's token budget or
of the context, deeper nodes could not be used; a finished row in a batch has none, not even its root.

Shapes: B rows, N nodes, V vocabulary, P paths, D tree depth.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .proposal import Proposal
from .sampling import Sampling, draw, try_children, typical_threshold
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


def cut_path(paths: torch.Tensor, best: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Row b's path best[b] cut after count[b] candidates, its last node repeated: paths [P, D + 1] -> [B, D + 1]."""
    path = paths[best]  # [B, D + 1]
    steps = torch.arange(paths.shape[1], device=paths.device)
    return path.gather(1, torch.minimum(steps[None, :], count[:, None]))


def path_accept(tree: TreeTensors, tokens: torch.Tensor, y: torch.Tensor, *,
                usable: torch.Tensor | None = None) -> Accepted:
    """`reference.walk` for B rows, on the device: tokens [B, N], y [B, N] the backbone's token at every node.

    A path's candidate at depth d is accepted if it equals y at its parent and every shallower candidate
    was. All longest paths share their accepted nodes (below one node, at most one live child holds y),
    so the first longest path is the walk's path. A child whose token repeats an earlier sibling's is
    never accepted, as in the walk, which tries children in rank order.
    """
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, N, N]
    live = ~(tree.earlier_siblings & same).any(dim=-1)  # [B, N] not shadowed by an earlier sibling
    if usable is not None:
        live = live & usable
    paths = tree.paths  # [P, D + 1]
    ok = tree.path_valid[:, 1:] & live[:, paths[:, 1:]]  # [B, P, D]
    match = (tokens[:, paths[:, 1:]] == y[:, paths[:, :-1]]) & ok  # [B, P, D]
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B, P] accepted length of each path
    best = accepted.argmax(dim=-1)  # [B] the first longest path
    count = accepted.gather(1, best[:, None])[:, 0]  # [B]
    nodes = cut_path(paths, best, count)  # [B, D + 1]
    return Accepted(nodes=nodes, count=count, bonus=y.gather(1, nodes[:, -1:])[:, 0])


def greedy_accept_paths(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *,
                        usable: torch.Tensor | None = None) -> Accepted:
    """`reference.greedy_accept` for B rows: `path_accept` with y = the argmax of logits [B, N, V]
    (ties go to the lowest token id, as in the reference)."""
    return path_accept(tree, tokens, logits.argmax(dim=-1), usable=usable)


def typical_accept_paths(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                         generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.typical_accept` for B rows, on the device, with the same draws.

    Each path's accepted prefix ends at some node; among those the winner is the walk's: the deepest,
    then the larger sum of log p (added depth by depth in float64, in the walk's order, so equal sums
    are equal here too), then the smallest node index (the walk keeps the first it meets).
    """
    B, N, V = logits.shape
    p = sampling.probs(logits)  # [B, N, V], top-p included: outside the nucleus p = 0, which never passes
    bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta)  # [B, N]
    parent = tree.parents.clamp(min=0)  # [N], the root's own entry unused
    p_x = p.view(B, N * V).gather(1, parent[None] * V + tokens)  # [B, N] p(candidate | its parent's path)
    passes = p_x > bar[:, parent]  # [B, N]
    log_p = torch.log(p_x.clamp_min(1e-30)).double()  # [B, N]
    if usable is not None:
        passes = passes & usable
    paths = tree.paths  # [P, D + 1]
    kept = (passes[:, paths[:, 1:]] & tree.path_valid[:, 1:]).long().cumprod(dim=-1)  # [B, P, D]
    accepted = kept.sum(dim=-1)  # [B, P]
    log_p_on = log_p[:, paths[:, 1:]]  # [B, P, D]
    score = torch.zeros(accepted.shape, dtype=torch.float64, device=logits.device)  # [B, P]
    for d in range(kept.shape[-1]):  # D steps, fixed by the tree
        score = score + torch.where(kept[..., d].bool(), log_p_on[..., d], 0.0)
    last = paths.gather(1, accepted.t()).t()  # [B, P] each path's last accepted node
    longest = accepted == accepted.max(dim=-1, keepdim=True).values  # [B, P]
    top_score = torch.where(longest, score, float("-inf")).max(dim=-1, keepdim=True).values
    top = longest & (score == top_score)  # [B, P]
    winner = torch.where(top, last, N).min(dim=-1).values  # [B] the smallest such node
    best = (top & (last == winner[:, None])).long().argmax(dim=-1)  # [B] a path ending there
    count = accepted.gather(1, best[:, None])[:, 0]
    at_winner = p.gather(1, winner[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    return Accepted(nodes=cut_path(paths, best, count), count=count, bonus=draw(at_winner, generator))


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
    The same walk and draws as `reference.rejection_accept`."""
    tree, draft, B = proposal.tree, proposal.draft, logits.shape[0]
    tokens, samples = proposal.tokens.tolist(), draft.samples.tolist()
    ok = usable.tolist() if usable is not None else [[True] * tree.num_nodes] * B
    D1 = tree.depth + 1
    rows = []  # per row: the path's D + 1 nodes, the count, the bonus
    for b in range(B):
        path, bonus = [0], 0
        if ok[b][0]:
            drafts = draft.per_node(b, samples)
            while True:
                kids = [c for c in tree.children[path[-1]] if ok[b][c]]
                u = torch.rand(len(kids), generator=generator, device=logits.device).tolist()
                p = sampling.probs(logits[b, path[-1]]).double().cpu()  # [V]
                i, p = try_children(p, [tokens[b][c] for c in kids], drafts[path[-1]], u)
                if i is None:
                    bonus = int(draw(p.to(logits.device), generator))
                    break
                path.append(kids[i])
        rows.append(path + [path[-1]] * (D1 - len(path)) + [len(path) - 1, bonus])
    back = torch.tensor(rows, device=logits.device)  # [B, D + 3]: one copy to the device, not three
    return Accepted(nodes=back[:, :D1], count=back[:, D1], bonus=back[:, D1 + 1])


def accept_paths(proposal: Proposal, logits: torch.Tensor, *, sampling: Sampling,
                 generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`sampling.rule`'s acceptance for B rows: logits [B, N, V] at every node of the proposal."""
    tree, tokens = proposal.tree.tensors(logits.device), proposal.tokens
    if sampling.rule == "greedy":
        return greedy_accept_paths(tree, tokens, logits, usable=usable)
    if sampling.rule == "typical":
        return typical_accept_paths(tree, tokens, logits, sampling=sampling, generator=generator, usable=usable)
    if proposal.draft is None:
        return rejection_accept_topk(tree, tokens, logits, sampling=sampling, generator=generator, usable=usable)
    return rejection_accept_drawn(proposal, logits, sampling=sampling, generator=generator, usable=usable)
