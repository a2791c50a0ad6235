"""The engine's acceptance (acceptance.py) decides exactly what the reference's walks decide, for every
row of a batch: the same paths, the same bonus tokens, the same random numbers consumed."""

import random

import pytest
import torch

from conftest import random_tree
from medusa_mini import reference as ref
from medusa_mini.acceptance import accept, acceptance_uniforms, greedy_accept, typical_accept
from medusa_mini.proposal import Drawn
from medusa_mini.sampling import Sampling, gumbel_top_k, inverse_cdf, residual_after_miss
from medusa_mini.tree import Tree, chain


def random_case(seed: int, *, vocab: int = 4, rows: int = 1):
    """A random tree, per row tokens (siblings distinct, as every proposer makes them), integer logits full of ties."""
    tree, gen = random_tree(random.Random(seed)), torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, tree.num_nodes), generator=gen)
    for b in range(rows):
        for kids in tree.children:  # a random distinct token for each child of a node
            tokens[b, kids] = torch.randperm(vocab, generator=gen)[: len(kids)]
    return tree, tokens, torch.randint(0, 3, (rows, tree.num_nodes, vocab), generator=gen).float()


def decide(tree, tokens, logits, sampling, *, seed, drawn=None, usable=None):
    u = acceptance_uniforms(sampling, *tokens.shape, torch.Generator().manual_seed(seed), device="cpu")
    return accept(tree.tensors(), tokens, logits, sampling=sampling, u=u, drawn=drawn, usable=usable)


def as_host(accepted, tree, b=0):
    return tree.path(int(accepted.last[b])), int(accepted.bonus[b])


def test_vectorised_greedy_equals_the_node_walk_on_random_trees_in_every_row():
    """Ties too: argmax ties go to the lowest token id in both. The trees have depths 1-5 and widths 1-4."""
    deep = 0
    for seed in range(200):
        tree, tokens, logits = random_case(seed, rows=3)  # a small vocabulary: long matches happen
        got = greedy_accept(tree.tensors("cpu"), tokens, logits)
        for b in range(3):
            path, bonus = ref.greedy_accept(tree.parents, tokens[b].tolist(), logits[b])
            assert as_host(got, tree, b) == (path, bonus)
            deep += len(path) > 2
    assert deep > 60  # the cases exercise deep paths, not only the root


@pytest.mark.parametrize("temperature, top_p", [(0.5, 1.0), (1.0, 1.0), (2.0, 1.0), (0.9, 0.8)])
def test_vectorised_typical_equals_the_node_walk_with_the_same_draws_in_every_row(temperature, top_p):
    """Same path, bonus and random numbers consumed: row b draws its bonus with the generator's number b
    (torch.rand(B) is B single draws in order), as the reference walking it alone after b numbers; so a row
    decides in a batch as alone. Integer logits make equal log-p sums: the smaller node index wins in both."""
    deep, sampling = 0, Sampling(acceptance="typical", temperature=temperature, top_p=top_p, epsilon=0.3, delta=0.6)
    for seed in range(150):
        tree, tokens, logits = random_case(seed, rows=3)
        if seed % 2:  # continuous logits too: distinct scores decide
            logits = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)) * 2
        u = acceptance_uniforms(sampling, 3, 0, batch := torch.Generator().manual_seed(seed), device="cpu")
        got = typical_accept(tree.tensors("cpu"), tokens, logits, sampling=sampling, u=u)
        for b in range(3):
            alone = torch.Generator().manual_seed(seed)
            torch.rand(b, generator=alone)  # the numbers of the rows before it
            want = ref.typical_accept(tree.parents, tokens[b].tolist(), logits[b], sampling=sampling, generator=alone)
            assert as_host(got, tree, b) == want
            deep += len(want[0]) > 2
        assert torch.rand((), generator=batch) == torch.rand((), generator=alone)
    assert deep > 60


@pytest.mark.parametrize("rule", ["greedy", "typical", "rejection", "rejection of drawn candidates"])
def test_nodes_a_row_cannot_use_are_never_accepted(rule):
    """Near the end of a row's budget deeper nodes are unusable; a finished row accepts nothing."""
    tree, tokens = chain(3), torch.tensor([[0, 1, 2, 3]] * 3)  # a chain: 0 -> 1 -> 2 -> 3
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 0]] * 3), 4).float() * 20  # all accepted
    usable = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4])
    sampling, drawn = Sampling(acceptance=rule.split()[0], temperature=0.0 if rule == "greedy" else 1.0), None
    if rule.endswith("drawn candidates"):  # node i's child was drawn from q = a point mass on token i + 1
        draws = torch.tensor([[[1], [2], [3]]] * 3)  # [B, depth, 1 draw]
        log_q = torch.full((3, 3, 4), float("-inf")).scatter_(2, draws, 0.0)
        drawn = Drawn(log_q=log_q, draws=draws, q_index=torch.tensor([0, 1, 2, -1]))
    got = decide(tree, tokens, logits, sampling, seed=0, drawn=drawn, usable=usable)
    assert got.last.tolist() == [3, 1, 0]  # on a chain node i is i deep; the last row's root is unusable too


