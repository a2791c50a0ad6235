"""The engine's acceptance: the reference's three rules (reference.py), decided for B rows at once.

Greedy and typical acceptance run on the device over each row's root-to-leaf paths at once (official
Medusa's evaluate_posterior idea: candidates as a [P, D] matrix per row, a cumulative product of
per-depth matches gives each path's accepted length), so a decoding step reads its result with a
single host sync. Paths shorter than D are masked by `path_valid`, never padded with a token (GPT-2's
token 0 is a real token, "!"). Rejection sampling's tries are sequential by nature, so it runs the
reference's own walk (`reference.rejection_accept`) for each row on the host. Tests hold the
vectorised rules to the reference's walks, decision for decision and draw for draw.

`usable` [B, N] marks the nodes a row may accept this step: near the end of a row's token budget or
of the context, deeper nodes could not be used; a finished row in a batch has none, not even its root.

Shapes: B rows, N nodes, V vocabulary, P paths, D tree depth.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .proposal import Proposal, StepTree
from .reference import rejection_accept, typical_threshold
from .sampling import Sampling, draw


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


def on_paths(x: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """A per-node value read along every path: x [B, N], paths [B, P, D + 1] -> [B, P, D + 1]."""
    B, P, D1 = paths.shape
    return x.gather(1, paths.reshape(B, P * D1)).view(B, P, D1)


def cut_path(paths: torch.Tensor, best: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Row b's path best[b] cut after count[b] candidates, its last node repeated: -> [B, D + 1]."""
    B, _, D1 = paths.shape
    path = paths.gather(1, best[:, None, None].expand(B, 1, D1))[:, 0]  # [B, D + 1]
    steps = torch.arange(D1, device=paths.device)
    return path.gather(1, torch.minimum(steps[None, :], count[:, None]))


def greedy_accept_paths(tree: StepTree, tokens: torch.Tensor, logits: torch.Tensor, *,
                        usable: torch.Tensor | None = None) -> Accepted:
    """`reference.greedy_accept` for B rows, on the device. tokens [B, N], logits [B, N, V].

    A path's candidate at depth d is accepted if it equals the argmax at its parent and every
    shallower candidate was. All longest paths share their accepted nodes (below one node, at most
    one live child holds the argmax), so the first longest path is the walk's path. A child whose
    token repeats an earlier sibling's is never accepted, as in the walk, which tries children in
    rank order; argmax ties go to the lowest token id in both.
    """
    y = logits.argmax(dim=-1)  # [B, N] the backbone's own next token at every node
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, N, N]
    live = ~(tree.earlier_siblings & same).any(dim=-1)  # [B, N] not shadowed by an earlier sibling
    if usable is not None:
        live = live & usable
    paths = tree.paths  # [B, P, D + 1]
    ok = tree.path_valid[..., 1:] & on_paths(live, paths)[..., 1:]  # [B, P, D]
    match = (on_paths(tokens, paths)[..., 1:] == on_paths(y, paths)[..., :-1]) & ok  # [B, P, D]
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B, P] accepted length of each path
    best = accepted.argmax(dim=-1)  # [B] the first longest path
    count = accepted.gather(1, best[:, None])[:, 0]  # [B]
    nodes = cut_path(paths, best, count)  # [B, D + 1]
    return Accepted(nodes=nodes, count=count, bonus=y.gather(1, nodes[:, -1:])[:, 0])


