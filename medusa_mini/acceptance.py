"""The engine's acceptance: the reference's three rules (reference.py), decided for B rows at once.

Every rule judges each node on its own, on the device and all at once: does the candidate pass at its parent (greedy: it
is the backbone's token there; typical: p(candidate) clears the bar; rejection: its try at the parent accepts it)? A
node is accepted when every node of its path below the root passes (one matmul counts them, `path_scores`), and the step
keeps the accepted node the rule prefers: the deepest (typical: then the most likely; drawn candidates: a node's first
child that passes). A step thus reads its result with a single host read. Greedy and top-k rejection sampling are one
rule with two sources of y, the backbone's token at every node: its argmax, or one draw from p
(`reference.rejection_accept` says why that is exact). Drawn candidates' tries are sequential among a node's children,
but the residuals they are judged against depend on no decision: each node's residuals are built turn by turn, then
every try is judged at once. Every rule takes the uniforms it draws from (`acceptance_uniforms`, drawn before it, in the
reference's order). Tests hold every rule to the reference, draw for draw.

`usable` [B, N] (None: every node) marks the nodes a row may accept: near the end of its token budget or of
the context deeper nodes could not be used; a finished row in a batch has none, not even its root.

Shapes: B rows, N nodes, V vocabulary, D tree depth, R ranks; n inner nodes, n_s of them with an s-th child (`Tries`).
"""

from typing import NamedTuple

import torch

from .model import at_each_row
from .proposal import Drawn
from .sampling import Sampling, greedy_token, inverse_cdf, try_accepts, typical_threshold, without_earlier_draws
from .tree import TreeTensors, Tries


class Accepted(NamedTuple):
    """An acceptance decision for B rows, as device tensors: last [B] long, each row's deepest accepted node (the
    root if none), whose path from the root (`Tree.path`) is the accepted path and whose hidden state proposes
    the next tree; bonus [B], the backbone's token after it."""

    last: torch.Tensor
    bonus: torch.Tensor


def path_scores(tree: TreeTensors, passes: torch.Tensor) -> torch.Tensor:
    """[B, N] float: node i's index where every node of its path below the root passes (the root's 0 always),
    below 0 where one does not (passes [B, N], each node's own test at its parent). One matmul counts each
    path's passing nodes (`TreeTensors.path_weights`), exactly in float32 or TF32 (whose 10 bits hold N <= 2048)."""
    bias, weights = tree.path_weights  # [N], [N, N]
    return torch.addmm(bias, passes.float(), weights)


def path_accept(tree: TreeTensors, tokens: torch.Tensor, y: torch.Tensor, *,
                usable: torch.Tensor | None = None) -> Accepted:
    """`reference.walk` for B rows, on the device: tokens [B, N], y [B, N] the backbone's token at every node.

    A candidate passes when it is y at its parent. Siblings hold distinct tokens (a proposer's promise: a
    top-k, or draws without replacement), so at most one child of a node passes, the accepted nodes form one path
    from the root, and its deepest node, which ends the walk's path, has the largest index (parents come first).
    """
    match = tokens == y[:, tree.parent_index]  # [B, N]
    last = path_scores(tree, match if usable is None else match & usable).argmax(dim=-1)  # [B]
    return Accepted(last, y.gather(1, last[:, None])[:, 0])


def greedy_accept(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *,
                  usable: torch.Tensor | None = None) -> Accepted:
    """`reference.greedy_accept` for B rows: `path_accept` with y = the argmax of logits [B, N, V] at every node
    (`greedy_token`: ties go to the lowest token id, as in the reference)."""
    return path_accept(tree, tokens, greedy_token(logits), usable=usable)


