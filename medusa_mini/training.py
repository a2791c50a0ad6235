"""Training losses and data for the backbone and the Medusa heads (paper §2.2).

- Backbone: next-token cross-entropy.
- Medusa-1 (§2.2.1): backbone frozen; heads trained with Σ_k w_k · CE(head_k at t, token t+k+1).
- Medusa-2 (§2.2.2): joint; L = L_LM + λ · Σ_k 0.8^k · L_k, heads at a higher learning rate, λ ramped
  up so the young heads do not disturb the backbone early on.
- Self-distillation (§2.3.2): the heads learn from text the backbone itself writes, so they predict
  what the model will actually say at decoding time, and no dataset is needed.

Shapes: B batch, T tokens, K heads, V vocabulary, C n_embd.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .heads import MedusaHeads
from .hydra import HydraHeads, teacher_forced_logits
from .model import GPT, KVCache
from .sampling import sampling_probs


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits [B, T, V], targets y [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def head_targets(y: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of head k (1-based) at every position: y shifted left by k, with a validity mask.

    y[:, t] is token t+1, so head k at t must predict y[:, t + k] (token t+k+1). The last k
    positions have no target. valid [B, T] (optional) marks targets that may be trained on.
    Returns targets [B, T] (0 where invalid) and mask [B, T] bool.
    """
    B, T = y.shape
    tgt = torch.zeros_like(y)
    mask = torch.zeros(B, T, dtype=torch.bool, device=y.device)
    if k < T:
        tgt[:, : T - k] = y[:, k:]
        mask[:, : T - k] = True if valid is None else valid[:, k:]
    return tgt, mask


def medusa_head_losses(
    head_logits: torch.Tensor, y: torch.Tensor, *, valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Per-head cross-entropy and top-1 accuracy. head_logits [K, B, T', V], y [B, T] -> K losses, K accs.

    positions [T'] (optional): the columns of y the head logits were computed at (default: all T).
    """
    losses, accs = [], []
    for i in range(head_logits.shape[0]):
        tgt, mask = head_targets(y, i + 1, valid)
        if positions is not None:
            tgt, mask = tgt[:, positions], mask[:, positions]  # [B, T']
        logits = head_logits[i][mask]  # [M, V]
        target = tgt[mask]  # [M]
        if target.numel() == 0:
            losses.append(head_logits.sum() * 0.0)
            accs.append(0.0)
            continue
        losses.append(F.cross_entropy(logits.float(), target))
        accs.append((logits.argmax(-1) == target).float().mean().item())
    return losses, accs


def head_weights(num_heads: int, *, decay: float) -> list[float]:
    """decay^k for k = 1..K (the paper's 0.8^k); decay 1.0 gives the official unweighted sum."""
    return [decay**k for k in range(1, num_heads + 1)]


def lambda_schedule(step: int, total: int, *, lambda0: float, ramp: float = 0.3) -> float:
    """Medusa-2's heads weight: ramped linearly from 0 to λ0 over the first `ramp` of training."""
    ramp_steps = max(1, int(total * ramp))
    return lambda0 * min(1.0, (step + 1) / ramp_steps)


def cosine_lr(step: int, total: int, *, lr: float, warmup: float = 0.05, min_ratio: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to min_ratio · lr."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MedusaLM(nn.Module):
    """Backbone + heads as one module, so one optimizer (and one DDP wrapper) sees both."""

    def __init__(self, model: GPT, heads: MedusaHeads | HydraHeads | None) -> None:
        super().__init__()
        self.model = model
        self.heads = heads

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        lm_weight: float,
        heads_weight: float,
        decay: float,
        valid: torch.Tensor | None = None,
        detach_backbone: bool = False,
        heads_stride: int = 1,
        heads_offset: int = 0,
    ) -> tuple[torch.Tensor, dict]:
        """Total loss and a metrics dict. x, y: [B, T]; valid [B, T] marks trainable targets.

        heads_stride s > 1 trains the heads at every s-th position only (from heads_offset):
        K full-vocabulary projections per position would otherwise cost more than the backbone; the caller
        moves heads_offset each step so every position is trained in turn.
        """
        if lm_weight == 0.0 and detach_backbone:
            with torch.no_grad():  # frozen backbone: hidden states only, no lm_head over all positions
                _, hidden = self.model(x, logits_at=slice(0, 0))
            logits = None
        else:
            logits, hidden = self.model(x)
        loss = torch.zeros((), device=x.device)
        metrics: dict = {}
        if logits is not None:
            ce = lm_loss(logits, y)
            metrics["lm"] = ce.item()
            loss = loss + lm_weight * ce
        if self.heads is not None and heads_weight > 0:
            h = hidden.detach() if detach_backbone else hidden
            positions = None
            if heads_stride > 1:
                positions = torch.arange(heads_offset % heads_stride, x.shape[1], heads_stride, device=x.device)  # [T']
                h = h[:, positions]  # [B, T', C]
            head_logits = teacher_forced_logits(self.heads, h, y, self.model, positions=positions)  # [K, B, T', V]
            losses, accs = medusa_head_losses(head_logits, y, valid=valid, positions=positions)
            weights = head_weights(len(losses), decay=decay)
            loss = loss + heads_weight * sum(w * l for w, l in zip(weights, losses))
            metrics["heads"] = [l.item() for l in losses]
            metrics["acc"] = accs
        return loss, metrics


@torch.no_grad()
def sample_continuations(
    model: GPT,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Self-distillation data: continue B equal-length prompts [B, P] with the backbone -> [B, P + n].

    Batched decoding with the KV cache; temperature 0 is greedy. Equal lengths need no padding.
    """
    B, P = prompts.shape
    n = min(max_new_tokens, model.config.block_size - P)
    cache = KVCache(model.config, batch_size=B, max_len=P + n, device=prompts.device, dtype=model.lm_head.weight.dtype)
    out = torch.empty(B, P + n, dtype=torch.long, device=prompts.device)
    out[:, :P] = prompts
    logits, _ = model(prompts, cache=cache, logits_at=slice(-1, None))  # [B, 1, V]
    for t in range(n):
        last = logits[:, -1]  # [B, V]
        if temperature == 0:
            tok = last.argmax(-1)  # [B]
        else:
            probs = sampling_probs(last, temperature=temperature)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
        out[:, P + t] = tok
        if t + 1 < n:
            logits, _ = model(tok[:, None], cache=cache)
    return out
