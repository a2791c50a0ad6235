"""Trees from choices (paper §2.1.2, Fig. 2): structure, the ancestor mask, validation, presets."""

import pytest

from medusa_mini.tree import CPU_CHOICES, GPU_CHOICES, Tree, chain, preset

# The tree used throughout, drawn by hand:
#   0 root
#   ├─ 1 (0,)      head 1 rank 0
#   │  ├─ 3 (0,0)  head 2 rank 0
#   │  │  └─ 5 (0,0,0)
#   │  └─ 4 (0,1)  head 2 rank 1
#   └─ 2 (1,)      head 1 rank 1
HAND = [(1,), (0, 0, 0), (0,), (0, 1), (0, 0)]  # deliberately unsorted


def test_choices_are_sorted_so_parents_precede_children():
    tree = Tree.from_choices(HAND)
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.parents == [-1, 0, 0, 1, 1, 3]
    assert tree.children == [[1, 2], [3, 4], [], [5], [], []]


def test_node_sees_only_its_ancestors():
    mask = Tree.from_choices(HAND).ancestor_mask()
    expected = [
        # 0  1  2  3  4  5   (key node)
        [1, 0, 0, 0, 0, 0],  # 0 root sees itself
        [1, 1, 0, 0, 0, 0],  # 1 sees root
        [1, 0, 1, 0, 0, 0],  # 2 does not see its sibling 1
        [1, 1, 0, 1, 0, 0],  # 3 sees 1 and root
        [1, 1, 0, 0, 1, 0],  # 4 does not see its sibling 3
        [1, 1, 0, 1, 0, 1],  # 5 sees 3, 1, root
    ]
    assert mask.tolist() == [[bool(v) for v in row] for row in expected]


def test_position_offsets_are_depths():
    assert Tree.from_choices(HAND).depths().tolist() == [0, 1, 1, 2, 2, 3]


def test_each_node_is_filled_by_the_head_of_its_depth_with_the_rank_of_its_last_choice():
    head, rank = Tree.from_choices(HAND).node_head_rank()
    assert head.tolist() == [0, 0, 1, 1, 2]
    assert rank.tolist() == [0, 1, 0, 1, 0]
    assert Tree.from_choices(HAND).top_k() == [2, 2, 1]


def test_paths_of_different_lengths_carry_an_explicit_validity_mask():
    idx, valid = Tree.from_choices(HAND).paths()
    rows = sorted(tuple(i for i, v in zip(r, m) if v) for r, m in zip(idx.tolist(), valid.tolist()))
    assert rows == [(0, 1, 3, 5), (0, 1, 4), (0, 2)]
    assert valid.sum().item() == 4 + 3 + 2  # the rest is padding that must never be read


@pytest.mark.parametrize(
    "choices, kwargs, message",
    [
        ([(0,), (0, 1, 0)], {}, r"\[0, 1, 0\] has no parent: add \[0, 1\]"),
        ([(0,), (0,)], {}, r"\[0\] appears twice"),
        ([(0,), (-1,)], {}, r"\[-1\] has a negative rank"),
        ([(0,), (5,)], {"top_k": 5}, r"\[5\] uses a rank >= top_k=5"),
        ([(0,), (0, 0), (0, 0, 0)], {"num_heads": 2}, r"\[0, 0, 0\] has depth 3 but there are only 2 heads"),
        ([(0,), ()], {}, r"empty"),
        ([(0,), ("a",)], {}, r"integer ranks"),
        ([0, 1], {}, r"integer ranks"),
    ],
)
def test_bad_choices_are_a_clear_error_naming_the_choice(choices, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_choices(choices, **kwargs)


def test_a_tree_deeper_than_the_heads_is_rejected():
    with pytest.raises(ValueError, match="depth 4 but the model has 3 Medusa heads"):
        chain(4).check_heads(3)


def test_chain_is_one_top1_guess_per_head():
    tree = chain(3)
    assert tree.choices == ((0,), (0, 0), (0, 0, 0)) and tree.parents == [-1, 0, 1, 2]


def test_presets_are_valid_and_sized_for_their_device():
    cpu, gpu = preset("cpu"), preset("gpu")
    assert cpu.num_nodes <= 16 and cpu.depth == 4
    assert 60 <= gpu.num_nodes - 1 <= 70 and gpu.depth == 4
    assert Tree.from_choices(CPU_CHOICES, num_heads=4) == cpu
    assert Tree.from_choices(GPU_CHOICES, num_heads=4, top_k=10) == gpu
    assert preset("chain5") == chain(5)
    with pytest.raises(ValueError, match="unknown tree"):
        preset("huge")


def test_truncation_keeps_the_shallow_part_of_the_tree():
    tree = Tree.from_choices(HAND).truncated(1)
    assert tree.choices == ((0,), (1,))
    assert Tree.from_choices(HAND).truncated(0).num_nodes == 1


def test_drawings_show_every_node_and_every_mask_entry():
    tree = Tree.from_choices(HAND)
    drawing = tree.draw(labels=["'a'", "'b'", "'c'", "'d'", "'e'", "'f'"])
    assert drawing.splitlines()[0] == "[0] root 'a'"
    assert "[5] head 3 rank 0 'f'" in drawing and len(drawing.splitlines()) == 6
    rows = tree.draw_mask().splitlines()[1:]
    filled = [row.split()[1:].count("■") for row in rows]
    assert filled == tree.ancestor_mask().sum(1).tolist() == [1, 2, 2, 3, 3, 4]
