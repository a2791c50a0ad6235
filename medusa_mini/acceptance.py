"""Acceptance rules: from the backbone's logits at every tree node to an accepted path and a bonus token.

All three are pure functions of (tree, candidate tokens [N], tree logits [N, V]) — no model inside — so
they are tested with hand-written logits. Each returns (path, bonus): `path` is the list of accepted node
indices from the root (node 0, always accepted) down; `bonus` is the token the backbone itself yields
after the last accepted node, which becomes the next root. A step therefore emits len(path) tokens:
len(path) - 1 accepted candidates plus the bonus.

p denotes the backbone (target) distribution at a node after temperature (and top-p) — the very
distribution plain sampling draws from; q the heads' draft distribution when candidates are sampled.

Greedy and typical acceptance come twice. The node-by-node walks (`greedy_accept`, `typical_accept`)
are the readable spec. The `*_paths` forms decide the same thing on the device, over the tree's P
root-to-leaf paths at once (official Medusa's evaluate_posterior idea: candidates as a [P, D] matrix,
a cumulative product of per-depth matches gives each path's accepted length), so a decoding step
reads its result with a single host sync. Paths shorter than D are masked by `path_valid`, never
padded with a token (GPT-2's token 0 is a real token, "!"). Tests hold the two equal.

Shapes: N nodes, V vocabulary, P paths, D tree depth.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .draft import Draft, try_candidates
from .sampling import draw, sample, sampling_probs
from .tree import Tree


def greedy_accept(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy (exact) acceptance: descend while the backbone's argmax is one of the node's children.

    tokens: [N] candidate token at each node (tokens[0] = root). logits: [N, V].
    At each node y = argmax p; if a child holds y, descend into it, else stop and emit y as the bonus.
    The output is then exactly what plain greedy decoding would produce, only in fewer passes.
    """
    choice = logits.argmax(dim=-1).tolist()  # [N] the backbone's own next token at every node
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if toks[c] == choice[node]), None)
        if nxt is None:
            return path, choice[node]
        node = nxt
        path.append(node)


class PathChoice(NamedTuple):
    """An acceptance decision as device tensors, fixed in shape by the tree alone.

    nodes: [D + 1] long: the root, then the accepted nodes; past them the last accepted node repeats,
        so nodes[-1] is always the node whose hidden state proposes the next tree.
    accepted: [] long, the number of accepted candidates (len(path) - 1 in the walks' terms).
    bonus: [] long, the backbone's token after the last accepted node.
    """

    nodes: torch.Tensor
    accepted: torch.Tensor
    bonus: torch.Tensor

    def to_host(self) -> tuple[list[int], int]:
        """(path, bonus) as the walks return them; one host sync."""
        *nodes, accepted, bonus = torch.cat([self.nodes, self.accepted[None], self.bonus[None]]).tolist()
        return nodes[: accepted + 1], bonus


def at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-dim index tensor i, without leaving the device: `x[i]` would first turn i into a
    Python int, a host sync on a GPU."""
    return x.index_select(0, i.reshape(1))[0]


def accepted_path(path: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """A path's nodes [D + 1] cut after `accepted` candidates, the last kept node repeated to length D + 1."""
    steps = torch.arange(path.numel(), device=path.device)  # [D + 1]
    return path[torch.minimum(steps, accepted)]


