"""Checkpoints: a saved model and its heads (draft vocabulary included) reload with identical logits, a
broken directory gives one line naming the file, and a failed save never damages the previous one."""

import io
import json
import os
import struct

import pytest
import torch

from conftest import random_heads, save_small_checkpoint, tiny_model
from medusa_mini.heads import next_tokens
from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint
from medusa_mini.io.loading import load_for_decoding, load_prompts, prompt_ids
from medusa_mini.io.safetensors import read_safetensors, write_safetensors
from medusa_mini.model import GPT, GPTConfig

CHECKPOINT_FILES, HEADS_FILES = {"config.json", "model.safetensors"}, {"medusa_heads.safetensors", "medusa_config.json"}
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])  # [B, T]
BROKEN = {  # file: [(what is written there, what the error says)]; a dict updates its JSON ("delete" removes a key)
    "config.json": [(None, "config.json is missing; save the checkpoint again"), (b"{not json", "is not readable JSON"),
        (b"[]", "JSON object"), (b"[" * 10**5, "not readable JSON"),
        ({"model_type": "llama"}, "model_type is 'llama'"), ({"n_head": 0}, "n_head must be an integer > 0, not 0"),
        ({"activation_function": "relu"}, "activation_function='relu'"), ({"n_head": "delete"}, "missing 'n_head'"),
        ({"n_inner": 7}, "n_inner"), ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"scale_attn_weights": False}, "scale_attn_weights"), ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"n_layer": None}, "invalid value"), ({"n_embd": float("inf")}, "invalid"), ({"n_positions": -1}, "-1")],
    "model.safetensors": [(None, "no model.safetensors in"), (b"\x00" * 5, "too short")],
    "medusa_config.json": [
        (None, "medusa_config.json is missing; save the heads again"), ({"n_embd": 8}, "n_embd=8"),  # not "no heads"
        ({"vocab_size": 60}, "vocab_size=60; the"), ({"num_heads": 4}, "lacks tensor 'blocks.3.linear.weight'"),
        (b"[1, 2]", "must be a JSON object"), ({"num_heads": "4"}, "num_heads must be an integer"),
        ({"hidden_act": "relu"}, "unexpected keyword argument 'hidden_act'"), ({"kind": "eagle"}, "unknown head kind"),
        ({"own_lm_head": True}, "own lm_head are no longer supported"), ({"num_heads": "delete"}, "has no num_heads"),
        ({"vocab_size": "delete"}, "has no vocab_size")],
    "medusa_heads.safetensors": [(None, "medusa_heads.safetensors is missing"),
                                 ({"vocab_order": torch.zeros(61, dtype=torch.long)}, "vocab_order is not an order")]}


def randomized(module, seed: int):
    torch.manual_seed(seed)
    for p in module.parameters():  # every tensor random (biases and LayerNorms too), so nothing can hide
        torch.nn.init.normal_(p, 0.0, 0.3)
    return module.eval()


def tiny_gpt(seed: int = 0) -> GPT:
    """A GPT whose LayerNorm epsilon is not GPT-2's: one this large moves the logits, so it must be saved."""
    config = GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=16, layer_norm_epsilon=1e-2)
    return randomized(GPT(config), seed)


def tiny_heads(*, kind: str = "medusa", draft: int = 0, seed: int = 1):
    return randomized(random_heads(tiny_gpt(), num_heads=3, seed=seed, kind=kind, draft=draft), seed)


@torch.no_grad()
def outputs(model: GPT, heads=None) -> list[torch.Tensor]:
    logits, hidden = model(IDS)  # [B, T, V], [B, T, C]
    return [logits] + ([heads(hidden, model, following=next_tokens(IDS, 3))] if heads is not None else [])


