"""Exact sequence distributions by enumeration, and the statistics that compare a sampler against them."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch

from medusa_mini.sampling import sampling_probs


@torch.no_grad()
def exact_sequence_probs(model, prompt, n, *, temperature, top_p=1.0, eos_id=None):
    """Chain rule by brute force, every sequence over the tiny vocabulary in one forward: P(x1..xn | prompt).

    With eos_id a sequence ends at its first end token (kept), and holds the mass of every sequence
    that shares it up to there."""
    V, P = model.config.vocab_size, len(prompt)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # [V^n, n]
    logits, _ = model(torch.cat([torch.tensor(prompt).expand(len(seqs), P), seqs[:, :-1]], dim=1))
    p = sampling_probs(logits[:, P - 1 :], temperature=temperature, top_p=top_p)  # [V^n, n, V]
    probs = {}
    for seq, prob in zip(seqs.tolist(), p.gather(2, seqs[..., None])[..., 0].double().prod(dim=1).tolist()):
        seq = tuple(seq[: seq.index(eos_id) + 1] if eos_id in seq else seq)
        probs[seq] = probs.get(seq, 0.0) + prob
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
