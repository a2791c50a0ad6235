"""OpenAI's GPT-2 as a `GPT`: the four configs, loading from local files or the Hugging Face hub, and a
resumable downloader with a cache.

`load_gpt2("gpt2")` downloads config.json and model.safetensors once into
`$MEDUSA_MINI_CACHE/gpt2/` (default `~/.cache/medusa_mini`); `MEDUSA_MINI_HUB_URL` replaces
https://huggingface.co (a mirror, or a local server in tests). GPT-2's tokenizer is
`tiktoken.get_encoding("gpt2")`.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import torch

from ..model import GPT, GPTConfig
from .gpt2_layout import config_from_gpt2_dict, load_gpt2_weights
from .safetensors import read_safetensors, remove_file

GPT2_CONFIGS: dict[str, GPTConfig] = {
    name: GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    for name, (n_layer, n_head, n_embd) in {
        "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)
    }.items()
}
HUB_URL = "https://huggingface.co"
HUB_FILES = ("config.json", "model.safetensors")


class DownloadError(OSError):
    """A download failed; the message says why in one line."""


class _Interrupted(Exception):
    """The connection broke mid-transfer: the `.part` file holds what arrived and can be resumed."""


def _copy_body(resp, f, *, done: int, total: int | None, label: str, progress: bool) -> None:
    start_done, t0, shown = done, time.monotonic(), 0.0

    def show(end: str) -> None:
        size = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB ({100 * done / total:.0f}%)" if total else f"{done / 1e6:.1f} MB"
        rate = (done - start_done) / max(time.monotonic() - t0, 1e-9)
        print(f"\r{label}: {size}, {rate / 1e6:.1f} MB/s", end=end, file=sys.stderr, flush=True)

    while True:
        try:
            chunk = resp.read(1 << 20)
        except (OSError, http.client.HTTPException) as e:
            raise _Interrupted(f"{type(e).__name__}: {e}") from None
        if not chunk:
            break
        f.write(chunk)
        done += len(chunk)
        if progress and time.monotonic() - shown > 0.5:
            shown = time.monotonic()
            show("")
    if progress:
        show("\n")
    # http.client returns b"" when a server closes early instead of raising, so count the bytes.
    if total is not None and done < total:
        raise _Interrupted(f"connection closed after {done} of {total} bytes")


def _fetch(url: str, part: str, *, expected_size: int | None, progress: bool, timeout: float) -> int | None:
    """Fetch `url` into `part`, resuming what is there; return the size the server announced."""
    for _ in range(2):  # a second round only after throwing away an unusable partial file
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if expected_size is not None and have >= expected_size:
            if have == expected_size:
                return expected_size
            os.remove(part)
            have = 0
        headers = {"User-Agent": "medusa_mini", **({"Range": f"bytes={have}-"} if have else {})}
        try:
            resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 416 and have:  # nothing left after our partial file: complete, or not ours
                m = re.fullmatch(r"bytes \*/(\d+)", (e.headers.get("Content-Range") or "").strip())
                if m and int(m.group(1)) == have:
                    return have
                remove_file(part)
                continue
            raise DownloadError(f"HTTP {e.code} {e.reason} for {url}") from None
        except (urllib.error.URLError, OSError) as e:
            raise DownloadError(f"cannot connect to {url}: {getattr(e, 'reason', e)}") from None
        with resp:
            m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
            if resp.status == 206:
                if not (have and m and int(m.group(1)) == have):  # a part we did not ask for
                    remove_file(part)
                    continue
                mode, total = "ab", (int(m.group(2)) if m.group(2) != "*" else None)
            else:  # no Range asked, or the server ignored it: start over
                length = resp.headers.get("Content-Length", "")
                have, mode, total = 0, "wb", (int(length) if length.isdigit() else None)
            if expected_size is not None and total is not None and total != expected_size:
                raise DownloadError(f"{url} has {total} bytes but {expected_size} were expected")
            with open(part, mode) as f:
                label = os.path.basename(part).removesuffix(".part")
                _copy_body(resp, f, done=have, total=total, label=label, progress=progress)
                f.flush()
                os.fsync(f.fileno())
            return total
    raise DownloadError(f"{url}: the server refused to resume or restart the download")


def download(url: str, dest: str | os.PathLike, *, expected_size: int | None = None, progress: bool = True,
             timeout: float = 30, retries: int = 2) -> str:
    """Download `url` to `dest` via `dest + ".part"`, resuming a partial file with a Range request (up to
    `retries` times; then the .part file stays for the next call). `dest` appears only once the size
    matches `expected_size` or the server's Content-Length. Raises DownloadError."""
    dest = os.fspath(dest)
    part = dest + ".part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    for attempt in range(retries + 1):
        try:
            total = _fetch(url, part, expected_size=expected_size, progress=progress, timeout=timeout)
            break
        except _Interrupted as e:
            if attempt == retries:
                raise DownloadError(f"download of {url} interrupted ({e}); run again to resume") from None
            time.sleep(0.5 * 2**attempt)
    size = os.path.getsize(part)
    want = expected_size if expected_size is not None else total
    if want is not None and size != want:
        os.remove(part)  # complete as far as the server is concerned, yet wrong: do not resume it
        raise DownloadError(f"{url} gave {size} bytes but {want} were expected; the download was discarded")
    os.replace(part, dest)
    return dest


