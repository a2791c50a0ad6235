"""What `train_tiny.py` reports: progress lines, validation loss every --eval-every steps, and the
summary, measured never assumed: validation loss, each head's top-1/top-5 accuracy on held-out text and
against the backbone's own greedy continuation (what decoding meets), the tokens per step trees built
from them should give; saved as heads_accuracy.json (`decode.py --tree N`), with held-out prompts.
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
from ..training import IGNORE, lm_loss, sample_continuations, stacked_head_targets
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
    losses, hits, counts = [], 0, 0
    for _ in range(batches):
        x, y = get_batch(val_tokens, batch_size=batch_size, block_size=T, generator=g, device=model.device)
        logits, hidden = model(x)
        losses.append(lm_loss(logits, y).item())
        head_logits = teacher_forced_logits(heads, hidden, y, model)  # [K, B, T, V]
        targets = stacked_head_targets(y, head_logits.shape[0])  # [K, B, T]
        right = head_logits.topk(5, dim=-1).indices == targets[..., None]  # [K, B, T, 5]; IGNORE never right
        hits = hits + torch.stack([right[..., 0].sum((1, 2)), right.any(-1).sum((1, 2))])  # [2, K]
        counts = counts + (targets != IGNORE).sum((1, 2))  # [K]
    top1, top5 = (hits.double() / counts.clamp(min=1)).tolist()
    return sum(losses) / len(losses), top1, top5


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
    """A function step -> prints the backbone's loss on fixed validation batches, in float32 whatever --dtype.

    The batches come from a generator of their own, so --eval-every never changes the trained weights.
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
    own1, own5 = acc[:, 0].tolist(), acc[:, :5].sum(1).tolist()
    rows = [("head", [k + 1 for k in range(K)]), ("top-1 on held-out text", top1), ("top-5 on held-out text", top5),
            ("top-1 vs own greedy continuation", own1), ("top-5 vs own greedy continuation", own5),
            ("official Medusa-1, Vicuna-7B top-1", OFFICIAL_TOP1[:K])]
    lines = [f"summary    validation loss {val_loss:.3f} nats/token (perplexity {math.exp(val_loss):.1f})"]
    lines += [f"           {name:<36}" + "".join(f"{v:>7d}" if isinstance(v, int) else f"{v:7.2f}" for v in xs)
              for name, xs in rows]
    lines.append(f"           {'expected tokens/step, greedy (bonus counted):':<48}"
                 + ", ".join(f"{b} nodes {build_tree(acc, b)[1]:.2f}" for b in (4, 8, 16, 32, 64))
                 + f"; cpu preset {expected_tokens_per_step(acc, preset('cpu').truncated(K)):.2f}")
    run.log("\n".join(lines))
    return {"val_loss": round(val_loss, 4), "head_top1_text": [round(v, 4) for v in top1],
            "head_top5_text": [round(v, 4) for v in top5], "head_top1_own": [round(v, 4) for v in own1]}


def held_out_prompts(out: str, val_docs, enc, *, count: int, seed: int, block_size: int,
                     chars: int = 240) -> list[str]:
    """`count` snippets of held-out text, from line boundary to line boundary, under a third of the
    context: decode.py's default prompts, so its figures come from text the model never trained on."""
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
