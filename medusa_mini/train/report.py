"""What `train_tiny.py` reports and leaves behind after training: the summary, the heads' accuracy
table (heads_accuracy.json, which `decode.py --tree N` builds trees from) and held-out prompts.

Along the way: the progress lines and the backbone's validation loss every --eval-every steps.
The summary is measured, never assumed: validation loss, each head's top-1/top-5 accuracy on held-out
text, each head's accuracy against the backbone's own greedy continuation (what decoding actually
meets), and the tokens per step a tree built from those accuracies should give (the product rule).
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import torch

from ..hydra import teacher_forced_logits
from ..io.loading import PROMPTS_FILE
from ..io.safetensors import atomic_write_text
from ..training import head_targets, lm_loss, sample_continuations
from ..tree import build_tree, expected_tokens_per_step, preset
from ..tune.acceptance_tables import measure_head_accuracy, save_accuracy
from .data import get_batch

# Official Medusa-1 heads on Vicuna-7B, top-1 accuracy of heads 1-4 (paper and its repository).
OFFICIAL_TOP1 = (0.56, 0.32, 0.20, 0.15)


@torch.no_grad()
def text_accuracy(model, heads, val_tokens: np.ndarray, *, batches: int = 8, batch_size: int = 8, seed: int = 0):
    """Validation loss and per-head top-1/top-5 accuracy on held-out text (teacher forcing)."""
    g = torch.Generator().manual_seed(seed)
    T = min(model.config.block_size, 256, len(val_tokens) - 1)
    losses, top1, top5, counts = [], None, None, None
    for _ in range(batches):
        x, y = get_batch(val_tokens, batch_size=batch_size, block_size=T, generator=g, device=model.device)
        logits, hidden = model(x)
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
        head_logits = teacher_forced_logits(heads, hidden, y, model)  # [K, B, T, V]
        K = head_logits.shape[0]
        top1 = top1 if top1 is not None else [0.0] * K
        top5 = top5 if top5 is not None else [0.0] * K
        counts = counts if counts is not None else [0] * K
        for k in range(K):
            tgt, mask = head_targets(y, k + 1)
            guesses = head_logits[k].topk(5, dim=-1).indices[mask]  # [M, 5]
            right = guesses == tgt[mask][:, None]
            top1[k] += right[:, 0].sum().item()
            top5[k] += right.any(-1).sum().item()
            counts[k] += right.shape[0]
    return (
        sum(losses) / len(losses),
        [a / max(c, 1) for a, c in zip(top1, counts)],
        [a / max(c, 1) for a, c in zip(top5, counts)],
    )


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


def periodic_validation(r, val_tokens: np.ndarray, *, batch_size: int, block_size: int, batches: int = 8):
    """A function step -> prints the backbone's loss on a fixed set of validation batches.

    The batches are drawn once, from a generator of their own: evaluating never moves the training
    batches' generator, so a run with and without --eval-every trains the same weights. Evaluated in
    float32 whatever --dtype, so the figures compare across formats and with the summary's.
    """
    g = torch.Generator().manual_seed(r.args.seed * 7919 + 101)
    T = min(block_size, len(val_tokens) - 1)
    fixed = [get_batch(val_tokens, batch_size=batch_size, block_size=T, generator=g, device=r.device)
             for _ in range(batches)]

    @torch.no_grad()
    def evaluate(step: int) -> None:
        total = sum(lm_loss(r.model(x)[0], y) for x, y in fixed) / len(fixed)  # one read for all batches
        r.log(f"{'eval':9s} step {step:5d}/{r.args.backbone_steps}  validation loss {total.item():.3f}")

    return evaluate


def summarize(run, model, heads, enc, val_docs, val_tokens: np.ndarray) -> dict:
    """Measure, print and save (heads_accuracy.json) the trained model's figures; return them."""
    args = run.args
    model.eval()
    heads.eval()
    val_loss, top1, top5 = text_accuracy(model, heads, val_tokens, seed=args.seed)
    # Accuracy against what the model itself says: held-out prompts continued greedily.
    g = torch.Generator().manual_seed(args.seed + 5)
    P = min(32, model.config.block_size // 4)
    n = min(96, model.config.block_size - P)
    x, _ = get_batch(val_tokens, batch_size=min(64, 8 * args.eval_prompts), block_size=P, generator=g, device=model.device)
    seqs = sample_continuations(model, x, max_new_tokens=n, temperature=0.0)
    acc = measure_head_accuracy(model, heads, seqs, prompt_lens=P, top_k=10)  # [K, 10]
    save_accuracy(args.out, acc, meta={"measured_on": f"{seqs.shape[0]} held-out prompts x {n} greedy tokens"})
    K = acc.shape[0]
    own1 = acc[:, 0].tolist()
    own5 = acc[:, :5].sum(1).tolist()
    col = "".join(f"{k + 1:>7d}" for k in range(K))
    fmt = lambda xs: "".join(f"{v:7.2f}" for v in xs)  # noqa: E731
    official = "".join(f"{v:7.2f}" for v in OFFICIAL_TOP1[:K])
    lines = [
        f"summary    validation loss {val_loss:.3f} nats/token (perplexity {math.exp(val_loss):.1f})",
        f"           head                                {col}",
        f"           top-1 on held-out text              {fmt(top1)}",
        f"           top-5 on held-out text              {fmt(top5)}",
        f"           top-1 vs own greedy continuation    {fmt(own1)}",
        f"           top-5 vs own greedy continuation    {fmt(own5)}",
        f"           official Medusa-1, Vicuna-7B top-1  {official}",
    ]
    budgets = (4, 8, 16, 32, 64)
    lines.append(
        f"           {'expected tokens/step, greedy (bonus counted):':<48}"
        + ", ".join(f"{b} nodes {build_tree(acc, b)[1]:.2f}" for b in budgets)
        + f"; cpu preset {expected_tokens_per_step(acc, preset('cpu').truncated(K)):.2f}"
    )
    run.log("\n".join(lines))
    return {"val_loss": round(val_loss, 4), "head_top1_text": [round(v, 4) for v in top1],
            "head_top5_text": [round(v, 4) for v in top5], "head_top1_own": [round(v, 4) for v in own1]}


def held_out_prompts(out: str, val_docs, enc, *, count: int, seed: int, block_size: int,
                     chars: int = 240) -> list[str]:
    """Pick `count` snippets of held-out text, each starting and ending at a line boundary.

    They are decode.py's default prompts, so every figure it prints comes from text the model never
    trained on. A snippet stays under a third of the context so the continuation has room.
    """
    rng = random.Random(seed)
    prompts: list[str] = []
    texts = [t for _, t in val_docs if t.strip()]
    attempts = 0
    while len(prompts) < count and texts and attempts < count * 50:
        attempts += 1
        text = texts[rng.randrange(len(texts))]
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        snippet = ""
        for line in lines[start:]:
            if snippet and len(snippet) + len(line) > chars:
                break
            snippet += line
        snippet = snippet[:chars]
        n = len(enc.encode_ordinary(snippet))
        if snippet.strip() and 0 < n < block_size // 3:
            prompts.append(snippet)
    atomic_write_text(os.path.join(out, PROMPTS_FILE), json.dumps({"prompts": prompts}, indent=1, ensure_ascii=False))
    return prompts
