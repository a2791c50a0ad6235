"""Dynamic trees (dynamic.py): each step keeps the N candidates whose paths the heads are most sure of.

The kept nodes always form a tree, its tensors are what a fixed tree of the same nodes would have,
confident heads make deep trees and torn heads wide ones, and nothing about exactness changes."""

import random

import pytest
import torch
from conftest import random_heads, tiny_model
from distributions import empirical, exact_sequence_probs, expected_tv, total_variation

from medusa_mini.decoding import generate, medusa_generate, medusa_generate_batch
from medusa_mini.dynamic import Calibration, DynamicProposer, DynamicTree, kept_tree, path_scores, select_nodes
from medusa_mini.proposal import StepTree
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree, build_tree, preset

ACC = torch.tensor([[0.6, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.1, 0.1, 0.05], [0.2, 0.1, 0.05, 0.05]])
CANDIDATES = build_tree(ACC, 40)[0]


def test_a_nodes_path_score_never_exceeds_its_parents_even_when_its_own_log_q_is_zero():
    gen = torch.Generator().manual_seed(0)
    log_q = -torch.rand(3, CANDIDATES.num_nodes, generator=gen) * 3
    log_q[:, ::3] = 0.0  # probability 1: a child then ties its parent exactly
    score = path_scores(CANDIDATES, log_q)
    parents = torch.tensor(CANDIDATES.parents[1:])
    assert (score[:, 1:] <= score[:, parents]).all() and (score[:, 0] == 0).all()


@pytest.mark.parametrize("seed", range(20))
def test_the_kept_nodes_always_form_a_tree(seed):
    """Ties (equal scores, zero log q) and candidates too deep to use included."""
    gen = torch.Generator().manual_seed(seed)
    log_q = -torch.randint(0, 3, (4, CANDIDATES.num_nodes), generator=gen).float()  # many exact ties
    nodes = select_nodes(CANDIDATES, path_scores(CANDIDATES, log_q), 12, max_depth=random.Random(seed).randint(0, 4))
    for row in nodes.tolist():
        assert row[0] == 0 and row == sorted(row) and len(set(row)) == 13
        assert all(CANDIDATES.parents[c] in row for c in row[1:])


def test_the_most_confident_paths_are_kept():
    tree = Tree.from_choices([(0,), (1,), (0, 0), (1, 0)])  # 0 -> 1 -> 3, 0 -> 2 -> 4
    log_q = torch.log(torch.tensor([[1.0, 0.5, 0.4, 0.9, 0.99]]))  # paths: 1: .5, 2: .4, 3: .45, 4: .396
    assert select_nodes(tree, path_scores(tree, log_q), 2).tolist() == [[0, 1, 3]]
    assert select_nodes(tree, path_scores(tree, log_q), 3).tolist() == [[0, 1, 2, 3]]


def test_the_kept_trees_tensors_are_those_of_the_fixed_tree_on_the_same_nodes():
    gen = torch.Generator().manual_seed(3)
    nodes = select_nodes(CANDIDATES, path_scores(CANDIDATES, -torch.rand(2, CANDIDATES.num_nodes, generator=gen)), 9)
    step = kept_tree(CANDIDATES, nodes)
    for b, row in enumerate(nodes.tolist()):
        fixed = StepTree.of(Tree.from_choices([CANDIDATES.choices[c - 1] for c in row[1:]]), 1, "cpu")
        for name in ("parents", "depths", "ancestor_mask", "earlier_siblings"):
            assert torch.equal(getattr(step, name)[b], getattr(fixed, name)[0]), name

        def leaf_paths(t, i):  # the set of valid root-to-node paths, each as a tuple of node indices
            return {tuple(p[v].tolist()) for p, v in zip(t.paths[i], t.path_valid[i])}

        assert leaf_paths(fixed, 0) <= leaf_paths(step, b)  # every leaf path, plus some of their prefixes
        assert all(any(p == q[: len(p)] for q in leaf_paths(fixed, 0)) for p in leaf_paths(step, b))


