"""The heads' calibration (tune/calibration.py): how often a guess of confidence q is right, per head and
line, made non-decreasing in q; measured on greedy continuations; stored next to the checkpoint."""

import json

import pytest
import torch
from conftest import ContinuationHeads, random_heads, tiny_model

from medusa_mini.decoding import generate
from medusa_mini.dynamic import Calibration
from medusa_mini.tune.calibration import (
    format_calibration,
    load_calibration,
    measure_calibration,
    monotone,
    save_calibration,
)


def test_rates_are_made_non_decreasing_with_the_least_weighted_change():
    assert monotone([0.1, 0.5, 0.3, 0.9], [1, 1, 1, 1]) == pytest.approx([0.1, 0.4, 0.4, 0.9])
    assert monotone([0.1, 0.5, 0.3, 0.9], [1, 3, 1, 1]) == pytest.approx([0.1, 0.45, 0.45, 0.9])  # weighted
    assert monotone([0.2, 0.4, 0.6], [0, 0, 0]) == [0.2, 0.4, 0.6]  # already in order: untouched


def test_heads_that_know_the_continuation_are_rated_right_at_high_confidence_and_wrong_at_low():
    model, prompt = tiny_model(2), [3, 1, 4]
    heads = ContinuationHeads(model, prompt, max_new_tokens=40)  # rank 0 right (logit 10), the rest random
    seq = prompt + generate(model, prompt, max_new_tokens=40)[0]
    cal = measure_calibration(model, heads, [seq], prompt_lens=[len(prompt)])
    for k, (main, off) in enumerate(cal.rates):
        assert main[-1] == 1.0 and main[0] == 0.0, k  # q near 1: right; q near 0: the random ranks, wrong
        assert all(a <= b for a, b in zip(main, main[1:])) and all(a <= b for a, b in zip(off, off[1:]))


def test_a_stored_calibration_reads_back_the_same_and_a_broken_file_is_a_clear_error(tmp_path):
    model = tiny_model(3)
    seq = [1, 2, 3] + generate(model, [1, 2, 3], max_new_tokens=20)[0]
    cal = measure_calibration(model, random_heads(model), [seq], prompt_lens=[3])
    save_calibration(tmp_path, cal)
    assert load_calibration(tmp_path) == cal
    assert load_calibration(tmp_path / "nowhere") is None
    (tmp_path / "heads_calibration.json").write_text(json.dumps({"edges": [0, 1], "rates": [[[0.5]]]}))
    with pytest.raises(ValueError, match="two lines"):
        load_calibration(tmp_path)


def test_the_sampled_table_is_stored_beside_the_greedy_one_and_an_older_file_has_none(tmp_path):
    greedy = Calibration(edges=(0.0, 0.5, 1.0), rates=(((0.1, 0.9), (0.1, 0.8)),))
    sampled = Calibration(edges=(0.0, 0.5, 1.0), rates=(((0.05, 0.6), (0.02, 0.4)),))
    save_calibration(tmp_path, greedy, sampled=sampled, temperature=0.8)
    assert load_calibration(tmp_path) == greedy and load_calibration(tmp_path, sampled=True) == sampled
    assert json.loads((tmp_path / "heads_calibration.json").read_text())["sampled_temperature"] == 0.8
    save_calibration(tmp_path, greedy)  # as checkpoints trained before the sampled table
    assert load_calibration(tmp_path) == greedy and load_calibration(tmp_path, sampled=True) is None
    with pytest.raises(ValueError, match="temperature"):
        save_calibration(tmp_path, greedy, sampled=sampled)


def test_a_top_k_draft_is_accepted_exactly_when_a_draw_from_p_would_be_its_token():
    """Why the sampled table is rejection sampling's calibration: trying top-k candidates x1, x2, ...
    (point-mass drafts) accepts x_i with probability p(x_i), as drawing x ~ p and keeping the equal one."""
    from medusa_mini.reference import try_children

    p = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1], dtype=torch.float64)
    candidates, n = [3, 1, 4], 20000
    g = torch.Generator().manual_seed(0)
    counts = [0] * (len(candidates) + 1)  # the last: none accepted
    for u in torch.rand(n, len(candidates), generator=g).tolist():
        i, _ = try_children(p.clone(), candidates, None, u)
        counts[len(candidates) if i is None else i] += 1
    for i, x in enumerate(candidates):
        sd = (float(p[x]) * (1 - float(p[x])) / n) ** 0.5
        assert abs(counts[i] / n - float(p[x])) < 4 * sd, (x, counts)


def test_the_log_acceptance_reads_each_nodes_head_line_and_bin():
    from medusa_mini.tree import Tree

    tree = Tree.from_choices([(0,), (1,), (0, 0), (1, 0)])  # (1, 0) sits below a rank-1 node: line 1
    cal = Calibration(edges=(0.0, 0.5, 1.0), rates=(((0.1, 0.9), (0.1, 0.9)), ((0.2, 0.8), (0.05, 0.3))))
    q = torch.tensor([[1.0, 0.7, 0.2, 0.7, 0.7]])
    got = cal.log_accept(q.log(), tree).exp()[0]
    assert got.tolist() == pytest.approx([1.0, 0.9, 0.1, 0.8, 0.3])


def test_the_printed_table_has_one_row_per_head_and_line_and_one_column_per_bin():
    cal = Calibration(edges=(0.0, 0.5, 1.0), rates=(((0.25, 0.75), (0.5, 0.5)), ((0.0, 1.0), (0.1, 0.2))))
    header, *rows = format_calibration(cal).splitlines()
    assert header.split()[-2:] == ["0.00", "0.50"]  # each bin's lower edge
    assert [r.split()[-2:] for r in rows] == [["0.25", "0.75"], ["0.00", "1.00"], ["0.10", "0.20"]]
    assert rows[0].startswith("head 1 ") and "below top guesses only" in rows[1] and "below any other" in rows[2]
