"""train_tiny.py as a user runs it: stages, checkpoints, exact resume (float16 loss scaling included),
bad input, DDP replicas."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train_tiny  # noqa: E402
from medusa_mini.io.checkpoint import load_checkpoint  # noqa: E402
from medusa_mini.train import run as run_mod  # noqa: E402
from medusa_mini.tree import build_tree, expected_tokens_per_step, preset  # noqa: E402
from medusa_mini.tune.acceptance_tables import load_accuracy  # noqa: E402
from medusa_mini.tune.trees import resolve_tree  # noqa: E402

FAST = ["--preset", "smoke", "--max-bytes", "60000", "--vocab-size", "300", "--backbone-steps", "6",
        "--heads-steps", "4", "--distill-prompts", "8", "--distill-tokens", "12", "--eval-prompts", "2",
        "--batch-size", "4", "--block-size", "64", "--n-embd", "32", "--log-every", "1000"]


def weights(out, backbone_only=False):
    model, heads, _ = load_checkpoint(out)
    return {**model.state_dict(), **({} if backbone_only else {"heads." + k: v for k, v in heads.state_dict().items()})}


def same_weights(a, b, backbone_only=False, **tolerance) -> bool:
    wa, wb = weights(a, backbone_only), weights(b, backbone_only)
    same = (lambda a, b: torch.allclose(a, b, **tolerance)) if tolerance else torch.equal
    return wa.keys() == wb.keys() and all(same(wa[k], wb[k]) for k in wa)


def test_a_run_writes_a_complete_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_tiny.main(FAST + ["--out", str(out)]) == 0
    assert set(os.listdir(out)) == {"config.json", "model.safetensors", "medusa_heads.safetensors", "medusa_config.json",
                                    "tokenizer.tiktoken", "tokenizer_config.json", "prompts.json",
                                    "heads_accuracy.json"}  # no resume state
    text = capsys.readouterr().out
    assert all(stage in text for stage in ("tokenizer", "backbone", "distill", "heads", "summary", "official Medusa-1"))
    # the summary's expected tokens per step are the product rule on the stored accuracies
    assert (acc := load_accuracy(out)).shape == (4, 10)
    want = ", ".join(f"{b} nodes {build_tree(acc, b)[1]:.2f}" for b in (4, 8, 16, 32, 64))
    assert f"{want}; cpu preset {expected_tokens_per_step(acc, preset('cpu')):.2f}" in text
    model, heads, cfg = load_checkpoint(out)
    assert heads.num_heads == 4 and cfg["medusa_mini"]["eot_id"] == model.config.vocab_size - 1
    # decode.py's default tree on a CPU: 8 nodes built from those accuracies
    tree, name = resolve_tree(None, ckpt_dir=str(out), device="cpu", num_heads=4)
    assert name == "8" and tree == build_tree(acc, 8)[0]


def test_hydra_heads_train_and_then_train_alone_on_the_same_backbone(tmp_path, capsys):
    # The fair comparison of head kinds: one backbone, then heads-only training (--init) per kind.
    import decode
    from medusa_mini.hydra import HydraHeads

    first = tmp_path / "hydra"
    assert train_tiny.main(FAST + ["--heads", "hydra", "--out", str(first)]) == 0
    _, heads, cfg = load_checkpoint(first)
    assert isinstance(heads, HydraHeads) and cfg["medusa_mini"]["heads"] == "hydra"
    again = tmp_path / "hydra_on_it"
    assert train_tiny.main(FAST + ["--heads", "hydra", "--init", str(first), "--out", str(again)]) == 0
    assert isinstance(load_checkpoint(again)[1], HydraHeads) and same_weights(first, again, backbone_only=True)
    capsys.readouterr()
    assert decode.main(["--ckpt", str(again), "--compare", "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "Medusa greedy" in text and "hydra heads" in text and " no\n" not in text


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    ref = tmp_path_factory.mktemp("ref")
    assert train_tiny.main(FAST + ["--out", str(ref)]) == 0
    return ref


@pytest.mark.parametrize("where", ["backbone:0", "backbone:3", "heads:0", "heads:2"])
def test_an_interrupted_run_resumes_exactly_where_it_stopped(tmp_path, where, reference_run):
    ref, out = reference_run, tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(out), "--interrupt-at", where]) == 130
    assert (out / "train_state.pt").exists() and (out / "config.json").exists()
    load_checkpoint(out)  # what was saved at the interruption is a usable checkpoint
    assert train_tiny.main(FAST + ["--out", str(out), "--resume"]) == 0
    assert same_weights(ref, out)


def test_validation_during_training_and_chunked_heads_leave_the_weights_unchanged(tmp_path, reference_run, capsys):
    """--eval-every draws its batches from a generator of its own; --heads-chunk only splits the work."""
    out = tmp_path / "eval"
    assert train_tiny.main(FAST + ["--out", str(out), "--eval-every", "2", "--heads-chunk", "7"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [line.split()[2] for line in lines] == ["2/6", "4/6", "6/6"] and "validation loss" in lines[0]
    assert same_weights(reference_run, out, rtol=1e-4, atol=1e-6)  # chunks add gradients up in another order


def test_bfloat16_training_reaches_float32s_validation_loss(tmp_path, reference_run, capsys):
    out = tmp_path / "bf16"
    assert train_tiny.main(FAST + ["--out", str(out), "--dtype", "bfloat16"]) == 0
    assert "stages     backbone" in capsys.readouterr().out  # time per stage in the summary
    f32, bf16 = (load_checkpoint(d)[2]["medusa_mini"]["val_loss"] for d in (reference_run, out))
    assert abs(bf16 - f32) <= 0.05 * f32
    assert not same_weights(reference_run, out)  # autocast really ran in bfloat16


def test_an_unfinished_run_is_neither_overwritten_nor_resumed_with_another_configuration(tmp_path, capsys):
    out = tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(out), "--interrupt-at", "backbone:2"]) == 130
    before = (out / "train_state.pt").read_bytes()
    assert train_tiny.main(FAST + ["--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert train_tiny.main(FAST + ["--out", str(out), "--resume", "--lr", "0.5"]) == 2
    assert "different configuration (lr)" in capsys.readouterr().err
    assert (out / "train_state.pt").read_bytes() == before


def test_bad_flags_or_data_are_a_one_line_error_with_code_2_and_write_nothing(tmp_path, capsys):
    # One run as a user starts it (the exit code and stderr of the real process), the rest in-process:
    # the same parser and checks, without paying for a Python start each.
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.bin").write_bytes(b"\x00\x01\x02" * 100)
    r = subprocess.run([sys.executable, str(ROOT / "train_tiny.py"), *FAST, "--lr", "-1", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("train_tiny.py: error:") and r.stderr.count("\n") == 1, r.stderr
    for bad in (["--n-embd", "30", "--n-head", "4"], ["--distill-temperatures", "hot"],
                ["--device", "tpu9"], ["--own-lm-head", "maybe"], ["--threads", "0"], ["--dtype", "float8"],
                ["--dtype", "float16", "--device", "cpu"], ["--eval-every", "-1"], ["--heads-chunk", "-2"],
                ["--heads", "eagle"], ["--heads", "hydra", "--own-lm-head", "true"], ["--resume"],
                *(["--data", str(tmp_path / name)] for name in ("missing.txt", "empty.txt", "binary.bin")),
                ["--init", str(tmp_path / "nope")]):
        try:
            code = train_tiny.main([*FAST, *bad, "--out", str(tmp_path / "x")])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("train_tiny.py: error:"), (bad, err)
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())  # nothing half-written


def test_help_lists_presets_and_every_hyper_parameter():
    r = subprocess.run([sys.executable, str(ROOT / "train_tiny.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and all(flag in r.stdout for flag in (
        "--preset", "--data", "--resume", "--medusa", "--heads-steps", "--distill-temperatures", "--init", "--dtype",
        "--eval-every", "--heads-chunk"))


def _torchrun(*args):
    with socket.socket() as sock:  # a fixed port can still be held by an earlier run; the OS knows a free one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(ROOT / "train_tiny.py"), *FAST, "--device", "cpu", *args],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_two_ddp_processes_keep_identical_replicas_and_resume_exactly(tmp_path):
    def checksums(stdout):
        return [line.split()[-1] for line in stdout.splitlines() if "weights sha256" in line]

    full = _torchrun("--out", str(tmp_path / "ddp"))
    assert full.returncode == 0, full.stderr[-2000:]
    sums = checksums(full.stdout)
    assert len(sums) == 2 and sums[0] == sums[1], full.stdout[-3000:] + full.stderr[-2000:]
    assert "ranks 2" in full.stdout
    # interrupted on both ranks, then resumed: the same final weights as the uninterrupted run
    out = str(tmp_path / "cut")
    assert _torchrun("--out", out, "--interrupt-at", "heads:2").returncode != 0
    resumed = _torchrun("--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert checksums(resumed.stdout) == sums


def test_init_trains_heads_on_a_frozen_checkpoint_replacing_an_older_run_and_resumes_exactly(tmp_path, reference_run):
    """--init with a local GPT-2 layout directory (as the hub's, but written here): heads only, backbone kept."""
    args = FAST + ["--init", str(reference_run), "--preset", "gpt2-cpu", "--heads-steps", "4", "--distill-prompts", "4"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(ref), "--n-embd", "48", "--backbone-steps", "2"]) == 0  # older run
    assert train_tiny.main(args + ["--out", str(ref)]) == 0
    assert same_weights(reference_run, ref, backbone_only=True)
    _, heads, cfg = load_checkpoint(ref)
    assert heads.num_heads == 4 and cfg["medusa_mini"]["init"] == str(reference_run)
    assert (ref / "tokenizer.tiktoken").read_bytes() == (reference_run / "tokenizer.tiktoken").read_bytes()
    assert train_tiny.main(args + ["--out", str(out), "--interrupt-at", "heads:2"]) == 130
    assert train_tiny.main(args + ["--out", str(out), "--resume"]) == 0
    assert same_weights(ref, out)


