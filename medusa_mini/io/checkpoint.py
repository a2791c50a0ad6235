"""Checkpoint directories that transformers loads as a GPT-2, plus the heads' state_dict (vocab_order included) and
HeadsConfig, all written together, config.json last: a failed save leaves the previous checkpoint loadable."""

import os
from dataclasses import asdict

import torch

from ..heads import DraftHeads, HeadsConfig, make_heads
from ..model import GPT
from .files import atomic_write_files, fsync_dir, json_writer, read_json, remove_file
from .gpt2 import check_tensors, gpt2_config_dict, gpt2_state_dict, load_gpt2
from .safetensors import read_safetensors, write_safetensors

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
HEADS_FILE, HEADS_CONFIG_FILE = "medusa_heads.safetensors", "medusa_config.json"
CHECKPOINT_FILES = (WEIGHTS_FILE, HEADS_FILE, HEADS_CONFIG_FILE, CONFIG_FILE)  # what save_checkpoint may write
PT = {"format": "pt"}  # transformers refuses safetensors files whose metadata lacks it


def save_checkpoint(directory: str | os.PathLike, model: GPT, *, heads: DraftHeads | None = None,
                    extra: dict | None = None, eos_token_id: int | None = None, write_model: bool = True) -> None:
    """Save `model` (and `heads`) as a GPT-2 directory, `extra` under config.json's "medusa_mini"; `eos_token_id`
    is GPT-2's bos and eos id. write_model=False keeps an existing model.safetensors (a frozen backbone)."""
    os.makedirs(directory, exist_ok=True)
    files = {}
    if write_model or not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        files[WEIGHTS_FILE] = lambda f: write_safetensors(f, gpt2_state_dict(model), PT)
    if heads is not None:
        files[HEADS_FILE] = lambda f: write_safetensors(f, heads.state_dict(), PT)
        files[HEADS_CONFIG_FILE] = json_writer(asdict(heads.config))
    files[CONFIG_FILE] = json_writer(gpt2_config_dict(model, eos_token_id=eos_token_id) | {"medusa_mini": extra or {}})
    atomic_write_files(directory, files)
    if heads is None:  # heads of an earlier save would not belong to this model
        remove_file(os.path.join(directory, HEADS_FILE))
        remove_file(os.path.join(directory, HEADS_CONFIG_FILE))
        fsync_dir(directory)


def load_heads(directory: str | os.PathLike, model: GPT, *, device: torch.device | str = "cpu") -> DraftHeads:
    """The heads saved in `directory`, for `model`; a one-line ValueError names what is wrong."""
    config_path, weights_path = os.path.join(directory, HEADS_CONFIG_FILE), os.path.join(directory, HEADS_FILE)
    if not isinstance(fields := read_json(config_path, hint="save the heads again"), dict):
        raise ValueError(f"{config_path} must be a JSON object; save the heads again")
    if fields.pop("own_lm_head", False):  # the format before draft vocabularies; False: the lm_head is shared
        raise ValueError(f"{config_path}: heads with their own lm_head are no longer supported; train them again")
    if missing := {"num_heads", "n_embd", "vocab_size"} - fields.keys():  # their defaults would describe other heads
        raise ValueError(f"{config_path} has no {sorted(missing)[0]}; save the heads again")
    try:
        config = HeadsConfig(**fields)
    except (TypeError, ValueError) as e:  # a field HeadsConfig does not know, or a value it refuses
        raise ValueError(f"{config_path}: {e}; save the heads again") from None
    if (config.n_embd, config.vocab_size) != (model.config.n_embd, model.config.vocab_size):
        raise ValueError(f"heads in {directory} need n_embd={config.n_embd}, vocab_size={config.vocab_size}; "
                         f"the model is {model.config}")
    if not os.path.isfile(weights_path):
        raise ValueError(f"{weights_path} is missing; save the heads again")
    heads, tensors = make_heads(config), read_safetensors(weights_path)
    tensors.setdefault("vocab_order", heads.vocab_order)  # saved before draft vocabularies: the whole one
    try:
        check_tensors({k: t.shape for k, t in heads.state_dict().items()}, tensors, fits=repr(config))
        heads.load_state_dict(tensors)
        if not torch.equal(heads.vocab_order.sort().values, torch.arange(config.vocab_size)):  # else an IndexError
            raise ValueError(f"vocab_order is not an order of the {config.vocab_size} token ids; save the heads again")
    except ValueError as e:
        raise ValueError(f"{weights_path}: {e}") from None
    return heads.to(device).eval()


def load_checkpoint(directory: str | os.PathLike, *,
                    device: torch.device | str = "cpu") -> tuple[GPT, DraftHeads | None, dict]:
    """(model, heads or None, config.json) from save_checkpoint's or any GPT-2 directory; one-line ValueErrors."""
    if not os.path.isdir(directory):
        what = "is a file, not a checkpoint directory" if os.path.exists(directory) else "does not exist"
        raise ValueError(f"checkpoint directory {directory} {what}; pass a saved checkpoint's folder "
                         "(python train_tiny.py saves one in out/tiny)")
    model = load_gpt2(directory, device=device)  # checks config.json; a directory: nothing is downloaded
    config = read_json(os.path.join(directory, CONFIG_FILE), hint="save the checkpoint again")
    has_heads = any(os.path.exists(os.path.join(directory, f)) for f in (HEADS_CONFIG_FILE, HEADS_FILE))  # either one
    return model, load_heads(directory, model, device=device) if has_heads else None, config
