"""Candidate trees and tree attention (paper §2.1.2, Fig. 2).

A tree is built from *choices*: each choice is a path of top-k ranks, e.g. (0,) = head 1's top-1
guess, (0, 2) = its child filled with head 2's top-3 guess. Node 0 is the root: the last committed
token, which the verify pass feeds together with every candidate. A node at depth d is filled by head d
with rank `choice[-1]`, so all nodes at one depth draw from the same head's top-k list.

Everything here is a pure function of the choices: parents, depths, the N x N ancestor mask, position
offsets (= depth), each node's path from the root, and text drawings of the tree and the mask.
`build_tree` grows the tree with the most expected accepted tokens for a node budget from a measured
acceptance table.

Shapes: N nodes (root included), K heads, D maximum depth.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

Choice = tuple[int, ...]


@dataclass(frozen=True, eq=True)
class Tree:
    """A validated candidate tree. Node i > 0 corresponds to `choices[i - 1]`; node 0 is the root."""

    choices: tuple[Choice, ...]

    @staticmethod
    def from_choices(
        choices, *, num_heads: int | None = None, top_k: int | None = None
    ) -> "Tree":
        """Validate and sort choices (by depth, then rank) so parents always precede children.

        Raises ValueError naming the offending choice: not a sequence of ints, a negative rank, a rank
        >= top_k, a depth > num_heads, a duplicate, or a missing prefix (official Medusa fails later
        with an index error on the last two).
        """
        parsed: list[Choice] = []
        for c in choices:
            if isinstance(c, int) or not all(isinstance(r, int) and not isinstance(r, bool) for r in c):
                raise ValueError(f"tree choice {c!r} must be a list of integer ranks, e.g. [0, 1]")
            c = tuple(c)
            if len(c) == 0:
                raise ValueError("tree choice () is empty; the root is implicit, leave it out")
            if any(r < 0 for r in c):
                raise ValueError(f"tree choice {list(c)} has a negative rank")
            if top_k is not None and any(r >= top_k for r in c):
                raise ValueError(f"tree choice {list(c)} uses a rank >= top_k={top_k}")
            if num_heads is not None and len(c) > num_heads:
                raise ValueError(
                    f"tree choice {list(c)} has depth {len(c)} but there are only {num_heads} heads"
                )
            parsed.append(c)
        seen: set[Choice] = set()
        for c in parsed:
            if c in seen:
                raise ValueError(f"tree choice {list(c)} appears twice")
            seen.add(c)
        for c in parsed:
            if len(c) > 1 and c[:-1] not in seen:
                raise ValueError(f"tree choice {list(c)} has no parent: add {list(c[:-1])}")
        return Tree(tuple(sorted(parsed, key=lambda c: (len(c), c))))

    # ---- structure ---------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """N, the root included."""
        return len(self.choices) + 1

    @cached_property
    def parents(self) -> list[int]:
        """parents[i] = node index of i's parent; parents[0] = -1."""
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        return [-1] + [index.get(c[:-1], 0) for c in self.choices]

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i] = i's children in rank order (rank 0 first)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def depth_list(self) -> list[int]:
        return [0] + [len(c) for c in self.choices]

    @property
    def depth(self) -> int:
        """D, the deepest node's depth = the number of heads the tree needs."""
        return max(self.depth_list)

    @cached_property
    def max_rank(self) -> int:
        """The largest rank any node uses (0 for a root-only tree)."""
        return max((c[-1] for c in self.choices), default=0)

    def top_k(self) -> list[int]:
        """For head d (index d-1): how many of its top guesses the tree uses."""
        k = [0] * self.depth
        for c in self.choices:
            k[len(c) - 1] = max(k[len(c) - 1], c[-1] + 1)
        return k

    def tensors(self, device: torch.device | str = "cpu") -> "TreeTensors":
        """Every index tensor a decoding step reads, on `device`, built once per tree and device
        (`tree_tensors`): rebuilding them each step cost a tenth of a tiny model's step, and a captured
        step needs fixed inputs."""
        return tree_tensors(self, str(device))

    def depths(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N] long: position offset of each node from the root (positions = prefix_len + depth)."""
        return torch.tensor(self.depth_list, dtype=torch.long, device=device)

    def node_head_rank(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Two [N - 1] long tensors: node i+1 is filled by head `head[i]` (0-based) with rank `rank[i]`."""
        head = torch.tensor([len(c) - 1 for c in self.choices], dtype=torch.long, device=device)
        rank = torch.tensor([c[-1] for c in self.choices], dtype=torch.long, device=device)
        return head, rank

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True iff j is i or an ancestor of i (paper Fig. 2).

        Row i marks node i's path from the root (`node_paths`), not a walk up from each node as the
        reference's `tree_attention_mask` does: two constructions, held equal by a test."""
        N = self.num_nodes
        mask = torch.zeros(N, N, dtype=torch.bool)
        mask[torch.arange(N)[:, None], self.node_paths()] = True  # [N, D + 1] ancestors of each row
        return mask.to(device)

    def earlier_siblings(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True iff j is a sibling of i with a smaller rank (tried first)."""
        parents = torch.tensor(self.parents)  # [N]
        same_parent = (parents[:, None] == parents[None, :]) & (parents[:, None] >= 0)  # [N, N]
        return (same_parent & torch.ones(self.num_nodes, self.num_nodes, dtype=torch.bool).tril(-1)).to(device)

    def node_paths(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, D + 1] long: row i is the path from the root to node i, then node i repeated.

        The acceptance rules pick one node, the last accepted one; its row is then the accepted path
        in the fixed shape a step copies (its last entry is always the node itself)."""
        rows = []
        for i in range(self.num_nodes):
            path = [i]
            while path[-1] != 0:
                path.append(self.parents[path[-1]])
            path.reverse()
            rows.append(path + [i] * (self.depth + 1 - len(path)))
        return torch.tensor(rows, dtype=torch.long, device=device)

    def truncated(self, max_depth: int) -> "Tree":
        """The subtree of nodes at depth <= max_depth (used near the end of a generation), built once per
        tree and depth (`truncated_tree`), so the last steps of every generation reuse it and its tensors."""
        return self if self.depth <= max_depth else truncated_tree(self, max_depth)

    def check_heads(self, num_heads: int) -> None:
        """A clear error when the tree needs more heads than the model has."""
        if self.depth > num_heads:
            raise ValueError(
                f"tree has depth {self.depth} but the model has {num_heads} Medusa heads; "
                f"use a tree of depth <= {num_heads}"
            )

    # ---- drawings ----------------------------------------------------------------------------

    def draw(self, labels: list[str] | None = None) -> str:
        """The tree as indented text, one node a line: `[i] (head d, rank r) label`."""
        lines: list[str] = []

        def visit(node: int, prefix: str, last: bool) -> None:
            label = f" {labels[node]}" if labels is not None else ""
            if node == 0:
                lines.append(f"[0] root{label}")
            else:
                c = self.choices[node - 1]
                branch = "└─ " if last else "├─ "
                lines.append(f"{prefix}{branch}[{node}] head {len(c)} rank {c[-1]}{label}")
                prefix += "   " if last else "│  "
            kids = self.children[node]
            for j, kid in enumerate(kids):
                visit(kid, prefix if node else "", j == len(kids) - 1)

        visit(0, "", True)
        return "\n".join(lines)

    def draw_mask(self) -> str:
        """The N x N tree attention mask: row = query node, column = key node, ■ = may attend."""
        mask = self.ancestor_mask()
        N = self.num_nodes
        width = len(str(N - 1))
        header = " " * (width + 1) + " ".join(f"{j:>{width}}" for j in range(N))
        rows = [header]
        for i in range(N):
            cells = " ".join(f"{'■' if mask[i, j] else '·':>{width}}" for j in range(N))
            rows.append(f"{i:>{width}} {cells}")
        return "\n".join(rows)


@dataclass(frozen=True)
class TreeTensors:
    """A tree's index tensors on one device (`Tree.tensors`). N nodes, D depth."""

    parents: torch.Tensor  # [N] long: each node's parent, -1 for the root
    ancestor_mask: torch.Tensor  # [N, N] bool: the tree attention mask among the nodes
    depths: torch.Tensor  # [N] long: position offset of each node from the root
    head: torch.Tensor  # [N - 1] long: the head (0-based) that fills node i + 1
    rank: torch.Tensor  # [N - 1] long: the rank within that head's guesses
    node_paths: torch.Tensor  # [N, D + 1] long: the root-to-node path of each node, then the node repeated
    earlier_siblings: torch.Tensor  # [N, N] bool: j is a sibling of i with a smaller rank


@lru_cache(maxsize=64)
def truncated_tree(tree: Tree, max_depth: int) -> Tree:
    """`Tree.truncated`, cached by (tree, depth) like `tree_tensors`."""
    return Tree(tuple(c for c in tree.choices if len(c) <= max_depth))


@lru_cache(maxsize=64)
def tree_tensors(tree: Tree, device: str) -> TreeTensors:
    """`Tree.tensors`, cached by (tree, device): the project's one cache of tree tensors."""
    head, rank = tree.node_head_rank(device)
    return TreeTensors(parents=torch.tensor(tree.parents, dtype=torch.long, device=device),
                       ancestor_mask=tree.ancestor_mask(device), depths=tree.depths(device), head=head, rank=rank,
                       node_paths=tree.node_paths(device), earlier_siblings=tree.earlier_siblings(device))


# ---- presets ---------------------------------------------------------------------------------


def chain(k: int) -> Tree:
    """k nodes in a line: each head's top-1 guess (classic speculative decoding with a chain draft)."""
    return Tree.from_choices([tuple([0] * d) for d in range(1, k + 1)])


# A small tree for CPU, where each extra node costs real time: 11 nodes + root, depth 4.
CPU_CHOICES: list[Choice] = [
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
]


def _gpu_choices() -> list[Choice]:
    """About 64 nodes for a GPU, where a 64-token verify pass costs about as much as one token.

    Rank budgets shrink with depth and with the ranks above, the shape the paper's optimised sparse
    trees take (deeper heads are less accurate, lower ranks rarely win).
    """
    out: list[Choice] = []
    budget = {1: 10, 2: 4, 3: 3, 4: 2}  # per depth: ranks tried below a top-ranked parent
    frontier: list[Choice] = [()]
    for depth in range(1, 5):
        nxt: list[Choice] = []
        for parent in frontier:
            penalty = sum(parent)  # parents reached through low ranks get fewer children
            for r in range(max(1, budget[depth] - penalty)):
                nxt.append(parent + (r,))
        frontier = nxt
        out.extend(nxt)
    return out


GPU_CHOICES: list[Choice] = _gpu_choices()

PRESETS = {"cpu": CPU_CHOICES, "gpu": GPU_CHOICES}


def preset(name: str) -> Tree:
    """'cpu', 'gpu', or 'chainN' (e.g. 'chain4')."""
    if name.startswith("chain") and name[5:].isdigit() and int(name[5:]) > 0:
        return chain(int(name[5:]))
    if name not in PRESETS:
        raise ValueError(f"unknown tree {name!r}: use one of {sorted(PRESETS)} or chainN")
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


def build_tree(acc: torch.Tensor, num_nodes: int) -> tuple[Tree, float]:
    """The tree of `num_nodes` candidates (root excluded) grown greedily by expected acceptance.

    Candidates are the next sibling and the first child of every chosen node; the one with the
    largest value Π_i acc[i][r_i] joins next (ties: shallower, then smaller ranks). A child is offered
    only after its parent and rank r+1 only after rank r, so every prefix is present. When each row
    of acc decreases with rank, values decrease along these offers and the greedy tree is the optimum.
    Nodes of value 0 are never added, so a table with few nonzero entries gives a smaller tree.
    Returns (tree, expected tokens per step = 1 + Σ values, the bonus token counted).
    """
    a = check_acc(acc).tolist()
    K, R = len(a), len(a[0])
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    heap = [(-a[0][0], 1, (0,), 1.0)]  # (-value, depth, choice, parent's value)
    chosen, total = [], 0.0
    while heap and len(chosen) < num_nodes:
        neg, depth, choice, parent_value = heapq.heappop(heap)
        if neg == 0:  # never accepted: such a node would only cost verify time
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
    total = 0.0
    for choice in tree.choices:
        if len(choice) > len(a) or max(choice) >= len(a[0]):
            raise ValueError(f"tree node {list(choice)} needs more heads or ranks than acc {len(a)}x{len(a[0])}")
        total += math.prod(a[i][r] for i, r in enumerate(choice))
    return 1.0 + total
