"""OpenAI's GPT-2 as a `GPT`: its four configs, its file layout, and its weights from local files or the Hugging Face
hub, downloaded resumably into `$MEDUSA_MINI_CACHE` (default ~/.cache/medusa_mini; `MEDUSA_MINI_HUB_URL` replaces
https://huggingface.co). Its tokenizer is tiktoken's "gpt2", fetched by tiktoken from its own host (offline: its files
in `$TIKTOKEN_CACHE_DIR`). The file layout is transformers' GPT2LMHeadModel: its four Conv1D weights are stored
[in, out], this GPT's nn.Linear [out, in], so those are transposed; lm_head is wte (tied)."""

import http.client
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace

import torch

from ..model import GPT, GPTConfig
from .files import read_json, remove_file
from .safetensors import read_safetensors

GPT2_CONFIGS: dict[str, GPTConfig] = {
    name: GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    for name, n_layer, n_head, n_embd in [("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024),
                                          ("gpt2-large", 36, 20, 1280), ("gpt2-xl", 48, 25, 1600)]}
RETRIES = 2  # resumptions or restarts of a broken download within one call
META_ABOVE = 50_000_000  # parameters: a larger model is built on the meta device (`load_gpt2`)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers saved with the weights
_PREFIX = "transformer."


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel file's tensors (see above), all views: saving from a GPU takes no second copy there."""
    wte, lm_head = model.transformer.wte.weight, model.lm_head.weight
    if lm_head is not wte and not torch.equal(lm_head, wte):
        raise ValueError("lm_head.weight is not tied to transformer.wte.weight; GPT-2 files cannot hold it")
    return {k: t.t() if k.endswith(_CONV1D) else t for k, t in model.state_dict().items() if k != "lm_head.weight"}


def check_tensors(expected: dict[str, tuple], found: dict[str, torch.Tensor], *, fits: str) -> None:
    """A one-line ValueError for the first missing, unexpected or misshaped tensor; `fits` names the owner."""
    missing, unexpected = [k for k in expected if k not in found], [k for k in found if k not in expected]
    for keys, what in ((missing, "lacks tensor {}, which {} needs"), (unexpected, "has tensor {}, which {} lacks")):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise ValueError("checkpoint " + what.format(repr(keys[0]) + more, fits))
    for key, shape in expected.items():
        if (got := list(found[key].shape)) != list(shape):
            raise ValueError(f"tensor {key!r} has shape {got} in the checkpoint but {fits} needs {list(shape)}")


def load_gpt2_weights(model: GPT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy GPT-2-layout tensors (keys with or without "transformer.") into `model`; a failed load changes nothing."""
    names = Counter(k.removeprefix(_PREFIX) for k in tensors if not k.endswith(_BUFFERS))  # buffers: made, not read
    if twice := [name for name, n in names.items() if n > 1]:
        raise ValueError(f"tensor {twice[0]!r} appears both with and without the 'transformer.' prefix")
    found = {k.removeprefix(_PREFIX): t for k, t in tensors.items() if not k.endswith(_BUFFERS)}
    lm_head = found.pop("lm_head.weight", None)  # tied: equal to wte if a file holds it
    views = {k.removeprefix(_PREFIX): t for k, t in gpt2_state_dict(model).items()}  # GPT-2 file shapes
    check_tensors({k: t.shape for k, t in views.items()}, found, fits=f"this GPT ({model.config})")
    wte = found["wte.weight"]
    if lm_head is not None and not torch.equal(lm_head.to(wte.device, wte.dtype), wte):
        raise ValueError("lm_head.weight differs from wte.weight; this GPT ties them, so it cannot load it")
    with torch.no_grad():
        for key, view in views.items():  # state_dict tensors share storage with the parameters
            view.copy_(found[key])


def gpt2_config_dict(model: GPT, *, eos_token_id: int | None = None) -> dict:
    """The config.json of a transformers GPT-2 shaped like `model`; `eos_token_id` is also its bos id."""
    c, dtype = model.config, str(model.transformer.wte.weight.dtype).removeprefix("torch.")
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=c.vocab_size, n_positions=c.block_size,
                n_ctx=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, n_inner=None,
                activation_function="gelu_new", layer_norm_epsilon=c.layer_norm_epsilon, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.02, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, tie_word_embeddings=True,
                use_cache=True, bos_token_id=eos_token_id, eos_token_id=eos_token_id, torch_dtype=dtype)


def read_gpt2_config(path: str) -> GPTConfig:
    """GPTConfig from a GPT-2 config.json; a ValueError naming the file for anything this GPT cannot reproduce."""
    d = read_json(path, hint="save the checkpoint again (a GPT-2 folder: its config.json beside the weights)")
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a GPT-2 config must be a JSON object")
    if d.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {d.get('model_type')!r}; only 'gpt2' models can be loaded")
    try:
        config = GPTConfig(block_size=int(d["n_positions"] if "n_positions" in d else d["n_ctx"]),
                           vocab_size=int(d["vocab_size"]), n_layer=int(d["n_layer"]), n_head=int(d["n_head"]),
                           n_embd=int(d["n_embd"]), layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)))
    except KeyError as e:
        raise ValueError(f"{path}: GPT-2 config is missing {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:  # the last: an infinite size
        raise ValueError(f"{path}: GPT-2 config has an invalid value: {e}") from None
    supported = {  # this GPT's MLP is 4 C wide with tanh-GELU, and its attention scales by 1/sqrt(hs)
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"), "n_inner": (None, 4 * config.n_embd),
        "tie_word_embeddings": (True,), "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,)}
    if bad := [field for field, values in supported.items() if field in d and d[field] not in values]:
        raise ValueError(f"{path}: GPT-2 config sets {bad[0]}={d[bad[0]]!r}, which this GPT does not implement")
    return config


def _copy_body(resp, f, *, done: int, total: int | None, label: str) -> None:
    """Append the response body to `f`, showing progress on stderr every half second."""
    start, t0, shown, chunk = done, time.monotonic(), 0.0, None
    while chunk != b"":  # b"": the body has ended
        try:
            chunk = resp.read(1 << 20)
        except (OSError, http.client.HTTPException) as e:
            raise ConnectionError(f"{type(e).__name__}: {e}") from None
        f.write(chunk)
        done += len(chunk)
        if not chunk or time.monotonic() - shown > 0.5:
            shown = time.monotonic()
            size = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if total else f"{done / 1e6:.1f} MB"
            rate = (done - start) / max(shown - t0, 1e-9) / 1e6
            print(f"\r{label}: {size}, {rate:.1f} MB/s", end="" if chunk else "\n", file=sys.stderr, flush=True)
    if total is not None and done < total:  # http.client returns b"" when a server closes early instead of raising
        raise ConnectionError(f"connection closed after {done} of {total} bytes")


def _fetch(url: str, part: str) -> None:
    """Fetch `url` into `part`, resuming what is there with a Range request; a ConnectionError is worth a retry."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    headers = {"User-Agent": "medusa_mini", **({"Range": f"bytes={have}-"} if have else {})}
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and have:  # nothing after our partial file: it is complete, or not this file's
            if re.fullmatch(rf"bytes \*/{have}", (e.headers.get("Content-Range") or "").strip()):
                return
            remove_file(part)
            raise ConnectionError("the partial file is longer than the file") from None
        raise OSError(f"HTTP {e.code} {e.reason} for {url}") from None
    except OSError as e:
        raise OSError(f"cannot connect to {url}: {getattr(e, 'reason', e)}") from None
    with resp:
        m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
        if resp.status != 206:  # no Range asked, or the server ignored it: start over
            have, m = 0, None
        elif not (have and m and int(m.group(1)) == have):
            remove_file(part)
            raise ConnectionError("the server sent a part that was not asked for")
        length = m.group(2) if m else resp.headers.get("Content-Length", "")  # the whole file's, if known
        with open(part, "ab" if have else "wb") as f:
            _copy_body(resp, f, done=have, total=int(length) if length.isdigit() else None, label=os.path.basename(url))
            f.flush()
            os.fsync(f.fileno())


def download(url: str, dest: str | os.PathLike) -> None:
    """Download `url` to `dest` via `dest + ".part"`, which a broken connection leaves for the next call to resume."""
    part = f"{dest}.part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    for attempt in range(RETRIES + 1):
        try:
            _fetch(url, part)
            break
        except ConnectionError as e:
            if attempt == RETRIES:
                raise OSError(f"download of {url} interrupted ({e}); run again to resume") from None
            time.sleep(0.5 * 2**attempt)
    os.replace(part, dest)


def download_gpt2(name: str) -> str:
    """The cache folder holding `name`'s config.json and model.safetensors, downloading what it lacks."""
    if name not in GPT2_CONFIGS:
        raise ValueError(f"{name!r} is no local file or directory, nor one of {', '.join(GPT2_CONFIGS)}")
    folder = os.path.join(os.path.expanduser(os.environ.get("MEDUSA_MINI_CACHE") or "~/.cache/medusa_mini"), name)
    hub = (os.environ.get("MEDUSA_MINI_HUB_URL") or "https://huggingface.co").rstrip("/")
    for file, check in (("config.json", read_gpt2_config), ("model.safetensors", read_safetensors)):
        if not os.path.exists(dest := os.path.join(folder, file)):
            download(f"{hub}/{name}/resolve/main/{file}", dest)
            try:  # a proxy's login page, a file cut short by a server that sent no length: never kept
                check(dest)
            except ValueError as e:
                remove_file(dest)
                raise ValueError(f"{e} (downloaded from {hub}, then deleted)") from None
    return folder


def infer_gpt2_config(tensors: dict[str, torch.Tensor]) -> GPTConfig:
    """GPTConfig from GPT-2-layout tensor shapes; n_head, which they cannot tell, from the GPT-2 of that shape."""
    short = {k.removeprefix(_PREFIX): t for k, t in tensors.items()}
    if any(k not in short or short[k].dim() != 2 for k in ("wte.weight", "wpe.weight")):  # embedding matrices
        raise ValueError("tensors lack wte.weight / wpe.weight matrices; not a GPT-2 layout")
    vocab_size, n_embd = short["wte.weight"].shape
    n_layer = max((int(m.group(1)) + 1 for k in short if (m := re.match(r"h\.(\d+)\.", k))), default=0)
    if not (known := [c for c in GPT2_CONFIGS.values() if (c.n_layer, c.n_embd) == (n_layer, n_embd)]):
        raise ValueError(f"cannot tell n_head of a GPT-2 with n_layer={n_layer}, n_embd={n_embd}; "
                         "put its config.json beside the weights file")
    return replace(known[0], vocab_size=vocab_size, block_size=short["wpe.weight"].shape[0])


def load_gpt2(name_or_path: str | os.PathLike, *, device: torch.device | str = "cpu") -> GPT:
    """GPT-2 in eval mode from a directory (config.json + model.safetensors), a .safetensors file or a hub name:
    gpt2, gpt2-medium, gpt2-large, gpt2-xl (downloaded once). The hub ships each as safetensors: no pickle is read."""
    path = os.path.expanduser(os.fspath(name_or_path))
    path = path if os.path.exists(path) else download_gpt2(path)
    weights = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    if not weights.endswith(".safetensors") or not os.path.isfile(weights):
        sharded = os.path.isfile(os.path.join(os.path.dirname(weights), "model.safetensors.index.json"))
        raise ValueError(f"no model.safetensors in {path}: GPT-2 weights are read from safetensors only, one file " + (
            "(save them unsharded: save_pretrained(..., max_shard_size='100GB'))" if sharded else "(convert a "
            "pytorch_model.bin: save_file({k: v for k, v in torch.load(p).items() if k != 'lm_head.weight'}, ...))"))
    config_path = os.path.join(os.path.dirname(weights), "config.json")  # a directory needs one, a lone file not
    config = read_gpt2_config(config_path) if os.path.isfile(config_path) or os.path.isdir(path) else None
    tensors = read_safetensors(weights)
    config = config or infer_gpt2_config(tensors)  # a bare weights file: its shapes say which GPT-2 it is
    # GPT-2's random init takes seconds (gpt2: 3 s on two CPU cores), skipped on the meta device, whose normal_ imports
    # torch's compiler (2 s): a small model is drawn, in ms, on a fork of the CPU generator (the global one untouched).
    approx_params = 12 * config.n_layer * config.n_embd**2 + config.vocab_size * config.n_embd  # blocks, wte
    with torch.random.fork_rng(devices=[]), torch.device("meta" if approx_params > META_ABOVE else "cpu"):
        model = GPT(config).to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight  # to_empty gave the tied pair separate storage
    try:
        load_gpt2_weights(model, tensors)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    return model.eval()
