"""Candidate trees, tree attention (paper §2.1.2, Fig. 2), and the index tables the engine's step reads.

A tree is built from *choices*: each choice is a tuple of ranks, e.g. (0,) = head 1's top-1 guess, (0, 2) = its child
filled with head 2's rank-2 guess (third best, or third drawn). Node 0 is the root: the last emitted token, which the
verify pass feeds with every candidate. A node at depth d holds head d's guess of rank `choice[-1]`. A Tree is a value
(frozen, hashed by its choices); its index tensors are made once per tree and device (`tree_tensors`). `build_tree`
grows the tree with the most expected accepted tokens for a node budget from a measured acceptance table.

Shapes: N nodes (root included), K heads, D maximum depth, R ranks.
"""

import heapq
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, NamedTuple, Sequence

import torch

from .model import mask_table
from .sampling import draw_bounds

Choice = tuple[int, ...]


def choice_problem(choices: list[Choice] | tuple[Choice, ...], *, num_heads: int | None = None) -> str | None:
    """The first thing wrong with a tree's choices, naming the choice, or None: empty, a negative rank, deeper
    than num_heads, a duplicate, a missing prefix (the last two fail later in official Medusa, as an index error)."""
    seen: set[Choice] = set()
    for c in choices:
        if not c:
            return "tree choice () is empty; the root is implicit, leave it out"
        if min(c) < 0:
            return f"tree choice {list(c)} has a negative rank"
        if num_heads is not None and len(c) > num_heads:
            return f"tree choice {list(c)} has depth {len(c)} but there are only {num_heads} heads"
        if c in seen:
            return f"tree choice {list(c)} appears twice"
        seen.add(c)
    return next((f"tree choice {list(c)} has no parent: add {list(c[:-1])}" for c in choices
                 if len(c) > 1 and c[:-1] not in seen), None)


