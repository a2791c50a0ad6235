"""Checkpoints: safetensors files byte for byte as documented, hostile files rejected with one clear
error, saved models (with or without Medusa heads) reloaded with identical logits, and a save that
fails midway never damages the checkpoint already in the directory."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest
import torch

from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.io.checkpoint import (
    SafetensorsError,
    load_checkpoint,
    load_heads,
    read_safetensors,
    read_safetensors_metadata,
    save_checkpoint,
    write_safetensors,
)
from medusa_mini.io.gpt2_layout import (
    config_from_gpt2_dict,
    gpt2_config_dict,
    gpt2_state_dict,
)
from medusa_mini.model import GPT, GPTConfig

CHECKPOINT_FILES = {"config.json", "model.safetensors"}
HEADS_FILES = {"medusa_heads.safetensors", "medusa_config.json"}
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # every tensor random (biases and LayerNorms too), so nothing can hide
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def tiny_heads(model: GPT, *, own_lm_head: bool, seed: int = 1) -> MedusaHeads:
    torch.manual_seed(seed)
    config = HeadsConfig(num_heads=3, n_embd=16, vocab_size=61, own_lm_head=own_lm_head)
    heads = MedusaHeads(config, lm_head_weight=model.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.3)
    return heads.eval()


@torch.no_grad()
def outputs(model: GPT, heads: MedusaHeads | None = None) -> list[torch.Tensor]:
    logits, hidden = model(IDS)
    return [logits] + ([heads(hidden, model.lm_head)] if heads is not None else [])


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


# ----------------------------------------------------------------------------- safetensors


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype is not torch.uint8 else 0, 100, shape, dtype=dtype)


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_safetensors_round_trip_keeps_dtype_shape_and_every_bit(tmp_path, dtype):
    tensors = {"matrix": sample(dtype, (3, 5)), "scalar": sample(dtype, ()), "empty": sample(dtype, (0, 4))}
    write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"format": "pt"})
    back = read_safetensors(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)
    assert read_safetensors_metadata(tmp_path / "t.safetensors") == {"format": "pt"}


def test_written_file_has_the_documented_byte_layout(tmp_path):
    tensors = {"a": torch.randn(2, 3), "b": torch.arange(5), "c": torch.tensor([1, 2, 255]).to(torch.uint8)}
    write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"note": "hi"})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header padded so the data starts 8-byte aligned"
    text = raw[8 : 8 + n].decode("utf-8")
    assert set(text[len(text.rstrip(" ")) :]) <= {" "}, "padding is spaces"
    header = json.loads(text)
    assert header.pop("__metadata__") == {"note": "hi"}
    data = raw[8 + n :]
    expected = {"a": ("F32", "<f4"), "b": ("I64", "<i8"), "c": ("U8", "u1")}
    covered = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype, np_dtype = expected[name]
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == dtype and entry["shape"] == list(tensors[name].shape)
        assert begin == covered, "tensors tile the buffer in order"
        assert data[begin:end] == tensors[name].numpy().astype(np_dtype).tobytes()
        covered = end
    assert covered == len(data)


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
    "header length absurd": (st_file(b"{}", length=2**62), "exceeds"),
    "invalid JSON": (st_file(b'{"a": '), "not valid JSON"),
    "invalid UTF-8": (st_file(b"\xff\xfe\xfd"), "not valid JSON"),
    "JSON but not an object": (st_file(b"[1, 2]"), "not an object"),
    "duplicate tensor name": (st_file(b'{"a": 1, "a": 2}'), "duplicate key 'a'"),
    "entry without fields": (st_file({"a": {"dtype": "F32"}}), "needs dtype, shape and data_offsets"),
    "unknown dtype": (st_file({"a": entry("F128", [1], 0, 16)}, bytes(16)), "unknown dtype 'F128'"),
    "negative shape": (st_file({"a": entry("F32", [-1, 2], 0, 8)}, bytes(8)), "non-negative integers"),
    "float in shape": (st_file({"a": entry("F32", [2.0], 0, 8)}, bytes(8)), "non-negative integers"),
    "string in shape": (st_file({"a": entry("F32", ["2"], 0, 8)}, bytes(8)), "non-negative integers"),
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
    assert one_line(err).startswith(str(path))


@pytest.mark.parametrize("length", [2**62, 150 * 2**20], ids=["2**62", "150MB"])
def test_a_huge_header_length_is_rejected_before_any_allocation(tmp_path, length):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.truncate(8 + 200 * 2**20)  # sparse: the file really is long enough for a 150 MB header
    tracemalloc.start()
    try:
        with pytest.raises(SafetensorsError, match="exceeds"):
            read_safetensors(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


# ----------------------------------------------------------------------------- GPT-2 layout


def test_state_dict_uses_transformers_gpt2_names_and_conv1d_storage():
    model = tiny_gpt()
    sd = gpt2_state_dict(model)
    per_layer = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]
    names = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    names += [f"h.{i}.{p}" for i in range(2) for p in per_layer]
    assert set(sd) == {"transformer." + n for n in names}, "no lm_head.weight: it is wte"
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (16, 48)  # [in, out]
    assert sd["transformer.h.1.mlp.c_fc.weight"].shape == (16, 64)
    assert sd["transformer.h.1.mlp.c_proj.weight"].shape == (64, 16)
    assert torch.equal(sd["transformer.h.0.attn.c_proj.weight"], model.transformer.h[0].attn.c_proj.weight.T)


def test_the_gpt2_state_dict_is_views_of_the_weights_and_saves_the_same_bytes(tmp_path):
    """No tensor is copied before writing (gpt2-xl's transposed weights would take 5.9 GB more on a
    GPU); the writer transposes each one on the host, and the file holds exactly the transposed bytes."""
    model = tiny_gpt()
    params = dict(model.state_dict())
    sd = gpt2_state_dict(model)
    for key, t in sd.items():
        p = params[key]
        assert t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and t.data_ptr() == p.data_ptr()
    assert not sd["transformer.h.0.mlp.c_fc.weight"].is_contiguous()  # a transposed view, not a copy
    save_checkpoint(tmp_path / "ckpt", model)
    copies = {k: t.contiguous() for k, t in sd.items()}  # what the file held when the copies were made first
    write_safetensors(tmp_path / "copies.safetensors", copies, metadata={"format": "pt"})
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == (tmp_path / "copies.safetensors").read_bytes()
    torch.testing.assert_close(read_safetensors(tmp_path / "ckpt" / "model.safetensors"), copies, rtol=0, atol=0)


def test_an_untied_lm_head_cannot_be_saved_as_gpt2():
    model = tiny_gpt()
    model.lm_head.weight = torch.nn.Parameter(torch.randn(61, 16))
    with pytest.raises(ValueError, match="not tied"):
        gpt2_state_dict(model)


def test_config_json_round_trips_and_names_gpt2():
    config = GPTConfig(vocab_size=61, block_size=32, n_layer=3, n_head=2, n_embd=16)
    d = gpt2_config_dict(config, bos_token_id=7, eos_token_id=7)
    assert d["model_type"] == "gpt2" and d["architectures"] == ["GPT2LMHeadModel"]
    assert d["activation_function"] == "gelu_new" and d["tie_word_embeddings"] is True
    assert (d["n_positions"], d["n_ctx"], d["eos_token_id"], d["resid_pdrop"]) == (32, 32, 7, 0.0)
    assert config_from_gpt2_dict(json.loads(json.dumps(d))) == config


@pytest.mark.parametrize("change, match", [
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"n_inner": 7}, "n_inner"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"n_layer": None}, "invalid value"),
    ({"n_head": "delete"}, "missing 'n_head'"),
])
def test_config_json_this_gpt_cannot_reproduce_or_without_a_required_field_is_rejected(change, match):
    d = {**gpt2_config_dict(GPTConfig()), **change}
    d = {k: v for k, v in d.items() if v != "delete"}
    with pytest.raises(ValueError, match=match):
        config_from_gpt2_dict(d)


# ----------------------------------------------------------------------------- checkpoint directories


@pytest.mark.parametrize("heads_kind", ["no heads", "shared lm_head", "own lm_head"])
def test_save_then_load_gives_identical_logits(tmp_path, heads_kind):
    model = tiny_gpt()
    heads = None if heads_kind == "no heads" else tiny_heads(model, own_lm_head=heads_kind == "own lm_head")
    extra = {"tokenizer": "bpe-61", "step": 100}
    save_checkpoint(tmp_path, model, heads=heads, extra=extra, eos_token_id=60)
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | (HEADS_FILES if heads else set())
    model2, heads2, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == extra and config["eos_token_id"] == 60
    assert (heads2 is None) == (heads is None)
    for a, b in zip(outputs(model, heads), outputs(model2, heads2), strict=True):
        assert torch.equal(a, b)
    assert model2.lm_head.weight is model2.transformer.wte.weight
    assert read_safetensors_metadata(tmp_path / "model.safetensors") == {"format": "pt"}


def test_hydra_heads_round_trip_and_the_config_says_their_kind(tmp_path):
    from medusa_mini.hydra import HydraHeads, make_heads, teacher_forced_logits

    model = tiny_gpt()
    cfg = model.config
    torch.manual_seed(0)
    heads = make_heads(HeadsConfig(num_heads=3, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, kind="hydra")).eval()
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.normal_(0.0, 0.5)
    save_checkpoint(tmp_path, model, heads=heads)
    assert json.loads((tmp_path / "medusa_config.json").read_text())["kind"] == "hydra"
    model2, heads2, _ = load_checkpoint(tmp_path)
    assert isinstance(heads2, HydraHeads)
    x = torch.randint(cfg.vocab_size, (2, 9))
    _, hidden = model(x)
    assert torch.equal(teacher_forced_logits(heads, hidden, x, model), teacher_forced_logits(heads2, hidden, x, model2))


def test_heads_load_alone_next_to_any_backbone_and_those_saved_before_kinds_existed_are_medusa_heads(tmp_path):
    model = tiny_gpt()
    heads = tiny_heads(model, own_lm_head=False)
    save_checkpoint(tmp_path, model, heads=heads)
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    del config["kind"]
    (tmp_path / "medusa_config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path, model)
    assert type(loaded).__name__ == "MedusaHeads"
    assert torch.equal(outputs(model, heads)[1], outputs(model, loaded)[1])


def test_saving_without_heads_removes_heads_of_an_earlier_save(tmp_path):
    model = tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(model, own_lm_head=False))
    save_checkpoint(tmp_path, model)
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES
    assert load_checkpoint(tmp_path)[1] is None


def fail_replace_into(monkeypatch, name: str) -> None:
    real = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == name and str(src).endswith(".tmp"):
            raise OSError(f"disk full while replacing {name}")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("failing", ["config.json", "medusa_heads.safetensors", "medusa_config.json"])
def test_a_save_failing_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, failing):
    old = tiny_gpt(seed=0)
    old_heads = tiny_heads(old, own_lm_head=True)
    save_checkpoint(tmp_path, old, heads=old_heads, extra={"version": 1})
    new = tiny_gpt(seed=5)
    fail_replace_into(monkeypatch, failing)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, new, heads=tiny_heads(new, own_lm_head=True, seed=9), extra={"version": 2})
    monkeypatch.undo()
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | HEADS_FILES, "no temporary files left behind"
    model, heads, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == {"version": 1}
    for a, b in zip(outputs(old, old_heads), outputs(model, heads), strict=True):
        assert torch.equal(a, b)


def test_a_writer_failing_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    old = tiny_gpt(seed=0)
    save_checkpoint(tmp_path, old)
    with pytest.raises(TypeError):  # model.safetensors is already staged when config.json fails
        save_checkpoint(tmp_path, tiny_gpt(seed=5), extra={"not json": object()})
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES
    assert torch.equal(outputs(old)[0], outputs(load_checkpoint(tmp_path)[0])[0])


def corrupt(directory, name: str, content: bytes | None) -> None:
    path = directory / name
    path.unlink() if content is None else path.write_bytes(content)


@pytest.mark.parametrize("name, content, match", [
    ("config.json", None, "config.json is missing"),
    ("config.json", b"{not json", "config.json is not readable JSON"),
    ("config.json", b"[]", "config.json does not hold a JSON object"),
    ("config.json", b'{"model_type": "bert"}', "model_type is 'bert'"),
    ("model.safetensors", None, "model.safetensors is missing"),
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
def test_a_broken_checkpoint_gives_a_one_line_error_naming_the_file(tmp_path, name, content, match):
    model = tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(model, own_lm_head=False))
    corrupt(tmp_path, name, content)
    with pytest.raises(ValueError, match=match) as err:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in one_line(err)


def test_a_missing_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as err:
        load_checkpoint(tmp_path / "nowhere")
    assert "nowhere" in one_line(err)


def test_transformers_loads_a_saved_checkpoint_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(model, own_lm_head=False), eos_token_id=60)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.allclose(hf(IDS).logits, outputs(model)[0], atol=1e-4)


def test_saving_heads_again_can_keep_the_backbone_file_untouched(tmp_path):
    model = tiny_gpt()
    heads = tiny_heads(model, own_lm_head=False)
    save_checkpoint(tmp_path, model, heads=heads)
    weights = tmp_path / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.read_bytes())
    with torch.no_grad():
        heads.blocks[0].linear.bias.fill_(0.5)
    save_checkpoint(tmp_path, model, heads=heads, write_model=False)
    assert (weights.stat().st_mtime_ns, weights.read_bytes()) == before
    _, loaded, _ = load_checkpoint(tmp_path)
    assert torch.all(loaded.blocks[0].linear.bias == 0.5)
