"""Training losses and data for the backbone and the draft heads (paper §2.2). Medusa-1 (§2.2.1): backbone
frozen, heads trained with Σ_k w_k · CE(head_k at t, token t+k+1), w_k = 1 in train_tiny (the paper: 0.8^k).
Medusa-2 (§2.2.2): joint, L = L_LM + λ · Σ_k 0.8^k · L_k, heads at a higher learning rate, λ ramped up; the heads
share the lm_head, tied to the embedding, so their losses train those too (the paper: a copy per head).
Self-distillation (§2.3.2): heads learn from text the backbone writes, what it will say when decoding.

Shapes: B batch, T tokens, K heads, V vocabulary, M draft vocabulary, C n_embd.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .decoding import generate_batch
from .heads import IGNORE, DraftHeads, next_tokens
from .model import GPT
from .sampling import Sampling

LOGITS_PER_CHUNK = 2**26  # 256 MB of float32 logits: the cpu preset's heads stage in one chunk, GPT-2's in 16


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits [B, T, V], targets y [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # [B T, V], [B T]


def head_targets(y: torch.Tensor, num_heads: int, *, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Every head's targets [K, B, T] from y [B, T], IGNORE where none: head k (1-based) at t predicts token
    t+k+1 = y[:, t + k] (paper §2.1.1); the last k positions have none, nor those `valid` [B, T] marks False.
    Fixed shapes, so nothing waits for the device."""
    y = y if valid is None else y.masked_fill(~valid, IGNORE)
    return next_tokens(y, num_heads + 1, fill=IGNORE)[..., 1:].movedim(-1, 0)  # [B, T, 1 + K], k = 0 is y -> [K, B, T]


def _chunk_head_sums(heads: DraftHeads, model: GPT, h: torch.Tensor, targets: torch.Tensor,
                     following: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [n, C], targets [K, n], following [n, K] -> summed cross-entropy [K] and top-1 hits [K]."""
    logits = heads(h, model, following=following).float()  # [K, n, M]; ce: [K, n]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # IGNORE: 0
    hits = (logits.detach().argmax(-1) == targets).sum(-1)  # [K]; IGNORE never equals an index
    return ce.sum(-1), hits.to(logits.dtype)


def chunked_head_loss(heads: DraftHeads, model: GPT, hidden: torch.Tensor, targets: torch.Tensor, *,
                      following: torch.Tensor, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' cross-entropy without all K x B x T x M logits at once: hidden [B, T, C], targets [K, B, T]
    (draft-vocabulary indices, IGNORE where none), following [B, T, K] (the true next tokens, which dependent
    heads read) -> mean cross-entropy [K] and detached top-1 accuracy [K] where a target exists (0 for none).
    `chunk_size` positions at a time (default: LOGITS_PER_CHUNK logits), several chunks each under checkpointing,
    so both passes hold one chunk's logits at the price of computing them twice. No data-dependent shapes."""
    h, tgt, fol = hidden.flatten(0, 1), targets.flatten(1), following.flatten(0, 1)  # [n, C], [K, n], [n, K]: n = B·T
    K, n = tgt.shape
    size = chunk_size or max(1, LOGITS_PER_CHUNK // (K * (heads.config.draft_vocab_size or heads.config.vocab_size)))
    ce_sum = hits = h.new_zeros(())  # a scalar 0: each chunk's [K] sums broadcast onto it, in their dtype
    for i in range(0, n, size):
        chunk = (heads, model, h[i : i + size], tgt[:, i : i + size], fol[i : i + size])
        # One chunk: nothing to free early, so no recomputation. The chunk draws no random numbers: no state to replay.
        c, t = _chunk_head_sums(*chunk) if size >= n else checkpoint(_chunk_head_sums, *chunk, use_reentrant=False,
                                                                      preserve_rng_state=False)
        ce_sum, hits = ce_sum + c, hits + t
    counts = (tgt != IGNORE).sum(-1).clamp(min=1).to(ce_sum.dtype)  # [K]
    return ce_sum / counts, hits / counts


def head_weights(num_heads: int, *, decay: float) -> list[float]:
    """decay^k for k = 1..K (the paper's 0.8^k); decay 1.0 gives the official unweighted sum."""
    return [decay**k for k in range(1, num_heads + 1)]


def lambda_schedule(step: int, total: int, *, lambda0: float, ramp: float = 0.3) -> float:
    """Medusa-2's heads weight: ramped linearly up to λ0 over the first `ramp` of training (step 0
    already takes one ramp step's share, λ0 / int(total · ramp): no step trains the heads with weight 0)."""
    return lambda0 * min(1.0, (step + 1) / max(1, int(total * ramp)))


def cosine_lr(step: int, total: int, *, lr: float, warmup: float = 0.05, min_ratio: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to min_ratio · lr."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MedusaLM(nn.Module):
    """Backbone + heads as one module, so one optimizer (and one DDP wrapper) sees both."""

    def __init__(self, model: GPT, heads: DraftHeads | None) -> None:
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, lm_weight: float, heads_weight: float, decay: float,
                valid: torch.Tensor | None = None, detach_backbone: bool = False, heads_stride: int = 1,
                heads_offset: int = 0, heads_chunk: int | None = None) -> tuple[torch.Tensor, dict]:
        """Total loss and detached on-device metrics ("lm" [], "heads" [K], "acc" [K]); x, y, valid: [B, T].
        heads_stride s > 1 trains the heads at every s-th position from heads_offset only (K vocabulary
        projections per position cost more than the backbone); the caller moves the offset each step."""
        loss, metrics = torch.zeros((), device=x.device), {}
        if lm_weight == 0.0 and detach_backbone:
            with torch.no_grad():  # frozen backbone: hidden states only, no lm_head over all positions
                _, hidden = self.model(x, logits_at=slice(0, 0))
        else:
            logits, hidden = self.model(x)
            ce = lm_loss(logits, y)
            metrics["lm"] = ce.detach()
            loss = loss + lm_weight * ce
        if self.heads is not None and heads_weight > 0:
            K, cols = self.heads.num_heads, slice(heads_offset % heads_stride, None, heads_stride)  # T' positions
            h = (hidden.detach() if detach_backbone else hidden)[:, cols]  # [B, T', C]
            targets = self.heads.draft_index(head_targets(y, K, valid=valid)[:, :, cols])  # [K, B, T'] draft indices
            losses, accs = chunked_head_loss(self.heads, self.model, h, targets, following=next_tokens(y, K)[:, cols],
                                             chunk_size=heads_chunk)
            loss = loss + heads_weight * sum(w * l for w, l in zip(head_weights(K, decay=decay), losses.unbind()))
            metrics["heads"], metrics["acc"] = losses.detach(), accs
        return loss, metrics


def self_distill(model: GPT, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Self-distillation data (paper §2.3.2): the backbone continues prompts [B, P] -> [B, P + n], plain
    decoding at `temperature` (0: greedy), within the context."""
    n = min(max_new_tokens, model.config.block_size - prompts.shape[1])
    rows = generate_batch(model, prompts.tolist(), max_new_tokens=n, sampling=Sampling(temperature=temperature),
                          generator=generator)
    new = torch.tensor([out for out, _ in rows], dtype=torch.long, device=prompts.device).view(len(rows), n)  # [B, n]
    return torch.cat([prompts, new], dim=1)
