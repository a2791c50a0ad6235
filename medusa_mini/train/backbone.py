"""Medusa heads on real GPT-2 weights, frozen: `train_tiny.py --init gpt2` (gpt2-medium, ..., or a local
directory/file) skips the tokenizer and backbone stages and trains Medusa-1 heads by self-distillation
(paper §2.3.2): GPT-2 writes the text its heads learn from, so only a few corpus prompts are needed.
"""

from __future__ import annotations

import os

import tiktoken

from ..io.gpt2 import GPT2_CONFIGS, download_gpt2, load_gpt2
from ..io.tokenizer import load_tokenizer, save_tokenizer, save_tokenizer_reference
from ..model import GPT

# Heads only, sized for one GPU (gpt2 124M: well under an hour), and a try-out size for a CPU.
GPT2_PRESETS: dict[str, dict] = {
    "gpt2": dict(medusa=1, backbone_steps=0, distill_prompts=4096, distill_prompt_len=32, distill_tokens=128,
                 heads_steps=2000, heads_batch_size=32, heads_lr=1e-3, eval_prompts=32),
    "gpt2-cpu": dict(medusa=1, backbone_steps=0, distill_prompts=32, distill_prompt_len=16, distill_tokens=32,
                     heads_steps=30, heads_batch_size=4, heads_lr=1e-3, eval_prompts=4),
}


def fetch_backbone(init: str) -> None:
    """Download what `--init` names and the cache lacks (nothing for a local path). Under torchrun rank 0
    alone (Run.main_first): ranks downloading into the same `.part` file would corrupt it."""
    if os.path.exists(os.path.expanduser(init)) or init not in GPT2_CONFIGS:
        return
    try:
        download_gpt2(init)
    except (ValueError, OSError) as e:
        raise ValueError(f"--init {init}: {e}") from None
    tiktoken.get_encoding("gpt2")


def init_backbone(init: str, *, device: str) -> tuple[GPT, tiktoken.Encoding]:
    """GPT-2 weights and their tokenizer: the directory's own if it has one, else tiktoken's "gpt2"."""
    try:
        model = load_gpt2(init, device=device)
    except (ValueError, OSError) as e:
        raise ValueError(f"--init {init}: {e}") from None
    folder = init if os.path.isdir(init) else os.path.dirname(os.path.abspath(init))
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        enc = load_tokenizer(folder)
    else:
        enc = tiktoken.get_encoding("gpt2")  # downloads its files once, like the weights
    if enc.n_vocab > model.config.vocab_size:
        raise ValueError(f"--init {init}: tokenizer has {enc.n_vocab} tokens, the model {model.config.vocab_size}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model, enc


def save_tokenizer_for(enc: tiktoken.Encoding, out: str) -> None:
    """GPT-2's own encoding is saved as a reference (tiktoken fetches it); any other in full."""
    if enc.name in GPT2_CONFIGS or enc.name == "gpt2":
        save_tokenizer_reference(out, enc.name)
    else:
        save_tokenizer(enc, out)
