"""GPT-2's file layout: tensors and config as a transformers GPT2LMHeadModel stores them, and back. Its four
projections are Conv1D layers, weights stored [in, out]; this GPT's are nn.Linear ([out, in]) under the same
names, so exactly those four are transposed. The lm_head is the token embedding (tied): not stored."""

from __future__ import annotations

import torch

from ..model import GPT, GPTConfig

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers saved with the weights
_PREFIX = "transformer."


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The tensors of a GPT2LMHeadModel file: no lm_head, Conv1D weights [in, out]. All are views, so that
    saving from a GPU takes no second copy of the weights there."""
    wte, lm_head = model.transformer.wte.weight, model.lm_head.weight
    if lm_head is not wte and not torch.equal(lm_head, wte):
        raise ValueError("lm_head.weight is not tied to transformer.wte.weight; GPT-2 files cannot hold it")
    return {key: t.t() if key.endswith(_CONV1D) else t
            for key, t in model.state_dict().items() if key != "lm_head.weight"}


def check_tensors(expected: dict[str, tuple], found: dict[str, torch.Tensor], *, fits: str) -> None:
    """A one-line ValueError for the first missing, unexpected or misshaped tensor; `fits` names the owner."""
    missing, unexpected = [k for k in expected if k not in found], [k for k in found if k not in expected]
    for keys, what in ((missing, "lacks tensor {}, which {} needs"), (unexpected, "has tensor {}, which {} lacks")):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise ValueError("checkpoint " + what.format(repr(keys[0]) + more, fits))
    for key, shape in expected.items():
        if tuple(found[key].shape) != tuple(shape):
            raise ValueError(f"tensor {key!r} has shape {list(found[key].shape)} in the checkpoint but {fits} "
                             f"needs {list(shape)}")


def load_gpt2_weights(model: GPT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy GPT-2-layout tensors, keys with or without the "transformer." prefix, into `model`. Everything
    is checked before anything is copied, so a failed load leaves the model untouched."""
    found: dict[str, torch.Tensor] = {}
    lm_head = None  # tied: equal to wte if a file holds it
    for key, t in tensors.items():
        short = key.removeprefix(_PREFIX)
        if short == "lm_head.weight":
            lm_head = t
        elif not short.endswith(_BUFFERS):
            if short in found:
                raise ValueError(f"tensor {short!r} appears both with and without the 'transformer.' prefix")
            found[short] = t
    params = {k.removeprefix(_PREFIX): p for k, p in model.state_dict().items() if k.startswith(_PREFIX)}
    check_tensors({k: p.shape[::-1] if k.endswith(_CONV1D) else p.shape for k, p in params.items()}, found,
                  fits=f"this GPT ({model.config})")
    wte = found["wte.weight"]
    if lm_head is not None and not torch.equal(lm_head.to(wte.device, wte.dtype), wte):
        raise ValueError("lm_head.weight differs from wte.weight; this GPT ties them, so it cannot load it")
    with torch.no_grad():
        for key, p in params.items():  # state_dict tensors share storage with the parameters
            p.copy_(found[key].t() if key.endswith(_CONV1D) else found[key])


def gpt2_config_dict(model: GPT, *, eos_token_id: int | None = None) -> dict:
    """The config.json of a transformers GPT-2 shaped like `model`; `eos_token_id` is also its bos id."""
    c = model.config
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
            "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
            "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
            "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
            "torch_dtype": str(model.transformer.wte.weight.dtype).removeprefix("torch.")}


def config_from_gpt2_dict(d: object) -> GPTConfig:
    """GPTConfig from a GPT-2 config.json; a ValueError for anything this GPT cannot reproduce."""
    if not isinstance(d, dict):
        raise ValueError("a GPT-2 config must be a JSON object")
    if d.get("model_type") != "gpt2":
        raise ValueError(f"model_type is {d.get('model_type')!r}; only 'gpt2' models can be loaded")
    try:
        n_embd = int(d["n_embd"])
        block_size = int(d["n_positions"] if "n_positions" in d else d["n_ctx"])
        config = GPTConfig(vocab_size=int(d["vocab_size"]), block_size=block_size, n_layer=int(d["n_layer"]),
                           n_head=int(d["n_head"]), n_embd=n_embd,
                           layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)))
    except KeyError as e:
        raise ValueError(f"GPT-2 config is missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"GPT-2 config has an invalid value: {e}") from None
    unsupported = {  # this GPT's MLP is 4 C wide with tanh-GELU, and its attention scales by 1/sqrt(hs)
        "activation_function": d.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
        "n_inner": d.get("n_inner") not in (None, 4 * n_embd),
        "tie_word_embeddings": d.get("tie_word_embeddings", True) is not True,
        "scale_attn_weights": d.get("scale_attn_weights", True) is not True,
        "scale_attn_by_inverse_layer_idx": d.get("scale_attn_by_inverse_layer_idx", False) is not False,
    }
    for field, bad in unsupported.items():
        if bad:
            raise ValueError(f"GPT-2 config sets {field}={d[field]!r}, which this GPT does not implement")
    return config