def test_a_draft_model_can_share_another_checkpoints_tokenizer(tmp_path, reference_run):
    base, draft = reference_run, tmp_path / "draft"
    assert train_tiny.main(FAST + ["--out", str(draft), "--tokenizer", str(base), "--n-layer", "1",
                                   "--vocab-size", "512"]) == 0
    assert (draft / "tokenizer.tiktoken").read_bytes() == (base / "tokenizer.tiktoken").read_bytes()
    assert load_checkpoint(draft)[0].config.vocab_size == load_checkpoint(base)[0].config.vocab_size


@pytest.mark.slow
def test_smoke_preset_end_to_end_medusa_greedy_equals_plain_greedy(tmp_path, capsys):
    """The user's path in small: train the smoke preset, then decode.py --compare --json on it."""
    import decode

    out = tmp_path / "smoke"
    assert train_tiny.main(["--preset", "smoke", "--out", str(out), "--log-every", "1000"]) == 0
    capsys.readouterr()
    assert decode.main(["--ckpt", str(out), "--compare", "--json", "--max-new-tokens", "48"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    plain, medusa = rows["plain_greedy"], rows["medusa_greedy"]
    assert plain["tokens"] == medusa["tokens"] and medusa["same_as_plain_greedy"] is True
    assert medusa["tokens_per_step"] > 1.0 and plain["tokens_per_step"] == 1.0


class _EagerScaler(torch.amp.GradScaler):
    """torch's GradScaler starting at 2**17 and growing after every good step: on this tiny model the
    backbone's float16 gradients overflow from 2**18 and the heads' from 2**22, so each stage skips steps,
    backs off and grows again, and the scale it resumes with decides which later steps are skipped."""

    made: list = []

    def __init__(self, device="cuda", *, enabled=True, **kw):
        super().__init__(device, init_scale=2.0**17, growth_interval=1, enabled=enabled)
        _EagerScaler.made.append(self)


@pytest.mark.slow
def test_float16_loss_scaling_skips_overflows_and_resumes_exactly(tmp_path, monkeypatch):
    """The real loop with an enabled GradScaler: scale, unscale, clip, step (or skip), update; its state
    saved with the run and restored on --resume, so the resumed steps are the uninterrupted ones."""
    # float16 is refused on a CPU (slow there), but torch's GradScaler runs on one since 2.3. The summary
    # reads no scaler and takes most of a run's time: left out.
    for module in (train_tiny, run_mod):
        monkeypatch.setattr(module, "check_dtype", lambda dtype, device: None)
    monkeypatch.setattr(torch.amp, "GradScaler", _EagerScaler)
    monkeypatch.setattr(run_mod, "summarize", lambda *args, **kwargs: {})
    _EagerScaler.made = []
    args = FAST + ["--dtype", "float16", "--heads-steps", "8"]
    ref = tmp_path / "ref"
    assert train_tiny.main(args + ["--out", str(ref)]) == 0
    assert [s.is_enabled() for s in _EagerScaler.made] == [True, True]  # backbone, heads
    assert all(torch.isfinite(v).all() for v in weights(ref).values())
    for where in ("backbone:3", "heads:3"):
        out = tmp_path / where.replace(":", "_")
        assert train_tiny.main(args + ["--out", str(out), "--interrupt-at", where]) == 130
        saved = torch.load(out / "train_state.pt", weights_only=True)["scaler"]
        assert saved["scale"] != 2.0**17 and saved["growth_interval"] == 1  # the scaler's own state, saved
        assert train_tiny.main(args + ["--out", str(out), "--resume"]) == 0
        assert same_weights(ref, out), where
