"""The step benchmark runs and reports every number it promises (no timing assertions: machines are noisy)."""

import json

import pytest
import torch

from benchmarks.bench_step import NODES, bench_config, format_table, main, verify_tree
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
    for n in NODES:
        assert verify_tree(n).num_nodes == n
    with pytest.raises(ValueError):
        verify_tree(0)


def test_table_lists_every_row(result):
    text = format_table({"small": result}, header=["header line"], warmup=1)
    assert text.startswith("header line")
    for n in NODES:
        assert f"verify, N = {n}" in text
    assert "Medusa step, cpu tree (12 nodes incl. root)" in text and "/ plain step" in text


def test_json_output_parses(capsys):
    threads = torch.get_num_threads()
    try:
        main(["--configs", "tiny", "--repeat", "2", "--warmup", "0", "--prefix", "32", "--threads", "1", "--json"])
    finally:
        torch.set_num_threads(threads)  # a process-wide setting: leave it as the other tests expect
    out = json.loads(capsys.readouterr().out)
    assert out["device"] in ("cpu", "cuda") and out["threads"] == 1
    assert "--json" in out["command"]
    tiny = out["configs"]["tiny"]
    assert set(tiny["verify_ms"]) == {str(n) for n in NODES}  # JSON keys are strings
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
