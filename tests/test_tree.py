"""Trees from choices (paper §2.1.2, Fig. 2): structure, the ancestor mask (held equal to the reference's), each node's
path, validation, presets, and the tree grown from measured acceptance (`build_tree`)."""

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import VICUNA, random_tree
from medusa_mini import reference as ref
from medusa_mini.tree import Tree, build_tree, chain, expected_tokens_per_step, preset

#   0 root ─┬─ 1 (0,) ─┬─ 3 (0,0) ── 5 (0,0,0)    node (c): head len(c)'s guess of rank c[-1]
#           │          └─ 4 (0,1)
#           └─ 2 (1,)
TREE = Tree.from_choices([(1,), (0, 0, 0), (0,), (0, 1), (0, 0)])  # the choices deliberately unsorted
ACC_HAND = torch.tensor([[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]])  # acc[head][rank]


def test_choices_are_sorted_so_parents_precede_children_and_a_nodes_position_offset_is_its_depth():
    assert TREE.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert TREE.parents == [-1, 0, 0, 1, 1, 3] and TREE.children == [[1, 2], [3, 4], [], [5], [], []]
    assert TREE.depths == [0, 1, 1, 2, 2, 3] and TREE.first == [0, 1, 3, 5, 6]  # nodes of one depth in a run
    assert TREE.ranks == [0, 0, 1, 0, 1, 0] and TREE.max_rank == 1 and TREE.depth == 3  # head d fills depth d
    assert Tree.from_choices(c for c in TREE.choices[::-1]) == TREE  # any iterable of choices, a generator too
    assert Tree.from_choices([list(c) for c in np.array(TREE.choices[:2])]) == Tree(((0,), (1,)))  # numpy's ranks


def test_the_tree_tensors_live_on_the_device_asked_for():
    every = [x for x in torch.utils._pytree.tree_leaves(vars(TREE.tensors("meta"))) if isinstance(x, torch.Tensor)]
    assert len(every) > 15 and {x.device.type for x in every} == {"meta"}  # the tries' and scores' too


def test_node_sees_only_its_ancestors_the_nodes_of_its_path_from_the_root():
    seen = ["".join("x" if v else "." for v in row) for row in TREE.tensors().ancestor_mask.tolist()]
    assert seen == ["x.....", "xx....", "x.x...", "xx.x..", "xx..x.", "xx.x.x"]  # 2 not 1, 4 not 3: siblings


def test_the_ancestor_mask_equals_the_references_walk_up_the_parents_on_random_trees():
    """Two independent constructions of the tree attention mask: each node's root-to-node path marked
    (tree.py) and a walk from every node up to the root (reference.py)."""
    trees = [Tree.from_choices([])] + [random_tree(random.Random(seed)) for seed in range(100)]
    for tree in trees:
        assert torch.equal(tree.tensors().ancestor_mask, ref.tree_attention_mask(tree.parents)), tree.choices
    assert {t.depth for t in trees} == {0, 1, 2, 3, 4, 5}  # the root alone, chains and bushes of every depth
    assert ref.tree_attention_mask([0]).tolist() == [[True]]  # parents that are no tree (a cycle): the walk ends


@pytest.mark.parametrize("choices, kwargs, message", [
    ([(0,), (0, 1, 0)], {}, r"\[0, 1, 0\] has no parent: add \[0, 1\]"), ([(0,), (0,)], {}, r"\[0\] appears twice"),
    ([(0,), (-1,)], {}, r"\[-1\] has a negative rank"), ([0.5], {}, r"integer ranks"),
    ([(0,), (0, 0), (0, 0, 0)], {"num_heads": 2}, r"\[0, 0, 0\] has depth 3 but there are only 2 heads"),
    ([(0,), ()], {}, r"empty"), ([(0,), ("a",)], {}, r"integer ranks"), ([0, 1], {}, r"integer ranks")])
def test_bad_choices_are_a_clear_error_naming_the_choice(choices, kwargs, message):
    pytest.raises(ValueError, Tree.from_choices, choices, **kwargs).match(message)


@pytest.mark.parametrize("choices", [((0,), (0, 0), (1,)), ((1,), (0,)), ((0,), (1, 0)), ((0,), (-1,)), ((),), [[0]]])
def test_tree_itself_refuses_unsorted_or_invalid_choices_and_points_to_from_choices(choices):
    """Its node lists assume prefix-closed choices sorted by depth, then rank: unsorted ones would put a depth-1 node
    in the run of depth 2, or children out of rank order; a missing parent would hang its child on the root."""
    pytest.raises(ValueError, Tree, choices).match("Tree.from_choices")