def typical_accept_paths(tree: StepTree, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                         generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.typical_accept` for B rows, on the device, with the same draws.

    Each path's accepted prefix ends at some node; among those the winner is the walk's: the deepest,
    then the larger sum of log p (added depth by depth in float64, in the walk's order, so equal sums
    are equal here too), then the smallest node index (the walk keeps the first it meets).
    """
    B, N, V = logits.shape
    p = F.softmax(logits.float() / sampling.temperature, dim=-1)  # [B, N, V]
    bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta)  # [B, N]
    parent = tree.parents.clamp(min=0)  # [B, N], the root's own entry unused
    p_x = p.view(B, N * V).gather(1, parent * V + tokens)  # [B, N] p(candidate | its parent's path)
    passes = p_x > bar.gather(1, parent)  # [B, N]
    log_p = torch.log(p_x.clamp_min(1e-30)).double()  # [B, N]
    if usable is not None:
        passes = passes & usable
    paths = tree.paths  # [B, P, D + 1]
    kept = (on_paths(passes, paths)[..., 1:] & tree.path_valid[..., 1:]).long().cumprod(dim=-1)  # [B, P, D]
    accepted = kept.sum(dim=-1)  # [B, P]
    log_p_on = on_paths(log_p, paths)[..., 1:]  # [B, P, D]
    score = torch.zeros(accepted.shape, dtype=torch.float64, device=logits.device)  # [B, P]
    for d in range(kept.shape[-1]):  # D steps, fixed by the tree
        score = score + torch.where(kept[..., d].bool(), log_p_on[..., d], 0.0)
    last = paths.gather(2, accepted[..., None])[..., 0]  # [B, P] each path's last accepted node
    longest = accepted == accepted.max(dim=-1, keepdim=True).values  # [B, P]
    top_score = torch.where(longest, score, float("-inf")).max(dim=-1, keepdim=True).values
    top = longest & (score == top_score)  # [B, P]
    winner = torch.where(top, last, N).min(dim=-1).values  # [B] the smallest such node
    best = (top & (last == winner[:, None])).long().argmax(dim=-1)  # [B] a path ending there
    count = accepted.gather(1, best[:, None])[:, 0]
    at_winner = logits.gather(1, winner[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    return Accepted(nodes=cut_path(paths, best, count), count=count, bonus=draw(sampling.probs(at_winner), generator))


def rejection_accept_rows(proposal: Proposal, logits: torch.Tensor, *, sampling: Sampling,
                          generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.rejection_accept`, row by row on the host: the tries are sequential (each depends on
    the residual the previous rejection left), a few scalar operations each. Unusable nodes are left
    out of the walk; a row without a usable root is skipped (it accepts nothing, draws nothing)."""
    tree, B = proposal.tree, logits.shape[0]
    tokens = proposal.tokens.tolist()
    ok = usable.tolist() if usable is not None else [[True] * tree.num_nodes] * B
    parents = [list(tree.host_parents)] * B if tree.host_parents is not None else tree.parents.tolist()
    draft = proposal.draft
    samples = draft.samples.tolist() if draft is not None else None
    D1 = tree.paths.shape[-1]
    rows = []  # per row: the path's D + 1 nodes, the count, the bonus
    for b in range(B):
        path, bonus = [0], 0
        if ok[b][0]:
            kept = [par if ok[b][i] else -2 for i, par in enumerate(parents[b])]  # -2: in no node's children
            drafts = draft.per_node(b, samples) if draft is not None else None
            path, bonus = rejection_accept(kept, tokens[b], logits[b], sampling=sampling, generator=generator,
                                           drafts=drafts)
        rows.append(path + [path[-1]] * (D1 - len(path)) + [len(path) - 1, bonus])
    back = torch.tensor(rows, device=logits.device)  # [B, D + 3]: one copy to the device, not three
    return Accepted(nodes=back[:, :D1], count=back[:, D1], bonus=back[:, D1 + 1])


def accept_paths(proposal: Proposal, logits: torch.Tensor, *, sampling: Sampling,
                 generator: torch.Generator | None, usable: torch.Tensor | None = None) -> Accepted:
    """`sampling.rule`'s acceptance for B rows: logits [B, N, V] at every node of the proposal."""
    if sampling.rule == "greedy":
        return greedy_accept_paths(proposal.tree, proposal.tokens, logits, usable=usable)
    if sampling.rule == "typical":
        return typical_accept_paths(proposal.tree, proposal.tokens, logits, sampling=sampling, generator=generator,
                                    usable=usable)
    return rejection_accept_rows(proposal, logits, sampling=sampling, generator=generator, usable=usable)
