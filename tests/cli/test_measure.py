"""`python -m medusa_mini.cli.measure`: the heads' acceptance table, which `--tree N` builds trees from."""

import json

import pytest
from conftest import save_small_checkpoint

from medusa_mini.cli import measure
from medusa_mini.tree import build_tree
from medusa_mini.tune.acceptance_tables import load_accuracy


def test_measure_saves_the_accuracy_table_and_prints_the_product_rule_by_node_budget(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    acc = load_accuracy(tmp_path)
    assert acc.shape == (3, 10) and "top-1" in out
    assert f"8 nodes: {build_tree(acc, 8)[1]:.2f}" in out  # the estimate printed is build_tree's own
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert saved["num_prompts"] == 3 and saved["max_new_tokens"] == 8 and saved["top_k"] == 10


@pytest.mark.parametrize("argv, needle", [
    (["--ckpt", "{tmp}/missing"], "missing"),
    (["--ckpt", "{tmp}", "--prompts", "0"], "--prompts"),
    (["--ckpt", "{tmp}", "--max-new-tokens", "2"], "--max-new-tokens"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        measure.main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m medusa_mini.cli.measure: error: ") and err.count("\n") == 1 and needle in err