def test_presets_are_valid_and_sized_for_their_device_and_a_chain_is_one_top1_guess_per_head():
    cpu, gpu = preset("cpu"), preset("gpu")
    assert chain(3).choices == ((0,), (0, 0), (0, 0, 0)) and chain(3).parents == [-1, 0, 1, 2]
    assert cpu.num_nodes <= 16 and 60 <= gpu.num_nodes - 1 <= 70 and (cpu.depth, gpu.depth, gpu.max_rank) == (4, 4, 9)
    assert preset("chain1") == chain(1) and preset("chain256").num_nodes == 257  # MAX_NODES below the root
    assert all(pytest.raises(ValueError, preset, b).match("unknown tree") for b in ("chain0", "chain257", 3, None))


def test_truncation_keeps_the_shallow_part_of_the_tree_and_a_shallow_enough_tree_whole():
    assert [TREE.truncated(d).choices for d in range(3)] == [(), ((0,), (1,)), ((0,), (1,), (0, 0), (0, 1))]
    assert TREE.truncated(3) == TREE == TREE.truncated(9)


def test_build_tree_takes_the_largest_values_in_order_so_a_dominant_top1_gives_a_chain():
    tree, expected = build_tree(ACC_HAND, 6)
    assert set(tree.choices) == {(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)}
    assert expected == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.12 + 0.1 + 0.08)
    tree7, expected7 = build_tree(ACC_HAND, 7)
    assert set(tree7.choices) - set(tree.choices) == {(0, 0, 0)} and expected7 == pytest.approx(expected + 0.072)
    assert build_tree(ACC_HAND, 0) == (Tree.from_choices([]), 1.0)  # zero nodes: the root alone, the bonus token
    dominant = torch.full((4, 10), 0.01).index_fill(1, torch.tensor([0]), 0.9)
    assert build_tree(dominant, 4)[0] == chain(4)  # a dominant top-1 and K nodes: a chain


@pytest.mark.parametrize("min_gain", [0.01, 0.025, 0.05, 0.2])
def test_where_nodes_cost_time_a_node_joins_only_while_it_adds_min_gain_of_the_tokens_so_far(min_gain):
    tree, expected = build_tree(VICUNA, 64, min_gain=min_gain)
    assert (tree, expected) == build_tree(VICUNA, n := tree.num_nodes - 1)  # a prefix of the greedy order
    value = [build_tree(VICUNA, k)[1] for k in range(n + 2)]  # expected tokens per step of the first k nodes
    assert all(value[k] - value[k - 1] >= min_gain * value[k - 1] for k in range(1, n + 1))  # each joined while it paid
    assert value[n + 1] - expected < min_gain * expected  # the next one would not
    assert 1 <= n < 64 and build_tree(VICUNA, 64, min_gain=0.0)[0].num_nodes == 65


@pytest.mark.parametrize("seed", range(20))
def test_the_built_tree_is_always_valid_and_its_value_follows_the_product_rule(seed):
    gen, K, R = torch.Generator().manual_seed(seed), 1 + seed % 4, 1 + seed % 5
    acc = torch.rand(K, R, generator=gen) * (0.5 if seed % 2 else 1.0)  # rows not sorted: still valid
    for n in (1, 3, 8, 30):
        tree, expected = build_tree(acc, n)
        assert Tree.from_choices(tree.choices, num_heads=K) == tree and tree.max_rank < R  # every prefix present
        assert tree.num_nodes - 1 == min(n, sum(R**d for d in range(1, K + 1)))
        for c in tree.choices:  # rank r is only offered after rank r - 1 of the same parent
            assert c[-1] == 0 or c[:-1] + (c[-1] - 1,) in tree.choices
        assert expected == pytest.approx(expected_tokens_per_step(acc, tree))


def test_with_ranks_ordered_by_accuracy_the_greedy_tree_is_the_best_of_all_valid_trees():
    acc = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.05]])
    nodes = [(r,) for r in range(3)] + [(r, s) for r in range(3) for s in range(3)]
    for n in range(1, 7):
        trees = [Tree.from_choices(s) for s in itertools.combinations(nodes, n) if all(c[:1] in s for c in s)]
        best = max(expected_tokens_per_step(acc, tree) for tree in trees)  # over every prefix-closed tree
        assert build_tree(acc, n)[1] == pytest.approx(best)


def test_product_rule_rejects_a_tree_deeper_or_wider_than_the_table_and_values_that_are_no_probabilities():
    for tree in (chain(4), Tree.from_choices([(ACC_HAND.shape[1],)])):  # ranks 0 .. R - 1 only
        pytest.raises(ValueError, expected_tokens_per_step, ACC_HAND, tree).match("more heads or ranks")
    pytest.raises(ValueError, build_tree, torch.tensor([[1.5]]), 1).match("probabilities")
    assert build_tree(torch.tensor([[1.0, 0.0]]), 4) == (chain(1), 2.0)  # 0 and 1 are probabilities; a 0 never joins
    pytest.raises(ValueError, build_tree, torch.zeros(3), 4).match(r"\[heads, ranks\]")
    for bad, needle in ((lambda: build_tree(ACC_HAND, 2.5), "integer >= 0, not 2.5"), (lambda: chain(-1), "not -1")):
        pytest.raises(ValueError, bad).match(needle)  # not 3 nodes, nor the root alone, silently
