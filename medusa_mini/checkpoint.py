"""Checkpoints: GPT-2's weight layout and checkpoint directories that transformers loads as a GPT-2.

A checkpoint directory holds

    config.json               GPT-2 config.json; the key "medusa_mini" holds the caller's `extra`
    model.safetensors         the backbone under GPT-2 key names, Conv1D weights stored [in, out]
    medusa_heads.safetensors  the heads' state_dict                    (only when heads were saved)
    medusa_config.json        HeadsConfig.to_dict()                    (only when heads were saved)

Saving writes every file under a temporary name first, then renames them into place with config.json
last; if a rename fails, the files already replaced are restored, so an earlier checkpoint in the
directory stays loadable. The safetensors reader and writer live in `safetensors_io`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import IO

import torch

from .heads import HeadsConfig, MedusaHeads
from .model import GPT, GPTConfig
from .safetensors_io import (
    read_json,
    SafetensorsError,
    fsync_dir,
    read_safetensors,
    read_safetensors_metadata,
    remove_file,
    stage_file,
    write_safetensors,
    write_safetensors_to,
)

__all__ = [
    "SafetensorsError", "read_safetensors", "read_safetensors_metadata", "write_safetensors",
    "gpt2_state_dict", "load_gpt2_weights", "gpt2_config_dict", "config_from_gpt2_dict",
    "save_checkpoint", "load_checkpoint", "load_heads",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEADS_FILE = "medusa_heads.safetensors"
HEADS_CONFIG_FILE = "medusa_config.json"

# GPT-2 implements these four projections as Conv1D, whose weight is stored [in, out].
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that older transformers versions saved with the weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")
_PREFIX = "transformer."


# ----------------------------------------------------------------------------- GPT-2 layout


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's tensors as in a transformers GPT2LMHeadModel file: lm_head omitted (it is wte),
    Conv1D weights transposed to [in, out]."""
    wte, lm_head = model.transformer.wte.weight, model.lm_head.weight
    if lm_head is not wte and not torch.equal(lm_head, wte):
        raise ValueError("lm_head.weight is not tied to transformer.wte.weight; GPT-2 files cannot hold it")
    out = {}
    for key, t in model.state_dict().items():
        if key != "lm_head.weight":
            out[key] = t.t().contiguous() if key.endswith(_CONV1D) else t
    return out


def _config_summary(c: GPTConfig) -> str:
    return (
        f"n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
        f"vocab_size={c.vocab_size}, block_size={c.block_size}"
    )


def _check_tensors(expected: dict[str, tuple], found: dict[str, torch.Tensor], *, fits: str) -> None:
    """One-line ValueError for the first missing, unexpected or misshaped tensor."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    problems = ((missing, "lacks tensor {}, which {} needs"), (unexpected, "has tensor {}, which {} lacks"))
    for keys, what in problems:
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise ValueError("checkpoint " + what.format(repr(keys[0]) + more, fits))
    for key, shape in expected.items():
        if tuple(found[key].shape) != tuple(shape):
            raise ValueError(
                f"tensor {key!r} has shape {list(found[key].shape)} in the checkpoint but {fits} "
                f"needs {list(shape)}"
            )


def load_gpt2_weights(model: GPT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy GPT-2-layout tensors into `model`, keys with or without the "transformer." prefix.

    Checks everything before copying anything, so a failed load leaves the model untouched.
    """
    found: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, t in tensors.items():
        short = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        if short == "lm_head.weight":
            lm_head = t
        elif not short.endswith(_BUFFERS):
            if short in found:
                raise ValueError(f"tensor {short!r} appears both with and without the 'transformer.' prefix")
            found[short] = t
    params = {k[len(_PREFIX):]: p for k, p in model.state_dict().items() if k.startswith(_PREFIX)}
    shapes = {k: p.shape[::-1] if k.endswith(_CONV1D) else p.shape for k, p in params.items()}
    _check_tensors(shapes, found, fits=f"this GPT ({_config_summary(model.config)})")
    wte = found["wte.weight"]
    if lm_head is not None and not torch.equal(lm_head.to(wte.device, wte.dtype), wte):
        raise ValueError("lm_head.weight differs from wte.weight; this GPT ties them, so it cannot load it")
    with torch.no_grad():
        for key, p in params.items():  # state_dict tensors share storage with the parameters
            t = found[key]
            p.copy_(t.t() if key.endswith(_CONV1D) else t)


