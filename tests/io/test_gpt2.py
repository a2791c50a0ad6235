"""GPT-2 loading: Hugging Face files (both key layouts) reproduce an independent reference forward pass, bad files
give clear errors, downloads (from a local HTTP server) resume (one by name, under torchrun: tests/train)."""

import contextlib
import http.server
import json
import os
import re
import socket
import threading

import numpy as np
import pytest
import torch

from medusa_mini.io import gpt2
from medusa_mini.io.files import atomic_write
from medusa_mini.io.gpt2 import GPT2_CONFIGS, download, infer_gpt2_config, load_gpt2
from medusa_mini.io.safetensors import write_safetensors
from medusa_mini.model import GPT, GPTConfig

V, P, C, L, H = 50, 24, 32, 2, 4  # vocab, positions, width, layers, heads of the tiny GPT-2
IDS = [7, 3, 41, 0, 12, 12, 5, 49, 20]
HF_CONFIG = {"model_type": "gpt2", "vocab_size": V, "n_positions": P, "n_ctx": P, "n_embd": C, "n_layer": L,
             "n_head": H, "activation_function": "gelu_new", "n_inner": 4 * C}  # epsilon: GPT-2's 1e-5 by default
DATA = bytes(range(256)) * 4000  # what the hub serves: ~1 MB, more than one read chunk


