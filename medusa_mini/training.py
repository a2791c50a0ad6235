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
from torch.utils.checkpoint import checkpoint

from .heads import MedusaHeads
from .hydra import HydraHeads, next_tokens
from .model import GPT, KVCache
from .sampling import sampling_probs


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits [B, T, V], targets y [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def head_targets(y: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Head k (1-based) at t predicts token t+k+1 = y[:, t + k] (paper §2.1.1); the last k positions have none.

    valid [B, T] (optional) marks trainable targets. Returns targets [B, T] (0 where invalid), mask [B, T].
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
    """Per-head cross-entropy and top-1 accuracy the plain way (it waits for the device): the reference
    `chunked_head_loss` must reproduce. head_logits [K, B, T', V] at columns `positions` of y [B, T]."""
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


IGNORE = -100  # F.cross_entropy's default ignore_index: a position with no target


def stacked_head_targets(
    y: torch.Tensor, num_heads: int, *, valid: torch.Tensor | None = None, positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """All K heads' targets [K, B, T'], IGNORE where none: fixed shapes, so nothing waits for the device."""
    rows = []
    for k in range(1, num_heads + 1):
        tgt, mask = head_targets(y, k, valid)  # [B, T] each
        rows.append(tgt.masked_fill(~mask, IGNORE))
    targets = torch.stack(rows)  # [K, B, T]
    return targets if positions is None else targets[:, :, positions]  # [K, B, T']


def head_chunk_size(num_heads: int, vocab_size: int, *, budget: int = 2**26) -> int:
    """Positions per chunk so one chunk's logits [K, positions, V] hold at most `budget` (256 MB float32):
    the cpu preset's heads stage fits in one chunk (exact), GPT-2's vocabulary takes 16, not 4 GB at once."""
    return max(1, budget // (num_heads * vocab_size))


def _chunk_head_sums(heads: nn.Module, lm_head: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                     tokens: torch.Tensor | None, wte: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, C], targets [K, M], tokens [M, K] or None -> summed cross-entropy [K] and top-1 hits [K]."""
    logits = heads(h, lm_head) if tokens is None else heads(h, lm_head, tokens=tokens, wte=wte)
    logits = logits.float()  # [K, M, V]
    K, M, V = logits.shape
    ce = F.cross_entropy(logits.reshape(K * M, V), targets.reshape(K * M), ignore_index=IGNORE, reduction="none")
    hits = (logits.detach().argmax(-1) == targets).sum(-1)  # [K]; IGNORE never equals a token
    return ce.view(K, M).sum(-1), hits.to(logits.dtype)


def chunked_head_loss(
    heads: nn.Module, lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
    tokens: torch.Tensor | None = None, wte: nn.Module | None = None, chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa heads' cross-entropy (paper §2.2.1) without all K x B x T x V logits at once.

    hidden [B, T, C], targets [K, B, T] (IGNORE where none) -> mean cross-entropy [K] and detached top-1
    accuracy [K] over the positions with a target (0 for none). `chunk_size` positions at a time
    (default: head_chunk_size); with several chunks each runs under torch.utils.checkpoint, so both
    passes hold one chunk's logits, at the price of computing them twice. No `.item()`, no
    data-dependent shapes. Hydra heads also read tokens [B, T, K] (hydra.next_tokens) through wte.
    """
    K, C = targets.shape[0], hidden.shape[-1]
    h = hidden.reshape(-1, C)  # [B·T, C]
    tgt = targets.reshape(K, -1)  # [K, B·T]
    tok = None if tokens is None else tokens.reshape(-1, K)  # [B·T, K]
    n = h.shape[0]
    size = chunk_size or head_chunk_size(K, heads.config.vocab_size)
    if size >= n:  # one chunk: nothing to free early, so no recomputation either
        ce_sum, hits = _chunk_head_sums(heads, lm_head, h, tgt, tok, wte)
    else:
        ce_sum = hits = 0
        for i in range(0, n, size):
            # preserve_rng_state=False: the chunk draws no random numbers, so there is no state to replay
            c, t = checkpoint(_chunk_head_sums, heads, lm_head, h[i : i + size], tgt[:, i : i + size],
                              None if tok is None else tok[i : i + size], wte, use_reentrant=False, preserve_rng_state=False)
            ce_sum, hits = ce_sum + c, hits + t
    counts = (tgt != IGNORE).sum(-1).clamp(min=1).to(ce_sum.dtype)  # [K]
    return ce_sum / counts, hits / counts


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
        self, x: torch.Tensor, y: torch.Tensor, *, lm_weight: float, heads_weight: float, decay: float,
        valid: torch.Tensor | None = None, detach_backbone: bool = False, heads_stride: int = 1,
        heads_offset: int = 0, heads_chunk: int | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Total loss and detached on-device metrics ("lm" [], "heads" [K], "acc" [K]); x, y, valid: [B, T].

        heads_stride s > 1 trains the heads at every s-th position from heads_offset only (K vocabulary
        projections per position cost more than the backbone); the caller moves the offset each step.
        """
        loss = torch.zeros((), device=x.device)
        metrics: dict = {}
        if lm_weight == 0.0 and detach_backbone:
            with torch.no_grad():  # frozen backbone: hidden states only, no lm_head over all positions
                _, hidden = self.model(x, logits_at=slice(0, 0))
        else:
            logits, hidden = self.model(x)
            ce = lm_loss(logits, y)
            metrics["lm"] = ce.detach()
            loss = loss + lm_weight * ce
        if self.heads is not None and heads_weight > 0:
            h = hidden.detach() if detach_backbone else hidden
            positions = None
            if heads_stride > 1:
                positions = torch.arange(heads_offset % heads_stride, x.shape[1], heads_stride, device=x.device)  # [T']
                h = h[:, positions]  # [B, T', C]
            targets = stacked_head_targets(y, self.heads.num_heads, valid=valid, positions=positions)  # [K, B, T']
            tokens = None
            if self.heads.config.kind == "hydra":  # dependent heads read x_{t+1..t+K}
                tokens = next_tokens(y, self.heads.num_heads)  # [B, T, K]
                tokens = tokens if positions is None else tokens[:, positions]  # [B, T', K]
            losses, accs = chunked_head_loss(self.heads, self.model.lm_head, h, targets, tokens=tokens,
                                             wte=self.model.transformer.wte, chunk_size=heads_chunk)
            weights = head_weights(self.heads.num_heads, decay=decay)
            loss = loss + heads_weight * sum(w * l for w, l in zip(weights, losses.unbind()))
            metrics["heads"] = losses.detach()
            metrics["acc"] = accs
        return loss, metrics


@torch.no_grad()
def sample_continuations(
    model: GPT, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Self-distillation data (paper §2.3.2): the backbone continues prompts [B, P] -> [B, P + n], batched
    with the KV cache; temperature 0 is greedy."""
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
