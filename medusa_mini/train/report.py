"""What `train_tiny.py` reports, measured: progress lines, the validation loss, the summary (with the acceptance
tables of accuracy.py, saved as heads_accuracy.json) and prompts.json."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import torch

from ..io.files import atomic_write_text
from ..io.loading import PROMPTS_FILE
from ..model import GPT
from ..sampling import SAMPLING_TEMPERATURE
from ..training import lm_loss
from ..tree import build_tree, expected_tokens_per_step, preset
from . import accuracy
from .data import get_batch

OFFICIAL_TOP1 = (0.56, 0.32, 0.20, 0.15)  # official Medusa-1 heads on Vicuna-7B, heads 1-4 (paper, repository)
COVERAGE_SIZES = (256, 512, 1024, 2048, 4096, 8192)


def progress_line(stage: str, step: int, steps: int, metrics: dict, *, tokens_per_s: float, eta: float) -> str:
    """One progress line: the current step's losses and head top-1, throughput, time left."""
    parts = [f"{stage:9s} step {step + 1:5d}/{steps}"]
    if "lm" in metrics:
        parts.append(f"lm {metrics['lm']:.3f}")
    if "heads" in metrics:
        parts.append("heads " + " ".join(f"{v:.2f}" for v in metrics["heads"]))
        parts.append("top1 " + " ".join(f"{v:.2f}" for v in metrics["acc"]))
    parts.append(f"{tokens_per_s:,.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    return "  ".join(parts)


def validation_batches(val_tokens: np.ndarray, *, block_size: int, seed: int, device: str) -> list:
    """Eight fixed batches (x, y) of 8 held-out windows [8, T], T <= 256; their own generator, so measuring
    never changes what is trained."""
    g = torch.Generator().manual_seed(seed * 7919 + 101)
    T = min(block_size, 256, len(val_tokens) - 1)
    return [get_batch(val_tokens, batch_size=8, block_size=T, generator=g, device=device) for _ in range(8)]


@torch.no_grad()
def validation_loss(model: GPT, batches: list) -> float:
    """The backbone's mean next-token loss on `batches`, in float32 whatever --dtype, one read."""
    return (sum(lm_loss(model(x)[0], y) for x, y in batches) / len(batches)).item()


def summarize(r, val_batches: list, val_tokens: np.ndarray) -> dict:
    """Measure, print and save (heads_accuracy.json) the trained model's figures; return them."""
    model, heads, args, T = r.model, r.heads, r.args, SAMPLING_TEMPERATURE
    K, V, M = heads.num_heads, heads.config.vocab_size, heads.config.draft_vocab_size
    val_loss, top_k = validation_loss(model, val_batches), min(10, heads.draft_ids.numel())
    windows = [row for x, _ in val_batches for row in x.tolist()]
    text = accuracy.measure_head_accuracy(model, heads, windows, prompt_lens=1, top_k=top_k)
    # Against what the model itself says: held-out prompts (a draw of their own) continued greedily, and sampled.
    P = min(32, model.config.block_size // 4)
    n = min(96, model.config.block_size - P)
    prompts, _ = get_batch(val_tokens, batch_size=min(64, 8 * args.eval_prompts), block_size=P,
                           generator=torch.Generator().manual_seed(args.seed + 5))
    seqs = accuracy.continuations(model, prompts.tolist(), max_new_tokens=n)
    acc = accuracy.measure_head_accuracy(model, heads, seqs, prompt_lens=P, top_k=top_k)
    sampled = accuracy.continuations(model, prompts.tolist(), max_new_tokens=n, temperature=T, seed=args.seed + 6)
    accept = accuracy.measure_sampled_acceptance(model, heads, sampled, prompt_lens=P, temperature=T)
    drawn = accuracy.measure_try_acceptance(model, heads, sampled, prompt_lens=P, temperature=T, ranks=top_k,
                                            seed=args.seed + 7)
    accuracy.save_accuracy(args.out, acc, drawn=drawn, meta={
        "measured_on": f"{len(seqs)} held-out prompts x {n} greedy tokens",
        "drawn_on": f"the same prompts x {n} tokens sampled at T={T:g}"})
    # The share of the greedy tokens inside the draft vocabulary of each size m: rank[token] < m.
    ranks = heads.vocab_order.cpu().argsort()[torch.tensor([s[P:] for s in seqs])]
    sizes = sorted({m for m in COVERAGE_SIZES if m < V} | ({M} if M else set()))
    coverage = {m: (ranks < m).double().mean().item() for m in sizes}
    figures = {"top-1 on held-out text": text[:, 0], "top-5 on held-out text": text[:, :5].sum(1),
               "top-1 vs own greedy continuation": acc[:, 0], "top-5 vs own greedy continuation": acc[:, :5].sum(1),
               f"Σ min(p, q) on own text at T={T:g}": accept,
               "official Medusa-1, Vicuna-7B top-1": torch.tensor(OFFICIAL_TOP1[:K])}
    lines = [f"summary    validation loss {val_loss:.3f} nats/token (perplexity {math.exp(val_loss):.1f})",
             f"           {'head':<36}" + "".join(f"{k:>7d}" for k in range(1, K + 1))]
    lines += [f"           {name:<36}" + "".join(f"{v:7.2f}" for v in xs.tolist()) for name, xs in figures.items()]
    lines.append(f"           {'expected tokens/step, greedy (bonus counted):':<48}"
                 + ", ".join(f"{b} nodes {build_tree(acc, b)[1]:.2f}" for b in (4, 8, 16, 32, 64))
                 + f"; cpu preset {expected_tokens_per_step(acc, preset('cpu').truncated(K)):.2f}")
    lines.append(f"           {f'expected tokens/step, rejection (T={T:g}):':<48}"
                 + ", ".join(f"{b} nodes {build_tree(drawn, b)[1]:.2f}" for b in (4, 8, 16, 32, 64)))
    if coverage:
        lines.append("           draft vocabulary coverage of greedy text: "
                     + ", ".join(f"{m} {c:.2f}" for m, c in coverage.items()))
    r.log("\n".join(lines))
    return {"val_loss": round(val_loss, 4), "head_top1_text": [round(v, 4) for v in text[:, 0].tolist()],
            "head_top1_own": [round(v, 4) for v in acc[:, 0].tolist()],
            "head_accept_sampled": [round(v, 4) for v in accept.tolist()],
            "draft_vocab_coverage": {str(m): round(c, 4) for m, c in coverage.items()}}


def held_out_prompts(out: str, val_docs, enc, *, count: int, seed: int, block_size: int) -> None:
    """`count` snippets of held-out text (at most 240 characters, line to line, under a third of the
    context), saved as prompts.json: decode.py's default prompts, text the model never trained on."""
    rng, prompts = random.Random(seed), []
    texts = [t for _, t in val_docs if t.strip()]
    for _ in range(count * 50 if texts else 0):
        if len(prompts) == count:
            break
        lines = texts[rng.randrange(len(texts))].splitlines(keepends=True)
        snippet = ""
        for line in lines[rng.randrange(len(lines)):]:
            if snippet and len(snippet) + len(line) > 240:
                break
            snippet += line
        snippet = snippet[:240]
        if snippet.strip() and 0 < len(enc.encode_ordinary(snippet)) < block_size // 3:
            prompts.append(snippet)
    atomic_write_text(os.path.join(out, PROMPTS_FILE), json.dumps({"prompts": prompts}, indent=1, ensure_ascii=False))