def reference_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights under the file's key names; Conv1D weights stored [in, out]."""
    rng = np.random.default_rng(seed)
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    layer = {"ln_1": (C, C), "attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "ln_2": (C, C),
             "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}  # (in, out); a LayerNorm's weight is [C]
    shapes |= {f"h.{i}.{name}.{kind}": (n_in, n_out) if kind == "weight" and "ln" not in name else (n_out,)
               for i in range(L) for name, (n_in, n_out) in layer.items() for kind in ("weight", "bias")}
    w = {k: rng.normal(0.0, 0.3, s) for k, s in shapes.items()}  # then LayerNorm gains near 1
    return {k: (1.0 + 0.1 * v if "ln_" in k and k.endswith("weight") else v).astype(np.float32) for k, v in w.items()}


def reference_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """GPT-2 written from its key names alone, in float64: pre-LN, tanh-GELU, eps 1e-5, tied output."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def layer_norm(x, name):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    def conv1d(x, name):  # GPT-2's Conv1D: x @ W with W stored [in, out]
        return x @ w[name + ".weight"] + w[name + ".bias"]

    def gelu(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    T = len(ids)
    x = w["wte.weight"][ids] + w["wpe.weight"][:T]  # [T, C]
    for i in range(L):
        qkv = conv1d(layer_norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn")
        q, k, v = (a.reshape(T, H, C // H).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=1))  # [H, T, hs]
        att = np.where(np.tri(T, dtype=bool), q @ k.transpose(0, 2, 1) / np.sqrt(C // H), -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + conv1d(y, f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu(conv1d(layer_norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return layer_norm(x, "ln_f") @ w["wte.weight"].T  # [T, V]


def as_tensors(w: dict[str, np.ndarray], *, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    return {prefix + k: torch.from_numpy(v.copy()) for k, v in w.items()}


def hub_style(w: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The hub's original file: no "transformer." prefix, causal-mask buffers, an (equal) lm_head."""
    tensors = as_tensors(w, prefix="") | {"lm_head.weight": torch.from_numpy(w["wte.weight"].copy())}
    return tensors | {f"h.{i}.attn.{name}": torch.tril(torch.ones(1, 1, P, P)) if name == "bias" else torch.tensor(-1e4)
                      for i in range(L) for name in ("bias", "masked_bias")}


def write_dir(directory, tensors: dict[str, torch.Tensor], *, weights: str = "model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    atomic_write(directory / weights, lambda f: write_safetensors(f, tensors))
    return directory


@pytest.mark.parametrize("layout, file", [(as_tensors, ""), (hub_style, ""), (as_tensors, "model.safetensors")],
                         ids=["transformers keys", "hub keys and buffers", "weights file"])
@pytest.mark.parametrize("meta_above", [0, gpt2.META_ABOVE], ids=["built on meta", "small"])
def test_gpt2_files_give_the_reference_logits_with_a_tied_output_and_no_random_init(tmp_path, monkeypatch, layout,
                                                                                     file, meta_above):
    monkeypatch.setattr(gpt2, "META_ABOVE", meta_above)
    w, before = reference_weights(), torch.get_rng_state()
    model = load_gpt2(write_dir(tmp_path / "m", layout(w)) / file)
    assert torch.equal(torch.get_rng_state(), before)  # loading draws nothing from the global generator
    assert model.config == GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=H, n_embd=C)
    assert sum(p.numel() for p in model.parameters()) == sum(v.size for v in w.values())
    np.testing.assert_allclose(model(torch.tensor([IDS]))[0][0].detach().double(), reference_logits(w, IDS), atol=1e-4)


def test_each_gpt2_has_its_published_size_and_without_a_config_json_is_told_by_its_tensor_shapes():
    with torch.device("meta"):  # shapes only: no memory
        sizes = [GPT(config).num_params() for config in GPT2_CONFIGS.values()]
    assert sizes == [124_439_808, 354_823_168, 774_030_080, 1_557_611_200]  # gpt2 ... gpt2-xl, as published
    meta = {f"h.{i}.ln_1.weight": torch.empty(1024, device="meta") for i in range(24)}  # shapes only, no memory
    meta |= {k: torch.empty(n, 1024, device="meta") for k, n in (("wte.weight", 50257), ("wpe.weight", 1024))}
    assert infer_gpt2_config(meta) == GPT2_CONFIGS["gpt2-medium"]
    meta["wpe.weight"] = torch.empty(512, 1024, device="meta")  # [positions, C]: a shorter context
    assert infer_gpt2_config(meta).block_size == 512
    for broken in ({k: t for k, t in meta.items() if k != "wpe.weight"}, {**meta, "wpe.weight": torch.ones(())}):
        pytest.raises(ValueError, infer_gpt2_config, broken).match("layout")  # missing, or no [positions, C] matrix


def edited(change: dict):
    """Writes folder m holding the reference weights after `change` (a tensor None is left out)."""
    return lambda d: write_dir(d / "m", {k: v for k, v in (REFERENCE | change).items() if v is not None})


REFERENCE = as_tensors(reference_weights())  # under transformers' key names
BAD_SOURCES = {  # name: (what to write into the folder, the source to load, what the error says)
    "unknown name": (lambda d: None, "gpt3", "gpt2-medium"),
    "pickle, never unpickled": (lambda d: torch.save(REFERENCE, d / "t.bin"), "t.bin", "safetensors only.*convert"),
    "unknown shape, no config.json": (lambda d: atomic_write(d / "t.safetensors", lambda f: write_safetensors(
        f, REFERENCE)), "t.safetensors", "cannot tell n_head"),
    "folder with a .bin only": (lambda d: write_dir(d / "m", {}, weights="pytorch_model.bin"), "m",
                                "no model.safetensors in m: .*convert a pytorch_model.bin: save_file"),
    "sharded": (lambda d: write_dir(d / "m", {}, weights="model.safetensors.index.json"), "m", "save them unsharded"),
    "missing tensor": (edited({"transformer.h.1.ln_2.bias": None}), "m", r"lacks tensor 'h\.1\.ln_2\.bias'"),
    "unexpected tensor": (edited({"transformer.h.2.ln_1.weight": torch.ones(C)}), "m",
                          r"has tensor 'h\.2\.ln_1\.weight'"),
    "misshaped tensor": (edited({"transformer.h.0.attn.c_attn.weight": torch.ones(3 * C, C)}), "m",
                         r"'h\.0\.attn\.c_attn\.weight' has shape \[96, 32\] .* needs \[32, 96\]"),
    "untied lm_head": (edited({"lm_head.weight": torch.ones(V, C)}), "m", "differs from wte"),
    "both key styles": (edited({"wpe.weight": torch.ones(P, C)}), "m", "both with and without"),
    "lm_head in both key styles": (edited({f"{k}lm_head.weight": torch.ones(V, C) for k in ("", "transformer.")}), "m",
                                   "'lm_head.weight' appears both with and without")}


@pytest.mark.parametrize("write, source, match", BAD_SOURCES.values(), ids=BAD_SOURCES.keys())
def test_a_bad_source_gives_one_clear_line_and_a_pickle_is_never_read(tmp_path, monkeypatch, write, source, match):
    monkeypatch.chdir(tmp_path)
    write(tmp_path)
    err = pytest.raises(ValueError, load_gpt2, source)
    assert err.match(match) and "\n" not in str(err.value)


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Serves the server's `files`, honouring Range, with scripted faults: per path a queue of "drop" (close
    halfway), "no-range" (ignore Range), "no-length" (no Content-Length) or an HTTP status."""

    def do_GET(self) -> None:
        hub = self.server
        hub.requests.append((self.path, self.headers.get("Range")))
        fault = (hub.faults.get(self.path) or [None]).pop(0)
        if isinstance(fault, int) or self.path not in hub.files:
            return self.send_error(fault if isinstance(fault, int) else 404)
        data, m = hub.files[self.path], re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        start = int(m.group(1)) + (fault == "shifted") if m and fault != "no-range" else 0
        body, n = data[start:], len(data)
        self.send_response(200 if not start else 206 if start < n else 416)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{n - 1}/{n}" if start < n else f"bytes */{n}")
        if fault != "no-length":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client may give up early
            self.wfile.write(body[: len(body) // 2] if fault == "drop" else body)


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler) as hub:
        hub.url, hub.files, hub.faults, hub.requests = f"http://127.0.0.1:{hub.server_address[1]}", {}, {}, []
        threading.Thread(target=hub.serve_forever, args=(0.05,), daemon=True).start()
        yield hub
        hub.shutdown()


@pytest.mark.parametrize("part, faults, ranges", [
    (b"", [], [None]), (b"", ["no-length"], [None]),  # a plain download, and one from a server sending no length
    (b"", ["drop"], [None, "bytes=512000-"]),  # a dropped connection is resumed within one call
    (b"", ["drop", "no-range"], [None, "bytes=512000-"]),  # a server ignoring Range: start over
    (DATA[:512000], [], ["bytes=512000-"]),  # the .part file an interrupted call left is resumed
    (DATA[:512000], ["shifted"], ["bytes=512000-", None]),  # a part from elsewhere than asked: start over
    (DATA, [], [f"bytes={len(DATA)}-"]),  # a complete .part file (stopped before the rename) is kept
    (DATA + b"!", [], [f"bytes={len(DATA) + 1}-", None])])  # a .part file longer than the file: start over
def test_a_download_shows_progress_and_resumes_a_broken_connection_or_a_part_file(hub, tmp_path, capsys, part, faults,
                                                                                  ranges):
    hub.files["/f"], hub.faults["/f"] = DATA, list(faults)
    if part:  # else a first download: no .part file
        (tmp_path / "f.part").write_bytes(part)
    download(hub.url + "/f", tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == DATA and not (tmp_path / "f.part").exists()
    assert [r for _, r in hub.requests] == ranges
    assert ("MB/s" in capsys.readouterr().err) == (part != DATA)  # progress whenever bytes arrive


def test_a_downloaded_file_that_is_no_gpt2_file_is_not_kept(hub, tmp_path, monkeypatch):
    for name, value in (("HOME", str(tmp_path)), ("MEDUSA_MINI_CACHE", "~/cache"), ("MEDUSA_MINI_HUB_URL", hub.url)):
        monkeypatch.setenv(name, value)  # ~/cache: as a quoted value or a Docker ENV line leaves it
    hub.files["/gpt2/resolve/main/config.json"] = b"<html>Sign in to continue</html>"  # a proxy's: the next run retries
    pytest.raises(ValueError, gpt2.download_gpt2, "gpt2").match(r"not readable JSON.*downloaded from .*then deleted")
    assert os.listdir(tmp_path / "cache" / "gpt2") == []


@pytest.mark.parametrize("faults, match", [
    (["drop"] * 3, "interrupted .* run again to resume"),  # the .part file stays for the next call
    ([404], r"HTTP 404 .* for http://127\.0\.0\.1:\d+/f$"), ([], "cannot connect")])  # to a port nobody listens on
def test_a_failed_download_is_one_clear_line_and_leaves_no_file(hub, tmp_path, faults, match):
    hub.files["/f"], hub.faults["/f"] = DATA, list(faults)
    with socket.socket() as s:  # a port free a moment ago: nobody listens there
        s.bind(("127.0.0.1", 0))
        url = hub.url + "/f" if faults else f"http://127.0.0.1:{s.getsockname()[1]}/f"
    pytest.raises(OSError, download, url, tmp_path / "f").match(match)
    assert not (tmp_path / "f").exists() and (tmp_path / "f.part").exists() == (faults[:1] == ["drop"])
