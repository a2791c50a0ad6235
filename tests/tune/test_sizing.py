"""Trees from head accuracies: the greedy builder, the product rule, measuring acc, budget choice."""


import pytest
import torch
from conftest import random_heads, tiny_model

from medusa_mini.step import medusa_step
from medusa_mini.tree import build_tree
from medusa_mini.tune.sizing import (
    CHOICE_BUDGETS,
    CLEAR_GAIN,
    MEASURED_BUDGETS,
    auto_tree,
    fit_step_cost,
    measure_verify_cost,
    steps_compiled,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Matrices this small finish faster than threads can hand work over, most of all on a busy CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Three heads, three ranks; node values by hand: (0,) .6, (0,0) .24, (1,) .2, (0,1) .12, (2,) .1,
# (1,0) .08, (0,0,0) .072, (0,2) .06, ...
HAND = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]])
# Official Medusa-1 heads on Vicuna-7B (top-1 per head), lower ranks decaying: a realistic table.
VICUNA = torch.tensor([[a * 0.45**r for r in range(10)] for a in (0.56, 0.32, 0.20, 0.15)])


















# ---- measuring accuracy ------------------------------------------------------------------------




def _prompts(n, length=5):
    return [torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]










# ---- saving, cost, budget choice ---------------------------------------------------------------








def test_verify_cost_is_measured_for_each_node_count():
    model = tiny_model(0)
    cost = measure_verify_cost(model, heads=random_heads(model), node_counts=(1, 4, 16), repeat=2, prefix_len=20)
    assert sorted(cost) == [1, 4, 16] and all(ms > 0 for ms in cost.values())


def _chosen(why: str) -> int:
    return int(why.splitlines()[-1].split()[1])  # "chose N nodes: ..."


def _rates(acc, step_ms):
    return {n: build_tree(acc, n)[1] / ms for n, ms in step_ms.items()}


def test_auto_tree_takes_the_smallest_budget_within_a_clear_gain_of_the_best_when_cost_is_flat():
    tree, why = auto_tree(VICUNA, {n: 10.0 for n in (1, 2, 4, 8, 16, 32, 64)})
    rates = _rates(VICUNA, {n: 10.0 for n in CHOICE_BUDGETS})
    best = max(rates.values())
    chosen = tree.num_nodes - 1
    assert f"chose {chosen} nodes" in why and rates[chosen] * (1 + CLEAR_GAIN) >= best
    assert all(rates[n] * (1 + CLEAR_GAIN) < best for n in CHOICE_BUDGETS if n < chosen)
    assert why.count("\n") == 9  # header, seven budgets, the cost model, the reason
    assert "flat" in why.splitlines()[-2] and "<- chosen" in why


def test_auto_tree_takes_a_small_budget_when_cost_grows_steeply():
    tree, why = auto_tree(VICUNA, {n: 10.0 * (n + 1) for n in (1, 2, 4, 8, 16, 32, 64)})
    assert tree.num_nodes == 2 and "chose 1 nodes" in why


def test_auto_tree_balances_tokens_against_cost():
    step_ms = {n: 20.0 + 0.5 * n for n in (1, 2, 4, 8, 16, 32, 64)}  # a CPU-like cost curve
    tree, _ = auto_tree(VICUNA, step_ms)
    rates = _rates(VICUNA, step_ms)
    best = max(rates.values())
    chosen = tree.num_nodes - 1
    assert rates[chosen] * (1 + CLEAR_GAIN) >= best
    assert all(rates[n] * (1 + CLEAR_GAIN) < best for n in rates if n < chosen)


def test_auto_tree_chooses_on_the_grid_within_the_measured_budgets():
    step_ms = {n: 5.0 + 0.01 * n for n in (3, 6, 12, 24)}
    _, why = auto_tree(VICUNA, step_ms)
    listed = [int(line.split()[0]) for line in why.splitlines()[1:-2]]
    assert listed == [4, 8, 16] and _chosen(why) in listed
    assert all(line.split()[2] == "-" for line in why.splitlines()[1:-2])  # none measured at exactly N


