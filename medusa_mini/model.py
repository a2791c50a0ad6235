"""The backbone: a GPT with the GPT-2 architecture and GPT-2 parameter names, plus a static KV cache.

One forward serves every use: training (no cache, causal), plain decoding (cache, causal over the
prefix) and Medusa's tree verification (cache, explicit tree mask, position ids = prefix + depth).
Module names follow GPT-2 checkpoints (`transformer.wte`, `transformer.h.{i}.attn.c_attn`, ...), so the
tiny model and GPT-2 are one class and loading weights is one loop.

Shapes: B batch, T new tokens, S cache slots attended (`attended`, default all max_len), C n_embd, nh
attention heads, hs head size, V vocabulary.
"""

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
        sizes = {k: getattr(self, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
        if bad := [k for k, n in sizes.items() if not (isinstance(n, int) and n > 0)]:  # a hand-edited config's too
            raise ValueError(f"{bad[0]} must be an integer > 0, not {sizes[bad[0]]!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


def cache_attention_mask(lengths: torch.Tensor, table: torch.Tensor, *, max_len: int) -> torch.Tensor:
    """[B, T, max_len] additive mask (0: may attend, -inf: not), T new tokens at slots [lengths[b], lengths[b] + T).
    table [(B,) T, T + 2] (`mask_table`): new token i's bias at its row's prefix (column 0), at new token j (1 + j:
    causal when decoding, the tree's ancestor mask when verifying, Fig. 2), and past them (T + 1: stale slots)."""
    B, T = lengths.shape[0], table.shape[-2]
    column = (torch.arange(1, max_len + 1, device=table.device) - lengths[:, None, None]).clamp(0, T + 1)  # [B, 1, S]
    return table.expand(B, T, T + 2).gather(2, column.expand(B, T, max_len))  # [B, T, max_len]


def mask_table(new_mask: torch.Tensor) -> torch.Tensor:
    """new_mask [..., T, T] bool -> its table [..., T, T + 2] float32, 0 / -inf: additive once, not in each SDPA."""
    seen = torch.cat([torch.ones_like(new_mask[..., :1]), new_mask, torch.zeros_like(new_mask[..., :1])], dim=-1)
    return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))


def causal_table(T: int, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The causal mask's table [T, T + 2]: new token i sees the prefix and new tokens 0..i (columns <= i + 1)."""
    return torch.full((T, T + 2), float("-inf"), dtype=dtype, device=device).triu(2)


class KVCache:
    """Static, preallocated keys and values of every layer, kv [n_layer, 2, B, nh, max_len, hs], and a length
    per row (one tensor, so keeping the accepted path is one copy for all layers: `compact_kv_cache`).

    A forward writes row b's T new keys/values at slots [lengths[b], lengths[b] + T) and advances its length,
    unless advance=False (a tree verify: `step.keep_path` advances it). Slots are storage, not positions: a tree's
    nodes sit in consecutive slots but carry position ids prefix + depth. The lengths live on the device in
    `length_buffer`, changed in place (`lengths` reads a snapshot), so a step reads and advances them without the host.
    """

    def __init__(self, config: GPTConfig, *, batch_size: int = 1, max_len: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.max_len, self.batch_size = max_len if max_len is not None else config.block_size, batch_size
        self.kv = torch.zeros(KVCache.kv_shape(config, batch_size, self.max_len), device=device, dtype=dtype)
        self.length_buffer = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.rows = torch.arange(batch_size, device=device)[:, None]  # [B, 1]: each row's index, for every write
        self.layers = torch.arange(config.n_layer, device=device)  # [n_layer]: each layer's, for its writes

    @staticmethod
    def kv_shape(config: GPTConfig, batch_size: int, max_len: int) -> tuple[int, ...]:
        """kv's shape, [n_layer, 2, B, nh, max_len, hs]."""
        return config.n_layer, 2, batch_size, config.n_head, max_len, config.n_embd // config.n_head

    @property
    def lengths(self) -> torch.Tensor:
        """[B] long: slots in use per row, as a snapshot (it does not move with the cache)."""
        return self.length_buffer.clone()

    @lengths.setter
    def lengths(self, value: int | torch.Tensor) -> None:
        self.length_buffer.copy_(torch.as_tensor(value))  # in place: the buffer's address never changes

    def place(self, T: int, table: torch.Tensor | None, *, attended: int | None, slots: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Where T new tokens go, slots [B, T]: each row's next T, lengths[b] + 0..T-1 (given, if the caller has
        them), and what each may see among the first S slots (S = attended, default all max_len): additive, [B, 1, T,
        S], in the cache's dtype (`cache_attention_mask`; table None: causal). Read before the forward advances."""
        if T > self.max_len:  # a fuller cache is caught by the write (its lengths are on the device)
            raise ValueError(f"KV cache full: {T} tokens > max_len {self.max_len}")
        device, S = self.length_buffer.device, self.max_len if attended is None else min(attended, self.max_len)
        table = causal_table(T, dtype=self.kv.dtype, device=device) if table is None else table.to(self.kv.dtype)
        slots = self.length_buffer[:, None] + torch.arange(T, device=device) if slots is None else slots  # [B, T]
        return slots, cache_attention_mask(self.length_buffer, table, max_len=S)[:, None], S  # [B, 1, T, S]

    def write(self, layer: int, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer `layer`'s new keys and values kv [B, T, 2, nh, hs] into each row's slots [B, T]: one index_put_
        into the whole tensor, the layer picked by a 1-element index (through a view of the layer a compiler
        would copy the layer whole). Index tensors split by a slice lead the result: its shape is [B, T, 2, nh, hs]."""
        self.kv[self.layers[layer : layer + 1], :, self.rows, :, slots] = kv


def at_each_row(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, F] (F any width) at one position per row, index [B] -> [B, F] (a row's last token or accepted node)."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def compact_kv_cache(cache: KVCache, keep: torch.Tensor, *, to: torch.Tensor, length: torch.Tensor) -> None:
    """Keep only the accepted path (paper §2.1.2): in row b, copy slots keep[b] [A] to slots to[b] [A] in every
    layer at once, and set its length to length[b]. Slots past a row's length are stale, whatever they hold.
    The read makes a copy before the write, so the two may overlap."""
    cache.kv[:, :, cache.rows, :, to] = cache.kv[:, :, cache.rows, :, keep]  # [B, A, n_layer, 2, nh, hs]
    cache.length_buffer.copy_(length)


class CausalSelfAttention(nn.Module):
    """Multi-head attention over the cached prefix and the new tokens, under an explicit mask. With a tree mask this
    is the paper's tree attention (§2.1.2): every node attends to the prefix, to itself and to its ancestors, so N
    candidate continuations share one forward pass."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, *, cache: KVCache | None, layer: int, slots: torch.Tensor | None,
                attn_mask: torch.Tensor | None, attended: int | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # [B, T, 3, nh, hs]
        query = qkv[:, :, 0].transpose(1, 2)  # [B, nh, T, hs]
        if cache is not None:  # written in place at each row's slots [B, T], then its first `attended` read
            cache.write(layer, qkv[:, :, 1:], slots)
            key, value = cache.kv[layer, :, :, :, :attended].unbind(0)  # [B, nh, S, hs] each
        else:
            key, value = qkv[:, :, 1:].permute(2, 0, 3, 1, 4).unbind(0)  # [B, nh, T, hs] each
        causal = attn_mask is None  # no cache and no mask: training's causal attention, SDPA's own
        y = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=causal)  # [B, nh, T, hs]
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # [B, T, C]


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


class GPT(nn.Module):
    """GPT-2: learned positions, pre-LayerNorm blocks, tanh-GELU, tied wte / lm_head, biases on."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's init: weights N(0, 0.02), biases 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, *, pos: torch.Tensor | None = None, cache: KVCache | None = None,
                mask_table: torch.Tensor | None = None, logits_at: torch.Tensor | slice | None = None,
                attended: int | None = None, advance: bool = True, slots: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """T new tokens per row, idx [B, T] -> (logits [B, T', V], hidden after ln_f [B, T, C]); T' is T, or 1 for
        a [B] logits_at, or the slice's length.

        pos: [T] or [B, T] position ids (default: each row's cache length + 0..T-1). cache: written at each row's
        next T slots (under torch.no_grad()), its lengths then advanced, unless advance=False (a tree's nodes are
        tentative until the step keeps its accepted path). mask_table: with a cache, what the new tokens see
        (`mask_table`: their row's prefix and, among themselves, causal by default). logits_at: the positions that
        get logits (a slice, or a [B] tensor, one per row; default all): the lm_head is a small model's largest
        matmul. attended: read only the cache's first `attended` slots (default all max_len). slots: [B, T] each
        row's next T cache slots, if the caller has them.
        """
        B, T = idx.shape
        if pos is None and cache is None and T > self.config.block_size:  # else wpe's IndexError
            raise ValueError(f"{T} tokens do not fit the context of {self.config.block_size}: pass at most that many")
        attn_mask = None  # without a cache: training's causal attention, SDPA's own
        if cache is not None:
            if torch.is_grad_enabled():  # a cache holds values for decoding, never an autograd graph
                raise RuntimeError("a forward with a KV cache decodes: run it under torch.no_grad()")
            slots, attn_mask, attended = cache.place(T, mask_table, attended=attended, slots=slots)  # [B, 1, T, S]
        if pos is None:
            pos = slots if cache is not None else torch.arange(T, device=idx.device)  # [B, T] or [T]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, C]
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache=cache, layer=i, slots=slots, attn_mask=attn_mask, attended=attended)
        hidden = self.transformer.ln_f(x)  # [B, T, C]
        if cache is not None and advance:
            cache.length_buffer.add_(T)
        if isinstance(logits_at, torch.Tensor):  # one position per row: [B] -> hidden [B, 1, C]
            return self.lm_head(at_each_row(hidden, logits_at)[:, None]), hidden
        return self.lm_head(hidden if logits_at is None else hidden[:, logits_at]), hidden

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    def num_params(self) -> int:
        """Parameters counted once (wte and lm_head are one tensor)."""
        return sum(p.numel() for p in self.parameters())
