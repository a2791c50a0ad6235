"""Acceptance rules on hand-written logits: no model, just the rules of paper §2.3 and their proofs."""

import math
import random
from collections import Counter

import pytest
import torch

from medusa_mini.acceptance import (
    greedy_accept,
    greedy_accept_paths,
    rejection_accept,
    typical_accept,
    typical_accept_paths,
)
from medusa_mini.draft import sample_draft
from medusa_mini.tree import Tree

#   0 root ─┬─ 1 (0,) token 3 ─┬─ 3 (0,0) token 1 ── 5 (0,0,0) token 2
#           │                  └─ 4 (0,1) token 0
#           └─ 2 (1,) token 2
TREE = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
TOKENS = torch.tensor([0, 3, 2, 1, 0, 2])
V = 5


def logits_from(probs_rows):
    """[N, V] logits whose softmax is exactly the given rows."""
    return torch.log(torch.tensor(probs_rows, dtype=torch.float))


def onehot_logits(argmaxes):
    return torch.stack([torch.nn.functional.one_hot(torch.tensor(a), V).float() * 5 for a in argmaxes])


def test_greedy_descends_while_the_argmax_is_a_child():
    # root argmax 3 -> node 1; node 1 argmax 1 -> node 3; node 3 argmax 4 (no such child) -> bonus 4
    path, bonus = greedy_accept(TREE, TOKENS, onehot_logits([3, 1, 0, 4, 0, 0]))
    assert (path, bonus) == ([0, 1, 3], 4)


def test_greedy_accepts_nothing_when_no_child_matches_and_emits_the_backbones_token():
    assert greedy_accept(TREE, TOKENS, onehot_logits([4, 1, 1, 1, 1, 1])) == ([0], 4)


def test_greedy_can_take_a_lower_ranked_branch():
    assert greedy_accept(TREE, TOKENS, onehot_logits([2, 0, 1, 0, 0, 0])) == ([0, 2], 1)


def test_greedy_accepts_the_whole_deepest_path():
    assert greedy_accept(TREE, TOKENS, onehot_logits([3, 1, 0, 2, 0, 4])) == ([0, 1, 3, 5], 4)








P_ROOT = [0.1, 0.2, 0.3, 0.4, 0.0]  # children: token 3 (p .4) then token 2 (p .3)
P_NODE1 = [0.5, 0.25, 0.0, 0.0, 0.25]  # children: token 1 (p .25) then token 0 (p .5)
P_OTHER = [0.2] * 5


def test_rejection_sampling_emits_tokens_with_exactly_the_backbones_probabilities():
    """First emitted token ~ p(root); given it is node 1's token, the second ~ p(node 1)."""
    logits = logits_from([P_ROOT, P_NODE1, P_OTHER, P_OTHER, P_OTHER, P_OTHER])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first, second = Counter(), Counter()
    for _ in range(n):
        path, bonus = rejection_accept(TREE, TOKENS, logits, temperature=1.0, generator=gen)
        emitted = TOKENS[path[1:]].tolist() + [bonus]
        first[emitted[0]] += 1
        if emitted[0] == 3:
            second[emitted[1]] += 1
    sigma = math.sqrt(0.25 / n)  # the largest standard error of a frequency
    for tok in range(V):
        assert abs(first[tok] / n - P_ROOT[tok]) < 5 * sigma
    m = sum(second.values())
    for tok in range(V):
        assert abs(second[tok] / m - P_NODE1[tok]) < 5 * math.sqrt(0.25 / m)


def test_rejection_sampling_never_emits_a_token_the_backbone_gives_zero_probability():
    logits = logits_from([P_ROOT, P_NODE1, P_OTHER, P_OTHER, P_OTHER, P_OTHER])
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        path, bonus = rejection_accept(TREE, TOKENS, logits, temperature=1.0, generator=gen)
        if len(path) == 1:
            assert bonus != 4  # p(root)[4] = 0
        if path[-1] == 1:
            assert bonus not in (2, 3)  # p(node 1) gives them 0




# Sampled candidates: the heads' q differs from p on purpose (a lossless rule must not care).
Q_HEAD1 = [0.05, 0.05, 0.6, 0.1, 0.2]  # q puts most mass on token 2, p (P_ROOT) on token 3
Q_HEAD2 = [0.1, 0.6, 0.1, 0.1, 0.1]


def draw_and_accept(tree, logits, gen, *, width=2):
    """One step as decoding runs it with a sampled draft: draw the candidates, then accept."""
    head_logits = torch.log(torch.tensor([Q_HEAD1, Q_HEAD2, Q_HEAD2]))
    draft = sample_draft(head_logits, depth=tree.depth, width=width, temperature=1.0, generator=gen)
    head, rank = tree.node_head_rank()
    tokens = torch.cat([torch.tensor([0]), draft.samples[head, rank]])
    path, bonus = rejection_accept(tree, tokens, logits, temperature=1.0, generator=gen, draft=draft)
    return tokens[path[1:]].tolist() + [bonus], len(path) - 1


