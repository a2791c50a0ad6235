"""Shared fixtures: tiny random models so the whole spec runs in seconds on a CPU."""

from __future__ import annotations

import pytest
import torch

from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.model import GPT, GPTConfig


def tiny_model(seed: int = 0, *, vocab_size: int = 64, block_size: int = 64, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32)
    model = GPT(config).eval()
    # GPT-2's init gives nearly uniform logits and, with tied embeddings, a model that repeats its
    # input. Larger random weights and an untied output layer give varied, peaked distributions, so
    # acceptance actually happens and argmax ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and "wpe" not in name:
                p.normal_(0.0, 0.3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, 32) * 0.3)
    return model


def random_heads(model: GPT, *, num_heads: int = 4, seed: int = 0, own_lm_head: bool = False) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = model.config
    heads = MedusaHeads(
        HeadsConfig(num_heads=num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, own_lm_head=own_lm_head),
        lm_head_weight=model.lm_head.weight,
    )
    with torch.no_grad():  # zero-initialised heads all agree with the backbone; make them differ
        for block in heads.blocks:
            torch.nn.init.normal_(block.linear.weight, std=0.5)
    return heads.eval()


@pytest.fixture
def model() -> GPT:
    return tiny_model()


class OracleHeads:
    """Heads that know the future: they propose the backbone's own greedy continuation.

    Random heads accept almost nothing, so the long-path machinery (deep acceptance, compaction of
    many slots) would go untested. The oracle follows the emitted tokens through `on_step` and runs the
    model ahead to find what each head *should* say; rank 0 is that token, other ranks are random.
    """

    def __init__(
        self, model: GPT, prompt: list[int], *, num_heads: int = 4, seed: int = 0, memo: dict | None = None
    ) -> None:
        self.model, self.seq, self.num_heads = model, list(prompt), num_heads
        self.gen = torch.Generator().manual_seed(seed)
        self.memo = memo if memo is not None else {}  # sequence -> its greedy future, shareable

    def on_step(self, tokens: list[int]) -> None:
        self.seq += tokens

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        from medusa_mini.decoding import generate

        V, block = self.model.config.vocab_size, self.model.config.block_size
        # seq ends with the root; head k guesses the token k places after it.
        key = tuple(self.seq)
        if key not in self.memo:
            room = block - len(self.seq)
            self.memo[key] = generate(self.model, self.seq, max_new_tokens=self.num_heads)[0] if room > 0 else []
        future = self.memo[key]
        logits = torch.rand(self.num_heads, 1, V, generator=self.gen)
        for k, tok in enumerate(future):
            logits[k, 0, tok] = 10.0
        return logits
