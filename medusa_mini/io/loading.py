"""Everything decoding needs from a checkpoint directory: model, heads, tokenizer, end token, prompts.

A checkpoint directory is what `train_tiny.py` writes (a GPT-2 directory plus the heads, the
tokenizer and held-out prompts). Bad input becomes a one-line ValueError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import tiktoken
import torch

from ..heads import MedusaHeads
from ..model import GPT
from .checkpoint import load_checkpoint
from .safetensors import read_json
from .tokenizer import load_tokenizer

PROMPTS_FILE = "prompts.json"  # held-out prompts that training stores next to the checkpoint


@dataclass
class Checkpoint:
    """Everything decoding needs from a checkpoint directory."""

    directory: str
    model: GPT
    heads: MedusaHeads | None
    enc: tiktoken.Encoding
    eot_id: int | None
    config: dict = field(repr=False)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def eot_id_of(config: dict, enc: tiktoken.Encoding) -> int | None:
    """The end-of-text id: the one training recorded in config.json, else the tokenizer's own."""
    extra = config.get("medusa_mini")
    if isinstance(extra, dict) and isinstance(extra.get("eot_id"), int):
        return extra["eot_id"]
    try:
        return enc.eot_token
    except KeyError:  # a tokenizer without <|endoftext|>: generation then stops only on length
        return None


def load_for_decoding(directory: str, *, device: torch.device, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Model, heads (or None), tokenizer and end-of-text id from a directory train_tiny.py wrote;
    `dtype` casts the backbone and the heads together (acceptance still computes in float32)."""
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist; train one with train_tiny.py")
    model, heads, config = load_checkpoint(directory, device=device)
    enc = load_tokenizer(directory)
    if enc.n_vocab > model.config.vocab_size:
        # Token ids past the embedding table would crash the forward pass much later.
        raise ValueError(
            f"the tokenizer in {directory} has {enc.n_vocab} tokens but the model only "
            f"{model.config.vocab_size}; they do not belong together"
        )
    model.to(dtype)
    if heads is not None:
        heads.to(dtype)
    return Checkpoint(directory, model, heads, enc, eot_id_of(config, enc), config)


def load_prompts(directory: str) -> list[str]:
    """The held-out snippets stored in prompts.json: {"prompts": ["...", ...]}."""
    path = os.path.join(directory, PROMPTS_FILE)
    obj = read_json(path, hint="pass prompts with --prompt TEXT")
    prompts = obj.get("prompts") if isinstance(obj, dict) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f'{path} must hold {{"prompts": ["text", ...]}} with at least one prompt')
    return prompts
