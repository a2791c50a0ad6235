"""The reference (reference.py), the spec a learner reads first: candidates, the three acceptance rules
as node-by-node walks on hand-written logits. The rules' claims (paper §2.3) are tested as claims:
rejection sampling emits exactly the backbone's probabilities (that typical acceptance does not is in
tests/test_exactness.py); that the reference's greedy decoding writes plain greedy's tokens, whole runs
on every tree, is tested beside the engine's, in tests/test_decoding.py."""

import math
from collections import Counter

import pytest
import torch

from conftest import assert_frequency
from medusa_mini import Sampling, Tree, chain
from medusa_mini import reference as ref

#   0 root ─┬─ 1 (0,) token 3 ─┬─ 3 (0,0) token 1 ── 5 (0,0,0) token 2
#           │                  └─ 4 (0,1) token 0
#           └─ 2 (1,) token 2
TREE = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
PARENTS, TOKENS, V, T1 = TREE.parents, [0, 3, 2, 1, 0, 2], 5, Sampling(acceptance="rejection", temperature=1.0)


def logits_from(probs_rows):
    """[N, V] logits whose softmax is exactly the given rows."""
    return torch.log(torch.tensor(probs_rows, dtype=torch.float))


# ---- candidates ---------------------------------------------------------------------------------------

DRAFT_IDS = torch.tensor([2, 5, 11, 17, 23, 31, 40, 63])  # a draft vocabulary of M = 8 of V = 64 tokens


def test_propose_fills_each_node_with_its_heads_guess_of_its_rank_from_the_draft_vocabulary():
    head_logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))  # [K, M]
    ranked = DRAFT_IDS[head_logits.topk(2, dim=-1).indices]  # [K, 2] token ids
    tokens, drawn = ref.propose(head_logits, DRAFT_IDS, TREE, 7, vocab_size=64, sampling=Sampling(), generator=None)
    assert drawn is None and tokens == [7] + [ranked[len(c) - 1, c[-1]].item() for c in TREE.choices]


def test_drawn_candidates_give_each_node_the_q_its_children_were_drawn_from():
    head_logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    tokens, drawn = ref.propose(head_logits, DRAFT_IDS, TREE, 7, vocab_size=64, sampling=Sampling(temperature=0.5),
                                generator=torch.Generator().manual_seed(0))
    assert set(tokens[1:]) <= set(DRAFT_IDS.tolist())
    for node, d in enumerate(TREE.depths):
        if kids := ref.children(PARENTS, node):
            log_q, draws = drawn[node]
            torch.testing.assert_close(log_q[DRAFT_IDS], torch.log_softmax(head_logits[d] / 0.5, -1))  # head d+1, at T
            assert [tokens[c] for c in kids] == [draws[TREE.choices[c - 1][-1]] for c in kids]


@pytest.mark.parametrize("argmaxes, want", [
    ([3, 1, 0, 4, 0, 0], ([0, 1, 3], 4)),  # root argmax 3 -> node 1, argmax 1 -> node 3, argmax 4: no child
    ([4, 1, 1, 1, 1, 1], ([0], 4)),  # no child matches: nothing accepted, the backbone's token emitted
    ([2, 0, 1, 0, 0, 0], ([0, 2], 1)),  # a lower-ranked branch
], ids=["descends-while-the-argmax-is-a-child", "no-match", "lower-ranked-branch"])
def test_greedy_descends_while_the_argmax_is_a_child_and_emits_the_backbones_token_after(argmaxes, want):
    assert ref.greedy_accept(PARENTS, TOKENS, torch.nn.functional.one_hot(torch.tensor(argmaxes), V) * 5.0) == want


# ---- rejection sampling ---------------------------------------------------------------------------------

P_ROOT = [0.1, 0.2, 0.3, 0.4, 0.0]  # p at the root
P_NODE1 = [0.5, 0.25, 0.0, 0.0, 0.25]  # p at every node below it
P_OTHER = [0.2] * 5
Q_HEADS = [[0.05, 0.05, 0.6, 0.1, 0.2], [0.1, 0.6, 0.1, 0.1, 0.1]]  # head 1's q: most mass on token 2, P_ROOT on 3
TWO_BY_TWO = [(0,), (1,), (0, 0), (0, 1)]


@pytest.mark.parametrize("choices, draft_ids, sampling", [
    (TWO_BY_TWO, range(V), Sampling(temperature=1.0, candidates="topk")), (TWO_BY_TWO, range(V), T1),
    ([(1,), (1, 0)], range(V), T1), (TWO_BY_TWO, [0, 1, 2], T1),
], ids=["top-k", "drawn", "drawn-rank-1-without-rank-0", "drawn-draft-vocabulary"])
def test_rejection_sampling_emits_tokens_with_exactly_the_backbones_probabilities(choices, draft_ids, sampling):
    """The first emitted token follows p(root), the second (below an accepted candidate) p(node 1), never a
    token p rules out: with q's top-k tried in turn, with candidates drawn from q (accepted with min(1, p/q),
    residual norm(max(0, p - q))), with rank 1 drawn without rank 0, and over a draft vocabulary."""
    tree, draft_ids = Tree.from_choices(choices), torch.tensor(draft_ids)
    logits = logits_from([P_ROOT] + [P_NODE1] * (tree.num_nodes - 1))
    head_logits = torch.log(torch.tensor(Q_HEADS))[:, draft_ids]  # [K, M]
    gen, first, second, accepted = torch.Generator().manual_seed(0), Counter(), Counter(), 0
    for _ in range(4000):
        tokens, drawn = ref.propose(head_logits, draft_ids, tree, 0, vocab_size=V, sampling=sampling, generator=gen)
        path, bonus = ref.rejection_accept(tree.parents, tokens, logits, sampling=sampling, generator=gen, drawn=drawn)
        out = [tokens[i] for i in path[1:]] + [bonus]
        accepted += len(path) - 1
        first[out[0]] += 1
        second.update(out[1:2])  # a second token came from a node below an accepted candidate: p = P_NODE1
    assert accepted > 0.3 * 4000  # candidates were really accepted, not only bonus tokens drawn
    for counter, p in ((first, P_ROOT), (second, P_NODE1)):
        for tok in range(V):
            assert_frequency(counter[tok], sum(counter.values()), p[tok])
    assert first[4] == 0 and second[2] == second[3] == 0  # p(root)[4] = 0; p(node 1) gives 2 and 3 none


