"""GPT-2 loading: files in the Hugging Face layout reproduce an independent reference forward pass,
the hub's key names and buffers are handled, bad files give clear errors, and downloads resume, check
their size and land in the cache exactly once, under torchrun too (tested against a local HTTP server,
never the network)."""

from __future__ import annotations

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
from medusa_mini.io.gpt2 import (
    GPT2_CONFIGS,
    DownloadError,
    download,
    empty_gpt,
    infer_gpt2_config,
    load_gpt2,
)
from medusa_mini.io.gpt2_layout import load_gpt2_weights
from medusa_mini.io.safetensors import write_safetensors
from medusa_mini.model import GPT, GPTConfig

V, P, C, L, H = 50, 24, 32, 2, 4  # vocab, positions, width, layers, heads of the tiny GPT-2
IDS = [7, 3, 41, 0, 12, 12, 5, 49, 20]


def reference_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights under the checkpoint's key names; Conv1D weights stored [in, out]."""
    rng = np.random.default_rng(seed)
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(L):
        shapes |= {
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
        }
    w = {k: rng.normal(0.0, 0.3, s) for k, s in shapes.items()}
    for k in w:
        if ".ln_" in k and k.endswith("weight") or k == "ln_f.weight":
            w[k] = 1.0 + 0.1 * w[k]
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

    T, hs = len(ids), C // H
    x = w["wte.weight"][ids] + w["wpe.weight"][:T]
    future = ~np.tril(np.ones((T, T), dtype=bool))
    for i in range(L):
        q, k, v = np.split(conv1d(layer_norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn"), 3, axis=1)
        outs = []
        for h in range(H):
            s = slice(h * hs, (h + 1) * hs)
            att = np.where(future, -np.inf, q[:, s] @ k[:, s].T / np.sqrt(hs))
            att = np.exp(att - att.max(-1, keepdims=True))
            outs.append(att / att.sum(-1, keepdims=True) @ v[:, s])
        x = x + conv1d(np.concatenate(outs, axis=1), f"h.{i}.attn.c_proj")
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


# ----------------------------------------------------------------------------- local files


def test_a_gpt2_directory_gives_the_reference_logits_without_random_weights_and_keeps_the_output_tied(tmp_path):
    """Meta-device construction: loading neither draws random numbers nor unties lm_head from wte."""
    w = reference_weights()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = load_gpt2(str(write_dir(tmp_path / "m", as_tensors(w))))
    assert torch.equal(torch.get_rng_state(), before)  # GPT(config) on a real device would draw ~all weights
    assert model.config == GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=H, n_embd=C)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p.numel() for p in model.parameters()) == sum(v.size for v in w.values())
    np.testing.assert_allclose(logits_of(model), reference_logits(w, IDS), atol=1e-4)


def test_an_empty_gpt_has_real_storage_on_the_asked_device():
    model = empty_gpt(GPTConfig(vocab_size=V, block_size=P, n_layer=L, n_head=H, n_embd=C), device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_hub_style_keys_without_prefix_and_with_mask_buffers_load_the_same(tmp_path):
    w = reference_weights()
    tensors = as_tensors(w, prefix="")
    for i in range(L):  # the hub's original file carries causal-mask buffers
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, P, P))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()  # tied: allowed when equal
    model = load_gpt2(write_dir(tmp_path / "m", tensors))
    np.testing.assert_allclose(logits_of(model), reference_logits(w, IDS), atol=1e-4)


def test_pytorch_model_bin_loads_from_its_directory_or_as_a_file(tmp_path):
    w = reference_weights()
    directory = write_dir(tmp_path / "m", as_tensors(w), fmt="bin")
    for source in (directory, directory / "pytorch_model.bin"):
        np.testing.assert_allclose(logits_of(load_gpt2(str(source))), reference_logits(w, IDS), atol=1e-4)


class NotWeights:
    pass