def download_gpt2(name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> str:
    """The cache folder holding `name`'s config.json and model.safetensors, downloading what is missing."""
    if name not in GPT2_CONFIGS:
        raise ValueError(f"unknown GPT-2 model {name!r}; choose one of {', '.join(GPT2_CONFIGS)}")
    if cache_dir is None:
        cache_dir = os.environ.get("MEDUSA_MINI_CACHE") or os.path.expanduser("~/.cache/medusa_mini")
    folder = os.path.join(os.fspath(cache_dir), name)
    base = (os.environ.get("MEDUSA_MINI_HUB_URL") or HUB_URL).rstrip("/")
    for file in HUB_FILES:
        dest = os.path.join(folder, file)
        if not os.path.exists(dest):
            download(f"{base}/{name}/resolve/main/{file}", dest, progress=progress)
    return folder


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return read_safetensors(path)
    try:
        # weights_only: a .bin file is a pickle, and a full unpickle can run arbitrary code.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for files that are not weights-only pickles
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a weights-only PyTorch file: {first_line}") from None
    if not isinstance(obj, dict) or not all(isinstance(t, torch.Tensor) for t in obj.values()):
        raise ValueError(f"{path} does not hold a dict of tensors (a state_dict)")
    return obj


def infer_gpt2_config(tensors: dict[str, torch.Tensor], *, name: str | None = None) -> GPTConfig:
    """GPTConfig from GPT-2-layout tensor shapes; n_head, which shapes cannot tell, from the known
    configs of the same depth and width, else from `name` (e.g. "gpt2-medium")."""
    short = {k.removeprefix("transformer."): t for k, t in tensors.items()}
    if "wte.weight" not in short or "wpe.weight" not in short:
        raise ValueError("tensors lack wte.weight / wpe.weight; not a GPT-2 layout")
    vocab_size, n_embd = short["wte.weight"].shape
    layers = {int(m.group(1)) for k in short if (m := re.match(r"h\.(\d+)\.", k))}
    n_layer = max(layers) + 1 if layers else 0
    known = [c for c in GPT2_CONFIGS.values() if (c.n_layer, c.n_embd) == (n_layer, n_embd)]
    if not known and name in GPT2_CONFIGS and GPT2_CONFIGS[name].n_embd == n_embd:
        known = [GPT2_CONFIGS[name]]
    if not known:
        raise ValueError(
            f"cannot tell n_head of a GPT-2 with n_layer={n_layer}, n_embd={n_embd}; "
            "put its config.json beside the weights file"
        )
    return replace(known[0], vocab_size=vocab_size, block_size=short["wpe.weight"].shape[0], n_layer=n_layer)


def load_gpt2(name_or_path: str | os.PathLike, *, device: torch.device | str = "cpu",
              cache_dir: str | os.PathLike | None = None, progress: bool = True) -> GPT:
    """GPT-2 as a `GPT` in eval mode, from a directory (config.json + model.safetensors or
    pytorch_model.bin), a single .safetensors/.bin file, or a hub name: gpt2, gpt2-medium, gpt2-large,
    gpt2-xl (downloaded once, then read from the cache)."""
    path = os.path.expanduser(os.fspath(name_or_path))
    if not os.path.exists(path):
        if path not in GPT2_CONFIGS:
            raise ValueError(f"{path!r} is no local file or directory, nor one of {', '.join(GPT2_CONFIGS)}")
        path = download_gpt2(path, cache_dir=cache_dir, progress=progress)
    if os.path.isdir(path):
        found = [w for f in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(w := os.path.join(path, f))]
        if not found:
            raise ValueError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
        folder, weights = path, found[0]
    else:
        folder, weights = os.path.dirname(os.path.abspath(path)), path
    config_path, config = os.path.join(folder, "config.json"), None
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = config_from_gpt2_dict(json.load(f))
        except ValueError as e:
            raise ValueError(f"{config_path}: {e}") from None
    elif os.path.isdir(path):
        raise ValueError(f"{config_path} is missing")
    tensors = _read_weights(weights)
    if config is None:  # a bare weights file: its name or its folder's may say which GPT-2 it is
        stem = os.path.basename(path).split(".")[0]
        config = infer_gpt2_config(tensors, name=stem if stem in GPT2_CONFIGS else os.path.basename(folder))
    model = empty_gpt(config, device=device)
    try:
        load_gpt2_weights(model, tensors)
    except ValueError as e:
        raise ValueError(f"{weights}: {e}") from None
    return model.eval()


def empty_gpt(config: GPTConfig, *, device: torch.device | str = "cpu") -> GPT:
    """A GPT with uninitialised weights on `device`: built on the meta device, so no random
    initialisation (slow for gpt2-xl) and no full copy on the CPU first."""
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight  # to_empty gave the tied pair separate storage
    return model
