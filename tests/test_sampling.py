"""The Sampling settings and the target distribution p (sampling.py): validated once, read everywhere."""

import math
from collections import Counter

import pytest
import torch

from medusa_mini.sampling import Sampling, sample, sampling_probs, typical_threshold


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = sampling_probs(torch.log(torch.tensor([0.1, 0.5, 0.25, 0.15])), temperature=1.0, top_p=0.7)
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5 / 0.75, 0.25 / 0.75, 0.0]))
    full = sampling_probs(torch.log(torch.tensor([0.1, 0.5, 0.25, 0.15])), temperature=1.0)
    torch.testing.assert_close(full, torch.tensor([0.1, 0.5, 0.25, 0.15]))


def test_the_typical_bar_is_min_epsilon_delta_exp_minus_entropy():
    p = torch.tensor([[0.25] * 4, [0.97, 0.01, 0.01, 0.01]])
    bar = typical_threshold(p, epsilon=0.09, delta=0.3)
    peaked_entropy = -(0.97 * math.log(0.97) + 3 * 0.01 * math.log(0.01))
    assert bar.tolist() == pytest.approx([0.3 * 0.25, min(0.09, 0.3 * math.exp(-peaked_entropy))])
    assert bar[1] == pytest.approx(0.09)  # a peaked p: epsilon caps the bar


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero_one():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = Counter(sample(probs, gen) for _ in range(n))
    assert set(counts) == {0, 2, 3}
    for tok in (0, 2, 3):
        assert abs(counts[tok] / n - probs[tok].item()) < 5 * math.sqrt(0.25 / n)


def test_sampling_at_temperature_zero_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(torch.zeros(3), temperature=0.0)


def test_greedy_is_decided_by_the_temperature_alone_and_sampling_means_lossless_rejection_sampling():
    assert Sampling().greedy and Sampling().rule == Sampling().acceptance == "greedy"
    assert Sampling(temperature=0.7).acceptance == "rejection"  # no acceptance rule named
    for rule in ("typical", "rejection"):
        assert Sampling(acceptance=rule, temperature=0.0).rule == "greedy"
        assert Sampling(acceptance=rule, temperature=0.5).rule == rule


@pytest.mark.parametrize("kwargs, needle", [
    (dict(acceptance="greedy", temperature=0.7), "greedy acceptance is for temperature 0"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(epsilon=0.0), "epsilon"),
    (dict(acceptance="nucleus"), "unknown acceptance rule"), (dict(draft="beam"), "unknown draft"),
])
def test_impossible_settings_fail_at_construction(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Sampling(**kwargs)


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        Sampling().temperature = 1.0


def test_choose_is_the_argmax_when_greedy_and_a_draw_from_p_otherwise():
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    assert int(Sampling().next_token(logits, None)) == 1
    gen = torch.Generator().manual_seed(0)
    draws = Counter(int(Sampling(temperature=1.0).next_token(logits, gen)) for _ in range(4000))
    assert abs(draws[0] / 4000 - 0.2) < 5 * math.sqrt(0.25 / 4000)
