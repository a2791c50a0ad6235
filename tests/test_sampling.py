"""The Sampling settings, the target distribution p, the heads' q and the draws (sampling.py)."""

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import assert_frequency
from medusa_mini import Sampling, sampling_probs
from medusa_mini.sampling import gumbel_top_k, inverse_cdf, q_log_probs, without_earlier_draws


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.tensor([0.1, 0.5, 0.25, 0.15])  # 0.5 + 0.25 reach 0.7: those two kept, renormalised to 2/3, 1/3
    torch.testing.assert_close(sampling_probs(p.log(), temperature=1.0, top_p=0.7), torch.tensor([0, 2, 1, 0]) / 3)
    torch.testing.assert_close(sampling_probs(p.log(), temperature=1.0), p)
    torch.testing.assert_close(sampling_probs(p.log(), temperature=1.0, top_p=1e-300), torch.eye(4)[1])  # < float32's


@pytest.mark.parametrize("temperature", [1e-4, 1e-30, 1e-45])
def test_a_tiny_temperature_gives_the_argmax_not_nan_and_shares_exact_ties_and_zero_is_refused(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [2.0, 7.0, 7.0, 0.0]])
    want = [[0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]]
    assert sampling_probs(logits, temperature=temperature).tolist() == want
    assert (s := Sampling(temperature=np.float32(temperature))).probs(logits).tolist() == want  # numpy's numbers too
    assert type(s.temperature) is float  # any real number is stored as the float torch divides by
    s = Sampling(temperature=0.8, top_p=Fraction(1, 2), epsilon=Fraction(1, 10), delta=np.float32(0.3))
    assert [type(x) for x in (s.top_p, s.epsilon, s.delta)] == [float] * 3  # each setting: torch compares with floats
    assert Sampling(temperature=torch.finfo().max).probs(logits).allclose(torch.tensor(0.25))  # the largest: flat
    pytest.raises(ValueError, sampling_probs, logits, temperature=0.0).match("temperature")


def test_q_over_a_draft_vocabulary_is_the_heads_softmax_there_and_zero_elsewhere():
    head_logits, draft_ids = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]), torch.tensor([1, 4, 6])  # [2, M = 3]
    log_q = q_log_probs(head_logits, draft_ids, temperature=0.5, vocab_size=8)  # [2, V = 8]
    torch.testing.assert_close(log_q[:, draft_ids], torch.log_softmax(head_logits / 0.5, dim=-1))
    assert torch.isneginf(log_q[:, [0, 2, 3, 5, 7]]).all()


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero_one():
    probs, n = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]), 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    counts = Counter(inverse_cdf(probs.expand(n, 5), u).tolist())
    assert set(counts) == {0, 2, 3}
    assert inverse_cdf(torch.tensor([2.0, 2.0]), torch.tensor(0.75)) == 1  # a row need not sum to 1
    edges = torch.tensor([0, 0.25, 0, 0.75])  # u = 0 and 0.25 begin tokens 1 and 3; 0 and 2 own empty intervals
    assert inverse_cdf(edges.expand(2, 4), torch.tensor([0, 0.25])).tolist() == [1, 3]
    for tok in (0, 2, 3):
        assert_frequency(counts[tok], n, probs[tok].item())


def test_drawn_candidates_are_distinct_draws_from_q_in_draw_order():
    log_q = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.0]).log().expand(4000, 5)
    rows = gumbel_top_k(log_q, 3, torch.rand(log_q.shape, generator=torch.Generator().manual_seed(4))).tolist()
    assert all(len(set(row)) == 3 and 4 not in row for row in rows)  # no repeat, nothing q rules out
    assert_frequency(sum(row[0] == 0 for row in rows), 4000, 0.7)
    assert_frequency(sum(row[1] == 0 for row in rows), 4000, 3 * 0.1 * 0.7 / 0.9)  # second, after another


def test_a_later_draw_is_tried_against_q_without_the_draws_before_it_however_little_is_left():
    """The rank-1 draw came from q without the rank-0 draw, renormalised, even when what is left is far below
    float32's exp (a low temperature); when nothing is left, the draw was a pick: a point mass."""
    log_q = torch.tensor([[0.0, -150.0, -152.0, float("-inf")]] * 2)  # [2, V]
    got = without_earlier_draws(log_q, torch.tensor([[0, 1], [0, 1]]), rank=torch.tensor([1, 0]))  # [2, R]: 1, then 0
    want = torch.tensor([-150.0, -152.0], dtype=torch.float64).softmax(0).float()
    torch.testing.assert_close(got[0], torch.cat([torch.zeros(1), want, torch.zeros(1)]))
    torch.testing.assert_close(got[1], log_q[1].softmax(0))  # rank 0: q itself
    only = torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")])
    assert without_earlier_draws(only, torch.tensor([0, 3]), rank=1).tolist() == [0, 0, 0, 1]


def test_a_zero_uniform_still_ranks_its_token_above_one_of_tiny_q():
    """torch.rand may return 0, whose Gumbel noise would be -inf: token 0 (q = 1/2) would rank below token 1 (e^-50)."""
    log_q = torch.tensor([0.0, -50.0, 0.0]).log_softmax(0)
    assert gumbel_top_k(log_q, 2, torch.tensor([0.0, 0.5, 0.5])).tolist() == [2, 0]


def test_greedy_is_decided_by_the_temperature_alone_and_sampling_means_lossless_rejection_sampling():
    assert Sampling().greedy and Sampling().acceptance == "greedy"
    assert Sampling(temperature=0.7).acceptance == "rejection"  # no acceptance rule named
    for rule in ("typical", "rejection"):
        assert [Sampling(acceptance=rule, temperature=T).acceptance for T in (0.0, 0.5)] == ["greedy", rule]
    assert [Sampling(temperature=0.5, **kw).draws_candidates for kw in ({}, {"candidates": "topk"})] == [True, False]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(acceptance="greedy", temperature=0.7), "greedy acceptance is for"), (dict(top_p=True), "top_p must be"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e39), "float32's largest"), (dict(temperature=True), "temperature must be a number"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(epsilon=0.0), "epsilon"), (dict(delta=0.0), "delta"),
    (dict(top_p="0.5"), "top_p must be a number"), (dict(epsilon="0.1"), "epsilon, delta must be > 0, not '0.1'"),
    (dict(acceptance="nucleus"), "unknown acceptance rule"), (dict(candidates="beam"), "unknown candidates")])
def test_impossible_settings_fail_at_construction(kwargs, needle):
    pytest.raises(ValueError, Sampling, **kwargs).match(needle)
