"""Medusa heads (paper §2.1.1): K extra heads that guess tokens further ahead from one hidden state.

Head k (1-based) reads the backbone's last hidden state h_t and predicts token t+k+1, while the
backbone's own lm_head predicts t+1. Each head is a residual block `x + SiLU(W_k x + b_k)` with W_k
zero-initialised, so an untrained head starts as a copy of the backbone's next-token prediction, then a
vocabulary projection: by default the backbone's own (tied) lm_head, all K heads in one batched matmul;
optionally each head its own lm_head initialised from the backbone's (the paper's Medusa-1 setup).

Shapes: K heads, C n_embd, V vocabulary, `...` any leading dims (B, or B and T in training).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_KINDS = ("medusa", "hydra")


@dataclass
class HeadsConfig:
    num_heads: int = 4
    n_embd: int = 256
    vocab_size: int = 2048
    own_lm_head: bool = False
    kind: str = "medusa"  # "medusa": head k reads h_t only; "hydra": h_t and the drafted path (hydra.py)

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}: use one of {', '.join(HEAD_KINDS)}")

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero, so the block starts as the identity."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_embd, n_embd)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K residual blocks, then the shared lm_head (passed in at call time) or K own lm_heads."""

    def __init__(self, config: HeadsConfig, *, lm_head_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if config.kind != "medusa":
            raise ValueError(f"these heads are of kind {config.kind!r}, not Medusa's: build them with "
                             "medusa_mini.hydra.make_heads (or load them with io.checkpoint.load_heads)")
        self.config = config
        self.blocks = nn.ModuleList([ResBlock(config.n_embd) for _ in range(config.num_heads)])
        if config.own_lm_head:
            # [K, V, C]: one projection per head, all starting from the backbone's.
            w = torch.zeros(config.num_heads, config.vocab_size, config.n_embd)
            if lm_head_weight is not None:
                w.copy_(lm_head_weight.detach().to(w.dtype).unsqueeze(0).expand_as(w))
            else:
                nn.init.normal_(w, std=0.02)
            self.lm_heads = nn.Parameter(w)
        else:
            self.lm_heads = None

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def hidden(self, x: torch.Tensor, *, num: int | None = None) -> torch.Tensor:
        """x: [..., C] -> the first `num` heads' features [K', ..., C] (default: all K)."""
        num = self.num_heads if num is None else num
        if self.training or torch.is_grad_enabled():
            return torch.stack([block(x) for block in self.blocks[:num]])  # [K', ..., C]
        # Decoding: the blocks' linears stacked into one [K C, C] matrix, one matmul for all heads. At
        # batch 1 a step spends more time calling K small layers than computing them.
        weight, bias = self._stacked_blocks()  # [K C, C] (out, in), [K C]
        C = x.shape[-1]
        z = F.linear(x, weight[: num * C], bias[: num * C]).unflatten(-1, (num, C))  # [..., K', C]
        z = x.unsqueeze(-2) + F.silu(z)  # [..., K', C]
        return z.movedim(-2, 0)  # [K', ..., C]

    def _stacked_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' weights stacked [K C, C] and biases [K C], rebuilt whenever a block's
        parameters change: a tensor's version counter moves with every in-place update (optimizer
        steps, load_state_dict), and its storage with .to()."""
        params = [t for block in self.blocks for t in (block.linear.weight, block.linear.bias)]
        key = tuple((t.data_ptr(), t._version) for t in params)
        if getattr(self, "_stacked_key", None) != key:
            weight = torch.cat([block.linear.weight.detach() for block in self.blocks])
            bias = torch.cat([block.linear.bias.detach() for block in self.blocks])
            self._stacked, self._stacked_key = (weight, bias), key
        return self._stacked

    def forward(self, x: torch.Tensor, lm_head: nn.Module, *, num: int | None = None) -> torch.Tensor:
        """x: [..., C] backbone hidden states -> logits [K, ..., V] (head k at index k-1).

        lm_head: the backbone's vocabulary projection; used unless the heads own theirs. It is passed
        in rather than stored so the heads' state dict holds only the heads. num: only the first `num`
        heads (a shallow tree needs no deeper guess, and each head costs a vocabulary projection).
        """
        z = self.hidden(x, num=num)  # [K', ..., C]
        if self.lm_heads is None:
            return lm_head(z)  # one matmul for all the heads: [K', ..., V]
        K = z.shape[0]
        flat = z.reshape(K, -1, z.shape[-1])  # [K', M, C]
        logits = torch.bmm(flat, self.lm_heads[:K].transpose(1, 2))  # [K', M, V]
        return logits.reshape(*z.shape[:-1], -1)  # [K, ..., V]
