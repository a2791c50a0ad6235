"""benchmarks/bench_step.py reports every stage of a step it promises (no timing assertions: machines are noisy)."""

import json
import re

import pytest
import torch

import benchmarks.bench_step as bench_step
from benchmarks.bench_step import CUDA_NODES, MAX_VERIFY_NODES, NODES, STAGES, bench_config, format_table, main, verify_tree
from medusa_mini.model import GPTConfig

SMALL = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def result() -> dict:
    return bench_config(SMALL, device=torch.device("cpu"), repeat=2, warmup=1, prefix_len=16)


def test_every_stage_of_both_trees_is_timed_and_the_ratios_are_the_steps_over_plain_and_verify(result):
    assert list(result["verify_ms"]) == list(NODES) and result["plain_ms"] > 0
    assert all(t > 0 for t in result["verify_ms"].values())
    assert {name: info["nodes"] for name, info in result["medusa"].items()} == {"cpu": 12, "gpu": 68}
    for info in result["medusa"].values():
        assert list(info["stages_ms"]) == list(STAGES) and all(t > 0 for t in info["stages_ms"].values())
        assert info["ms"] == info["stages_ms"]["step"]
        assert info["ratio"] == pytest.approx(info["ms"] / result["plain_ms"])
        assert info["step_vs_verify"] == pytest.approx(info["ms"] / info["stages_ms"]["verify"])
        assert 0 <= info["accepted"] < info["nodes"]


def test_verify_trees_have_the_requested_size_and_every_prefix():
    for n in (*NODES, *CUDA_NODES, MAX_VERIFY_NODES):
        tree = verify_tree(n)
        assert tree.num_nodes == n and all(len(c) == 1 or c[:-1] in tree.choices for c in tree.choices)
    for bad in (0, MAX_VERIFY_NODES + 1):
        with pytest.raises(ValueError):
            verify_tree(bad)


def test_table_prints_each_stage_and_the_step_over_verify_ratio(result):
    lines = format_table({"small": result}, header=["header line"]).splitlines()
    assert lines[0] == "header line"
    cells = dict(re.split(r"\s{2,}", line.strip()) for line in lines[4:] if "  " in line.strip())
    assert [k for k in cells if k.startswith("verify, N")] == [f"verify, N = {n}" for n in NODES]
    cpu = result["medusa"]["cpu"]
    for stage in STAGES[:-1]:
        assert cells[f"cpu tree (12 nodes incl. root): {stage}"] == f"{cpu['stages_ms'][stage]:.2f}"
    assert cells["cpu tree: whole medusa_step"] == f"{cpu['ms']:.2f}"
    assert cells["cpu tree: whole step / verify alone (x)"] == f"{cpu['step_vs_verify']:.2f}"


@pytest.mark.parametrize("argv, needle", [
    (["--configs", "gpt5"], "--configs"), (["--device", "tpu"], "unknown device"), (["--prefix", "0"], "--prefix"),
    (["--configs", "tiny", "--prefix", "100000"], "--prefix"), (["--threads", "0"], "--threads"),
    (["--warmup", "0"], "--warmup"), (["--dtypes", "float8"], "--dtypes"), (["--dtypes", ","], "--dtypes"),
    (["--nodes", "4,x"], "--nodes"), (["--nodes", "300"], "--nodes"),
])
def test_bad_input_is_one_line_and_exit_status_2_before_any_measuring(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("python benchmarks/bench_step.py: error: ") and err.count("\n") == 1
    assert needle in err


@pytest.mark.usefixtures("one_thread")  # restores the thread count that --threads sets process-wide
def test_json_names_the_command_and_gives_every_dtype_its_own_column(capsys, monkeypatch):
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    main(["--configs", "small", "--repeat", "1", "--warmup", "1", "--prefix", "16", "--threads", "1",
          "--dtypes", "float32,bfloat16", "--nodes", "2,100", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["threads"] == 1 and "--json" in out["command"]
    configs = out["configs"]
    assert list(configs) == ["small", "small bfloat16"]  # compiled columns: tests/benchmarks/test_gpu_report.py
    assert [r["dtype"] for r in configs.values()] == ["float32", "bfloat16"]
    assert all(set(r["verify_ms"]) == {"2", "100"} and not r["compiled"] for r in configs.values())
    header = next(line for line in format_table(configs, header=[]).splitlines() if "small bfloat16" in line)
    assert header.split() == ["small", "small", "bfloat16"]
