"""The optimizer loop of train/run.py, driven directly: when it reads the device and the clock, what
DDP adds to a step, and float16 loss scaling through save and exact resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train_tiny  # noqa: E402
from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.io.checkpoint import load_checkpoint  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402
from medusa_mini.train import run as run_mod  # noqa: E402
from medusa_mini.train.state import Run  # noqa: E402
from medusa_mini.training import MedusaLM  # noqa: E402

FAST = ["--preset", "smoke", "--max-bytes", "60000", "--vocab-size", "300", "--backbone-steps", "6",
        "--heads-steps", "4", "--distill-prompts", "8", "--distill-tokens", "12", "--eval-prompts", "2",
        "--batch-size", "4", "--block-size", "64", "--n-embd", "32", "--log-every", "1000"]

# The loop runs on a tiny model with a log of what it does: "step" when a batch is drawn, "read" when a
# value is copied from the device to the host, "reduce" for a collective on the device's group, "clock"
# for a clock reading, "line" for a progress line. The DDP test's workers load this file to run it.


class Recorder:
    """An event log, and the two modes that log each copy of a value to the host (a GPU would stall
    on it) as "read", unless paused: tensor methods (.tolist(), .item(), bool(), ...) and, below
    Python, the operators that read a value (e.g. indexing with a 0-dim tensor)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.paused = False
        self.modes = (_MethodReads(self), _OperatorReads(self))

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)

    def read(self) -> None:
        if not self.paused:
            self.events.append("read")


class _MethodReads(TorchFunctionMode):
    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.rec.read()
        return func(*args, **(kwargs or {}))


class _OperatorReads(TorchDispatchMode):
    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.rec.read()
        return func(*args, **(kwargs or {}))


def paused(rec: Recorder, fn):
    """`fn`, with the recorder paused while it runs."""
    def call(*args, **kwargs):
        rec.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            rec.paused = False

    return call


def run_loop(out: str, setattr_, *, steps: int, log_every: float):
    """run._train for `steps` steps of a tiny joint model; `setattr_` patches (monkeypatch's, or plain
    setattr in a worker process). Returns the Run and the event log."""
    args = train_tiny.parse_args(["--preset", "smoke", "--device", "cpu", "--out", out, "--log-every", str(log_every)])
    r = Run(args)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32))
    heads = MedusaHeads(HeadsConfig(num_heads=2, n_embd=32, vocab_size=50), lm_head_weight=model.lm_head.weight)
    r.model, r.heads = model, heads
    opt, lrs = run_mod._optimizer([(list(model.parameters()), 1e-3), (list(heads.parameters()), 4e-3)], args)
    rec = Recorder()
    # Off CUDA, AdamW keeps its step count in a host tensor and reads it; on CUDA the loop uses fused
    # AdamW, which reads nothing. Its step is left out of the log.
    opt.step = paused(rec, opt.step)

    def batch(g):
        rec.events.append("step")
        x = torch.randint(0, 50, (4, 17), generator=g)
        return x[:, :-1], x[:, 1:], None

    def clock():
        rec.events.append("clock")
        return time.time()

    line = run_mod.progress_line
    setattr_(run_mod, "progress_line", lambda *a, **k: (rec.events.append("line"), line(*a, **k))[1])
    setattr_(run_mod, "time", types.SimpleNamespace(time=clock))
    if r.world > 1:  # the host-side agreement (gloo, CPU tensors) may read its flags; nothing else may
        reduce = dist.all_reduce

        def logged_reduce(tensor, *a, **k):
            if not rec.paused:
                rec.events.append("reduce")
            return reduce(tensor, *a, **k)

        if hasattr(Run, "any_rank"):
            setattr_(Run, "any_rank", paused(rec, Run.any_rank))
        setattr_(dist, "all_reduce", logged_reduce)

    def loss_kwargs(s):
        return dict(lm_weight=1.0, heads_weight=0.5, decay=0.8, heads_stride=3, heads_offset=s)

    with rec:
        run_mod._train(r, MedusaLM(model, heads), opt, stage="backbone", steps=steps, start=0,
                       gen=torch.Generator().manual_seed(r.rank), batch_fn=batch, lrs=lrs, loss_kwargs=loss_kwargs)
    return r, rec.events


def per_step(events: list[str]) -> list[list[str]]:
    """The events of each step, from its batch to the next one's."""
    steps: list[list[str]] = []
    for e in events:
        if e == "step":
            steps.append([])
        elif steps:
            steps[-1].append(e)
    return steps


def test_the_clock_is_read_after_the_device_is_waited_for(tmp_path, monkeypatch):
    """tok/s and the ETA must count the device's work: on CUDA a clock read before the metrics are read
    counts only the time the host took to queue the kernels."""
    r, events = run_loop(str(tmp_path / "o"), monkeypatch.setattr, steps=3, log_every=0)
    steps = per_step(events)
    assert len(steps) == 3 and all("line" in s for s in steps)
    for s in steps:
        assert s.count("read") == 1 and "clock" in s[s.index("read"):s.index("line")], s