class FixedHeads:
    """Heads whose guesses are given distributions, the same at every hidden state: [K, V] probabilities."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.logits, self.num_heads = probs.log(), probs.shape[0]

    def __call__(self, hidden, lm_head):
        return self.logits[:, None].expand(-1, hidden.shape[0], -1)  # [K, B, V]


def kept_depths(probs: torch.Tensor, budget: int, calibration: Calibration | None = None) -> list[int]:
    model = tiny_model(0, vocab_size=probs.shape[1])
    tree = DynamicTree(budget, preset("gpu"), preset("cpu"), calibration)
    proposal = DynamicProposer(model, FixedHeads(probs), tree).propose(
        torch.tensor([0]), torch.zeros(1, 32), max_depth=4, sampling=Sampling(), generator=None)
    return proposal.tree.depths[0].tolist()


def test_confident_heads_make_a_deep_tree_and_torn_heads_a_wide_one():
    V = 16
    sure = torch.full((4, V), 0.001)
    sure[:, 0] = 1 - 0.001 * (V - 1)  # every head all but certain of one token
    torn = torch.full((4, V), 0.01)
    torn[:, :4] = (1 - 0.01 * (V - 4)) / 4  # every head split between four tokens
    assert max(kept_depths(sure, 4)) == 4  # a chain of the heads' top guesses
    assert max(kept_depths(torn, 4)) == 1  # four alternatives for the next token


def test_a_calibration_that_finds_the_heads_underconfident_makes_the_tree_deep():
    """Raw probabilities 0.35 / 0.3 / ... prefer wide shallow trees; if guesses at 0.3 and above are
    nearly always right (what calibration measured), the chain of top guesses is the better bet."""
    V = 16
    probs = torch.full((4, V), 0.35 / (V - 3))
    probs[:, 0], probs[:, 1], probs[:, 2] = 0.35, 0.2, 0.1
    calibration = Calibration(edges=(0.0, 0.15, 0.3, 1.0), rates=(((0.01, 0.2, 0.98),) * 2,) * 4)
    assert max(kept_depths(probs, 4)) < 4
    assert max(kept_depths(probs, 4, calibration)) == 4


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_a_dynamic_tree_equals_plain_greedy_in_every_row(seed):
    model, heads = tiny_model(seed), random_heads(tiny_model(seed), seed=seed)
    prompts = [[1 + seed, 2, 3], [9, 8, 7, 6, 5, 4], list(range(2, 40))]
    tree = DynamicTree(8, CANDIDATES, build_tree(ACC, 8)[0])
    got = medusa_generate_batch(model, heads, prompts, tree=tree, max_new_tokens=30)
    assert [g[0] for g in got] == [generate(model, p, max_new_tokens=30)[0] for p in prompts]


def test_sampled_drafts_keep_the_fixed_tree():
    model, heads = tiny_model(1), random_heads(tiny_model(1), seed=1)
    fixed = build_tree(ACC, 6)[0]
    proposer = DynamicProposer(model, heads, DynamicTree(12, CANDIDATES, fixed))
    proposal = proposer.propose(torch.tensor([3]), torch.randn(1, 32), max_depth=4,
                                sampling=Sampling(temperature=0.8), generator=torch.Generator().manual_seed(0))
    assert proposal.tree.host_parents == tuple(fixed.parents) and proposal.draft is not None


@pytest.mark.slow
@torch.no_grad()
def test_rejection_sampling_with_a_dynamic_tree_and_top_k_candidates_preserves_the_distribution():
    """The tree depends only on the heads, never on the backbone's draws: still lossless."""
    V, n, M, T = 4, 3, 2000, 0.8
    model = tiny_model(11, vocab_size=V, block_size=16)
    exact = exact_sequence_probs(model, [1, 2], n, temperature=T)
    acc = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.2], [0.3, 0.2, 0.1]])
    tree = DynamicTree(4, build_tree(acc, 12)[0], build_tree(acc, 4)[0])
    pool = [random_heads(model, num_heads=3, seed=s) for s in range(7)]
    gen = torch.Generator().manual_seed(0)
    sampling = Sampling(acceptance="rejection", temperature=T, draft="topk")
    got = empirical(lambda i: medusa_generate(model, pool[i % 7], [1, 2], tree=tree, max_new_tokens=n,
                                              sampling=sampling, generator=gen)[0], M)
    assert total_variation(got, exact) < 2.5 * expected_tv(exact, M)