def test_cost_fit_recovers_a_line_and_keeps_both_coefficients_non_negative():
    line = fit_step_cost({n: 1.0 + 0.05 * n for n in MEASURED_BUDGETS})
    assert line.fixed == pytest.approx(1.0) and line.per_node == pytest.approx(0.05)
    falling = fit_step_cost({n: 10.0 - 0.1 * n for n in MEASURED_BUDGETS})  # no device gets faster
    assert falling.per_node == 0.0 and falling.fixed > 0
    proportional = fit_step_cost({1: 0.5, 2: 2.0, 4: 5.0, 8: 11.0})  # a line through negative ms at 0
    assert proportional.fixed == 0.0 and proportional.per_node > 0


def test_cost_fit_calls_a_slope_within_the_noise_flat():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        noise = 0.8 + 0.4 * torch.rand(len(MEASURED_BUDGETS), generator=g)
        noisy_flat = {n: 10.0 * float(x) for n, x in zip(MEASURED_BUDGETS, noise)}
        assert fit_step_cost(noisy_flat).per_node == 0.0
        noisy_line = {n: (1.0 + 0.05 * n) * float(x) for n, x in zip(MEASURED_BUDGETS, noise)}
        assert fit_step_cost(noisy_line).per_node > 0.0


# Per-budget costs measured with up to ±20% error, as on a busy machine.
CPU_LIKE = {n: 1.0 + 0.05 * n for n in MEASURED_BUDGETS}  # every node costs 5% of a step
GPU_LIKE = {n: 1.0 for n in MEASURED_BUDGETS}  # batch 1: 64 nodes cost what one does
SAMPLED_LIKE = torch.tensor([[a * 0.5**r for r in range(10)] for a in (0.30, 0.15, 0.10, 0.08)])


@pytest.mark.parametrize("acc", [VICUNA, SAMPLED_LIKE], ids=["vicuna", "sampled"])
@pytest.mark.parametrize("cost", [CPU_LIKE, GPU_LIKE], ids=["cpu", "gpu"])
def test_the_chosen_budget_does_not_move_with_20_percent_timing_noise(acc, cost):
    _, exact = auto_tree(acc, cost)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        noise = 0.8 + 0.4 * torch.rand(len(cost), generator=g)  # [budgets], each in [0.8, 1.2)
        _, why = auto_tree(acc, {n: ms * float(x) for (n, ms), x in zip(cost.items(), noise)})
        assert _chosen(why) == _chosen(exact), f"seed {seed}:\n{why}"


def test_the_timed_step_gets_its_root_on_the_device_not_as_a_python_int(monkeypatch):
    # An int root is copied to the device inside every timed step, a blocking copy decoding never pays.
    from medusa_mini.tune import sizing

    roots = []

    def spy(model, cache, proposer, roots_, hidden, **kwargs):
        roots.append(roots_)
        return medusa_step(model, cache, proposer, roots_, hidden, **kwargs)

    monkeypatch.setattr(sizing, "medusa_step", spy)
    model = tiny_model(0)
    measure_verify_cost(model, heads=random_heads(model), node_counts=(1, 4), repeat=1, prefix_len=20)
    assert roots and all(isinstance(r, torch.Tensor) and r.shape == (1,) and r.device == model.device for r in roots)


def test_costs_are_measured_without_tf32_as_decoding_runs_and_the_setting_is_restored(monkeypatch):
    # Training turns TF32 on; decode.py's float32 matmuls run without it, and so must the sizing.
    from medusa_mini.tune import sizing

    seen = []

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return medusa_step(*args, **kwargs)

    monkeypatch.setattr(sizing, "medusa_step", spy)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what train/device.py's enable_tf32 sets
    try:
        model = tiny_model(0)
        measure_verify_cost(model, heads=random_heads(model), node_counts=(1, 4), repeat=1, prefix_len=20)
        assert seen and set(seen) == {"highest"} and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_compiled_steps_are_recognised_and_measured_on_their_own_cache():
    from medusa_mini.cli.compiled import compile_steps

    model = tiny_model(0)
    assert not steps_compiled(model)
    compile_steps(model, backend="eager")
    assert steps_compiled(model)
    for _ in range(2):  # the second measurement starts again from an empty shared cache
        cost = measure_verify_cost(model, heads=random_heads(model), node_counts=(1, 2), repeat=1, prefix_len=20)
        assert sorted(cost) == [1, 2]