def typical_accept(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                   u: torch.Tensor, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.typical_accept` for B rows, on the device, with the same draws: u [B] are the uniforms
    of the bonus draws (`acceptance_uniforms`).

    Among the accepted nodes the winner is the reference's: the deepest, then the larger sum of log p along
    its path (added root side first in float64, in the reference's order, so equal sums are equal here too),
    then the smallest node index (the reference keeps the first it meets).
    """
    B, N, V = logits.shape
    p = sampling.probs(logits)  # [B, N, V], top-p included: outside the nucleus p = 0, which never passes
    bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta)  # [B, N]
    p_x = p.view(B, N * V).gather(1, tree.parent_index * V + tokens)  # [B, N] p(candidate | its parent's path)
    passes = p_x > bar[:, tree.parent_index]  # [B, N]
    passes = passes if usable is None else passes & usable
    depth = torch.where(path_scores(tree, passes) >= 0, tree.depths, -1)  # [B, N]: the accepted nodes' depths
    along = torch.log(p_x.clamp_min(1e-30)).double()[:, tree.below_root] * tree.on_path  # [B, N, D]
    score = sum(along.unbind(-1), along.new_zeros(B, N))  # [B, N]: log p summed along each path, root side first
    top = depth == depth.max(dim=-1, keepdim=True).values  # [B, N] the deepest accepted nodes
    last = torch.where(top, score, float("-inf")).argmax(dim=-1)  # [B]: argmax returns the first of equal maxima
    return Accepted(last, inverse_cdf(at_each_row(p, last), u))


def uniform_dims(sampling: Sampling) -> int:
    """How many dimensions the uniforms of `sampling`'s rule have: 0 (none) for greedy; 1, [B], for
    typical, its bonus draws; 2, [B, N], for rejection sampling, one per node."""
    return {"greedy": 0, "typical": 1, "rejection": 2}[sampling.acceptance]


def acceptance_uniforms(sampling: Sampling, rows: int, nodes: int, generator: torch.Generator | None, *,
                        device: torch.device | str) -> torch.Tensor | None:
    """The uniform numbers a step's acceptance uses (`uniform_dims`), those `reference.accept` draws."""
    dims = uniform_dims(sampling)
    return torch.rand((rows, nodes)[:dims], generator=generator, device=device) if dims else None


def rejection_accept_topk(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                          u: torch.Tensor, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.rejection_accept` with point-mass candidates (top-k, prompt lookup's, a lone root), for B rows: a
    draw from p at every node of every row, node i's with u[:, i], then `path_accept`. u [B, N'] may hold more
    (drawn for a whole chain of which prompt lookup verifies the first N nodes)."""
    return path_accept(tree, tokens, inverse_cdf(sampling.probs(logits), u[:, : tokens.shape[1]]), usable=usable)


def try_distributions(p: torch.Tensor, q: torch.Tensor, tries: Tries) -> torch.Tensor:
    """The distributions the tries read, every node's residuals built at once (rounded as `residual_after_miss`
    rounds them): p [B, N, V], q [B, N - 1, V] in child order -> [B, 3N - 2, V] (`Tries`: p, the residuals, q); one
    whose miss left no mass (r = q up to rounding) is 0 / 0, NaN. Turn s: the first n_s inner nodes miss their s-th
    child; residuals are kept negated until one division, so one addcdiv makes -rest_s = min(0, q_s - r_{s-1})."""
    rest, mass, residuals, masses = p[:, tries.nodes], None, [], []  # rest [B, n, V]: p at inner nodes, then -rest
    for q_s in q.split(tries.sizes, dim=1):  # [B, n_s, V]
        n = q_s.shape[1]  # r_{s-1} = rest / mass = -rest / -mass, exactly
        rest = q_s - rest[:, :n] if mass is None else torch.addcdiv(q_s, rest[:, :n], mass[:, :n, None], value=-1)
        rest = rest.clamp_max(0.0)
        residuals.append(rest)
        masses.append(mass := rest.sum(dim=-1))  # [B, n_s], negated
    dists = torch.cat([p, *residuals, q], dim=1)  # [B, 3N - 2, V]
    dists[:, p.shape[1] : 2 * p.shape[1] - 1].div_(torch.cat(masses, dim=1)[..., None])  # [B, N - 1, V] normalised
    return dists


def rejection_accept_drawn(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
                           drawn: Drawn, u: torch.Tensor, usable: torch.Tensor | None = None) -> Accepted:
    """`reference.rejection_accept` with candidates drawn from q, for B rows at once, on the device.

    A node's tries are sequential, but what each is judged against depends on no decision: after a node's first s
    children miss, the target has become r_s = norm(max(0, r_{s-1} - q_s)), r_0 = p, q_s the q child s was drawn from.
    So every node's residuals are built at once (`try_distributions`), then every try judged at once, child k with
    u[:, k] against the r its elder siblings' misses left; a node keeps its first child that passes. The accepted nodes
    form one path; its deepest node draws the bonus with u[:, 0] from the r its live misses left: a miss leaving no mass
    (r = q up to rounding) ends the node's tries, and here that r is 0 / 0, NaN, which fails every later try. One matmul
    finds that node and that r (`Tries.dist_scores`). Unusable nodes are never tried (siblings share a depth); a
    row without a usable root tries nothing. A root alone has no drawn candidates (`accept`: top-k).
    """
    B, N, V = logits.shape
    tries, log_q, draws = tree.tries, *drawn.at(tree.tries.parents)  # [B, N - 1, V], [B, N - 1, R], child order
    dists = try_distributions(sampling.probs(logits), without_earlier_draws(log_q, draws, bounds=tries.bounds), tries)
    at_x = torch.add(tokens[:, None, 1:], tries.dist_index, alpha=V).flatten(1)  # [B, 3 (N - 1)]: dist · V + x_k
    r_x, after, q_x = dists.flatten(1).gather(1, at_x).view(B, 3, N - 1).unbind(1)  # [B, N - 1] each, node order
    live = after == after  # [B, N - 1]: k's miss left mass (r = rest / mass is NaN at x only where mass is 0 or NaN)
    judged = torch.stack([try_accepts(r_x, q_x, u[:, 1:N], live=live), live], dim=1)  # [B, 2, N - 1]
    judged = judged if usable is None else judged & usable[:, None, 1:]
    bias, weights = tries.dist_scores
    dist = torch.addmm(bias, judged.flatten(1).float(), weights).argmax(dim=-1)  # tries, then lives: [B] the bonus's r
    return Accepted(tries.dist_node[dist], inverse_cdf(at_each_row(dists, dist), u[:, 0]))


def check_uniforms(sampling: Sampling, u: torch.Tensor | None) -> None:
    """A ValueError unless `accept` can decide `sampling`'s rule with the uniforms u."""
    dims = uniform_dims(sampling)
    if dims and (u is None or u.dim() != dims):
        raise ValueError(f"{sampling.acceptance} acceptance draws from u: pass acceptance_uniforms(sampling, ...)")


def accept(tree: TreeTensors, tokens: torch.Tensor, logits: torch.Tensor, *, sampling: Sampling,
           u: torch.Tensor | None, drawn: Drawn | None = None, usable: torch.Tensor | None = None) -> Accepted:
    """The acceptance rule `sampling` names, for B rows on the device: logits [B, N, V] at every node of
    tokens [B, N]; u from `acceptance_uniforms` (unchecked: `check_uniforms` checks); drawn: the proposal's, the
    q its candidates were drawn from, or None: they are point masses (the heads' top-k, a prompt lookup's
    continuation, a lone root), which top-k rejection decides."""
    if sampling.greedy:
        return greedy_accept(tree, tokens, logits, usable=usable)
    if sampling.acceptance == "typical":
        return typical_accept(tree, tokens, logits, sampling=sampling, u=u, usable=usable)
    if drawn is None:
        return rejection_accept_topk(tree, tokens, logits, sampling=sampling, u=u, usable=usable)
    return rejection_accept_drawn(tree, tokens, logits, sampling=sampling, drawn=drawn, u=u, usable=usable)
