"""The training-memory benchmark: its computed sizes follow K x B x T x V, it measures only where it can
(CUDA), and the step it measures computes the same loss chunked or not."""

import subprocess
import sys

import pytest
import torch

from benchmarks.train_memory import ROOT, build, heads_step, logits_sizes, main
from medusa_mini.model import GPTConfig


def test_computed_sizes_are_heads_times_positions_times_vocabulary():
    s = logits_sizes(num_heads=4, batch=32, positions=159, vocab=50257, chunk=333, dtype="bfloat16")
    assert s["logits_elements"] == 4 * 32 * 159 * 50257
    assert s["logits_gib"] == pytest.approx(s["logits_gib_float32"] / 2)
    assert s["chunks"] == 16 and (s["chunks"] - 1) * 333 < 32 * 159 <= s["chunks"] * 333
    assert s["chunk_gib_float32"] == pytest.approx(4 * 333 * 50257 * 4 / 2**30)


def test_the_measured_step_gives_the_same_loss_chunked_or_whole():
    model, heads = build(GPTConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=16), num_heads=3,
                         device=torch.device("cpu"))
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    whole = heads_step(model, heads, batch=3, positions=20, chunk=None, dtype="float32")
    chunked = heads_step(model, heads, batch=3, positions=20, chunk=7, dtype="float32")
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert "peak_gib" not in whole  # a CPU has no peak counter: nothing is claimed


def test_on_a_cpu_it_says_that_nothing_was_measured(capsys):
    assert main(["--device", "cpu", "--batch", "2", "--positions", "8"]) == 0
    out = capsys.readouterr().out
    assert "computed  all logits" in out and "measured  nothing" in out


def test_bad_input_is_one_line_and_exit_code_2(capsys):
    r = subprocess.run([sys.executable, f"{ROOT}/benchmarks/train_memory.py", "--batch", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # as a user runs it
    for bad in (["--positions", "5000"], ["--shape", "gpt9"], ["--device", "tpu"]):  # the same checks, in-process
        with pytest.raises(SystemExit) as exc:
            main(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("train_memory.py: error:") and err.count("\n") == 1, (bad, err)
