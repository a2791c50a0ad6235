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
    """Static, preallocated keys and values, k[i] and v[i] [B, nh, max_len, hs] per layer, plus a length.

    Each layer's keys and values are tensors of their own, not slices of one: a compiled step then
    writes into them where they lie, whereas a write into a slice of one big tensor makes the
    compiler copy the whole cache, every step. A forward writes its T new keys/values at slots
    [length, length + T) and advances `length`.
    Slots are storage, not positions: a tree's nodes sit in consecutive slots but carry position ids
    prefix + depth. `compact_kv_cache` keeps the accepted path; stale slots are overwritten later.

    `length` is a 0-dim long tensor on the cache's device, changed only in place: a decoding step
    reads and advances it without asking the host, so the step has static shapes and fixed buffers
    (what torch.compile and CUDA graphs need). `cache.length = n` fills it in place; `int(cache.length)`
    reads it (on a GPU that waits for the device: decoding loops keep their own count instead).
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
        shape = (batch_size, config.n_head, self.max_len, hs)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self._length = torch.zeros((), dtype=torch.long, device=device)

    @property
    def length(self) -> torch.Tensor:
        """[] long: slots in use, as a snapshot (`L = cache.length` does not move when the cache does)."""
        return self._length.clone()

    @length.setter
    def length(self, value: int | torch.Tensor) -> None:
        self._length.copy_(torch.as_tensor(value))  # in place: the buffer's address never changes

    def advance(self, n: int) -> None:
        """n more slots are in use."""
        self._length.add_(n)


def compact_kv_cache(
    cache: KVCache, keep: torch.Tensor, *, start: int | torch.Tensor, count: int | torch.Tensor | None = None
) -> None:
    """Keep only the accepted path (paper §2.1.2): copy slots `keep` [A] to [start, start + A).

    The new length is start + count (default A). A static-shape step always copies a path of A = D + 1
    slots and passes the accepted count as a tensor: the copies past it are padding, stale like every
    slot after the length. `index_select` makes a copy first, so the ranges may overlap.
    """
    a = keep.numel()
    dest = start + torch.arange(a, device=keep.device)  # [A]
    for t in cache.k + cache.v:  # [B, nh, max_len, hs] each
        t.index_copy_(2, dest, t.index_select(2, keep))  # [B, nh, A, hs] moved
    cache.length = start + (a if count is None else count)


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
        layer_kv: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        if layer_kv is not None:
            # layer_kv: keys and values [B, nh, max_len, hs] each, written in place at the slot tensor
            # (no torch.cat, no Python-int slice); attention reads all max_len slots: shapes never change.
            # Reading the unused slots too costs little on a CPU: for the tiny model (max_len 268)
            # +7% on a plain step and +10% on a 12-node verify after a 16-token prefix, +2% / +5%
            # after 128 tokens, nothing after 240 (CPU time, 1 thread). Not worth a second path.
            k_cache, v_cache = layer_kv
            k_cache.index_copy_(2, slots, k)
            v_cache.index_copy_(2, slots, v)
            k, v = k_cache, v_cache  # [B, nh, max_len, hs]
        causal = attn_mask is None  # no cache and no mask: training's causal attention, SDPA's own
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


def cache_attention_mask(length: torch.Tensor, new_mask: torch.Tensor, *, max_len: int) -> torch.Tensor:
    """[T, max_len] bool, True = may attend, for T new tokens written at slots [length, length + T).

    Slots before `length` hold the committed prefix: every new token sees them. Slot length + j holds
    new token j: new token i sees it iff new_mask[i, j] ([T, T]: causal for plain decoding, the tree's
    ancestor mask for verification, paper Fig. 2). Later slots are stale or empty: nobody sees them.
    Built from the `length` tensor, so the host never needs to know it.
    """
    T = new_mask.shape[0]
    rel = torch.arange(max_len, device=new_mask.device) - length  # [max_len] slot - length
    is_new = (rel >= 0) & (rel < T)  # [max_len]
    among_new = new_mask[:, rel.clamp(0, T - 1)] & is_new  # [T, max_len]
    return among_new | (rel < 0)


def causal_mask(T: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, T] bool: new token i sees new tokens 0..i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


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
        cache: written at slots [cache.length, cache.length + T), then its length advances by T.
        attn_mask: [T, T] bool among the new tokens, True = may attend (default causal); with a cache,
        every new token also sees the whole cached prefix (`cache_attention_mask`).
        logits_at: which of the T positions get logits (default all): the lm_head is the largest
        matmul of a small model, so callers that need one position ask for one.

        With a cache every shape depends only on T and the cache's max_len, never on its length, so
        a decoding step (T = 1) and a tree verification (T = N) can each be captured once as a graph.
        """
        B, T = idx.shape
        slots = None
        if cache is not None:
            if T > cache.max_len:  # a fuller cache is caught by index_copy_ (its length is on the device)
                raise ValueError(f"KV cache full: {T} tokens > max_len {cache.max_len}")
            start = cache.length  # [] long, on the device
            slots = start + torch.arange(T, device=idx.device)  # [T]
            new_mask = attn_mask if attn_mask is not None else causal_mask(T, device=idx.device)
            attn_mask = cache_attention_mask(start, new_mask, max_len=cache.max_len)  # [T, max_len]
        if pos is None:
            pos = slots if slots is not None else torch.arange(T, device=idx.device)  # [T]
        if attn_mask is not None:
            # SDPA would turn a boolean mask into an additive one in every layer; do it once here.
            additive = torch.zeros(attn_mask.shape, dtype=self.transformer.wte.weight.dtype, device=idx.device)
            attn_mask = additive.masked_fill_(~attn_mask, float("-inf"))  # 0 = may attend, -inf = may not
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, C]
        for i, block in enumerate(self.transformer.h):
            layer_kv = (cache.k[i], cache.v[i]) if cache is not None else None
            x = block(x, layer_kv=layer_kv, slots=slots, attn_mask=attn_mask)
        hidden = self.transformer.ln_f(x)  # [B, T, C]
        if cache is not None:
            cache.advance(T)
        h = hidden if logits_at is None else hidden[:, logits_at]
        return self.lm_head(h), hidden

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    def num_params(self) -> int:
        """Parameters counted once (wte and lm_head are one tensor)."""
        return sum(p.numel() for p in self.parameters())
