"""Checkpoints: safetensors byte for byte as documented, hostile files rejected with one clear error,
saved models and heads reloaded with identical logits, and a failed save never damages the old one."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest
import torch

from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.hydra import HydraHeads, make_heads, teacher_forced_logits
from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint
from medusa_mini.io.gpt2_layout import gpt2_state_dict
from medusa_mini.io.safetensors import (
    SafetensorsError, read_safetensors, read_safetensors_metadata, write_safetensors,
)
from medusa_mini.model import GPT, GPTConfig

CHECKPOINT_FILES = {"config.json", "model.safetensors"}
HEADS_FILES = {"medusa_heads.safetensors", "medusa_config.json"}
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])


def randomized(module, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():  # every tensor random (biases and LayerNorms too), so nothing can hide
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def tiny_gpt(seed: int = 0) -> GPT:
    return randomized(GPT(GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=16)), seed)


def tiny_heads(model: GPT, *, own_lm_head: bool = False, kind: str = "medusa", seed: int = 1):
    config = HeadsConfig(num_heads=3, n_embd=16, vocab_size=61, own_lm_head=own_lm_head, kind=kind)
    return randomized(make_heads(config, lm_head_weight=model.lm_head.weight), seed)


@torch.no_grad()
def outputs(model: GPT, heads: MedusaHeads | HydraHeads | None = None) -> list[torch.Tensor]:
    logits, hidden = model(IDS)
    return [logits] + ([teacher_forced_logits(heads, hidden, IDS, model)] if heads is not None else [])


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safetensors_round_trip_keeps_dtype_shape_and_every_bit(tmp_path, dtype):
    def sample(*shape: int) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape).to(dtype)
        return torch.randint(-100 if dtype.is_signed else 0, 2 if dtype is torch.bool else 100, shape).to(dtype)

    tensors, path = {"matrix": sample(3, 5), "scalar": sample(), "empty": sample(0, 4)}, tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    back = read_safetensors(path)
    assert back.keys() == tensors.keys() and read_safetensors_metadata(path) == {"format": "pt"}
    for name, t in tensors.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def test_written_file_has_the_documented_byte_layout(tmp_path):
    tensors = {"a": torch.randn(2, 3), "b": torch.arange(5), "c": torch.tensor([1, 2, 255]).to(torch.uint8)}
    write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"note": "hi"})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header padded so the data starts 8-byte aligned"
    header, data, covered = json.loads(raw[8 : 8 + n].decode("utf-8")), raw[8 + n :], 0
    assert header.pop("__metadata__") == {"note": "hi"}
    formats = {"a": ("F32", "<f4"), "b": ("I64", "<i8"), "c": ("U8", "u1")}
    for (begin, end), name in sorted((e["data_offsets"], k) for k, e in header.items()):
        assert (header[name]["dtype"], header[name]["shape"]) == (formats[name][0], list(tensors[name].shape))
        assert begin == covered and data[begin:end] == tensors[name].numpy().astype(formats[name][1]).tobytes()
        covered = end
    assert covered == len(data), "tensors tile the buffer in order"


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"x": torch.ones(3)})
    with pytest.raises(ValueError, match="cannot be stored"):
        write_safetensors(path, {"y": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)})
    assert torch.equal(read_safetensors(path)["x"], torch.ones(3))
    assert os.listdir(tmp_path) == ["t.safetensors"]


def st_file(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = {
    "shorter than 8 bytes": (b"\x10\x00\x00", "too short"),
    "header length beyond the file": (st_file(b"{}", length=1000), "runs past the end"),
    "invalid JSON": (st_file(b'{"a": '), "not valid JSON"),
    "invalid UTF-8": (st_file(b"\xff\xfe\xfd"), "not valid JSON"),
    "JSON but not an object": (st_file(b"[1, 2]"), "not an object"),
    "duplicate tensor name": (st_file(b'{"a": 1, "a": 2}'), "duplicate key 'a'"),
    "entry without fields": (st_file({"a": {"dtype": "F32"}}), "needs dtype, shape and data_offsets"),
    "unknown dtype": (st_file({"a": entry("F128", [1], 0, 16)}, bytes(16)), "unknown dtype 'F128'"),
    "negative shape": (st_file({"a": entry("F32", [-1, 2], 0, 8)}, bytes(8)), "non-negative integers"),
    "float in shape": (st_file({"a": entry("F32", [2.0], 0, 8)}, bytes(8)), "non-negative integers"),
    "offsets not a pair": (st_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, b"x"),
                           "expected \\[begin, end\\]"),
    "shape disagrees with bytes": (st_file({"a": entry("F32", [3], 0, 8)}, bytes(8)), "needs 12 bytes"),
    "huge shape, tiny data": (st_file({"a": entry("F32", [2**40, 2**40], 0, 8)}, bytes(8)), "needs"),
    "offsets beyond the buffer": (st_file({"a": entry("F32", [4], 0, 16)}, bytes(8)), "outside"),
    "offsets reversed": (st_file({"a": entry("U8", [0], 8, 4)}, bytes(8)), "outside"),
    "overlapping tensors": (st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
                            "overlaps"),
    "gap between tensors": (st_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
                            "gap"),
    "bytes nobody owns": (st_file({"a": entry("F32", [1], 0, 4)}, bytes(8)), "cover 4 bytes"),
    "metadata not strings": (st_file({"__metadata__": {"a": 1}}), "__metadata__"),
    "BOOL byte other than 0/1": (st_file({"a": entry("BOOL", [2], 0, 2)}, b"\x01\x07"), "BOOL"),
}


@pytest.mark.parametrize("content, match", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_broken_or_hostile_file_gives_one_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsError, match=match) as err:
        read_safetensors(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


@pytest.mark.parametrize("length", [2**62, 150 * 2**20], ids=["2**62", "150MB"])
def test_a_huge_header_length_is_rejected_before_any_allocation(tmp_path, length):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.truncate(8 + 200 * 2**20)  # sparse: the file really is long enough for a 150 MB header
    tracemalloc.start()
    with pytest.raises(SafetensorsError, match="exceeds"):
        read_safetensors(path)
    assert tracemalloc.get_traced_memory()[1] < 2**20
    tracemalloc.stop()


def test_saved_conv1d_weights_are_views_not_copies_and_an_untied_lm_head_cannot_be_saved():
    """Names and [in, out] storage are checked by loading (test_gpt2) and the round trip below; a copy of
    gpt2-xl's transposed weights would take 5.9 GB more on a GPU."""
    model = tiny_gpt()
    sd, params = gpt2_state_dict(model), model.state_dict()
    assert "lm_head.weight" not in sd and sd["transformer.h.0.attn.c_attn.weight"].shape == (16, 48)
    assert all(t.data_ptr() == params[k].data_ptr() for k, t in sd.items())
    model.lm_head.weight = torch.nn.Parameter(torch.randn(61, 16))
    with pytest.raises(ValueError, match="not tied"):  # GPT-2 files have no room for it
        gpt2_state_dict(model)


