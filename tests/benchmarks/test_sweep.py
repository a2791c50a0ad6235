"""benchmarks/sweep.py: static and dynamic trees side by side, greedy and rejection sampling, budget by budget."""

import json

import pytest
import torch
from conftest import save_small_checkpoint, save_tiny

from benchmarks import sweep, sweep_methods
from medusa_mini.cli.measure import recompute_accuracy
from medusa_mini.decoding import GenerationStats
from medusa_mini.dynamic import DynamicTree
from medusa_mini.heads import HeadsConfig
from medusa_mini.hydra import make_heads
from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint

FAST = ["--budgets", "2,4", "--max-new-tokens", "8", "--repeat", "1", "--num-prompts", "2", "--device", "cpu",
        "--threads", "1"]  # one thread: tiny matmuls only lose to thread contention on a busy machine


def measured_checkpoint(directory, *, kind: str = "medusa") -> str:
    """save_small_checkpoint (with hydra heads instead, for kind "hydra") and its heads_accuracy.json.

    Its heads start as the identity on the backbone's hidden state, so they guess its next token:
    right whenever its greedy text repeats, which gives the trees something to accept."""
    save_small_checkpoint(directory)
    if kind == "hydra":
        model, _, _ = load_checkpoint(directory)
        torch.manual_seed(0)
        heads = make_heads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=model.config.vocab_size, kind="hydra"))
        with torch.no_grad():  # reading the drafted tokens a little, so they matter
            for block in heads.blocks:
                block.linear.weight.normal_(0.0, 0.02)
        save_checkpoint(directory, model, heads=heads.eval())
    recompute_accuracy(str(directory), num_prompts=4, max_new_tokens=8)
    return str(directory)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """--threads sets torch's thread count for the whole process: give the next test its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def medusa_ckpt(tmp_path_factory):
    return measured_checkpoint(tmp_path_factory.mktemp("medusa"))


def run_json(ckpt: str, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert sweep.main(["--ckpt", ckpt, *FAST, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_sweep_puts_static_and_dynamic_trees_side_by_side_for_greedy_and_rejection(medusa_ckpt, capsys, tmp_path):
    png = tmp_path / "sweep.png"
    result = run_json(medusa_ckpt, capsys, "--plot", str(png))
    rows = result["rows"]
    assert {(r["tree"], r["rule"], r["nodes"]) for r in rows} == {
        (tree, rule, n) for tree in ("static", "dynamic") for rule in ("greedy", "rejection") for n in (2, 4)}
    assert result["heads"] == "medusa" and result["draft"] == "topk" and set(result["plain"]) == {"greedy", "rejection"}
    for r in rows:
        plain = result["plain"][r["rule"]]
        assert r["tokens_per_step"] >= 1 and r["tokens_per_s"] > 0 and 1 <= r["verified_nodes"] <= r["nodes"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert (r["expected_tokens_per_step"] is not None) == (r["tree"] == "static")
        assert (r["same_as_plain_greedy"] is not None) == (r["rule"] == "greedy")
    for rule, best in result["best"].items():  # the fastest measured row of the rule, named by kind and budget
        fastest = max((r for r in rows if r["rule"] == rule), key=lambda r: r["tokens_per_s"])
        assert (best["tree"], best["nodes"]) == (fastest["tree"], fastest["nodes"])
    # measured on the same prompts, no greedy row, static or dynamic, passes the ceiling
    assert all(r["tokens_per_step"] <= result["greedy_ceiling"] + 1e-12 for r in rows if r["rule"] == "greedy")
    assert f"more than {result['greedy_ceiling']:.2f} tokens/step" in sweep.format_sweep(result)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 8


def test_greedy_rows_of_both_tree_kinds_write_plain_greedys_tokens_and_repeat_run_for_run(medusa_ckpt, capsys):
    first, again = (run_json(medusa_ckpt, capsys, "--rules", "greedy", "--seed", "3") for _ in range(2))
    greedy = first["rows"]
    assert {r["tree"] for r in greedy} == {"static", "dynamic"} and {r["rule"] for r in greedy} == {"greedy"}
    assert all(r["same_as_plain_greedy"] is True and r["prompts_same_as_plain_greedy"] == 2 for r in greedy)
    counts = ("tree", "nodes", "verified_nodes", "steps", "new_tokens", "tokens_per_step", "expected_tokens_per_step")
    assert [{k: r[k] for k in counts} for r in again["rows"]] == [{k: r[k] for k in counts} for r in greedy]


def test_rejection_rows_draft_the_top_k_so_dynamic_trees_choose_their_nodes_every_step(medusa_ckpt):
    tables = sweep_methods.load_tables(medusa_ckpt, num_heads=3)
    methods = sweep_methods.sweep_methods(medusa_ckpt, tables=tables, budgets=(2, 8), rules=("rejection",),
                                          kinds=("static", "dynamic"), temperature=0.8, num_heads=3,
                                          device=torch.device("cpu"))
    assert [(m.tree_kind, m.budget) for m in methods] == [
        (None, 0), ("static", 2), ("dynamic", 2), ("static", 8), ("dynamic", 8)]
    for m in methods:
        assert m.sampling.rule == "rejection" and not m.sampling.draws_candidates  # sampled drafts: a fixed tree
    dynamic = [m for m in methods if m.tree_kind == "dynamic"]
    assert all(isinstance(m.tree, DynamicTree) and m.tree.budget == m.verified_nodes for m in dynamic)


def test_with_drawn_drafts_the_rejection_rows_are_static_trees_drafting_as_decode_py_does(medusa_ckpt, capsys):
    # decode.py draws rejection sampling's drafts from the heads' q by default; the stored rejection
    # tree is sized for those, so this is the sweep that checks it.
    tables = sweep_methods.load_tables(medusa_ckpt, num_heads=3)
    methods = sweep_methods.sweep_methods(medusa_ckpt, tables=tables, budgets=(2, 4), rules=("greedy", "rejection"),
                                          kinds=("static", "dynamic"), temperature=0.8, num_heads=3,
                                          device=torch.device("cpu"), draft="sampled")
    rejection = [m for m in methods if m.rule == "rejection"]
    assert [(m.tree_kind, m.budget) for m in rejection] == [(None, 0), ("static", 2), ("static", 4)]
    assert all(m.sampling.draws_candidates for m in rejection if m.tree is not None)
    assert {m.tree_kind for m in methods if m.rule == "greedy"} == {None, "static", "dynamic"}
    result = run_json(medusa_ckpt, capsys, "--draft", "sampled")
    assert result["draft"] == "sampled"
    assert {(r["tree"], r["rule"]) for r in result["rows"]} == {
        ("static", "greedy"), ("dynamic", "greedy"), ("static", "rejection")}
    text = sweep.format_sweep(result)
    assert "rejection sampling (T=0.8, drafts drawn from q)" in text and "no dynamic rows" in text
    assert "these rows draft their top-k" not in text


def test_a_greedy_row_that_leaves_plain_greedy_says_so_on_which_prompts():
    def runs(*outputs):
        return [(tokens, GenerationStats(prompt_tokens=3, steps=2, step_tokens=[2, 2], seconds=0.01))
                for tokens in outputs]

    method = sweep_methods.Method("dynamic", "greedy", 4, sweep_methods.rule_sampling("greedy", temperature=0.8))
    plain = sweep_methods.speed(runs([1, 2, 3, 4], [5, 6, 7, 8]))
    row = sweep_methods.tree_row(method, runs([1, 2, 3, 4], [5, 6, 9, 8]), plain=plain,
                                 plain_greedy=runs([1, 2, 3, 4], [5, 6, 7, 8]))
    assert row["same_as_plain_greedy"] is False and row["prompts_same_as_plain_greedy"] == 1


def test_sweep_runs_hydra_heads_and_its_table_prints_their_kind_both_tree_kinds_and_the_fastest_per_rule(tmp_path, capsys):
    ckpt = measured_checkpoint(tmp_path, kind="hydra")
    result = run_json(ckpt, capsys, "--budgets", "3")
    assert result["heads"] == "hydra" and len(result["rows"]) == 4
    assert all(r["same_as_plain_greedy"] for r in result["rows"] if r["rule"] == "greedy")
    assert sweep.main(["--ckpt", ckpt, *FAST, "--budgets", "3"]) == 0
    out = capsys.readouterr().out
    assert "hydra heads (3)" in out and "static tree" in out and "dynamic tree" in out
    assert "most tokens/s, greedy: the" in out and "most tokens/s, rejection sampling (T=0.8, top-k drafts): the" in out
    assert "plain greedy" in out and "plain sampling (T=0.8)" in out


@pytest.mark.parametrize("flags, message", [
    (["--budgets", "0,4"], "--budgets"), (["--budgets", "two"], "--budgets"), (["--rules", "typical"], "--rules"),
    (["--trees", "static,bushy"], "--trees"), (["--repeat", "0"], "--repeat"), (["--temperature", "0"], "--temperature"),
    (["--num-prompts", "0"], "--num-prompts"), (["--plot", "/no/such/folder/s.png"], "--plot"),
    (["--draft", "sampled", "--rules", "rejection", "--trees", "dynamic"], "--draft sampled"),
    (["--draft", "drawn"], "--draft"),
])
def test_bad_flags_exit_2_with_one_line(medusa_ckpt, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", medusa_ckpt, "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def test_sweep_without_heads_accuracy_says_how_to_measure_it(tmp_path, capsys):
    save_small_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", str(tmp_path), *FAST])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "medusa_mini.cli.measure" in err


def test_heads_that_are_never_right_are_a_one_line_error_not_a_sweep_of_empty_trees(tmp_path, capsys):
    save_tiny(tmp_path, with_heads=True)  # random heads: their top guesses miss on every greedy continuation
    recompute_accuracy(str(tmp_path), num_prompts=3, max_new_tokens=8)
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", str(tmp_path), *FAST])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "train the heads" in err


def test_sweep_plot_without_matplotlib_stops_before_sweeping_with_one_line(medusa_ckpt, tmp_path, capsys, monkeypatch):
    import sys

    from medusa_mini.cli import plots

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("swept although it cannot plot"))
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--ckpt", medusa_ckpt, "--device", "cpu", "--plot", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and plots.MISSING in err
