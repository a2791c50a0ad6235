"""Exact sequence distributions by enumeration, and the statistics that compare a sampler against them."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch

from medusa_mini.sampling import sampling_probs


@torch.no_grad()
def exact_sequence_probs(model, prompt, n, *, temperature, top_p=1.0):
    """Chain rule by brute force: P(x1..xn | prompt) for every sequence over the tiny vocabulary."""
    V = model.config.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=n):
        logits = model(torch.tensor([prompt + list(seq)]))[0][0]  # [P + n, V]
        p = sampling_probs(logits[len(prompt) - 1 : len(prompt) - 1 + n], temperature=temperature, top_p=top_p)
        probs[seq] = math.prod(p[i, t].item() for i, t in enumerate(seq))
    return probs


def empirical(run, samples):
    counts = Counter(tuple(run(i)) for i in range(samples))
    return {seq: c / samples for seq, c in counts.items()}


def empirical_rows(run_batch, samples, *, batches):
    """Like `empirical`, from batched runs: run_batch(i, rows) -> rows outputs (tokens, ...) of batch i.

    Rows of one batch are independent draws (each row has its own acceptance walk and its own draws
    from the shared generator), so a batch of R rows is R samples at the price of about one run's forwards.
    """
    sizes = [samples // batches + (i < samples % batches) for i in range(batches)]
    counts = Counter(tuple(out[0]) for i, rows in enumerate(sizes) for out in run_batch(i, rows))
    return {seq: c / samples for seq, c in counts.items()}


def total_variation(p, q):
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def expected_tv(p, samples):
    """E|TV| of an honest empirical estimate is at most 1/2 Σ sqrt(p(1-p)/M) (Jensen)."""
    return 0.5 * sum(math.sqrt(x * (1 - x) / samples) for x in p.values())