@pytest.mark.parametrize(
    "choices", [[(0,), (1,), (0, 0), (0, 1)], [(1,), (1, 0)]], ids=["full-tree", "rank-1-without-rank-0"]
)
def test_rejection_with_sampled_candidates_emits_exactly_the_backbones_probabilities(choices):
    """Candidates drawn from q, accepted with min(1, p/q), residual norm(max(0, p - q)): the emitted
    tokens still follow p exactly, also when a node's sibling draws are skipped (rank 1 without rank 0)."""
    tree = Tree.from_choices(choices)
    logits = logits_from([P_ROOT] + [P_NODE1] * (tree.num_nodes - 1))
    gen = torch.Generator().manual_seed(0)
    n = 8000
    first, second, accepted = Counter(), Counter(), 0
    for _ in range(n):
        emitted, a = draw_and_accept(tree, logits, gen)
        accepted += a
        first[emitted[0]] += 1
        if a >= 1:  # the second token came from a node below an accepted candidate: p = P_NODE1
            second[emitted[1]] += 1
    assert accepted > 0.3 * n  # candidates were really accepted, not only bonus tokens drawn
    for tok in range(V):
        assert abs(first[tok] / n - P_ROOT[tok]) < 5 * math.sqrt(0.25 / n)
    m = sum(second.values())
    for tok in range(V):
        assert abs(second[tok] / m - P_NODE1[tok]) < 5 * math.sqrt(0.25 / m)


def test_a_draft_equal_to_the_backbone_is_always_accepted():
    """q = p makes min(1, p/q) = 1: every sampled candidate is accepted, the whole chain each time."""
    tree = Tree.from_choices([(0,), (0, 0)])
    p = torch.tensor([P_ROOT, P_NODE1]).clamp_min(1e-12)
    p = p / p.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        draft = sample_draft(torch.log(p), depth=2, width=1, temperature=1.0, generator=gen)
        tokens = torch.cat([torch.tensor([0]), draft.samples[:, 0]])
        logits = torch.log(torch.stack([p[0], p[1], p[1]]))  # node 1's p is head 2's q
        path, _ = rejection_accept(tree, tokens, logits, temperature=1.0, generator=gen, draft=draft)
        assert path == [0, 1, 2]


def test_sampled_candidates_accept_more_than_top_k_when_p_is_flat():
    """Per node, sampled candidates accept Σ min(p, q) and the top-1 candidate only p(x): for a flat p
    and a q close to it, many times more."""
    flat = [0.22, 0.2, 0.2, 0.19, 0.19]
    tree = Tree.from_choices([(0,)])
    logits = logits_from([flat, flat])
    gen = torch.Generator().manual_seed(3)
    n = 4000
    sampled = topk = 0
    for _ in range(n):
        draft = sample_draft(logits[:1], depth=1, width=1, temperature=1.0, generator=gen)
        tokens = torch.tensor([0, int(draft.samples[0, 0])])
        sampled += len(rejection_accept(tree, tokens, logits, temperature=1.0, generator=gen, draft=draft)[0]) - 1
        topk += len(rejection_accept(tree, torch.tensor([0, 0]), logits, temperature=1.0, generator=gen)[0]) - 1
    assert sampled / n > 0.95 and abs(topk / n - 0.22) < 0.05














def entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


def test_typical_accepts_exactly_the_candidates_above_min_epsilon_delta_exp_minus_entropy():
    # root p = P_ROOT: node 1 holds token 3 (p .4), node 2 token 2 (p .3); children below pass freely
    logits = logits_from([P_ROOT] + [P_OTHER] * 5)
    scale = math.exp(-entropy(P_ROOT))  # threshold = min(eps, delta * scale)
    gen = torch.Generator().manual_seed(0)

    def accepted_at_depth_1(eps, delta):
        depth1 = {1: "node1", 2: "node2"}
        ok = set()
        for forced in (1, 2):  # drop the other branch so each candidate is judged alone
            tree = Tree.from_choices([(0,)] if forced == 1 else [(1,)])
            toks = torch.tensor([0, TOKENS[forced].item()])
            path, _ = typical_accept(tree, toks, logits[:2], temperature=1.0, epsilon=eps, delta=delta, generator=gen)
            if len(path) == 2:
                ok.add(depth1[forced])
        return ok

    assert accepted_at_depth_1(1.0, 0.35 / scale) == {"node1"}  # .4 > .35 > .3
    assert accepted_at_depth_1(1.0, 0.25 / scale) == {"node1", "node2"}  # both above .25
    assert accepted_at_depth_1(1.0, 0.45 / scale) == set()  # both below .45
    assert accepted_at_depth_1(0.35, 10.0) == {"node1"}  # now epsilon is the smaller bound