def test_a_pickle_holding_objects_is_refused_not_executed(tmp_path):
    torch.save({"wte.weight": torch.zeros(2), "payload": NotWeights()}, tmp_path / "evil.bin")
    with pytest.raises(ValueError, match="not a weights-only PyTorch file"):
        load_gpt2(str(tmp_path / "evil.bin"))


def test_config_comes_from_tensor_shapes_when_no_config_json_is_given(tmp_path):
    medium = GPT2_CONFIGS["gpt2-medium"]
    shapes = {"wte.weight": (50257, 1024), "wpe.weight": (1024, 1024)}
    shapes |= {f"h.{i}.ln_1.weight": (1024,) for i in range(24)}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}  # shapes only, no memory
    assert infer_gpt2_config(meta) == medium
    w = reference_weights()
    write_safetensors(tmp_path / "tiny.safetensors", as_tensors(w))
    with pytest.raises(ValueError, match="cannot tell n_head"):
        load_gpt2(str(tmp_path / "tiny.safetensors"))


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


def test_an_unknown_name_lists_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="gpt2-medium"):
        load_gpt2("gpt3")


def test_a_transformers_gpt2_loads_with_equal_logits_and_greedy_continuation(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    fields = {k: v for k, v in HF_CONFIG.items() if k not in ("model_type", "architectures")}
    hf_config = transformers.GPT2Config(**fields)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_gpt2(str(tmp_path))
    ids = torch.tensor([IDS])
    with torch.no_grad():
        assert torch.allclose(ours(ids)[0], hf(ids).logits, atol=1e-4)
        a, b = ids, ids
        for _ in range(8):
            a = torch.cat([a, ours(a)[0][:, -1:].argmax(-1)], dim=1)
            b = torch.cat([b, hf(b).logits[:, -1:].argmax(-1)], dim=1)
    assert a.tolist() == b.tolist()


# ----------------------------------------------------------------------------- downloads


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
                queue = hub.faults.get(self.path) or []
                fault = queue.pop(0) if queue else None
                if isinstance(fault, int) or self.path not in hub.files:
                    self.send_error(fault if isinstance(fault, int) else 404)
                    return
                data, start = hub.files[self.path], 0
                m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if m and fault != "no-range":
                    start = int(m.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                if fault != "no-length":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body[: len(body) // 2] if fault == "drop" else body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up early, as it may
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def gets(self, path: str) -> int:
        return sum(p == path for p, _ in self.requests)


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    server = Hub()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()
    server.thread.join(timeout=5)


DATA = bytes(range(256)) * 4000  # ~1 MB, more than one read chunk


def test_download_writes_the_file_and_reports_progress(hub, tmp_path, capsys):
    hub.files["/f"] = DATA
    assert download(hub.url + "/f", tmp_path / "f", timeout=5) == str(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == DATA
    assert not (tmp_path / "f.part").exists()
    assert "MB/s" in capsys.readouterr().err


def test_an_interrupted_download_resumes_with_a_range_request(hub, tmp_path):
    hub.files["/f"], hub.faults["/f"] = DATA, ["drop"]
    with pytest.raises(DownloadError, match="interrupted.*run again to resume"):
        download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5, retries=0)
    assert not (tmp_path / "f").exists()
    half = (tmp_path / "f.part").stat().st_size
    assert 0 < half < len(DATA)
    download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5)
    assert hub.requests[-1] == ("/f", f"bytes={half}-")
    assert (tmp_path / "f").read_bytes() == DATA


def test_a_dropped_connection_is_resumed_within_one_call(hub, tmp_path):
    hub.files["/f"], hub.faults["/f"] = DATA, ["drop"]
    download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5)
    assert (tmp_path / "f").read_bytes() == DATA and hub.gets("/f") == 2


def test_a_complete_part_file_is_finished_without_downloading_again(hub, tmp_path):
    hub.files["/f"] = DATA
    (tmp_path / "f.part").write_bytes(DATA)  # e.g. stopped between the last byte and the rename
    download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5)
    assert (tmp_path / "f").read_bytes() == DATA and hub.requests == [("/f", f"bytes={len(DATA)}-")]


