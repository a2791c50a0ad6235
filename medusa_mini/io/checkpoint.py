"""Checkpoint directories that transformers loads as a GPT-2 (the tensor layout is gpt2_layout's).

A checkpoint directory holds

    config.json               GPT-2 config.json; the key "medusa_mini" holds the caller's `extra`
    model.safetensors         the backbone under GPT-2 key names, Conv1D weights stored [in, out]
    medusa_heads.safetensors  the heads' state_dict                    (only when heads were saved)
    medusa_config.json        HeadsConfig.to_dict(); "kind" says medusa or hydra heads (only when heads were saved)

Saving is atomic_write_files with config.json last: a failed save leaves an earlier checkpoint in the
directory loadable.
"""

from __future__ import annotations

import json
import os
from typing import IO, Callable

import torch

from ..heads import HeadsConfig, MedusaHeads
from ..hydra import HydraHeads, make_heads
from ..model import GPT
from .gpt2 import load_gpt2
from .gpt2_layout import check_tensors, gpt2_config_dict, gpt2_state_dict
from .safetensors import atomic_write_files, fsync_dir, read_json, read_safetensors, remove_file, write_safetensors_to

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEADS_FILE = "medusa_heads.safetensors"
HEADS_CONFIG_FILE = "medusa_config.json"


def _json_writer(obj: dict) -> Callable[[IO[bytes]], object]:
    return lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def save_checkpoint(
    directory: str | os.PathLike,
    model: GPT,
    *,
    heads: MedusaHeads | HydraHeads | None = None,
    extra: dict | None = None,
    eos_token_id: int | None = None,
    write_model: bool = True,
) -> None:
    """Save `model` (and `heads`) as a GPT-2 directory; `extra` (JSON) goes in config.json["medusa_mini"].
    `eos_token_id` becomes GPT-2's bos and eos id. write_model=False keeps an existing model.safetensors,
    so a frozen backbone (gigabytes for gpt2-xl) is not rewritten at every save of its heads."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = gpt2_config_dict(model.config, bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    config["torch_dtype"] = str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    config["medusa_mini"] = extra or {}
    files = {}  # transformers refuses safetensors files whose metadata lacks format "pt"
    if write_model or not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        files[WEIGHTS_FILE] = lambda f: write_safetensors_to(f, gpt2_state_dict(model), {"format": "pt"})
    if heads is not None:
        files[HEADS_FILE] = lambda f: write_safetensors_to(f, heads.state_dict(), {"format": "pt"})
        files[HEADS_CONFIG_FILE] = _json_writer(heads.config.to_dict())
    files[CONFIG_FILE] = _json_writer(config)  # last: it is what makes a directory a checkpoint
    atomic_write_files({os.path.join(directory, name): write for name, write in files.items()})
    if heads is None:  # heads from an earlier save would not belong to this model
        remove_file(os.path.join(directory, HEADS_FILE))
        remove_file(os.path.join(directory, HEADS_CONFIG_FILE))
        fsync_dir(directory)


def _read_json(path: str) -> dict:
    obj = read_json(path, hint="save the checkpoint again")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object; save the checkpoint again")
    return obj


def load_heads(
    directory: str | os.PathLike, model: GPT, *, device: torch.device | str = "cpu"
) -> MedusaHeads | HydraHeads:
    """The heads saved in `directory` (medusa_config.json + medusa_heads.safetensors) for `model`."""
    directory = os.fspath(directory)
    config_path = os.path.join(directory, HEADS_CONFIG_FILE)
    weights_path = os.path.join(directory, HEADS_FILE)
    try:
        config = HeadsConfig(**_read_json(config_path))
    except TypeError as e:
        raise ValueError(f"{config_path} has unknown fields ({e}); save the heads again") from None
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    mc = model.config
    if (config.n_embd, config.vocab_size) != (mc.n_embd, mc.vocab_size):
        raise ValueError(
            f"heads in {directory} need n_embd={config.n_embd}, vocab_size={config.vocab_size} but the model "
            f"has n_embd={mc.n_embd}, vocab_size={mc.vocab_size}; use the backbone they were trained on"
        )
    heads = make_heads(config)  # Medusa's heads or dependent (hydra) ones, as medusa_config.json says
    if not os.path.isfile(weights_path):
        raise ValueError(f"{weights_path} is missing; save the heads again")
    tensors = read_safetensors(weights_path)  # SafetensorsError is a ValueError and names the file
    expected = {k: t.shape for k, t in heads.state_dict().items()}
    try:
        check_tensors(expected, tensors, fits=f"{HEADS_CONFIG_FILE} ({config})")
    except ValueError as e:
        raise ValueError(f"{weights_path}: {e}") from None
    heads.load_state_dict(tensors)
    return heads.to(device).eval()


def load_checkpoint(
    directory: str | os.PathLike, *, device: torch.device | str = "cpu"
) -> tuple[GPT, MedusaHeads | HydraHeads | None, dict]:
    """(model, heads or None, config.json) from a directory save_checkpoint wrote, or any GPT-2
    directory; a one-line ValueError names what is missing or broken."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist; pass a saved checkpoint")
    config_json = _read_json(os.path.join(directory, CONFIG_FILE))
    model = load_gpt2(directory, device=device)  # an existing directory: nothing is downloaded
    has_heads = os.path.exists(os.path.join(directory, HEADS_CONFIG_FILE))
    heads = load_heads(directory, model, device=device) if has_heads else None
    return model, heads, config_json