@pytest.mark.parametrize("heads_kind", ["no heads", "shared lm_head", "own lm_head", "hydra", "saved before kinds"])
def test_save_then_load_gives_identical_logits_and_the_heads_config_says_their_kind(tmp_path, heads_kind):
    model, kind = tiny_gpt(), "hydra" if heads_kind == "hydra" else "medusa"
    heads = None if heads_kind == "no heads" else tiny_heads(model, own_lm_head=heads_kind == "own lm_head", kind=kind)
    extra = {"tokenizer": "bpe-61", "step": 100}
    save_checkpoint(tmp_path, model, heads=heads, extra=extra, eos_token_id=60)
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | (HEADS_FILES if heads else set())
    if heads is not None:
        heads_config = json.loads((tmp_path / "medusa_config.json").read_text())
        assert heads_config.pop("kind") == kind
        if heads_kind == "saved before kinds":  # such heads are Medusa's
            (tmp_path / "medusa_config.json").write_text(json.dumps(heads_config))
    model2, heads2, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == extra and config["eos_token_id"] == 60 and model2.config == model.config
    assert (config["model_type"], config["architectures"]) == ("gpt2", ["GPT2LMHeadModel"])
    assert (heads2 is None) == (heads is None) and type(heads2) is type(heads)
    for a, b in zip(outputs(model, heads), outputs(model2, heads2), strict=True):
        assert torch.equal(a, b)
    assert model2.lm_head.weight is model2.transformer.wte.weight
    assert read_safetensors_metadata(tmp_path / "model.safetensors") == {"format": "pt"}  # transformers needs it


