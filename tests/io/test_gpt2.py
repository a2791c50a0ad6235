"""GPT-2 loading: Hugging Face files (both key layouts) reproduce an independent reference forward pass,
bad files give clear errors, and downloads (from a local HTTP server) resume, check their size and land
in the cache once, under torchrun too."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint
from medusa_mini.io.gpt2 import GPT2_CONFIGS, DownloadError, download, infer_gpt2_config, load_gpt2
from medusa_mini.io.gpt2_layout import load_gpt2_weights
from medusa_mini.io.safetensors import write_safetensors
from medusa_mini.model import GPT, GPTConfig

V, P, C, L, H = 50, 24, 32, 2, 4  # vocab, positions, width, layers, heads of the tiny GPT-2
IDS = [7, 3, 41, 0, 12, 12, 5, 49, 20]


def reference_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights under the checkpoint's key names; Conv1D weights stored [in, out]."""
    rng = np.random.default_rng(seed)
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    layer = {"ln_1": (C, C), "attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "ln_2": (C, C),
             "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}  # (in, out); a LayerNorm's weight is [C]
    for i in range(L):
        for name, (n_in, n_out) in layer.items():
            shapes[f"h.{i}.{name}.weight"] = (n_out,) if "ln" in name else (n_in, n_out)
            shapes[f"h.{i}.{name}.bias"] = (n_out,)
    w = {k: rng.normal(0.0, 0.3, s) for k, s in shapes.items()}
    w |= {k: 1.0 + 0.1 * v for k, v in w.items() if "ln_" in k and k.endswith("weight")}
    return {k: v.astype(np.float32) for k, v in w.items()}


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
    x = w["wte.weight"][ids] + w["wpe.weight"][:T]
    for i in range(L):
        qkv = conv1d(layer_norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn")
        q, k, v = (a.reshape(T, H, C // H).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=1))  # [H, T, hs]
        att = np.where(np.tri(T, dtype=bool), q @ k.transpose(0, 2, 1) / np.sqrt(C // H), -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + conv1d(y, f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu(conv1d(layer_norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return layer_norm(x, "ln_f") @ w["wte.weight"].T


HF_CONFIG = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_positions": P,
    "n_ctx": P, "n_embd": C, "n_layer": L, "n_head": H, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-05, "bos_token_id": 0, "eos_token_id": 0,
}


def as_tensors(w: dict[str, np.ndarray], *, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    return {prefix + k: torch.from_numpy(v.copy()) for k, v in w.items()}


def write_dir(directory, tensors: dict[str, torch.Tensor], *, fmt: str = "safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    if fmt == "safetensors":
        write_safetensors(directory / "model.safetensors", tensors, metadata={"format": "pt"})
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def logits_of(model: GPT) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([IDS]))[0][0].double().numpy()



def hub_style(w: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The hub's original file: no "transformer." prefix, causal-mask buffers, an (equal) lm_head."""
    tensors = as_tensors(w, prefix="")
    for i in range(L):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, P, P))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return tensors | {"lm_head.weight": tensors["wte.weight"].clone()}


@pytest.mark.parametrize("layout, fmt, file", [
    (as_tensors, "safetensors", ""), (hub_style, "safetensors", ""),
    (as_tensors, "bin", ""), (as_tensors, "bin", "pytorch_model.bin"),
], ids=["transformers keys", "hub keys and buffers", "pytorch_model.bin directory", "pytorch_model.bin file"])
def test_gpt2_files_give_the_reference_logits_without_random_init_and_keep_the_output_tied(tmp_path, layout, fmt, file):
    """Meta-device construction: loading neither draws random numbers nor unties lm_head from wte."""
    w = reference_weights()
    source = write_dir(tmp_path / "m", layout(w), fmt=fmt) / file
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = load_gpt2(source)
    assert torch.equal(torch.get_rng_state(), before)  # GPT(config) on a real device would draw ~all weights
    assert model.config == GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=H, n_embd=C)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p.numel() for p in model.parameters()) == sum(v.size for v in w.values())
    np.testing.assert_allclose(logits_of(model), reference_logits(w, IDS), atol=1e-4)


def test_config_comes_from_tensor_shapes_when_no_config_json_is_given():
    meta = {f"h.{i}.ln_1.weight": torch.empty(1024, device="meta") for i in range(24)}  # shapes only, no memory
    meta |= {k: torch.empty(n, 1024, device="meta") for k, n in (("wte.weight", 50257), ("wpe.weight", 1024))}
    assert infer_gpt2_config(meta) == GPT2_CONFIGS["gpt2-medium"]


BAD_SOURCES = {  # name: (what to write into the folder, the source to load, what the error says)
    "unknown name": (lambda d: None, "gpt3", "gpt2-medium"),
    "pickle holding objects": (lambda d: torch.save({"x": torch.nn.Identity()}, d / "evil.bin"), "evil.bin",
                               "not a weights-only PyTorch file"),
    "unknown shape, no config.json": (lambda d: write_safetensors(d / "t.safetensors", as_tensors(reference_weights())),
                                      "t.safetensors", "cannot tell n_head"),
    "folder without weights": (lambda d: (d / "m").mkdir(), "m", "holds neither model.safetensors"),
}


@pytest.mark.parametrize("write, source, match", BAD_SOURCES.values(), ids=BAD_SOURCES.keys())
def test_a_bad_source_gives_a_clear_error_and_a_pickle_is_never_executed(tmp_path, monkeypatch, write, source, match):
    monkeypatch.chdir(tmp_path)
    write(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_gpt2(source)


MUTATIONS = {
    "missing tensor": (lambda t: t.pop("transformer.h.1.ln_2.bias"), r"lacks tensor 'h\.1\.ln_2\.bias'"),
    "unexpected tensor": (lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(C)}),
                          r"has tensor 'h\.2\.ln_1\.weight'"),
    "misshaped tensor": (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.ones(3 * C, C)}),
                         r"'h\.0\.attn\.c_attn\.weight' has shape \[96, 32\] .* needs \[32, 96\]"),
    "untied lm_head": (lambda t: t.update({"lm_head.weight": torch.ones(V, C)}), "differs from wte"),
    "both key styles": (lambda t: t.update({"wpe.weight": torch.ones(P, C)}), "both with and without"),
}