def test_between_progress_lines_a_step_reads_nothing_from_the_device(tmp_path, monkeypatch):
    r, events = run_loop(str(tmp_path / "o"), monkeypatch.setattr, steps=5, log_every=1000)
    steps = per_step(events)
    assert ["line" in s for s in steps] == [True, False, False, False, True]  # the first and the last step
    assert all("read" not in s for s in steps[1:4])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


WORKER = r'''
import importlib.util, json, sys
import torch.distributed as dist
spec = importlib.util.spec_from_file_location("loop_under_test", sys.argv[1])
loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loop)
r, events = loop.run_loop(sys.argv[2], setattr, steps=5, log_every=1000)
print(json.dumps({"rank": r.rank, "events": events}))
dist.barrier()  # as train_tiny does: a rank tearing gloo down while its peer still talks aborts the peer
dist.destroy_process_group()
'''


def test_under_ddp_the_ranks_agree_through_the_host_and_reduce_metrics_only_for_a_line(tmp_path):
    """Two gloo ranks: stopping and printing are agreed in host memory every step; the metrics are
    all-reduced and read only at the steps that print, so a GPU's queue is never drained between."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [subprocess.Popen([sys.executable, str(script), __file__, str(tmp_path / "o")], cwd=str(ROOT), text=True,
                              env={**env, "RANK": str(i), "LOCAL_RANK": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    for out, _ in results:
        steps = per_step(json.loads(out.strip().splitlines()[-1])["events"])
        assert ["line" in s for s in steps] == [True, False, False, False, True]
        for s in steps:
            synced = [e for e in s if e in ("read", "reduce")]
            assert synced == (["reduce", "read"] if "line" in s else []), s  # one all-reduce, then the read
            if "line" in s:
                assert s.index("clock", s.index("read")) < s.index("line")


# ---- float16: the GradScaler really enabled, on a CPU -------------------------------------------


class _EagerScaler(torch.amp.GradScaler):
    """torch's GradScaler starting at 2**17 and growing after every good step: on this tiny model the
    backbone's float16 gradients overflow from 2**18 and the heads' from 2**22, so within a few steps
    each stage skips steps, backs off and grows again, and the scale it resumes with decides which
    later steps are skipped."""

    made: list = []

    def __init__(self, device="cuda", *, enabled=True, **kw):
        super().__init__(device, init_scale=2.0**17, growth_interval=1, enabled=enabled)
        _EagerScaler.made.append(self)


def _float16_on_cpu(monkeypatch):
    # float16 is refused on a CPU (it is slow there); the scaler logic is what is tested, and torch's
    # GradScaler runs on a CPU since 2.3. The summary after training (tables, trees) is left out: it
    # reads no scaler and takes most of a run's time.
    monkeypatch.setattr(train_tiny, "check_dtype", lambda dtype, device: None)
    monkeypatch.setattr(run_mod, "check_dtype", lambda dtype, device: None)
    monkeypatch.setattr(torch.amp, "GradScaler", _EagerScaler)
    monkeypatch.setattr(run_mod, "summarize", lambda *args, **kwargs: {})
    _EagerScaler.made = []


def _weights(out):
    model, heads, _ = load_checkpoint(out)
    return {**model.state_dict(), **{"heads." + k: v for k, v in heads.state_dict().items()}}


@pytest.mark.slow
def test_float16_loss_scaling_skips_overflows_and_resumes_exactly(tmp_path, monkeypatch):
    """The real loop with an enabled GradScaler: scale, unscale, clip, step (or skip), update; its state
    saved with the run and restored on --resume, so the resumed steps are the uninterrupted ones."""
    _float16_on_cpu(monkeypatch)
    args = FAST + ["--dtype", "float16", "--heads-steps", "8"]
    ref = tmp_path / "ref"
    assert train_tiny.main(args + ["--out", str(ref)]) == 0
    assert [s.is_enabled() for s in _EagerScaler.made] == [True, True]  # backbone, heads
    wr = _weights(ref)
    assert all(torch.isfinite(v).all() for v in wr.values())
    for where in ("backbone:3", "heads:3"):
        out = tmp_path / where.replace(":", "_")
        assert train_tiny.main(args + ["--out", str(out), "--interrupt-at", where]) == 130
        saved = torch.load(out / "train_state.pt", weights_only=True)["scaler"]
        assert saved["scale"] != 2.0**17 and saved["growth_interval"] == 1  # the scaler's own state, saved
        assert train_tiny.main(args + ["--out", str(out), "--resume"]) == 0
        wo = _weights(out)
        assert all(torch.equal(wr[k], wo[k]) for k in wr), where