def test_typical_acceptance_needs_p_strictly_above_the_bar():
    """§2.3.1 accepts x when p(x) > min(ε, δ·exp(−H(p))): a candidate exactly at the bar fails, in the
    reference and the engine. p is exactly 1/2 on tokens 0 and 1, so with δ = 10 the bar is ε."""
    tokens, logits = torch.tensor([[0, 1]]), torch.tensor([[[0.0, 0.0, -torch.inf, -torch.inf]] * 2])  # [1, 2 nodes, 4]
    for epsilon, accepted in [(0.5, False), (0.4999, True)]:
        sampling = Sampling(acceptance="typical", temperature=1.0, epsilon=epsilon, delta=10.0)
        path, _ = ref.typical_accept([-1, 0], tokens[0].tolist(), logits[0], sampling=sampling,
                                     generator=torch.Generator().manual_seed(0))
        got = decide(Tree.from_choices([(0,)]), tokens, logits, sampling, seed=0)
        assert (len(path) == 2, int(got.last[0]) == 1) == (accepted, accepted)


def test_topk_rejection_on_the_device_makes_the_reference_walks_decisions_with_the_same_draws():
    """The engine draws y from p at every node of every row at once, then matches paths; the reference walks
    each row, drawing at each node: one generator, the same numbers in row order, paths of every depth."""
    tree, tokens = Tree.from_choices([(0,), (1,), (0, 0)]), torch.tensor([[0, 1, 2, 3], [0, 2, 1, 0]])
    sampling, depths = Sampling(acceptance="rejection", temperature=1.0, candidates="topk"), set()
    for seed in range(12):
        logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(seed))
        got, gen = decide(tree, tokens, logits, sampling, seed=seed + 100), torch.Generator().manual_seed(seed + 100)
        for b in range(2):
            want = ref.rejection_accept(tree.parents, tokens[b].tolist(), logits[b], sampling=sampling, generator=gen)
            assert as_host(got, tree, b) == want
            depths.add(len(want[0]) - 1)
    assert depths == {0, 1, 2}


WIDE_GAP_TREE = Tree.from_choices([(0,), (1,), (2,), (3,), (0, 0), (0, 2), (1, 1), (0, 0, 0), (0, 2, 1)])
DRAWN_CASES = {  # name: (tree or None for random trees, heads, q, top_p, room: the deepest usable depth)
    "hydra-random-trees": (None, "hydra", "near-p", 1.0, 9), "q-equal-to-p": (WIDE_GAP_TREE, "hydra", "p", 1.0, 9),
    "medusa-rank-gaps": (WIDE_GAP_TREE, "medusa", "near-p", 1.0, 9),
    "draft-vocabulary-runs-out": (WIDE_GAP_TREE, "medusa", "three-tokens", 1.0, 9),
    "top-p": (WIDE_GAP_TREE, "hydra", "near-p", 0.7, 9), "cut-short": (WIDE_GAP_TREE, "medusa", "near-p", 1.0, 1)}