@pytest.mark.parametrize("kind, draft", [(None, 0), ("medusa", 0), ("medusa", 20), ("hydra", 20)])
def test_save_then_load_gives_identical_logits_over_the_same_draft_vocabulary(tmp_path, kind, draft):
    model, heads = tiny_gpt(), tiny_heads(kind=kind, draft=draft) if kind else None
    save_checkpoint(tmp_path, model, heads=heads, extra={"tokenizer": "bpe-61", "step": 100}, eos_token_id=60)
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | (HEADS_FILES if heads else set())
    model2, heads2, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == {"tokenizer": "bpe-61", "step": 100}
    assert config["bos_token_id"] == config["eos_token_id"] == 60  # GPT-2's: one token for both
    assert (config["model_type"], config["architectures"]) == ("gpt2", ["GPT2LMHeadModel"])
    assert model2.config == model.config and model2.lm_head.weight is model2.transformer.wte.weight  # epsilon too
    raw = (tmp_path / "model.safetensors").read_bytes()  # transformers needs the format in the metadata
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"] == {"format": "pt"} and "lm_head.weight" not in header  # tied: stored once
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, heads), outputs(model2, heads2), strict=True))


def test_heads_saved_before_draft_vocabularies_load_over_the_whole_vocabulary(tmp_path):
    """The earlier format (no vocab_order; own_lm_head false) still loads, with identical logits."""
    save_checkpoint(tmp_path, model := tiny_gpt(), heads=(heads := tiny_heads()))
    fields = json.loads((tmp_path / "medusa_config.json").read_text())
    del fields["draft_vocab_size"]
    (tmp_path / "medusa_config.json").write_text(json.dumps({**fields, "own_lm_head": False}))
    tensors = {k: v for k, v in read_safetensors(tmp_path / "medusa_heads.safetensors").items() if k != "vocab_order"}
    with open(tmp_path / "medusa_heads.safetensors", "wb") as f:
        write_safetensors(f, tensors)
    model2, heads2, _ = load_checkpoint(tmp_path)
    assert len(heads2.draft_ids) == 61 and torch.equal(outputs(model, heads)[1], outputs(model2, heads2)[1])


@pytest.mark.parametrize("failing", ["config.json", "medusa_heads.safetensors", "medusa_config.json", "writer",
                                     "config.json, saving no heads"])  # two files: model.safetensors goes back too
def test_a_save_failing_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, failing):
    old, old_heads, new_heads = tiny_gpt(seed=0), tiny_heads(draft=20), None if "," in failing else tiny_heads(seed=9)
    save_checkpoint(tmp_path, old, heads=old_heads, extra={"version": 1})
    renamed = []

    def replace(src, dst, real=os.replace):
        assert os.path.dirname(src) == os.path.dirname(dst)  # a sibling: a rename across filesystems fails
        renamed.extend([os.path.basename(dst)] * str(src).endswith(".tmp"))
        if failing.startswith(os.path.basename(dst)) and str(src).endswith(".tmp"):
            raise KeyboardInterrupt(f"Ctrl-C while replacing {failing}")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    extra = {"version": object() if failing == "writer" else 2}  # "writer": config.json's, the rest staged
    with pytest.raises(TypeError if failing == "writer" else KeyboardInterrupt):
        save_checkpoint(tmp_path, tiny_gpt(seed=5), heads=new_heads, extra=extra)
    monkeypatch.undo()
    assert failing != "config.json" or renamed == ["model.safetensors", "medusa_heads.safetensors",
                                                   "medusa_config.json", "config.json"]  # config.json last
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES | HEADS_FILES, "no temporary files left behind"
    model, heads, config = load_checkpoint(tmp_path)
    assert config["medusa_mini"] == {"version": 1} and {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o644}
    assert all(torch.equal(a, b) for a, b in zip(outputs(old, old_heads), outputs(model, heads), strict=True))


@pytest.mark.parametrize("name, content, match", [(name, *case) for name, cases in BROKEN.items() for case in cases])
def test_a_broken_or_missing_checkpoint_gives_one_line_naming_it(tmp_path, name, content, match):
    save_checkpoint(tmp_path, tiny_gpt(), heads=tiny_heads())
    path = tmp_path / name
    if isinstance(content, dict) and name.endswith(".safetensors"):  # tensors replaced
        write_safetensors(buffer := io.BytesIO(), {**read_safetensors(path), **content})
        content = buffer.getvalue()
    elif isinstance(content, dict):
        changed = {**json.loads(path.read_text()), **content}
        content = json.dumps({k: v for k, v in changed.items() if v != "delete"}).encode()
    path.unlink() if content is None else path.write_bytes(content)
    err = pytest.raises(ValueError, load_checkpoint, tmp_path)
    assert err.match(match) and str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_transformers_loads_a_saved_checkpoint_with_equal_logits(tmp_path):
    transformers, model = pytest.importorskip("transformers"), tiny_gpt()
    save_checkpoint(tmp_path, model, heads=tiny_heads(), eos_token_id=60)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.allclose(hf(IDS).logits, outputs(model)[0], atol=1e-4)