def test_typical_threshold_is_capped_by_epsilon_on_peaked_distributions():
    # a peaked root: exp(-H) is large, so the threshold is epsilon itself
    p_root = [0.02, 0.02, 0.06, 0.88, 0.02]
    assert 0.3 * math.exp(-entropy(p_root)) > 0.09
    logits = logits_from([p_root, P_OTHER, P_OTHER, P_OTHER, P_OTHER, P_OTHER])
    gen = torch.Generator().manual_seed(0)
    path, _ = typical_accept(TREE, TOKENS, logits, temperature=1.0, generator=gen)
    assert path[1] == 1  # token 3 (p .88) passes; node 2's token 2 (p .06 < .09) would not


def test_typical_takes_the_longest_accepted_path():
    # everything passes everywhere (uniform p, threshold .2 * .3 = .06): deepest node 5 wins
    logits = logits_from([P_OTHER] * 6)
    path, _ = typical_accept(TREE, TOKENS, logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert path == [0, 1, 3, 5]


def test_typical_breaks_ties_by_the_larger_sum_of_log_p():
    tree = Tree.from_choices([(0,), (1,)])  # two depth-1 candidates, both pass
    tokens = torch.tensor([0, 1, 2])
    logits = logits_from([[0.1, 0.3, 0.6, 0.0, 0.0], P_OTHER, P_OTHER])
    path, _ = typical_accept(tree, tokens, logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert path == [0, 2]  # token 2 (p .6) beats the higher-ranked token 1 (p .3)


def test_typical_acceptance_approaches_greedy_as_temperature_goes_to_zero():
    gen = torch.Generator().manual_seed(0)
    for seed in range(20):
        logits = torch.randn(TREE.num_nodes, V, generator=torch.Generator().manual_seed(seed))
        want = greedy_accept(TREE, TOKENS, logits)
        assert typical_accept(TREE, TOKENS, logits, temperature=1e-4, generator=gen) == want




# ---- the vectorised rules (`*_paths`) decide exactly what the walks decide ------------------------


def random_tree(rng: random.Random) -> Tree:
    """Depth 1-5, up to 4 children per node (some nodes none), every prefix present."""
    depth, width = rng.randint(1, 5), rng.randint(1, 4)
    choices, frontier = [], [()]
    for _ in range(depth):
        frontier = [parent + (r,) for parent in frontier for r in range(rng.randint(0, width))] or [frontier[0] + (0,)]
        choices += frontier
    return Tree.from_choices(choices)


def random_case(seed: int, *, vocab: int = 4):
    """A random tree, tokens with repeats among siblings, and integer logits full of argmax ties."""
    rng = random.Random(seed)
    tree = random_tree(rng)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (tree.num_nodes,), generator=gen)
    logits = torch.randint(0, 3, (tree.num_nodes, vocab), generator=gen).float()
    return tree, tokens, logits


def test_random_trees_cover_depths_one_to_five_and_widths_one_to_four():
    trees = [random_case(seed)[0] for seed in range(300)]
    assert {t.depth for t in trees} == {1, 2, 3, 4, 5}
    assert {max(len(k) for k in t.children) for t in trees} == {1, 2, 3, 4}


def test_vectorised_greedy_equals_the_node_walk_on_random_trees():
    """Ties too: argmax ties go to the lowest token id in both, and a child repeating an earlier
    sibling's token is never the one accepted."""
    deep = 0
    for seed in range(300):
        tree, tokens, logits = random_case(seed, vocab=3)  # a small vocabulary: long matches happen
        choice = greedy_accept_paths(tree, tokens, logits)
        path, bonus = greedy_accept(tree, tokens, logits)
        assert choice.to_host() == (path, bonus)
        assert choice.nodes.shape == (tree.depth + 1,) and choice.nodes[-1] == path[-1]
        deep += len(path) > 2
    assert deep > 30  # the cases exercise deep paths, not only the root


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_vectorised_typical_equals_the_node_walk_with_the_same_draws(temperature):
    """Same path, same bonus and the same random numbers consumed, on random trees and logits;
    integer logits make equal log-p sums, where the smaller node index wins in both."""
    deep = 0
    for seed in range(150):
        tree, tokens, logits = random_case(seed)
        if seed % 2:  # continuous logits too: distinct scores decide
            logits = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)) * 2
        settings = dict(temperature=temperature, epsilon=0.3, delta=0.6)
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = typical_accept(tree, tokens, logits, generator=g1, **settings)
        assert typical_accept_paths(tree, tokens, logits, generator=g2, **settings).to_host() == want
        assert torch.rand((), generator=g1) == torch.rand((), generator=g2)
        deep += len(want[0]) > 2
    assert deep > 10