@pytest.mark.parametrize("case", DRAWN_CASES)
def test_drawn_rejection_on_the_device_makes_the_reference_walks_decisions_in_every_row(case):
    """The engine tries every node's children at once; the reference walks each row, trying children in rank order
    against the residual. With a row's uniforms (the reference's torch.rand(N)) both accept the same path and bonus:
    Medusa's q per depth and Hydra's per node, rank gaps, q = p (no residual left), q over three tokens (later draws are
    point masses), top-p, and nodes past the end (the reference walks the cut tree, whose nodes come first)."""
    fixed, heads, q_kind, top_p, room = DRAWN_CASES[case]
    sampling, deepest, after_a_miss = Sampling(acceptance="rejection", temperature=1.0, top_p=top_p), 0, 0
    for seed in range(8):
        tree = fixed or random_tree(random.Random(seed))
        B, N, V, gen = 5, tree.num_nodes, 8, torch.Generator().manual_seed(seed)
        logits = torch.randn(B, N, V, generator=gen) * 2  # [B, N, V]
        qs = N if heads == "hydra" else tree.depth  # q per node, or per depth (head)
        near = logits[:, :qs] if heads == "hydra" else logits[:, [tree.first[d] for d in range(qs)]]  # [B, Q, V]
        noisy = near + torch.randn(near.shape, generator=gen)
        log_q = {"p": sampling.probs(near).log(), "near-p": torch.log_softmax(noisy, -1),
                 "three-tokens": torch.log_softmax(near, -1).masked_fill(torch.arange(V) >= 3, float("-inf"))}[q_kind]
        draws = gumbel_top_k(log_q, tree.max_rank + 1, torch.rand(log_q.shape, generator=gen))  # [B, Q, R]
        q_of = [n if heads == "hydra" else tree.depths[n] for n in range(N)]  # node n's q
        tokens = torch.zeros(B, N, dtype=torch.long)
        for c in range(1, N):  # child c holds the draw of its rank from its parent's q
            tokens[:, c] = draws[:, q_of[tree.parents[c]], tree.ranks[c]]
        q_index = torch.tensor([q_of[n] if tree.children[n] else -1 for n in range(N)])
        cut, u = tree.truncated(room), torch.rand(B, N, generator=gen)
        u[:, : cut.num_nodes] = torch.stack([torch.rand(cut.num_nodes, generator=torch.Generator().manual_seed(b))
                                             for b in range(B)])
        got = accept(tree.tensors(), tokens, logits, sampling=sampling, u=u, drawn=Drawn(log_q, draws, q_index),
                     usable=tree.tensors().depths[None].expand(B, N) <= room)
        for b in range(B):
            drawn = [(log_q[b, q_of[n]], draws[b, q_of[n]].tolist()) if cut.children[n] else None
                     for n in range(cut.num_nodes)]
            want = ref.rejection_accept(cut.parents, tokens[b, : cut.num_nodes].tolist(), logits[b, : cut.num_nodes],
                                        sampling=sampling, generator=torch.Generator().manual_seed(b), drawn=drawn)
            assert as_host(got, tree, b) == want
            after_a_miss += any(tree.children[a].index(n) > 0 for a, n in zip(want[0], want[0][1:]))
        deepest = max(deepest, int(tree.tensors().depths[got.last].max()))
    assert deepest == min(room, fixed.depth) if fixed else deepest >= 2  # as deep as the tree or the cut allows
    assert after_a_miss or q_kind == "p"  # a child accepted after its elder sibling missed


def test_with_no_residual_left_a_try_passes_iff_p_gives_the_candidate_mass_and_a_miss_ends_the_tries():
    """q = p up to rounding leaves no residual: a try passes iff p(x) > 0, even where rounding puts q(x) above p(x)
    with u near 1; a miss there (the last row: p(x) = 0) ends the tries, the bonus from p; the engine decides alike."""
    B, V, sampling, tree = 300, 3, Sampling(temperature=1.0), Tree.from_choices([(0,), (1,)])  # children: draws 0, 1
    gen, u, kinds = torch.Generator().manual_seed(0), torch.full((B, 3), 1 - 2**-24), set()  # u: the float below 1
    logits = torch.randn(B, 3, V, generator=gen)  # [B, N, V]
    log_q = torch.log_softmax(logits[:, :1] + torch.randint(-1, 2, (B, 1, V), generator=gen) * 1e-7, -1)  # ~ p
    logits[-1, 0], log_q[-1, 0] = torch.tensor([-torch.inf, 0.0, -torch.inf]), torch.tensor([-800.0, 0.0, -900.0])
    drawn = Drawn(log_q=log_q, draws=torch.arange(2).expand(B, 1, 2), q_index=torch.tensor([0, -1, -1]))
    got = accept(tree.tensors(), torch.tensor([[0, 0, 1]] * B), logits, sampling=sampling, u=u, drawn=drawn)
    for b in range(B):
        p, q = sampling.probs(logits[b]), log_q[b, 0].softmax(-1)  # [N, V]; [V], what token 0, drawn first, was from
        i, rest = ref.try_children(p[0], [0, 1], (log_q[b, 0], [0, 1]), u[b, 1:])
        at = 0 if i is None else i + 1
        assert (int(got.last[b]), int(got.bonus[b])) == (at, int(inverse_cdf(rest if at == 0 else p[at], u[b, 0])))
        if residual_after_miss(p[0], q)[1] == 0:
            kinds.add("passes though q(x) > p(x)" if q[0] > p[0, 0] and at == 1 else "misses" if at == 0 else "passes")
    assert kinds == {"passes though q(x) > p(x)", "passes", "misses"}
    assert (int(got.last[-1]), int(got.bonus[-1])) == (0, 1)  # q = p up to e^-800, yet p rules token 0 out: a miss