@pytest.mark.parametrize("failing", ["config.json", "medusa_heads.safetensors", "medusa_config.json", "writer"])
def test_a_save_failing_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, failing):
    old = tiny_gpt(seed=0)
    old_heads = tiny_heads(old, own_lm_head=True)
    save_checkpoint(tmp_path, old, heads=old_heads, extra={"version": 1})
    new, real = tiny_gpt(seed=5), os.replace

    def replace(src, dst):
        if os.path.basename(dst) == failing and str(src).endswith(".tmp"):
            raise OSError(f"disk full while replacing {failing}")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    # "writer": the other files are already staged when config.json cannot be written
    extra = {"version": object() if failing == "writer" else 2}
    with pytest.raises(TypeError if failing == "writer" else OSError):
        save_checkpoint(tmp_path, new, heads=tiny_heads(new, own_lm_head=True, seed=9), extra=extra)
    monkeypatch.undo()
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | HEADS_FILES, "no temporary files left behind"
    model, heads, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == {"version": 1}
    for a, b in zip(outputs(old, old_heads), outputs(model, heads), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, content, match", [
    ("config.json", None, "config.json is missing"),
    ("config.json", b"{not json", "config.json is not readable JSON"),
    ("config.json", b"[]", "config.json does not hold a JSON object"),
    ("config.json", {"model_type": "llama"}, "model_type is 'llama'"),  # a dict: a change to the saved config
    ("config.json", {"activation_function": "relu"}, "activation_function 'relu'"),
    ("config.json", {"n_inner": 7}, "n_inner"),
    ("config.json", {"tie_word_embeddings": False}, "tie_word_embeddings"),
    ("config.json", {"n_layer": None}, "invalid value"),
    ("config.json", {"n_head": "delete"}, "missing 'n_head'"),
    ("model.safetensors", None, "holds neither model.safetensors nor pytorch_model.bin"),
    ("model.safetensors", b"\x00" * 5, "too short"),
    ("medusa_config.json", b'{"num_heads": 3, "n_embd": 8, "vocab_size": 61, "own_lm_head": false}',
     "n_embd=8"),
    ("medusa_config.json", b'{"num_heads": 4, "n_embd": 16, "vocab_size": 61, "own_lm_head": false}',
     "lacks tensor 'blocks.3.linear.weight'"),
    ("medusa_config.json", b'{"heads": 4}', "unknown fields"),
    ("medusa_config.json", b'{"num_heads": 3, "n_embd": 16, "vocab_size": 61, "kind": "eagle"}', "unknown head kind"),
    ("medusa_config.json", b'{"num_heads": 3, "n_embd": 16, "vocab_size": 61, "kind": "hydra"}',
     "lacks tensor 'blocks.0.linear.weight'|shape"),
    ("medusa_heads.safetensors", None, "medusa_heads.safetensors is missing"),
])
def test_a_broken_or_missing_checkpoint_gives_a_one_line_error_naming_it(tmp_path, name, content, match):
    model = tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(model))
    path = tmp_path / name
    if isinstance(content, dict):
        changed = {**json.loads(path.read_text()), **content}
        content = json.dumps({k: v for k, v in changed.items() if v != "delete"}).encode()
    path.unlink() if content is None else path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_transformers_loads_a_saved_checkpoint_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(model), eos_token_id=60)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(hf(IDS).logits, outputs(model)[0], atol=1e-4)


def test_saving_heads_again_can_keep_the_backbone_file_untouched_and_saving_none_removes_them(tmp_path):
    model = tiny_gpt()
    heads = tiny_heads(model)
    save_checkpoint(tmp_path, model, heads=heads)
    weights = tmp_path / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.read_bytes())
    with torch.no_grad():
        heads.blocks[0].linear.bias.fill_(0.5)
    save_checkpoint(tmp_path, model, heads=heads, write_model=False)
    assert (weights.stat().st_mtime_ns, weights.read_bytes()) == before
    assert torch.all(load_checkpoint(tmp_path)[1].blocks[0].linear.bias == 0.5)
    save_checkpoint(tmp_path, model)  # heads from an earlier save would not belong to this model
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES and load_checkpoint(tmp_path)[1] is None
