"""train_tiny.py as a user runs it: stages, checkpoints, exact resume, bad input, DDP replicas."""

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
from medusa_mini.tree import build_tree, expected_tokens_per_step, preset  # noqa: E402
from medusa_mini.tune.acceptance_tables import load_accuracy  # noqa: E402
from medusa_mini.tune.trees import resolve_tree  # noqa: E402

FAST = ["--preset", "smoke", "--max-bytes", "60000", "--vocab-size", "300", "--backbone-steps", "6",
        "--heads-steps", "4", "--distill-prompts", "8", "--distill-tokens", "12", "--eval-prompts", "2",
        "--batch-size", "4", "--block-size", "64", "--n-embd", "32", "--log-every", "1000"]


def weights(out):
    model, heads, cfg = load_checkpoint(out)
    return {**model.state_dict(), **{"heads." + k: v for k, v in heads.state_dict().items()}}


def test_a_run_writes_a_complete_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_tiny.main(FAST + ["--out", str(out)]) == 0
    names = set(os.listdir(out))
    assert names == {"config.json", "model.safetensors", "medusa_heads.safetensors", "medusa_config.json",
                     "tokenizer.tiktoken", "tokenizer_config.json", "prompts.json", "heads_accuracy.json"}  # no resume state
    text = capsys.readouterr().out
    for stage in ("tokenizer", "backbone", "distill", "heads", "summary", "official Medusa-1"):
        assert stage in text
    # the summary's expected tokens per step are the product rule on the stored accuracies
    acc = load_accuracy(out)
    assert acc.shape == (4, 10)
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
    model, heads, cfg = load_checkpoint(first)
    assert isinstance(heads, HydraHeads) and cfg["medusa_mini"]["heads"] == "hydra"
    again = tmp_path / "hydra_on_it"
    assert train_tiny.main(FAST + ["--heads", "hydra", "--init", str(first), "--out", str(again)]) == 0
    model2, heads2, _ = load_checkpoint(again)
    assert isinstance(heads2, HydraHeads)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    capsys.readouterr()
    assert decode.main(["--ckpt", str(again), "--compare", "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "Medusa greedy" in text and "hydra heads" in text and " no\n" not in text


def test_the_same_seed_gives_the_same_weights(tmp_path, reference_run):
    b = tmp_path / "b"
    assert train_tiny.main(FAST + ["--out", str(b)]) == 0
    wa, wb = weights(reference_run), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


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
    wr, wo = weights(ref), weights(out)
    assert all(torch.equal(wr[k], wo[k]) for k in wr)


def test_validation_during_training_and_chunked_heads_leave_the_weights_unchanged(tmp_path, reference_run, capsys):
    """--eval-every draws its batches from a generator of its own; --heads-chunk only splits the work."""
    out = tmp_path / "eval"
    assert train_tiny.main(FAST + ["--out", str(out), "--eval-every", "2", "--heads-chunk", "7"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [line.split()[2] for line in lines] == ["2/6", "4/6", "6/6"] and "validation loss" in lines[0]
    wr, wo = weights(reference_run), weights(out)
    # chunks add their gradients up in another order: equal up to rounding
    assert all(torch.allclose(wr[k], wo[k], rtol=1e-4, atol=1e-6) for k in wr)


def test_bfloat16_training_reaches_float32s_validation_loss(tmp_path, reference_run, capsys):
    out = tmp_path / "bf16"
    assert train_tiny.main(FAST + ["--out", str(out), "--dtype", "bfloat16"]) == 0
    assert "stages     backbone" in capsys.readouterr().out  # time per stage in the summary
    f32, bf16 = (load_checkpoint(d)[2]["medusa_mini"]["val_loss"] for d in (reference_run, out))
    assert abs(bf16 - f32) <= 0.05 * f32
    wr, wb = weights(reference_run), weights(out)
    assert any(not torch.equal(wr[k], wb[k]) for k in wr)  # autocast really ran in bfloat16


def test_resume_with_a_different_configuration_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(out), "--interrupt-at", "backbone:2"]) == 130
    assert train_tiny.main(FAST + ["--out", str(out), "--resume", "--lr", "0.5"]) == 2
    assert "different configuration (lr)" in capsys.readouterr().err
    assert train_tiny.main(FAST + ["--out", str(tmp_path / "nothing"), "--resume"]) == 2


def test_an_unfinished_run_is_not_overwritten_by_a_new_one(tmp_path, capsys):
    out = tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(out), "--interrupt-at", "backbone:2"]) == 130
    before = (out / "train_state.pt").read_bytes()
    assert train_tiny.main(FAST + ["--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (out / "train_state.pt").read_bytes() == before


@pytest.mark.parametrize("kind", ["missing", "empty", "binary"])
def test_bad_data_is_a_one_line_error_and_writes_nothing(tmp_path, capsys, kind):
    data = tmp_path / "data.txt"
    if kind == "empty":
        data.write_text("")
    elif kind == "binary":
        data.write_bytes(b"\x00\x01\x02" * 100)
    out = tmp_path / "out"
    assert train_tiny.main(FAST + ["--out", str(out), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train_tiny.py: error:") and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_bad_hyper_parameters_exit_with_code_2(tmp_path, capsys):
    # One run as a user starts it (the exit code and stderr of the real process), the rest in-process:
    # the same parser and checks, without paying for a Python start each.
    r = subprocess.run([sys.executable, str(ROOT / "train_tiny.py"), *FAST, "--lr", "-1", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("train_tiny.py: error:") and r.stderr.count("\n") == 1, r.stderr
    for bad in (["--n-embd", "30", "--n-head", "4"], ["--distill-temperatures", "hot"],
                ["--device", "tpu9"], ["--own-lm-head", "maybe"], ["--threads", "0"], ["--dtype", "float8"],
                ["--dtype", "float16", "--device", "cpu"], ["--eval-every", "-1"], ["--heads-chunk", "-2"],
                ["--heads", "eagle"], ["--heads", "hydra", "--own-lm-head", "true"]):
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
    assert r.returncode == 0
    for flag in ("--preset", "--data", "--resume", "--medusa", "--heads-steps", "--distill-temperatures", "--init",
                 "--dtype", "--eval-every", "--heads-chunk"):
        assert flag in r.stdout


def _free_port() -> int:
    # A fixed port can still be held by an earlier run's socket; the OS knows one that is free.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = _free_port()
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(ROOT / "train_tiny.py"), *FAST, "--device", "cpu", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )


def _checksums(stdout):
    return [line.split()[-1] for line in stdout.splitlines() if "weights sha256" in line]


def test_two_ddp_processes_keep_identical_replicas_and_resume_exactly(tmp_path):
    full = _torchrun("--out", str(tmp_path / "ddp"))
    assert full.returncode == 0, full.stderr[-2000:]
    sums = _checksums(full.stdout)
    assert len(sums) == 2 and sums[0] == sums[1], full.stdout[-3000:] + full.stderr[-2000:]
    assert "ranks 2" in full.stdout
    # interrupted on both ranks, then resumed: the same final weights as the uninterrupted run
    out = str(tmp_path / "cut")
    assert _torchrun("--out", out, "--interrupt-at", "heads:2").returncode != 0
    resumed = _torchrun("--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _checksums(resumed.stdout) == sums


def test_init_trains_heads_on_a_frozen_gpt2_layout_checkpoint(tmp_path, reference_run):
    """--init with a local GPT-2 directory (as the hub's, but written here): heads only, backbone kept."""
    base = reference_run
    out = tmp_path / "heads"
    assert train_tiny.main(FAST + ["--init", str(base), "--preset", "gpt2-cpu", "--heads-steps", "3",
                                   "--distill-prompts", "4", "--out", str(out)]) == 0
    m0, _, _ = load_checkpoint(base)
    m1, heads, cfg = load_checkpoint(out)
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
    assert heads.num_heads == 4 and cfg["medusa_mini"]["init"] == str(base)
    assert (out / "tokenizer.tiktoken").exists()


def test_heads_on_a_frozen_backbone_resume_exactly(tmp_path, reference_run):
    args = FAST + ["--init", str(reference_run), "--preset", "gpt2-cpu", "--heads-steps", "4",
                   "--distill-prompts", "4"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert train_tiny.main(args + ["--out", str(ref)]) == 0
    assert train_tiny.main(args + ["--out", str(out), "--interrupt-at", "heads:2"]) == 130
    assert train_tiny.main(args + ["--out", str(out), "--resume"]) == 0
    wr, wo = weights(ref), weights(out)
    assert all(torch.equal(wr[k], wo[k]) for k in wr)


def test_init_with_a_missing_model_is_a_clear_error(tmp_path, capsys):
    assert train_tiny.main(FAST + ["--init", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "--init" in capsys.readouterr().err


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
    result = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in result["rows"]}
    assert rows["plain_greedy"]["tokens"] == rows["medusa_greedy"]["tokens"]
    assert rows["medusa_greedy"]["same_as_plain_greedy"] is True
    assert rows["medusa_greedy"]["tokens_per_step"] > 1.0 and rows["plain_greedy"]["tokens_per_step"] == 1.0


def test_heads_on_a_new_backbone_replace_an_older_run_in_the_same_folder(tmp_path, reference_run):
    out = tmp_path / "reused"
    assert train_tiny.main(FAST + ["--out", str(out), "--n-embd", "48", "--backbone-steps", "2"]) == 0
    assert train_tiny.main(FAST + ["--init", str(reference_run), "--preset", "gpt2-cpu", "--heads-steps", "2",
                                   "--distill-prompts", "4", "--out", str(out)]) == 0
    m0, _, _ = load_checkpoint(reference_run)
    m1, _, _ = load_checkpoint(out)
    assert m1.config == m0.config
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