def test_saving_heads_again_can_keep_the_backbone_file_untouched_and_saving_none_removes_them(tmp_path):
    save_checkpoint(tmp_path, model := tiny_gpt(), heads=(heads := tiny_heads()))
    before = ((weights := tmp_path / "model.safetensors").stat().st_mtime_ns, weights.read_bytes())
    torch.nn.init.constant_(heads.blocks[0].linear.bias, 0.5)
    save_checkpoint(tmp_path, model, heads=heads, write_model=False)
    assert (weights.stat().st_mtime_ns, weights.read_bytes()) == before
    assert torch.all(load_checkpoint(tmp_path)[1].blocks[0].linear.bias == 0.5)
    save_checkpoint(tmp_path, other := tiny_gpt(seed=5))  # heads from an earlier save would not belong to it
    back, heads_back, config = load_checkpoint(tmp_path)
    assert set(os.listdir(tmp_path)) == CHECKPOINT_FILES and heads_back is None and config["medusa_mini"] == {}
    assert torch.equal(back.lm_head.weight, other.lm_head.weight)  # write_model=False spares only a frozen backbone
    pytest.raises(ValueError, save_checkpoint, tmp_path, tiny_model()).match("not tied")  # GPT-2 files: one matrix
    save_checkpoint(tmp_path / "new", model, heads=heads, write_model=False)  # no backbone file to keep: written
    assert torch.equal(load_checkpoint(tmp_path / "new")[0].lm_head.weight, model.lm_head.weight)


def test_prompts_json_gives_token_ids_cut_to_leave_room_for_the_new_tokens_and_a_bad_one_is_a_clear_error(tmp_path,
                                                                                                         monkeypatch):
    save_small_checkpoint(tmp_path)  # block size 64, no eot_id saved: the tokenizer's own
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    ck = load_for_decoding(f"~/{tmp_path.name}", device="meta", dtype=torch.bfloat16)  # ~: as --ckpt=~/... reaches it
    assert {(p.device.type, p.dtype) for p in [*ck.model.parameters(), *ck.heads.parameters()]} == {
        ("meta", torch.bfloat16)}  # all on `device`, in `dtype`
    assert prompt_ids(ck, count=3, max_new_tokens=63) == [  # each prompt's end: room for 63 new tokens of 64
        ck.enc.encode_ordinary(t)[-1:] for t in ("the cat sat", "on the mat and", "the dog")]
    pytest.raises(ValueError, prompt_ids, ck, count=1, max_new_tokens=64).match("leaves no room for a prompt in 64")
    assert ck.eot_id == ck.enc.eot_token
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": ["", "the dog<|endoftext|>"]}))  # empty: left out
    assert prompt_ids(ck, count=2, max_new_tokens=8) == [ck.enc.encode_ordinary("the dog<|endoftext|>")]
    for bad in ([], ["a", 5], "a"):
        (tmp_path / "prompts.json").write_text(json.dumps({"prompts": bad}))
        pytest.raises(ValueError, load_prompts, str(tmp_path)).match("must hold")
    for eot_id in (300, -1):  # vocabulary 300
        (tmp_path / "config.json").write_text(json.dumps(ck.config | {"medusa_mini": {"eot_id": eot_id}}))
        pytest.raises(ValueError, load_for_decoding, str(tmp_path), device="cpu").match(f"eot_id {eot_id} is no")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())  # a tokenizer of more tokens than the model
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"special_tokens": {"<|endoftext|>": 300}}))
    pytest.raises(ValueError, load_for_decoding, str(tmp_path), device="cpu").match("do not belong together")
