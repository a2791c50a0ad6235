"""`python -m medusa_mini.cli.measure`: the acceptance tables and this device's stored trees."""

import json
from functools import partial

import pytest
import torch
from conftest import save_small_checkpoint

from benchmarks import sweep
from medusa_mini.cli import measure
from medusa_mini.tree import build_tree
from medusa_mini.tune.acceptance_tables import load_accuracy, load_greedy_ranks
from medusa_mini.tune.calibration import load_calibration, save_calibration
from medusa_mini.tune.replay import replay_ceiling
from medusa_mini.tune.trees import candidate_count, dynamic_trees


def test_recompute_command_saves_the_accuracy_and_prints_the_table(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "top-1" in out and "64 nodes:" in out
    ceiling = replay_ceiling(load_greedy_ranks(tmp_path))  # the bound on any tree the heads' guesses make
    assert f"top-10 guesses, fixed or dynamic, makes more than {ceiling:.2f} tokens/step" in out
    assert "-- greedy acceptance" in out and "-- rejection sampling at T=0.8" in out
    assert "heads_calibration.json, read by dynamic trees" in out and "head 2, below top guesses only" in out
    assert load_calibration(tmp_path) is not None  # what dynamic trees read the heads' confidence through
    assert load_calibration(tmp_path, sampled=True) is not None  # ... under rejection sampling
    assert load_accuracy(tmp_path).shape == (3, 10) and load_accuracy(tmp_path, sampled=True).shape == (3, 10)
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert saved["num_prompts"] == 3 and saved["sampled_temperature"] == 0.8
    trees = json.loads((tmp_path / "trees.json").read_text())  # the default trees for how decode.py runs
    assert set(trees) == {"cpu/float32/eager"} and {"greedy", "rejection", "how"} <= set(trees["cpu/float32/eager"])
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8", "--no-trees"]) == 0


def test_rejection_sampling_dynamic_tree_reads_the_tables_measured_under_sampling(tmp_path):
    save_small_checkpoint(tmp_path)
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8", "--no-trees"]) == 0
    trees = dynamic_trees("dynamic:4", base=None, ckpt_dir=str(tmp_path), device=torch.device("cpu"), num_heads=3)
    greedy_cal, sampled_cal = load_calibration(tmp_path), load_calibration(tmp_path, sampled=True)
    assert trees.greedy.calibration == greedy_cal and trees.sampled.calibration == sampled_cal != greedy_cal
    assert trees.sampled.candidates == build_tree(load_accuracy(tmp_path, sampled=True), candidate_count(4))[0]
    assert trees.greedy.candidates == build_tree(load_accuracy(tmp_path), candidate_count(4))[0]
    save_calibration(tmp_path, greedy_cal)  # a checkpoint from before the sampled table: the greedy one serves
    trees = dynamic_trees("dynamic:4", base=None, ckpt_dir=str(tmp_path), device=torch.device("cpu"), num_heads=3)
    assert trees.sampled.calibration == greedy_cal


def test_measure_stores_trees_under_its_dtype_and_compile(tmp_path, capsys, monkeypatch):
    from medusa_mini.cli.compiled import compile_steps

    # The eager backend checks the capture without a compiler's minutes (cli/compiled.py).
    monkeypatch.setattr(measure, "compile_steps", partial(compile_steps, backend="eager"))
    save_small_checkpoint(tmp_path)
    (tmp_path / "trees.json").write_text(json.dumps({"cpu": {"greedy": [[0]], "rejection": [[0]], "how": "old"}}))
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "2", "--max-new-tokens", "4",
                         "--dtype", "bfloat16", "--compile"]) == 0
    assert "the default trees for cpu/bfloat16/compiled" in capsys.readouterr().out
    trees = json.loads((tmp_path / "trees.json").read_text())
    assert set(trees) == {"cpu/float32/eager", "cpu/bfloat16/compiled"}  # the old entry kept, its key in full
    assert "measured as cpu/bfloat16/compiled" in trees["cpu/bfloat16/compiled"]["how"]


@pytest.mark.parametrize("command, prog", [
    (measure.main, "python -m medusa_mini.cli.measure"), (sweep.main, "python benchmarks/sweep.py"),
])
def test_commands_turn_bad_input_into_one_line_and_exit_status_2(tmp_path, capsys, command, prog):
    with pytest.raises(SystemExit) as exc:
        command(["--ckpt", str(tmp_path / "missing")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1