def test_a_server_that_ignores_range_restarts_the_file(hub, tmp_path):
    hub.files["/f"], hub.faults["/f"] = DATA, ["drop", "no-range"]
    download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5)
    assert (tmp_path / "f").read_bytes() == DATA


@pytest.mark.parametrize("fault, expected_size", [(None, len(DATA) + 5), ("no-length", len(DATA) - 5)])
def test_a_wrong_size_is_rejected_and_leaves_no_file(hub, tmp_path, fault, expected_size):
    hub.files["/f"], hub.faults["/f"] = DATA, [fault]
    with pytest.raises(DownloadError, match=f"{expected_size} were expected"):
        download(hub.url + "/f", tmp_path / "f", expected_size=expected_size, progress=False, timeout=5)
    assert not (tmp_path / "f").exists() and not (tmp_path / "f.part").exists()


@pytest.mark.parametrize("status", [404, 500])
def test_an_http_error_is_one_clear_line(hub, tmp_path, status):
    hub.files["/f"], hub.faults["/f"] = DATA, [status]
    with pytest.raises(DownloadError, match=f"HTTP {status} .* for {hub.url}/f$"):
        download(hub.url + "/f", tmp_path / "f", progress=False, timeout=5)
    assert not (tmp_path / "f").exists() and not (tmp_path / "f.part").exists()


def test_an_unreachable_server_is_one_clear_line(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match="cannot connect"):
        download(f"http://127.0.0.1:{port}/f", tmp_path / "f", progress=False, timeout=5)
    assert not (tmp_path / "f").exists()


def test_load_gpt2_by_name_downloads_once_into_the_cache(hub, tmp_path, monkeypatch):
    w = reference_weights()
    write_safetensors(tmp_path / "hub.safetensors", as_tensors(w, prefix=""), metadata={"format": "pt"})
    hub.files["/gpt2/resolve/main/model.safetensors"] = (tmp_path / "hub.safetensors").read_bytes()
    hub.files["/gpt2/resolve/main/config.json"] = json.dumps(HF_CONFIG).encode()
    monkeypatch.setenv("MEDUSA_MINI_HUB_URL", hub.url)
    monkeypatch.setenv("MEDUSA_MINI_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    first = load_gpt2("gpt2", progress=False)
    cached = sorted(p.name for p in (tmp_path / "cache" / "gpt2").iterdir())
    assert cached == ["config.json", "model.safetensors"]
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
    for file in ("config.json", "model.safetensors"):
        hub.files[f"/gpt2/resolve/main/{file}"] = (tmp_path / "hub" / file).read_bytes()
    hub.delay = 1.5  # both ranks would be mid-download at once
    (tmp_path / "worker.py").write_text(TORCHRUN_WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root, "MEDUSA_MINI_HUB_URL": hub.url,
           "MEDUSA_MINI_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(tmp_path / "worker.py"), "--init", "gpt2", "--preset", "gpt2-cpu", "--device", "cpu",
         "--max-bytes", "60000", "--heads-steps", "2", "--distill-prompts", "4", "--distill-tokens", "8",
         "--eval-prompts", "2", "--log-every", "1000", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(path for path, _ in hub.requests) == ["/gpt2/resolve/main/config.json",
                                                        "/gpt2/resolve/main/model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "cache" / "gpt2").iterdir()) == ["config.json", "model.safetensors"]
    sums = [line.split()[-1] for line in r.stdout.splitlines() if "weights sha256" in line]
    assert len(sums) == 2 and sums[0] == sums[1]  # both ranks loaded the same backbone and trained alike
    model, _, _ = load_checkpoint(out)
    assert model.config.vocab_size == 257
