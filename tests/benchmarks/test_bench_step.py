"""benchmarks/bench_step.py reports every stage of a step it promises (no timing assertions: machines are noisy)."""

import json
import re

import pytest
import torch

import benchmarks.bench_step as bench_step
from benchmarks.bench_step import CONFIGS, STAGES, bench_config, check_config, main, verify_tree
from medusa_mini.model import GPTConfig

SMALL = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.usefixtures("one_thread")  # restores the thread count that --threads sets process-wide
def test_the_table_prints_every_stage_the_heads_share_of_a_plain_step_and_the_step_over_its_verify(capsys, monkeypatch):
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    main(["--configs", "small", "--repeat", "1", "--warmup", "1", "--prefix", "16", "--threads", "1", "--nodes", "1,4",
          "--draft-vocab", "16"])
    lines = capsys.readouterr().out.splitlines()
    cells = dict(re.split(r"\s{2,}", line.strip()) for line in lines if re.search(r"\S\s{2,}\S", line))
    assert cells["layers / heads / width / vocabulary / draft"] == "2 / 2 / 32 / 64 / 16"
    labels = ["plain step (1 token + argmax)", "verify, N = 1", "verify, N = 4"]
    for tree, nodes in (("cpu", 12), ("gpu", 68)):
        labels += [f"{tree} tree ({nodes} nodes incl. root): {stage}" for stage in STAGES]
        labels += [f"{tree} tree: {what}" for what in ("heads / plain step (%)", "whole step / verify alone (x)")]
    assert all(float(cells[label]) > 0 for label in labels)


def test_the_draft_vocabulary_is_4096_tokens_for_gpt2_shapes_and_all_for_tiny_unless_asked():
    assert check_config(CONFIGS["gpt2"], prefix_len=128, draft_vocab=None) == 4096
    assert check_config(CONFIGS["tiny"], prefix_len=128, draft_vocab=None) == 0
    assert check_config(CONFIGS["gpt2"], prefix_len=128, draft_vocab=0) == 0
    with pytest.raises(ValueError, match="--draft-vocab"):  # fewer tokens than the trees' ranks
        check_config(CONFIGS["gpt2"], prefix_len=128, draft_vocab=4)


def test_verify_trees_have_the_requested_size():
    assert [verify_tree(n).num_nodes for n in (1, 2, 64, 128, 256)] == [1, 2, 64, 128, 256]


def test_compiled_steps_are_measured_like_eager_ones():
    r = bench_config(SMALL, device=torch.device("cpu"), repeat=1, warmup=1, prefix_len=8, nodes=(1, 64),
                     compiled=True, compile_backend="eager")
    assert r["compiled"] and set(r["verify_ms"]) == {1, 64} and r["first_round_s"] > 0
    assert all(t > 0 for info in r["medusa"].values() for t in info["stages_ms"].values())


def test_each_figure_is_the_median_of_the_timed_rounds_the_warm_up_rounds_left_out(monkeypatch):
    """Fake clock: warm-up rounds take 9 s, the timed ones 1, 2 and 30 ms; every figure must be 2 ms."""
    real = bench_step.in_turns

    def fake_in_turns(calls, *, rounds, device, before_each=None):
        out = real(calls, rounds=rounds, device=device, before_each=before_each)  # the results, really run
        seconds = [9.0] * (rounds - 3) + [0.001, 0.030, 0.002]
        return {key: [(result, s) for (result, _), s in zip(runs, seconds)] for key, runs in out.items()}

    monkeypatch.setattr(bench_step, "in_turns", fake_in_turns)
    r = bench_config(SMALL, device=torch.device("cpu"), repeat=3, warmup=2, prefix_len=8, nodes=(1, 4))
    figures = [r["plain_ms"], *r["verify_ms"].values(), *(t for m in r["medusa"].values() for t in m["stages_ms"].values())]
    assert figures and all(t == pytest.approx(2.0) for t in figures)


@pytest.mark.parametrize("argv, needle", [
    (["--configs", "gpt5"], "--configs"), (["--device", "tpu"], "unknown device"), (["--prefix", "0"], "--prefix"),
    (["--configs", "tiny", "--prefix", "100000"], "--prefix"), (["--threads", "0"], "--threads"),
    (["--warmup", "0"], "--warmup"), (["--dtypes", "float8"], "--dtypes"), (["--dtypes", ","], "--dtypes"),
    (["--nodes", "4,x"], "--nodes"), (["--nodes", "300"], "--nodes"), (["--draft-vocab", "100000"], "--draft-vocab"),
    (["--seed", "99999999999999999999"], "--seed"), (["--seed", "-1"], "--seed"),
])
def test_bad_input_is_one_line_and_exit_status_2_before_any_measuring(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("python benchmarks/bench_step.py: error: ") and err.count("\n") == 1
    assert needle in err


@pytest.mark.usefixtures("one_thread")  # restores the thread count that --threads sets process-wide
def test_json_holds_every_stage_of_both_trees_per_dtype_and_names_the_command(capsys, monkeypatch):
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    main(["--configs", "small", "--repeat", "1", "--warmup", "1", "--prefix", "16", "--threads", "1",
          "--dtypes", "float32,bfloat16", "--nodes", "2,100", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["threads"] == 1 and "--json" in out["command"]
    assert list(out["configs"]) == ["small", "small bfloat16"]
    for r, dtype in zip(out["configs"].values(), ["float32", "bfloat16"]):
        assert r["dtype"] == dtype and set(r["verify_ms"]) == {"2", "100"} and not r["compiled"]
        assert {name: info["nodes"] for name, info in r["medusa"].items()} == {"cpu": 12, "gpu": 68}
        for info in r["medusa"].values():
            assert list(info["stages_ms"]) == list(STAGES) and all(t > 0 for t in info["stages_ms"].values())
            assert 0 <= info["accepted"] < info["nodes"]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert exc.value.code == 0
    assert "(default: tiny,gpt2)" in text and "(default: float32)" in text and "(default: 0)" in text
