"""What decoding needs from a train_tiny.py checkpoint: model, heads, tokenizer, end-of-text id, held-out prompts."""

import os
from dataclasses import dataclass, field

import tiktoken
import torch

from ..heads import DraftHeads
from ..model import GPT
from .checkpoint import load_checkpoint
from .files import read_json
from .tokenizer import load_tokenizer

PROMPTS_FILE = "prompts.json"  # held-out prompts that training stores next to the checkpoint
WRITE_PROMPTS = 'train_tiny.py writes it with the checkpoint, or write one yourself: {"prompts": ["text", ...]}'


@dataclass
class Checkpoint:
    directory: str
    model: GPT
    heads: DraftHeads | None
    enc: tiktoken.Encoding
    eot_id: int | None
    config: dict = field(repr=False)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size


def load_for_decoding(directory: str, *, device: torch.device, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The checkpoint in `directory`, backbone and heads cast to `dtype` (acceptance still computes in float32)."""
    directory = os.path.expanduser(directory)  # --ckpt=~/x reaches here unexpanded
    model, heads, config = load_checkpoint(directory, device=device)
    enc = load_tokenizer(directory)
    if enc.n_vocab > model.config.vocab_size:  # ids past the embedding table would crash much later
        raise ValueError(f"the tokenizer in {directory} has {enc.n_vocab} tokens but the model only "
                         f"{model.config.vocab_size}; they do not belong together")
    model, heads = model.to(dtype), heads.to(dtype) if heads is not None else None
    eot_id = extra.get("eot_id") if isinstance(extra := config.get("medusa_mini"), dict) else None
    if not isinstance(eot_id, int):  # else the tokenizer's own; without one, only the length stops generation
        eot_id = enc.eot_token if "<|endoftext|>" in enc.special_tokens_set else None
    elif not 0 <= eot_id < model.config.vocab_size:  # else refused only once decoding has begun to print
        raise ValueError(f"{directory}/config.json: eot_id {eot_id} is no token id of this model; save it again")
    return Checkpoint(directory, model, heads, enc, eot_id, config)


def load_prompts(directory: str, *, hint: str = "pass prompts with --prompt TEXT") -> list[str]:
    """The held-out prompts of prompts.json, {"prompts": ["...", ...]}; `hint` ends a missing or bad file's error."""
    path = os.path.join(directory, PROMPTS_FILE)
    prompts = obj.get("prompts") if isinstance(obj := read_json(path, hint=hint), dict) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f'{path} must hold {{"prompts": ["text", ...]}} with at least one prompt')
    return prompts


def prompt_ids(ck: Checkpoint, *, count: int, max_new_tokens: int) -> list[list[int]]:
    """The first `count` prompts of ck's prompts.json as token ids, each cut to leave room for max_new_tokens, empty
    ones left out; its callers take no prompts of their own, so a missing file's error says how to make one."""
    if (room := ck.block_size - max_new_tokens) < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in {ck.block_size}")
    texts = load_prompts(ck.directory, hint=WRITE_PROMPTS)[:count]
    if not (prompts := [ids[-room:] for ids in map(ck.enc.encode_ordinary, texts) if ids]):
        raise ValueError(f"every prompt in {os.path.join(ck.directory, PROMPTS_FILE)} encodes to no tokens")
    return prompts
