"""The backbone: a GPT with the GPT-2 architecture and GPT-2 parameter names, plus a static KV cache.

One forward serves every use: training (no cache, causal), plain decoding (cache, causal over the
prefix) and Medusa's tree verification (cache, explicit tree mask, position ids = prefix + depth).
Module names follow GPT-2 checkpoints (`transformer.wte`, `transformer.h.{i}.attn.c_attn`, ...), so the
tiny model and GPT-2 are one class and loading weights is one loop.

Shapes: B batch, T new tokens, L cached tokens, C n_embd, nh heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """GPT-2 hyper-parameters (field names follow nanoGPT; `block_size` is GPT-2's `n_positions`)."""

    vocab_size: int = 2048
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class KVCache:
    """Static, preallocated keys and values: [n_layer, 2, B, nh, max_len, hs] plus a length.

    A forward writes its T new keys/values at slots [length, length + T) and advances `length`.
    Slots are storage, not positions: a tree's nodes sit in consecutive slots but carry position ids
    prefix + depth. `compact_kv_cache` keeps the accepted path; stale slots are overwritten later.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        batch_size: int = 1,
        max_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.max_len = max_len if max_len is not None else config.block_size
        hs = config.n_embd // config.n_head
        self.kv = torch.zeros(
            config.n_layer, 2, batch_size, config.n_head, self.max_len, hs, device=device, dtype=dtype
        )
        self.length = 0


def compact_kv_cache(cache: KVCache, keep: torch.Tensor, *, start: int) -> None:
    """Keep only the accepted path (paper §2.1.2): copy slots `keep` [A] to [start, start + A).

    `index_select` makes a copy first, so source and destination ranges may overlap. The new length
    is start + A; everything after it is stale and will be overwritten by the next forward.
    """
    a = keep.numel()
    kept = cache.kv.index_select(4, keep)  # [n_layer, 2, B, nh, A, hs]
    cache.kv[:, :, :, :, start : start + a] = kept
    cache.length = start + a


class CausalSelfAttention(nn.Module):
    """Multi-head attention over the cached prefix and the new tokens, under an explicit mask.

    With a tree mask this is the paper's tree attention (§2.1.2): every node attends to the prefix, to
    itself and to its ancestors, so N candidate continuations share one forward pass.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(
        self,
        x: torch.Tensor,
        *,
        layer_kv: torch.Tensor | None,
        start: int,
        attn_mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        if layer_kv is not None:
            # layer_kv [2, B, nh, max_len, hs]: slots are written in place (no torch.cat per step), so
            # the cache never moves and the new tokens see every earlier slot.
            layer_kv[0, :, :, start : start + T] = k
            layer_kv[1, :, :, start : start + T] = v
            k = layer_kv[0, :, :, : start + T]  # [B, nh, L + T, hs]
            v = layer_kv[1, :, :, : start + T]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)  # [B, nh, T, hs]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.c_proj(y)


class MLP(nn.Module):
    """GPT-2's feed-forward block: C -> 4C -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation ("gelu_new"); exact GELU does not reproduce its logits.
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), **attn_kwargs)
        return x + self.mlp(self.ln_2(x))


def causal_mask(T: int, *, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, start + T] bool: new token i sees every cached slot and new tokens 0..i."""
    rows = torch.arange(T, device=device).unsqueeze(1) + start  # [T, 1]
    cols = torch.arange(start + T, device=device).unsqueeze(0)  # [1, L + T]
    return cols <= rows


class GPT(nn.Module):
    """GPT-2: learned positions, pre-LayerNorm blocks, tanh-GELU, tied wte / lm_head, biases on."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        *,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T new tokens; return (logits [B, T', V], hidden after ln_f [B, T, C]).

        idx: [B, T] token ids. pos: [T] or [B, T] position ids (default: cache length + 0..T-1).
        cache: written at slots [cache.length, cache.length + T), then advanced by T.
        attn_mask: [T, L + T] or [B, 1, T, L + T] bool, True = may attend; default causal.
        logits_at: which of the T positions get logits (default all): the lm_head is the largest
        matmul of a small model, so callers that need one position ask for one.
        """
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > max_len {cache.max_len}")
        if pos is None:
            pos = torch.arange(start, start + T, device=idx.device)  # [T]
        # The mask that applies when none is given: plain causal from slot 0 (SDPA's own, fastest); one
        # new token after a cache sees every slot, so it needs none; several need a causal block.
        causal = attn_mask is None and start == 0
        if attn_mask is None and start > 0 and T > 1:
            attn_mask = causal_mask(T, start=start, device=idx.device)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # SDPA would turn a boolean mask into an additive one in every layer; do it once here.
            additive = torch.zeros(attn_mask.shape, dtype=self.transformer.wte.weight.dtype, device=idx.device)
            attn_mask = additive.masked_fill_(~attn_mask, float("-inf"))  # 0 = may attend, -inf = may not
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, C]
        for i, block in enumerate(self.transformer.h):
            layer_kv = cache.kv[i] if cache is not None else None
            x = block(x, layer_kv=layer_kv, start=start, attn_mask=attn_mask, causal=causal)
        hidden = self.transformer.ln_f(x)  # [B, T, C]
        if cache is not None:
            cache.length = start + T
        h = hidden if logits_at is None else hidden[:, logits_at]
        return self.lm_head(h), hidden

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    def num_params(self) -> int:
        """Parameters counted once (wte and lm_head are one tensor)."""
        return sum(p.numel() for p in self.parameters())
