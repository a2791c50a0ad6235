"""benchmarks/sweep.py: expected against measured tokens per step, budget by budget, lossless throughout."""

import json

import pytest
from conftest import save_small_checkpoint

from benchmarks import sweep
from medusa_mini.cli import measure


def test_sweep_command_compares_expected_and_measured_and_stays_lossless(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    argv = ["--ckpt", str(tmp_path), "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu"]
    assert sweep.main(argv + ["--json"]) == 0  # no heads_accuracy.json yet: measured on the fly
    result = json.loads(capsys.readouterr().out)
    assert "measured now" in result["accuracy_source"]
    assert [row["nodes"] for row in result["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(row["equal_to_greedy"] == 2 and row["tokens_per_step"] >= 1 for row in result["rows"])
    measure.main(["--ckpt", str(tmp_path), "--prompts", "2", "--max-new-tokens", "6"])
    capsys.readouterr()
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "accuracies: heads_accuracy.json" in out and "speedup" in out and "auto_tree" in out


def test_sweep_at_a_temperature_measures_rejection_sampling_on_the_sampled_table(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    argv = ["--ckpt", str(tmp_path), "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
            "--temperature", "0.8"]
    with pytest.raises(SystemExit) as exc:  # no sampled table yet: say how to measure it
        sweep.main(argv)
    assert exc.value.code == 2 and "medusa_mini.cli.measure" in capsys.readouterr().err
    measure.main(["--ckpt", str(tmp_path), "--prompts", "2", "--max-new-tokens", "6"])
    capsys.readouterr()
    assert sweep.main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["temperature"] == 0.8 and "sampled table" in result["accuracy_source"]
    assert all(row["equal_to_greedy"] is None and row["tokens_per_step"] >= 1 for row in result["rows"])
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert "plain sampling (T=0.8)" in out and "rejection sampling at T=0.8" in out


def test_sweep_in_bfloat16_runs_every_budget_and_says_its_precision(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    argv = ["--ckpt", str(tmp_path), "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
            "--dtype", "bfloat16"]
    assert sweep.main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "bfloat16" and len(result["rows"]) == 7
    assert all(row["tokens_per_step"] >= 1 for row in result["rows"])
    assert sweep.main(argv) == 0
    assert "on cpu, bfloat16; accuracies" in capsys.readouterr().out


def test_sweep_plot_draws_its_rows_into_a_png(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    out = tmp_path / "sweep.png"
    assert sweep.main(["--ckpt", str(tmp_path), "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu",
                       "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 8
    assert f"plot: {out}" in capsys.readouterr().err


def test_sweep_plot_without_matplotlib_stops_before_sweeping_with_one_line(tmp_path, capsys, monkeypatch):
    import sys

    from medusa_mini.cli import plots

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("swept although it cannot plot"))
    save_small_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", str(tmp_path), "--device", "cpu", "--plot", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and plots.MISSING in err
