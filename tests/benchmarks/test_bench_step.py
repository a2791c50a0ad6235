"""The step benchmark runs and reports every number it promises (no timing assertions: machines are noisy)."""

import json
from functools import partial

import pytest
import torch

import benchmarks.bench_step as bench_step
from benchmarks.bench_step import (
    CUDA_NODES,
    MAX_VERIFY_NODES,
    NODES,
    bench_config,
    format_table,
    main,
    verify_tree,
)
from medusa_mini.cli.compiled import compile_steps
from medusa_mini.model import GPTConfig

SMALL = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def result() -> dict:
    return bench_config(SMALL, device=torch.device("cpu"), repeat=2, warmup=1, prefix_len=16)


def test_every_measurement_is_present_and_positive(result):
    assert result["repeat"] == 2 and result["prefix_len"] == 16
    assert list(result["verify_ms"]) == list(NODES)
    assert set(result["heads_ms"]) == {"shared", "own"}
    assert set(result["medusa"]) == {"cpu", "gpu"}
    times = [result["plain_ms"], *result["verify_ms"].values(), *result["heads_ms"].values()]
    times += [m["ms"] for m in result["medusa"].values()]
    assert all(t > 0 for t in times)


def test_ratio_is_medusa_step_over_plain_step(result):
    for tree in result["medusa"].values():
        assert tree["ratio"] == pytest.approx(tree["ms"] / result["plain_ms"])
        assert 0 <= tree["accepted"] < tree["nodes"]
    assert result["medusa"]["cpu"]["nodes"] == 12


def test_verify_trees_have_the_requested_size_and_are_valid():
    for n in (*NODES, *CUDA_NODES, MAX_VERIFY_NODES):
        tree = verify_tree(n)
        assert tree.num_nodes == n
        assert all(c[:-1] in tree.choices or len(c) == 1 for c in tree.choices)  # every prefix is a node
    for bad in (0, MAX_VERIFY_NODES + 1):
        with pytest.raises(ValueError):
            verify_tree(bad)


def test_table_lists_every_row(result):
    text = format_table({"small": result}, header=["header line"], warmup=1)
    assert text.startswith("header line")
    for n in NODES:
        assert f"verify, N = {n}" in text
    assert "Medusa step, cpu tree (12 nodes incl. root)" in text and "/ plain step" in text


def test_json_output_parses(capsys):
    threads = torch.get_num_threads()
    try:
        main(["--configs", "tiny", "--repeat", "2", "--warmup", "1", "--prefix", "32", "--threads", "1", "--json",
              "--nodes", "1,4"])
    finally:
        torch.set_num_threads(threads)  # a process-wide setting: leave it as the other tests expect
    out = json.loads(capsys.readouterr().out)
    assert out["device"] in ("cpu", "cuda") and out["threads"] == 1
    assert "--json" in out["command"]
    tiny = out["configs"]["tiny"]
    assert set(tiny["verify_ms"]) == {"1", "4"}  # JSON keys are strings
    assert tiny["dtype"] == "float32" and not tiny["compiled"] and tiny["first_round_s"] > 0
    assert tiny["medusa"]["cpu"]["ratio"] == pytest.approx(tiny["medusa"]["cpu"]["ms"] / tiny["plain_ms"])


def test_unknown_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--configs", "gpt5"])
    assert exc.value.code == 2
    assert "unknown config gpt5" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--device", "tpu"], "unknown device"),
    (["--prefix", "0"], "--prefix"),
    (["--configs", "tiny", "--prefix", "100000"], "--prefix"),
    (["--threads", "0"], "--threads"),
    (["--warmup", "0"], "--warmup"),
    (["--dtypes", "float8"], "unknown dtype 'float8'"),
    (["--dtypes", ","], "--dtypes"),
    (["--nodes", "4,x"], "--nodes"),
    (["--nodes", "300"], "--nodes"),
    (["--configs", "tiny,gpt5"], "unknown config gpt5"),
])
def test_bad_input_is_one_line_and_exit_status_2_before_any_measuring(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python benchmarks/bench_step.py: error: ") and err.count("\n") == 1
    assert needle in err


def test_help_works(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python benchmarks/bench_step.py")
    for option in ("--configs", "--device", "--repeat", "--threads", "--json"):
        assert option in out


def test_every_dtype_and_the_compiled_steps_get_their_own_column(capsys, monkeypatch):
    # The "eager" backend captures the same whole graphs as inductor, without a C++ compiler.
    torch.compiler.reset()
    monkeypatch.setattr(bench_step, "compile_steps", partial(compile_steps, backend="eager"))
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    threads = torch.get_num_threads()
    try:
        main(["--configs", "small", "--repeat", "1", "--warmup", "1", "--prefix", "16", "--threads", "1",
              "--dtypes", "float32,bfloat16", "--compile", "--nodes", "2,100", "--json"])
    finally:
        torch.set_num_threads(threads)
    configs = json.loads(capsys.readouterr().out)["configs"]
    assert list(configs) == ["small", "small compiled", "small bfloat16", "small bfloat16 compiled"]
    for name, result in configs.items():
        assert result["dtype"] == ("bfloat16" if "bfloat16" in name else "float32")
        assert result["compiled"] == name.endswith("compiled")
        assert set(result["verify_ms"]) == {"2", "100"} and all(t > 0 for t in result["verify_ms"].values())
    text = format_table(configs, header=["h"], warmup=1)
    assert "first round, s" in text
    header = next(line for line in text.splitlines() if "small bfloat16 compiled" in line)
    assert [c.strip() for c in header.split("  ") if c.strip()] == list(configs)


def test_timed_medusa_steps_get_their_root_on_the_device_not_as_a_python_int(monkeypatch):
    # An int root is copied to the device inside every timed step, a blocking copy decoding never pays.
    roots = []
    real = bench_step.medusa_step

    def spy(model, cache, tree, root, head_logits, **kwargs):
        roots.append(root)
        return real(model, cache, tree, root, head_logits, **kwargs)

    monkeypatch.setattr(bench_step, "medusa_step", spy)
    bench_config(SMALL, device=torch.device("cpu"), repeat=1, warmup=0, prefix_len=16, nodes=(1,))
    assert roots and all(isinstance(r, torch.Tensor) and r.shape == (1,) for r in roots)
