"""Trees from head accuracies: the greedy builder, the product rule, measuring acc, budget choice."""


import pytest
import torch
from conftest import random_heads, tiny_model

from medusa_mini.tree import build_tree
from medusa_mini.tune.sizing import auto_tree, measure_verify_cost


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


def test_auto_tree_takes_the_largest_budget_when_cost_is_flat():
    tree, why = auto_tree(VICUNA, {n: 10.0 for n in (1, 2, 4, 8, 16, 32, 64)})
    assert tree.num_nodes == 65 and "chose 64 nodes" in why
    assert why.count("\n") == 8  # header, seven budgets, the reason


def test_auto_tree_takes_a_small_budget_when_cost_grows_steeply():
    tree, why = auto_tree(VICUNA, {n: 10.0 * (n + 1) for n in (1, 2, 4, 8, 16, 32, 64)})
    assert tree.num_nodes == 2 and "chose 1 nodes" in why


def test_auto_tree_balances_tokens_against_cost():
    step_ms = {n: 20.0 + 0.5 * n for n in (1, 2, 4, 8, 16, 32, 64)}  # a CPU-like cost curve
    tree, _ = auto_tree(VICUNA, step_ms)
    rate = {n: build_tree(VICUNA, n)[1] / ms for n, ms in step_ms.items()}
    assert tree.num_nodes - 1 == max(rate, key=rate.get)