def greedy_accept_paths(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> PathChoice:
    """`greedy_accept` over all paths at once, without leaving the device.

    A path's candidate at depth d is accepted if it equals the argmax at its parent (d - 1) and every
    shallower candidate was. All longest paths share their accepted nodes (below one node, at most
    one live child holds the argmax), so the first longest path is the walk's path. Argmax ties go to
    the lowest token id in both forms (torch.argmax returns the first maximum). A child whose token
    repeats an earlier sibling's is never accepted, as in the walk, which tries children in rank order.
    """
    t = tree.tensors(logits.device)
    choice = logits.argmax(dim=-1)  # [N] the backbone's own next token at every node
    shadowed = (t.earlier_siblings & (tokens[:, None] == tokens[None, :])).any(dim=-1)  # [N]
    paths = t.paths  # [P, D + 1]
    live = t.path_valid[:, 1:] & ~shadowed[paths[:, 1:]]  # [P, D]
    match = (tokens[paths[:, 1:]] == choice[paths[:, :-1]]) & live  # [P, D]
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [P] accepted length of each path
    best = accepted.argmax()  # the first longest path
    nodes = accepted_path(at(paths, best), at(accepted, best))  # [D + 1]
    return PathChoice(nodes=nodes, accepted=at(accepted, best), bonus=at(choice, nodes[-1]))


def rejection_accept(
    tree: Tree,
    tokens: torch.Tensor,
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    draft: Draft | None = None,
) -> tuple[list[int], int]:
    """Lossless rejection sampling on a tree (speculative sampling, Leviathan et al. / SpecInfer).

    Walk from the root. At a node with target p, try its children x1, x2, ... in rank order: accept
    x_i with probability min(1, p(x_i) / q_i(x_i)), q_i being the distribution x_i was drawn from;
    after a rejection p <- norm(max(0, p - q_i)); if every child is rejected, the bonus is drawn from
    the last p. Each try emits exactly p: P(out = y) = min(p, q_i)(y) + (1 - Σ min(p, q_i)) ·
    norm(max(0, p - q_i))(y) = p(y), whatever q_i is, so by induction over the tries, fresh randomness
    per depth and the chain rule, the output has exactly the backbone's sequence distribution.

    - draft=None: deterministic candidates (the heads' top-k). Then q_i is a point mass on x_i: accept
      with probability p(x_i), else zero it in p and renormalise. That collapses into one draw: y ~ p,
      descend if a child holds y, else y is the bonus.
    - draft=Draft(log_q, samples): candidates drawn from the heads' q without replacement
      (`draft.sample_draft`), so q_i is q[d] with the earlier draws removed and renormalised
      (`draft.try_candidates`). Per node it accepts Σ min(p, q) instead of p(x): far more when p is
      flat and q resembles it.

    (Drawing one independent sample per candidate path, or sampling from one distribution while
    accepting with another, is not lossless.)
    """
    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        p = sampling_probs(logits[node], temperature=temperature, top_p=top_p)  # [V]
        kids = tree.children[node]
        if draft is None:
            y = sample(p, generator)
            nxt = next((c for c in kids if toks[c] == y), None)
        else:
            nxt = None
            if kids:
                # the children (depth d + 1) were drawn from head d+1's q, or from the node's own q
                log_q, drawn = draft.for_children_of(node, tree.depth_list[node])
                ranks = [tree.choices[c - 1][-1] for c in kids]
                i, p = try_candidates(p, log_q, drawn.tolist(), ranks, generator)
                nxt = None if i is None else kids[i]
            y = sample(p, generator) if nxt is None else None  # the bonus, from the residual p
        if nxt is None:
            return path, y
        node = nxt
        path.append(node)


def typical_accept(
    tree: Tree,
    tokens: torch.Tensor,
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Typical acceptance (paper §2.3.1): accept x at a node if p(x) > min(ε, δ · exp(-H(p))).

    H is the entropy of p at the parent. A candidate is accepted if it and all its ancestors pass;
    the longest accepted path wins, ties broken by the larger sum of log p along it. The bonus is
    drawn from p at the last accepted node (after top-p, like every other sampled token). The test
    itself uses p without top-p, as the paper states it: with top-p < 1 a candidate outside the
    nucleus can still be accepted, one more way in which typical acceptance is not p's distribution. Faster than rejection sampling on flat distributions but
    not distribution-preserving; its limit at temperature 0 is greedy acceptance.
    """
    passes, logp_cand = typical_tests(tree, tokens, logits, temperature=temperature, epsilon=epsilon, delta=delta)
    passes, logp_cand = passes[1:].tolist(), logp_cand[1:].tolist()

    # Parents precede children, so one forward sweep settles acceptance and path scores.
    accepted = [True] + [False] * (tree.num_nodes - 1)
    score = [0.0] * tree.num_nodes
    best = 0
    for i in range(1, tree.num_nodes):
        par = tree.parents[i]
        accepted[i] = accepted[par] and passes[i - 1]
        if not accepted[i]:
            continue
        score[i] = score[par] + logp_cand[i - 1]
        di, db = tree.depth_list[i], tree.depth_list[best]
        if di > db or (di == db and score[i] > score[best]):
            best = i
    path = [best]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    path.reverse()
    return path, sample(sampling_probs(logits[best], temperature=temperature, top_p=top_p), generator)


def typical_tests(
    tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, *, temperature: float, epsilon: float, delta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's own test (paper §2.3.1): (passes [N] bool, log p(candidate | parent) [N] float64).

    The root always passes, with log p = 0. float64, so that summing a path's log p gives the walk's
    Python floats bit for bit (the tie-break compares these sums).
    """
    if temperature <= 0:
        raise ValueError("typical acceptance samples: temperature must be > 0 (greedy_accept is its T = 0 limit)")
    p = F.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    log_p = torch.log(p.clamp_min(1e-30))  # [N, V]
    entropy = -(p * log_p).sum(dim=-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))  # [N]
    parents = torch.tensor(tree.parents, dtype=torch.long, device=logits.device).clamp(min=0)  # [N], root -> 0
    p_cand = p[parents, tokens]  # [N] p(candidate | parent's prefix); the root's entry is unused
    passes = p_cand > threshold[parents]  # [N]
    logp_cand = torch.log(p_cand.clamp_min(1e-30)).double()  # [N]
    passes[0], logp_cand[0] = True, 0.0
    return passes, logp_cand


def typical_accept_paths(
    tree: Tree,
    tokens: torch.Tensor,
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> PathChoice:
    """`typical_accept` over all paths at once, without leaving the device; the same draws.

    Each path's accepted prefix ends at some node; among those nodes the winner is the walk's: the
    deepest, then the larger sum of log p (added depth by depth in float64, in the walk's order, so
    equal sums are equal here too), then the smallest node index (the walk keeps the first it meets).
    """
    passes, logp = typical_tests(tree, tokens, logits, temperature=temperature, epsilon=epsilon, delta=delta)
    t = tree.tensors(logits.device)
    paths = t.paths  # [P, D + 1]
    ok = passes[paths[:, 1:]] & t.path_valid[:, 1:]  # [P, D]
    kept = ok.long().cumprod(dim=-1)  # [P, D] 1 while every candidate so far passed
    accepted = kept.sum(dim=-1)  # [P]
    score = torch.zeros(paths.shape[0], dtype=torch.float64, device=logits.device)  # [P]
    for d in range(paths.shape[1] - 1):  # D steps, fixed by the tree
        score = score + torch.where(kept[:, d].bool(), logp[paths[:, d + 1]], 0.0)
    last = paths.gather(1, accepted[:, None])[:, 0]  # [P] each path's last accepted node
    longest = accepted == accepted.max()  # [P]
    top = longest & (score == torch.where(longest, score, float("-inf")).max())  # [P]
    winner = torch.where(top, last, tree.num_nodes).min()  # [] the smallest such node
    best = (top & (last == winner)).long().argmax()  # [] a path ending there
    nodes = accepted_path(at(paths, best), at(accepted, best))  # [D + 1]
    bonus = draw(sampling_probs(at(logits, winner), temperature=temperature, top_p=top_p), generator)
    return PathChoice(nodes=nodes, accepted=at(accepted, best), bonus=bonus)