@dataclass(frozen=True)
class Tree:
    """A candidate tree, validated (`from_choices` also sorts). Node i > 0 is `choices[i - 1]`; node 0 is the root.

    parents[i]: node i's parent (-1 for the root); children[i]: its children in rank order; depths[i]:
    its depth (= its position offset from the root); ranks[i]: the rank it holds (0 for the root);
    first[d]: the first node of depth d (nodes of one depth are consecutive), first[D + 1] = N.
    """

    choices: tuple[Choice, ...]

    def __post_init__(self) -> None:
        if not all(isinstance(c, tuple) for c in self.choices):  # a list is unhashable: say what takes lists
            raise ValueError("Tree(choices) takes tuples of ranks; make trees from lists with Tree.from_choices")
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        # The host lists below assume sorted, distinct, prefix-closed choices: `from_choices` makes them.
        unsorted = list(self.choices) != sorted(index, key=lambda c: (len(c), c))
        if problem := choice_problem(self.choices) or (unsorted and "they are not sorted by depth then rank"):
            raise ValueError(f"Tree(choices): {problem}; make trees with Tree.from_choices")
        parents = [-1] + [index.get(c[:-1], 0) for c in self.choices]
        children: list[list[int]] = [[] for _ in parents]
        for i, parent in enumerate(parents[1:], start=1):
            children[parent].append(i)
        depths = [0] + [len(c) for c in self.choices]
        first = [depths.index(d) for d in range(max(depths) + 1)] + [len(depths)]
        for name, value in dict(parents=parents, children=children, depths=depths, first=first,
                                ranks=[0] + [c[-1] for c in self.choices]).items():
            object.__setattr__(self, name, value)

    @staticmethod
    def from_choices(choices: Iterable[Sequence[int]], *, num_heads: int | None = None) -> "Tree":
        """Validate and sort choices (by depth, then rank) so parents always precede children. Raises ValueError
        naming the offending choice: not a sequence of ints, or `choice_problem`'s."""
        for c in (choices := list(choices)):  # read twice below: a generator would be empty the second time
            if not isinstance(c, Sequence) or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                      for r in c):  # numpy's integers too (argsort's ranks)
                raise ValueError(f"tree choice {c!r} must be a list of integer ranks, e.g. [0, 1]")
        parsed = [tuple(map(int, c)) for c in choices]
        if problem := choice_problem(parsed, num_heads=num_heads):
            raise ValueError(problem)
        return Tree(tuple(sorted(parsed, key=lambda c: (len(c), c))))

    @property
    def num_nodes(self) -> int:
        """N, the root included."""
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        """D, the deepest node's depth = the number of heads the tree needs."""
        return len(self.first) - 2

    @property
    def max_rank(self) -> int:
        """The largest rank any node uses (0 for a root-only tree)."""
        return max(self.ranks)

    def tensors(self, device: torch.device | str = "cpu") -> "TreeTensors":
        """Every index tensor a decoding step reads, on `device` (built once per tree and device)."""
        return tree_tensors(self, str(device))

    def truncated(self, max_depth: int) -> "Tree":
        """The subtree of nodes at depth <= max_depth (the reference's near a row's end; prompt lookup's chains)."""
        return self if self.depth <= max_depth else Tree(tuple(c for c in self.choices if len(c) <= max_depth))

    def check_heads(self, num_heads: int, *, name: str = "tree", owner: str = "the model") -> None:
        """A clear error when the tree needs more heads than `owner` has; `name`: what a user called the tree."""
        if self.depth > num_heads:
            raise ValueError(f"{name} has depth {self.depth} but {owner} has {num_heads} heads; use a shallower tree")

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`."""
        return self.path(self.parents[node]) + [node] if node > 0 else [0]


# ---- presets ---------------------------------------------------------------------------------


def chain(k: int) -> Tree:
    """k nodes in a line: each head's top-1 guess (classic speculative decoding with a chain draft)."""
    if not (isinstance(k, numbers.Integral) and 0 <= k <= MAX_NODES):  # chain(-1) would be the root alone
        raise ValueError(f"a chain holds 0 to {MAX_NODES} nodes below the root, not {k!r}")
    return Tree.from_choices([tuple([0] * d) for d in range(1, k + 1)])


# A small tree for CPU, where each extra node costs real time: 11 nodes + root, depth 4.
CPU_CHOICES: list[Choice] = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0),  # depths 1 and 2
                             (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 1)]  # depths 3 and 4


def _gpu_choices() -> list[Choice]:
    """67 nodes for a GPU, where a 64-token verify costs about what one token does. Rank budgets shrink with
    depth and the ranks above, as in the paper's optimised sparse tree (deeper heads err more; later ranks win less)."""
    out, frontier = [], [()]
    budget = {1: 10, 2: 4, 3: 3, 4: 2}  # per depth: ranks tried below a top-ranked parent
    for depth in range(1, 5):  # parents reached through later ranks (a larger sum) get fewer children
        frontier = [parent + (r,) for parent in frontier for r in range(max(1, budget[depth] - sum(parent)))]
        out.extend(frontier)
    return out


GPU_CHOICES: list[Choice] = _gpu_choices()
PRESETS = {"cpu": CPU_CHOICES, "gpu": GPU_CHOICES}
MAX_NODES = 256  # a node budget's and a chain's ceiling: a longer chain's choices alone would fill the memory


def preset(name: str) -> Tree:
    """'cpu', 'gpu', or 'chainN' (e.g. 'chain4'), N from 1 to MAX_NODES."""
    if str(name).startswith("chain") and name[5:].isdigit() and 0 < int(name[5:]) <= MAX_NODES:
        return chain(int(name[5:]))
    if name not in PRESETS:
        raise ValueError(f"unknown tree {name!r}: use one of {sorted(PRESETS)} or chainN, N from 1 to {MAX_NODES}")
    return Tree.from_choices(PRESETS[name])


# ---- trees from measured acceptance (official Medusa's gen_results, EAGLE-2's expansion) ---------


def check_acc(acc: torch.Tensor) -> torch.Tensor:
    """acc as a float64 [K heads, R ranks] table of probabilities on the CPU; ValueError otherwise."""
    acc = torch.as_tensor(acc, dtype=torch.float64).cpu()
    if acc.dim() != 2 or 0 in acc.shape:
        raise ValueError(f"accuracies must be a [heads, ranks] table, got shape {list(acc.shape)}")
    if not bool(((acc >= 0) & (acc <= 1)).all()):
        raise ValueError("accuracies must be probabilities in [0, 1]")
    return acc


def build_tree(acc: torch.Tensor, budget: int, *, min_gain: float = 0.0) -> tuple[Tree, float]:
    """The tree of `budget` candidates (nodes but the root) grown greedily by expected acceptance.

    Candidates are the next sibling and the first child of every chosen node; the one with the largest value
    Π_i acc[i][r_i] joins next (ties: shallower, then smaller ranks). A child is offered only after its parent and
    rank r+1 only after rank r, so every prefix is present. When each row of acc decreases with rank, values decrease
    along these offers and the greedy tree is the optimum. Nodes of value 0 are never added, so a table with few
    nonzero entries gives a smaller tree; nor, where every node costs a share of the step (a CPU), one whose value is
    below min_gain times the expected tokens per step so far: it would slow the step more than it adds.
    Returns (tree, expected tokens per step = 1 + Σ values, the bonus token counted).
    """
    a = check_acc(acc).tolist()
    K, R = len(a), len(a[0])
    if not (isinstance(budget, numbers.Integral) and budget >= 0):  # 2.5 would grow 3 nodes
        raise ValueError(f"the node budget must be an integer >= 0, not {budget!r}")
    heap = [(-a[0][0], 1, (0,), 1.0)]  # (-value, depth, choice, parent's value)
    chosen, total = [], 0.0
    while heap and len(chosen) < budget:
        neg, depth, choice, parent_value = heapq.heappop(heap)
        if neg == 0 or -neg < min_gain * (1.0 + total):  # would cost more verify time than it earns
            break
        chosen.append(choice)
        total -= neg
        if choice[-1] + 1 < R:
            sibling = choice[:-1] + (choice[-1] + 1,)
            heapq.heappush(heap, (-parent_value * a[depth - 1][choice[-1] + 1], depth, sibling, parent_value))
        if depth < K:
            heapq.heappush(heap, (neg * a[depth][0], depth + 1, choice + (0,), -neg))
    return Tree.from_choices(chosen), 1.0 + total


def expected_tokens_per_step(acc: torch.Tensor, tree: Tree) -> float:
    """1 + Σ over the tree's nodes of Π_i acc[i][r_i]: the product rule for any tree (presets too)."""
    a = check_acc(acc).tolist()
    for choice in tree.choices:
        if len(choice) > len(a) or max(choice) >= len(a[0]):
            raise ValueError(f"tree node {list(choice)} needs more heads or ranks than acc {len(a)}x{len(a[0])}")
    return 1.0 + sum(math.prod(a[i][r] for i, r in enumerate(choice)) for choice in tree.choices)


# ---- the engine's index tensors --------------------------------------------------------------


class Tries(NamedTuple):
    """Rejection sampling's tables (`acceptance.rejection_accept_drawn`). Its dists [3N - 2]: p at each node,
    then in child order (turn after turn) the residual each child's miss leaves, then the q each child was drawn from.
    k = 1 .. N - 1: the nodes below the root (each a child), in node order. Turn s = 1, 2, ...: s-th children tried."""

    nodes: torch.Tensor  # [n] long: the nodes with children, most children first
    sizes: tuple[int, ...]  # per turn, how many of them have a child that turn tries: the first ones, a slice
    parents: torch.Tensor  # [N - 1] long: each child's parent, in child order
    bounds: torch.Tensor  # [N - 1, 2, R] float: `sampling.draw_bounds` of each child's rank, in child order
    dist_index: torch.Tensor  # [3, N - 1] long: node k's dists: the r it is tried against, its residual, its q
    dist_scores: tuple[torch.Tensor, torch.Tensor]  # `bonus_dist_scores`: bias [2N - 1], weights [2 (N - 1), 2N - 1]
    dist_node: torch.Tensor  # [2N - 1] long: the node n drawing the bonus from dist i < 2N - 1 (p at n, n's residuals)


@dataclass(frozen=True)
class TreeTensors:
    """A tree's index tensors on one device (`Tree.tensors`), and its sizes. N nodes, D depth."""

    parent_index: torch.Tensor  # [N] long: each node's parent, 0 for the root (an index into the nodes)
    ancestor_mask: torch.Tensor  # [N, N] bool: j is i or an ancestor of i, the tree attention mask (Fig. 2)
    mask_table: torch.Tensor  # [N, N + 2] float32: `model.mask_table` of it, what the verify's nodes see
    depths: torch.Tensor  # [N] long: position offset of each node from the root
    ranks: torch.Tensor  # [N] long: the rank of the head's guesses each node holds (0 for the root)
    q_by_depth: torch.Tensor  # [N] long: the q Medusa heads draw node i's children from, one per depth: its depth
    q_by_node: torch.Tensor  # [N] long: the q dependent heads draw them from, one per node: i (both -1 for a leaf)
    node_paths: torch.Tensor  # [N, D + 1] long: the root-to-node path of each node, then the node repeated
    # [N, 2D + 5] long, added to a row's length by `step.place_tree`: i | depth_i | node_paths[i] | 0..D | depth_i + 1
    offsets: torch.Tensor  # node i's slot and position, its path's slots, the slots they move to, the length after
    # `acceptance.path_scores`: node i scores N * (its path's passing nodes below the root - its depth) + i, one
    # matmul: (i - N * depth_i, float32 [N]; weights: N where row j is on column i's path below the root, [N, N])
    path_weights: tuple[torch.Tensor, torch.Tensor]
    below_root: torch.Tensor  # [N, D] long: each node's path without the root, then the node repeated
    on_path: torch.Tensor  # [N, D] float64: 1 where below_root holds a path's node, 0 where it repeats the last
    guess_index: torch.Tensor  # [N] long: where each node's token sits in [root, head 1's R guesses, head 2's, ...]
    tries: Tries
    first: tuple[int, ...]  # `Tree.first`: nodes of depth d are first[d] .. first[d + 1] - 1
    num_ranks: int  # R, the ranks any node uses (`Tree.max_rank` + 1)
    depth: int  # D, `Tree.depth`


def bonus_dist_scores(tree: Tree, dist_node: list[int], child_order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`Tries.dist_scores`: the dist the bonus is drawn from, found in one matmul (as `path_scores` finds
    the deepest accepted node). A dist, p at node n or the residual after n's child c missed, qualifies when every
    node of n's path below the root passes (its try accepts, and no elder sibling's does) and c's miss was live. Over
    judged [B, 2 (N - 1)] (each node's try accepts, then its miss live), bias + judged @ weights is W · (conditions
    met - conditions needed) + the dist's place in (node, dist) order, W = 2N - 1: in [0, W) iff it qualifies. Deeper
    nodes are larger and a node's live misses are its first children (a dead miss leaves NaN), so the argmax is the
    deepest accepted node's last live miss, or its p. Weights 0 or ±W: exact in float32, and in TF32 for N <= 1024."""
    N, W = tree.num_nodes, len(dist_node)
    weights = torch.zeros(2 * (N - 1), W)  # input k - 1: node k's try accepts; N - 2 + k: its miss live
    for dist, n in enumerate(dist_node):
        for k in tree.path(n)[1:]:
            kin = tree.children[tree.parents[k]]
            weights[k - 1, dist], weights[[e - 1 for e in kin[: kin.index(k)]], dist] = W, -W
        if dist >= N:
            weights[N - 2 + child_order[dist - N], dist] = W
    place = torch.tensor(sorted(range(W), key=lambda d: (dist_node[d], d))).argsort()  # [W]
    needs = torch.tensor([tree.depths[n] for n in dist_node]) + (torch.arange(W) >= N)  # [W]
    return (place - W * needs).float(), weights


@lru_cache(maxsize=64)
def tree_tensors(tree: Tree, device: str) -> TreeTensors:
    """`Tree.tensors`, built once per tree and device, so no step rebuilds them. Row i of the mask marks
    node i's path from the root, not the walk up from each node that the reference's
    `tree_attention_mask` takes: two constructions, held equal."""
    N, D = tree.num_nodes, tree.depth
    paths = torch.tensor([a + [i] * (D + 1 - len(a)) for i, a in enumerate(map(tree.path, range(N)))])  # [N, D + 1]
    mask = torch.zeros(N, N, dtype=torch.bool)
    mask[torch.arange(N)[:, None], paths] = True  # rows [N, 1] x paths [N, D + 1]: a repeated node marks itself again
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    R = tree.max_rank + 1
    guess = [0] + [1 + (d - 1) * R + r for d, r in zip(tree.depths[1:], tree.ranks[1:])]
    # Most children first, so the nodes with an s-th child are the first few: a slice, not a gather.
    inner = sorted((i for i, kids in enumerate(tree.children) if kids), key=lambda i: -len(tree.children[i]))
    sizes = tuple(sum(len(tree.children[i]) > s for i in inner) for s in range(max(map(len, tree.children))))
    by_turn = [(tree.children[i][s], i) for s, n in enumerate(sizes) for i in inner[:n]]  # (child, its parent)
    at, parents = {child: j for j, (child, _) in enumerate(by_turn)}, torch.tensor([i for _, i in by_turn]).long()
    depths, below = torch.tensor(tree.depths), paths[:, 1:]  # below: the root's own row is zeros, never read
    elder = {c: kids[j - 1] for kids in tree.children for j, c in enumerate(kids) if j}  # a later child's elder
    against = [N + at[elder[k]] if k in elder else tree.parents[k] for k in range(1, N)]  # its miss's r, else p
    index = torch.tensor([against, [N + at[k] for k in range(1, N)], [2 * N - 1 + at[k] for k in range(1, N)]])
    dist_node, child_order = list(range(N)) + [i for _, i in by_turn], [c for c, _ in by_turn]  # [2N - 1], [N - 1]
    bounds = draw_bounds(as_long([tree.ranks[c] for c in child_order]), R)  # [N - 1, 2, R]
    tries = Tries(as_long(inner), sizes, parents.to(device), bounds, index.to(device),
                  tuple(t.to(device) for t in bonus_dist_scores(tree, dist_node, child_order)), as_long(dist_node))
    moves = torch.cat([paths, torch.arange(D + 1).expand(N, -1), depths[:, None] + 1], 1)  # [N, 2D + 3]
    offsets = torch.cat([torch.arange(N)[:, None], depths[:, None], moves], 1)  # [N, 2D + 5]
    weights = (mask.T & (torch.arange(N) > 0)[:, None]) * float(N)  # [N, N]: N per node of i's path below the root
    return TreeTensors(parent_index=as_long(tree.parents).clamp(min=0), ancestor_mask=mask.to(device),
                       depths=depths.to(device), ranks=as_long(tree.ranks), mask_table=mask_table(mask).to(device),
                       q_by_depth=as_long([d if kids else -1 for d, kids in zip(tree.depths, tree.children)]),
                       q_by_node=as_long([i if kids else -1 for i, kids in enumerate(tree.children)]),
                       node_paths=paths.to(device), offsets=offsets.to(device), below_root=below.to(device),
                       path_weights=((torch.arange(N) - N * depths).to(device, torch.float32), weights.to(device)),
                       on_path=(torch.arange(1, D + 1) <= depths[:, None]).to(device, torch.float64), tries=tries,
                       first=tuple(tree.first), num_ranks=R, depth=D, guess_index=as_long(guess))