def test_a_draft_equal_to_the_backbone_is_always_accepted_and_a_lone_top_k_child_with_p_of_its_token():
    """q = p makes min(1, p/q) = 1: every sampled candidate is accepted, the whole chain each time; a lone top-1
    guess x (a point mass) is accepted with probability p(x), not 1/V nor another token's p."""
    tree, p = chain(2), torch.nn.functional.normalize(torch.tensor([P_ROOT, P_NODE1]).clamp_min(1e-12), p=1, dim=-1)
    logits, gen = torch.log(p[[0, 1, 1]]), torch.Generator().manual_seed(2)  # node 1's p is head 2's q
    for _ in range(200):
        tokens, drawn = ref.propose(torch.log(p), torch.arange(V), tree, 0, vocab_size=V, sampling=T1, generator=gen)
        path, _ = ref.rejection_accept(tree.parents, tokens, logits, sampling=T1, generator=gen, drawn=drawn)
        assert path == [0, 1, 2]
    peaked, topk = logits_from([[0.45, 0.15, 0.15, 0.15, 0.1]] * 2), Sampling(temperature=1.0, candidates="topk")
    paths = [ref.rejection_accept([-1, 0], [0, 0], peaked, sampling=topk, generator=gen)[0] for _ in range(2000)]
    assert_frequency(sum(len(path) == 2 for path in paths), 2000, 0.45)  # token 0, the top-1 guess, p .45


# ---- typical acceptance -------------------------------------------------------------------------------


def typical(epsilon=0.09, delta=0.3, temperature=1.0):
    return Sampling(acceptance="typical", temperature=temperature, epsilon=epsilon, delta=delta)


def test_typical_accepts_exactly_the_candidates_above_min_epsilon_delta_exp_minus_entropy():
    logits = logits_from([P_ROOT, P_OTHER])  # a lone candidate at depth 1, judged by p(root)
    scale = math.exp(sum(x * math.log(x) for x in P_ROOT if x > 0))  # exp(-H(p)): the bar is min(eps, delta * scale)
    gen, bars = torch.Generator().manual_seed(0), [  # (epsilon, delta, whether token 3 (p .4) and token 2 (p .3) pass)
        (1.0, 0.35 / scale, [True, False]), (1.0, 0.25 / scale, [True, True]),  # .4 > .35 > .3; both above .25
        (1.0, 0.45 / scale, [False, False]), (0.35, 10.0, [True, False])]  # both below .45; epsilon the lower bar
    for eps, delta, want in bars:
        assert [len(ref.typical_accept([-1, 0], [0, t], logits, sampling=typical(eps, delta), generator=gen)[0]) == 2
                for t in (3, 2)] == want


def test_typical_takes_the_longest_accepted_path_and_breaks_ties_by_the_larger_sum_of_log_p():
    logits = logits_from([P_OTHER] * 6)  # everything passes (uniform p, bar .06): the deepest node wins
    assert ref.typical_accept(PARENTS, TOKENS, logits, sampling=typical(), generator=None)[0] == [0, 1, 3, 5]
    logits = logits_from([[0.1, 0.3, 0.6, 0.0, 0.0], P_OTHER, P_OTHER])  # two depth-1 candidates, both pass
    path, _ = ref.typical_accept([-1, 0, 0], [0, 1, 2], logits, sampling=typical(), generator=torch.Generator())
    assert path == [0, 2]  # token 2 (p .6) beats the higher-ranked token 1 (p .3)
    path, _ = ref.typical_accept([-1, 0, 0], [0, 1, 2], logits_from([P_OTHER] * 3), sampling=typical(), generator=None)
    assert path == [0, 1]  # a tie in depth and in the sum of log p: the smaller node index


def test_typical_acceptance_approaches_greedy_as_temperature_goes_to_zero():
    gen, depths = torch.Generator().manual_seed(0), set()
    for seed in range(20):
        logits = torch.randn(TREE.num_nodes, V, generator=torch.Generator().manual_seed(seed))
        logits[PARENTS[1:], TOKENS[1:]] += 2  # each child's token favoured at its parent: paths of every depth
        want = ref.greedy_accept(PARENTS, TOKENS, logits)
        assert ref.typical_accept(PARENTS, TOKENS, logits, sampling=typical(temperature=1e-4), generator=gen) == want
        depths.add(len(want[0]) - 1)
    assert depths == {0, 1, 2, 3}
