"""Sampled drafts (draft.py): candidates drawn from the heads' q without replacement, tried with min(1, p/q)."""

import math
from collections import Counter

import pytest
import torch

from medusa_mini.draft import draft_acceptance, sample_draft, try_candidates
from medusa_mini.sampling import sampling_probs


def test_a_draft_holds_distinct_tokens_drawn_from_q():
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(4)
    firsts = Counter()
    for _ in range(4000):
        draft = sample_draft(torch.log(q), depth=1, width=3, temperature=1.0, generator=gen)
        row = draft.samples[0].tolist()
        assert len(set(row)) == 3  # without replacement: no node wasted on a repeated token
        firsts[row[0]] += 1
    assert abs(firsts[0] / 4000 - 0.7) < 5 * math.sqrt(0.25 / 4000)
    torch.testing.assert_close(draft.log_q.exp(), q)


def test_a_draft_equal_to_p_is_accepted_at_its_first_draw():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).clamp_min(1e-12)
    acc = draft_acceptance(p, p.log(), width=3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(acc, torch.tensor([[1.0, 0.0, 0.0]]))


def test_the_first_draw_is_accepted_with_the_overlap_of_p_and_q_on_average():
    """E over x ~ q of min(1, p(x)/q(x)) = Σ min(p, q) = 1 - TV(p, q)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    q = torch.tensor([0.05, 0.05, 0.6, 0.1, 0.2])
    acc = draft_acceptance(p.expand(20000, -1), q.log().expand(20000, -1), width=2,
                           generator=torch.Generator().manual_seed(1))  # [20000, 2]
    assert acc[:, 0].mean().item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.01)
    assert (acc[:, 1] > 0).any()  # a second child catches some of what the first misses


def test_trying_every_token_accepts_one_for_sure():
    """Each rejection removes the token from both p and q, so the last try has p = q = that token."""
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(50, 6, generator=gen), -1)
    q = torch.softmax(torch.randn(50, 6, generator=gen), -1)
    acc = draft_acceptance(p, q.log(), width=6, generator=gen)  # [50, 6]
    torch.testing.assert_close(acc.sum(-1), torch.ones(50))
    assert acc[:, 0].mean() < 0.9  # while one try alone often misses


def test_a_token_p_rules_out_is_never_accepted_even_when_q_matches_p_to_rounding():
    """q one-hot up to float64 underflow, equal to p: the residual has no mass, yet the drawn
    candidate (token 0, q = e^-800) has p = 0 and must not pass; the bonus comes from p."""
    p = torch.tensor([0.0, 1.0, 0.0, 0.0])
    log_q = torch.tensor([-800.0, 0.0, -900.0, -800.0])
    accepted, residual = try_candidates(p, log_q, [0, 1, 2, 3], [0], torch.Generator().manual_seed(0))
    assert accepted is None and residual.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_draft_temperature_sharpens_q_like_p():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    d = sample_draft(logits, depth=1, width=1, temperature=0.5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(d.log_q.exp(), sampling_probs(logits, temperature=0.5))
