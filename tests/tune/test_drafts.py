"""The sampled table's estimator (tune/drafts.py): how often rejection sampling accepts the r-th
candidate drawn from q, in expectation; and the drafts decoding draws (proposal.sample_draft)."""

import pytest
import torch

from medusa_mini.proposal import sample_draft
from medusa_mini.sampling import sampling_probs
from medusa_mini.tree import chain
from medusa_mini.tune.drafts import draft_acceptance


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


def test_draft_temperature_sharpens_q_like_p():
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])  # [B, K, V]
    d = sample_draft(logits, chain(1), temperature=0.5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(d.log_q.exp(), sampling_probs(logits, temperature=0.5))