@pytest.mark.parametrize("mutate, match", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_weights_that_do_not_fit_give_a_clear_error_and_leave_the_model_untouched(mutate, match):
    tensors = as_tensors(reference_weights())
    mutate(tensors)
    model = GPT(GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=H, n_embd=C))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_gpt2_weights(model, tensors)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_transformers_gpt2_loads_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    fields = {k: v for k, v in HF_CONFIG.items() if k not in ("model_type", "architectures")}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        hf.save_pretrained(tmp_path)
        np.testing.assert_allclose(logits_of(load_gpt2(str(tmp_path))), hf(torch.tensor([IDS])).logits[0], atol=1e-4)



class Hub:
    """An HTTP server on 127.0.0.1 serving fixed bytes, honouring Range, with scripted faults:
    per path a queue of "drop" (close halfway), "no-range" (ignore Range), "no-length" or a status."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, list] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.delay = 0.0  # seconds before each answer: a slow hub, so that clients overlap
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append((self.path, self.headers.get("Range")))
                time.sleep(hub.delay)
                fault = (hub.faults.get(self.path) or [None]).pop(0)
                if isinstance(fault, int) or self.path not in hub.files:
                    return self.send_error(fault if isinstance(fault, int) else 404)
                data = hub.files[self.path]
                m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                start = int(m.group(1)) if m and fault != "no-range" else 0
                if not start:
                    self.send_response(200)
                elif start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                else:
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                body = data[start:]
                if fault != "no-length":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client may give up early
                    self.wfile.write(body[: len(body) // 2] if fault == "drop" else body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    hub = Hub()
    thread = threading.Thread(target=hub.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield hub
    hub.server.shutdown()
    hub.server.server_close()  # shutdown() has waited for the serving thread


def free_port() -> int:
    with socket.socket() as s:  # free a moment ago: nobody listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DATA = bytes(range(256)) * 4000  # ~1 MB, more than one read chunk
CACHED = ["config.json", "model.safetensors"]


@pytest.mark.parametrize("part, faults, ranges", [
    (b"", [], [None]),  # a plain download
    (b"", ["drop"], [None, "bytes=512000-"]),  # a dropped connection is resumed within one call
    (b"", ["drop", "no-range"], [None, "bytes=512000-"]),  # a server ignoring Range: start over
    (DATA[:512000], [], ["bytes=512000-"]),  # the .part file an interrupted call left is resumed
    (DATA, [], [f"bytes={len(DATA)}-"]),  # a complete .part file (stopped before the rename) is kept
])
def test_a_download_reports_progress_and_recovers_from_a_broken_connection_or_a_leftover_part_file(
    hub, tmp_path, capsys, part, faults, ranges
):
    hub.files["/f"], hub.faults["/f"] = DATA, faults
    (tmp_path / "f.part").write_bytes(part)
    assert download(hub.url + "/f", tmp_path / "f", timeout=5) == str(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == DATA and not (tmp_path / "f.part").exists()
    assert [r for _, r in hub.requests] == ranges
    assert ("MB/s" in capsys.readouterr().err) == (part != DATA)  # progress whenever bytes arrive


@pytest.mark.parametrize("fault, expected_size, match", [
    ("drop", None, "interrupted .* run again to resume"),  # the .part file stays for the next call
    (None, len(DATA) + 5, f"{len(DATA) + 5} were expected"),
    ("no-length", len(DATA) - 5, f"{len(DATA) - 5} were expected"),
    (404, None, r"HTTP 404 .* for http://127\.0\.0\.1:\d+/f$"),
    (500, None, r"HTTP 500 .* for http://127\.0\.0\.1:\d+/f$"),
    ("unreachable", None, "cannot connect"),
])
def test_a_failed_download_is_one_clear_line_and_leaves_no_file(hub, tmp_path, fault, expected_size, match):
    hub.files["/f"], hub.faults["/f"] = DATA, [fault]
    url = f"http://127.0.0.1:{free_port()}/f" if fault == "unreachable" else hub.url + "/f"
    with pytest.raises(DownloadError, match=match):
        download(url, tmp_path / "f", expected_size=expected_size, progress=False, timeout=5, retries=0)
    part = tmp_path / "f.part"
    assert not (tmp_path / "f").exists()
    assert (part.stat().st_size if part.exists() else None) == (len(DATA) // 2 if fault == "drop" else None)


def test_load_gpt2_by_name_downloads_once_into_the_cache(hub, tmp_path, monkeypatch):
    w = reference_weights()
    write_dir(tmp_path / "hub", as_tensors(w, prefix=""))
    for file in CACHED:
        hub.files[f"/gpt2/resolve/main/{file}"] = (tmp_path / "hub" / file).read_bytes()
    monkeypatch.setenv("MEDUSA_MINI_HUB_URL", hub.url)
    monkeypatch.setenv("MEDUSA_MINI_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    first = load_gpt2("gpt2", progress=False)
    assert sorted(p.name for p in (tmp_path / "cache" / "gpt2").iterdir()) == CACHED
    second = load_gpt2("gpt2", progress=False)
    assert len(hub.requests) == 2, "the second load reads the cache only"
    for model in (first, second):
        np.testing.assert_allclose(logits_of(model), reference_logits(w, IDS), atol=1e-4)


# A torchrun worker: train_tiny.py with GPT-2's tokenizer replaced by a byte-level one (tiktoken would
# fetch the real one from the network) and without the summary after training (not under test here).
TORCHRUN_WORKER = r'''
import sys
import tiktoken
real_get_encoding = tiktoken.get_encoding
BYTES = tiktoken.Encoding(name="gpt2", pat_str=r"\s*\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                          special_tokens={"<|endoftext|>": 256})
tiktoken.get_encoding = lambda name: BYTES if name == "gpt2" else real_get_encoding(name)
import train_tiny
from medusa_mini.train import run
run.summarize = lambda *args, **kwargs: {}
sys.exit(train_tiny.main(sys.argv[1:]))
'''


def test_under_torchrun_rank_0_downloads_alone_and_every_rank_reads_the_cache(hub, tmp_path):
    """Ranks downloading at once would write into the same .part file: one download, then a barrier."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "hub", GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=32)))
    for file in CACHED:
        hub.files[f"/gpt2/resolve/main/{file}"] = (tmp_path / "hub" / file).read_bytes()
    hub.delay = 1.5  # both ranks would be mid-download at once
    (tmp_path / "worker.py").write_text(TORCHRUN_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root, "MEDUSA_MINI_HUB_URL": hub.url,
           "MEDUSA_MINI_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(tmp_path / "worker.py"), "--init", "gpt2", "--preset", "gpt2-cpu", "--device", "cpu",
         "--max-bytes", "60000", "--heads-steps", "2", "--distill-prompts", "4", "--distill-tokens", "8",
         "--eval-prompts", "2", "--log-every", "1000", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(path for path, _ in hub.requests) == [f"/gpt2/resolve/main/{file}" for file in CACHED]
    assert sorted(p.name for p in (tmp_path / "cache" / "gpt2").iterdir()) == CACHED
    sums = [line.split()[-1] for line in r.stdout.splitlines() if "weights sha256" in line]
    assert len(sums) == 2 and sums[0] == sums[1]  # both ranks loaded the same backbone and trained alike
    assert load_checkpoint(tmp_path / "out")[0].config.vocab_size == 257
