"""`decode.py --explain --demo`: a model and heads made on the spot, so one step can be shown on a fresh clone.

A 2-layer GPT and four Medusa heads learn the Zen of Python (the `this` module) by heart in a few
seconds (Medusa-2's joint loss, §2.2.2), so the heads are confident and the paths long. Seeded.
"""

from __future__ import annotations

import codecs
import contextlib
import io

import torch

from ..heads import HeadsConfig, MedusaHeads
from ..io.loading import Checkpoint
from ..io.tokenizer import make_encoding, train_bpe
from ..model import GPT, GPTConfig
from ..training import MedusaLM

DEMO_NOTE = ("DEMO: a 2-layer model and its 4 heads trained for a few seconds on the Zen of Python, which they "
             "know by heart;\nreal heads are right less often. Train one with train_tiny.py for real figures.")


def demo_checkpoint(*, steps: int = 300, seed: int = 0) -> tuple[Checkpoint, list[str]]:
    """A tiny memorising model with Medusa heads, its tokenizer and three prompts from its text."""
    with contextlib.redirect_stdout(io.StringIO()):  # its first import prints the text; stdout is the caller's
        import this
    text = codecs.decode(this.s, "rot13")  # the module stores it in rot13
    enc = make_encoding(train_bpe(text, vocab_size=300))
    ids = torch.tensor(enc.encode_ordinary(text))
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=enc.n_vocab, block_size=128, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config)
    heads = MedusaHeads(HeadsConfig(num_heads=4, n_embd=64, vocab_size=enc.n_vocab), lm_head_weight=model.lm_head.weight)
    module = MedusaLM(model, heads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small gain nothing from threads, and lose much on a busy machine
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    T = 64
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - T - 1, (16,), generator=gen)
        x = torch.stack([ids[s : s + T] for s in starts])  # [16, T]
        y = torch.stack([ids[s + 1 : s + T + 1] for s in starts])  # [16, T]
        loss, _ = module(x, y, lm_weight=1.0, heads_weight=0.5, decay=0.8)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.eval()
    heads.eval()
    lines = [line for line in text.splitlines() if line]
    prompts = [lines[i][: len(lines[i]) // 2].rstrip() for i in (8, 3, 14)]
    ck = Checkpoint("(demo)", model, heads, enc, None, {})
    return ck, prompts