def gpt2_config_dict(
    config: GPTConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict:
    """The config.json of a transformers GPT-2 with this shape."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def config_from_gpt2_dict(d: dict) -> GPTConfig:
    """GPTConfig from a GPT-2 config.json; ValueError for anything this GPT cannot reproduce."""
    if not isinstance(d, dict):
        raise ValueError("a GPT-2 config must be a JSON object")
    if d.get("model_type") != "gpt2":
        raise ValueError(f"model_type is {d.get('model_type')!r}; only 'gpt2' models can be loaded")
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {act!r} is not supported; this GPT uses gelu_new (tanh-GELU)")
    try:
        n_embd = int(d["n_embd"])
        config = GPTConfig(
            vocab_size=int(d["vocab_size"]),
            block_size=int(d["n_positions"] if "n_positions" in d else d["n_ctx"]),
            n_layer=int(d["n_layer"]),
            n_head=int(d["n_head"]),
            n_embd=n_embd,
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
        )
    except KeyError as e:
        raise ValueError(f"GPT-2 config is missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"GPT-2 config has an invalid value: {e}") from None
    unsupported = {
        "n_inner": d.get("n_inner") not in (None, 4 * n_embd),
        "tie_word_embeddings": d.get("tie_word_embeddings", True) is not True,
        "scale_attn_weights": d.get("scale_attn_weights", True) is not True,
        "scale_attn_by_inverse_layer_idx": d.get("scale_attn_by_inverse_layer_idx", False) is not False,
    }
    for field, bad in unsupported.items():
        if bad:
            raise ValueError(f"GPT-2 config sets {field}={d[field]!r}, which this GPT does not implement")
    return config


# ----------------------------------------------------------------------------- checkpoint directories


def _json_writer(obj: dict):
    def write(f: IO[bytes]) -> None:
        f.write((json.dumps(obj, indent=2) + "\n").encode("utf-8"))

    return write


def _replace_all(pairs: list[tuple[str, str]]) -> None:
    """os.replace each (temp, final) in order; on failure, put every earlier final file back."""
    done: list[tuple[str, str | None]] = []  # (final, hard link to its previous version or None)
    try:
        for tmp, final in pairs:
            backup = None
            if os.path.exists(final):
                backup = f"{final}.{os.getpid()}.bak"
                remove_file(backup)
                try:
                    os.link(final, backup)  # keeps the old bytes without copying them
                except OSError:
                    shutil.copyfile(final, backup)
            done.append((final, backup))
            os.replace(tmp, final)
    except BaseException:
        for final, backup in reversed(done):
            if backup is not None:
                os.replace(backup, final)
            else:
                remove_file(final)
        raise
    finally:
        for _, backup in done:
            if backup is not None:
                remove_file(backup)


def save_checkpoint(
    directory: str | os.PathLike,
    model: GPT,
    *,
    heads: MedusaHeads | None = None,
    extra: dict | None = None,
    eos_token_id: int | None = None,
    write_model: bool = True,
) -> None:
    """Save `model` (and `heads`) as a GPT-2 directory; `extra` (JSON) goes in config.json["medusa_mini"].

    `eos_token_id` becomes GPT-2's bos/eos ids (GPT-2 uses one token, 50256, for both).
    write_model=False keeps the model.safetensors already there: a frozen backbone (up to gigabytes
    for gpt2-xl) need not be copied again at every save of its heads.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = gpt2_config_dict(model.config, bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    config["torch_dtype"] = str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    config["medusa_mini"] = extra or {}
    # transformers refuses safetensors files whose metadata lacks format "pt".
    if not write_model and not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        write_model = True  # nothing to keep yet
    jobs = []
    if write_model:
        jobs.append((WEIGHTS_FILE, lambda f: write_safetensors_to(f, gpt2_state_dict(model), {"format": "pt"})))
    if heads is not None:
        jobs.append((HEADS_FILE, lambda f: write_safetensors_to(f, heads.state_dict(), {"format": "pt"})))
        jobs.append((HEADS_CONFIG_FILE, _json_writer(heads.config.to_dict())))
    jobs.append((CONFIG_FILE, _json_writer(config)))  # last: it is what makes a directory a checkpoint
    staged: list[tuple[str, str]] = []
    try:
        for name, write in jobs:
            final = os.path.join(directory, name)
            staged.append((stage_file(final, write), final))
        _replace_all(staged)
    finally:
        for tmp, _ in staged:
            remove_file(tmp)
    if heads is None:  # heads from an earlier save would not belong to this model
        remove_file(os.path.join(directory, HEADS_FILE))
        remove_file(os.path.join(directory, HEADS_CONFIG_FILE))
    fsync_dir(directory)


def _read_json(path: str) -> dict:
    obj = read_json(path, hint="save the checkpoint again")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object; save the checkpoint again")
    return obj


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; save the checkpoint again")
    return read_safetensors(path)  # SafetensorsError is a ValueError and names the file


def load_heads(
    directory: str | os.PathLike, model: GPT, *, device: torch.device | str = "cpu"
) -> MedusaHeads:
    """The heads saved in `directory` (medusa_config.json + medusa_heads.safetensors) for `model`."""
    directory = os.fspath(directory)
    config_path = os.path.join(directory, HEADS_CONFIG_FILE)
    weights_path = os.path.join(directory, HEADS_FILE)
    try:
        config = HeadsConfig(**_read_json(config_path))
    except TypeError as e:
        raise ValueError(f"{config_path} has unknown fields ({e}); save the heads again") from None
    mc = model.config
    if (config.n_embd, config.vocab_size) != (mc.n_embd, mc.vocab_size):
        raise ValueError(
            f"heads in {directory} need n_embd={config.n_embd}, vocab_size={config.vocab_size} but the model "
            f"has n_embd={mc.n_embd}, vocab_size={mc.vocab_size}; use the backbone they were trained on"
        )
    heads = MedusaHeads(config)
    tensors = _read_weights(weights_path)
    expected = {k: t.shape for k, t in heads.state_dict().items()}
    try:
        _check_tensors(expected, tensors, fits=f"{HEADS_CONFIG_FILE} ({config})")
    except ValueError as e:
        raise ValueError(f"{weights_path}: {e}") from None
    heads.load_state_dict(tensors)
    return heads.to(device).eval()


def load_checkpoint(
    directory: str | os.PathLike, *, device: torch.device | str = "cpu"
) -> tuple[GPT, MedusaHeads | None, dict]:
    """(model, heads or None, config.json) from a directory save_checkpoint wrote, or any GPT-2
    directory with model.safetensors; a one-line ValueError names what is missing or broken."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist; pass a saved checkpoint")
    config_path = os.path.join(directory, CONFIG_FILE)
    config_json = _read_json(config_path)
    try:
        config = config_from_gpt2_dict(config_json)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    model = GPT(config)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    tensors = _read_weights(weights_path)
    try:
        load_gpt2_weights(model, tensors)
    except ValueError as e:
        raise ValueError(f"{weights_path}: {e}") from None
    model = model.to(device).eval()
    has_heads = os.path.exists(os.path.join(directory, HEADS_CONFIG_FILE))
    heads = load_heads(directory, model, device=device) if has_heads else None
    return model, heads, config_json
