"""Trees from head accuracies: the greedy builder, the product rule, measuring acc, budget choice."""

import itertools
import json
import math

import pytest
import torch

from conftest import random_heads, tiny_model
from benchmarks import sweep
from medusa_mini.cli import measure
from medusa_mini.io.checkpoint import save_checkpoint
from medusa_mini.decoding import generate, medusa_generate
from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.model import GPT, GPTConfig
from medusa_mini.io.tokenizer import make_encoding, save_tokenizer, train_bpe
from medusa_mini.tree import Tree, chain, preset
from medusa_mini.tune.acceptance_tables import continuations, load_accuracy, measure_head_accuracy, save_accuracy
from medusa_mini.tree import build_tree, expected_tokens_per_step
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


def test_build_tree_on_a_hand_written_table_takes_the_largest_values_in_order():
    tree, expected = build_tree(HAND, 6)
    assert set(tree.choices) == {(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)}
    assert expected == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.12 + 0.1 + 0.08)
    tree7, expected7 = build_tree(HAND, 7)
    assert set(tree7.choices) - set(tree.choices) == {(0, 0, 0)}
    assert expected7 == pytest.approx(expected + 0.072)


def test_zero_nodes_is_the_root_alone_and_expects_only_the_bonus_token():
    tree, expected = build_tree(HAND, 0)
    assert tree.num_nodes == 1 and expected == 1.0


@pytest.mark.parametrize("seed", range(20))
def test_the_built_tree_is_always_valid_and_its_value_follows_the_product_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    K, R = 1 + seed % 4, 1 + seed % 5
    acc = torch.rand(K, R, generator=gen) * (0.5 if seed % 2 else 1.0)  # rows not sorted: still valid
    for n in (1, 3, 8, 30):
        tree, expected = build_tree(acc, n)
        again = Tree.from_choices(tree.choices, num_heads=K, top_k=R)  # every prefix present
        assert again == tree
        assert tree.num_nodes - 1 == min(n, sum(R**d for d in range(1, K + 1)))
        for c in tree.choices:  # rank r is only offered after rank r - 1 of the same parent
            assert c[-1] == 0 or c[:-1] + (c[-1] - 1,) in tree.choices
        assert expected == pytest.approx(expected_tokens_per_step(acc, tree))


def test_with_a_dominant_top1_and_k_nodes_the_tree_is_a_chain():
    acc = torch.full((4, 10), 0.01)
    acc[:, 0] = 0.9
    tree, _ = build_tree(acc, 4)
    assert tree.choices == chain(4).choices


def test_expected_tokens_of_a_chain_sums_the_running_products_of_top1_accuracies():
    a = VICUNA[:, 0].tolist()
    want = 1 + sum(math.prod(a[: d + 1]) for d in range(4))
    assert expected_tokens_per_step(VICUNA, chain(4)) == pytest.approx(want)
    flat = torch.full((4, 3), 0.5)
    assert expected_tokens_per_step(flat, chain(4)) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)


def test_the_built_tree_beats_the_cpu_preset_with_the_same_node_count():
    cpu = preset("cpu")
    _, expected = build_tree(VICUNA, cpu.num_nodes - 1)
    assert expected >= expected_tokens_per_step(VICUNA, cpu) - 1e-12


def test_with_ranks_ordered_by_accuracy_the_greedy_tree_is_the_best_of_all_valid_trees():
    acc = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.05]])
    nodes = [(r,) for r in range(3)] + [(r, s) for r in range(3) for s in range(3)]
    for n in range(1, 7):
        best = 0.0
        for subset in itertools.combinations(nodes, n):
            if all(len(c) == 1 or c[:1] in subset for c in subset):  # any prefix-closed tree
                best = max(best, expected_tokens_per_step(acc, Tree.from_choices(subset)))
        assert build_tree(acc, n)[1] == pytest.approx(best)


def test_product_rule_rejects_a_tree_deeper_or_wider_than_the_table():
    with pytest.raises(ValueError, match="more heads or ranks"):
        expected_tokens_per_step(HAND, chain(4))
    with pytest.raises(ValueError, match=r"\[heads, ranks\]"):
        build_tree(torch.zeros(3), 4)


# ---- measuring accuracy ------------------------------------------------------------------------


class LookupHeads:
    """Heads that know the sequences in advance: they recognise a hidden state (nearest neighbour
    among the states of the known sequences) and put the true future token at a chosen rank.

    true_rank_probs[r] = chance that the true token sits at rank r (independently per position and
    head); with the remaining chance it is outside the top 10. [1.0] makes a perfect oracle.
    """

    def __init__(self, model, sequences, *, num_heads=4, true_rank_probs=(1.0,), seed=0):
        self.num_heads, self.V = num_heads, model.config.vocab_size
        states, futures = [], []
        with torch.no_grad():
            for s in sequences:
                hidden = model(torch.tensor([s]))[1][0]  # [T, C]
                for t in range(len(s)):
                    states.append(hidden[t])
                    futures.append([s[t + k + 2] if t + k + 2 < len(s) else -1 for k in range(num_heads)])
        self.states, self.futures = torch.stack(states), torch.tensor(futures)  # [M, C], [M, K]
        gen = torch.Generator().manual_seed(seed)
        cum = torch.tensor(list(itertools.accumulate(true_rank_probs)))
        u = torch.rand(len(futures), num_heads, generator=gen)
        self.rank = torch.searchsorted(cum, u, right=True)  # [M, K] rank of the true token
        self.rank[self.rank >= len(true_rank_probs)] = 10  # the leftover chance: not in the top 10
        self.noise = torch.rand(len(futures), num_heads, self.V, generator=gen)

    def __call__(self, hidden, lm_head):
        flat = hidden.reshape(-1, hidden.shape[-1])
        row = torch.cdist(flat, self.states).argmin(dim=1)  # [m]
        logits = self.noise[row].clone()  # [m, K, V] in [0, 1)
        for i, j in enumerate(row.tolist()):
            for k in range(self.num_heads):
                tok, r = int(self.futures[j, k]), int(self.rank[j, k])
                if tok < 0:
                    continue
                others = logits[i, k].clone()
                others[tok] = -1.0
                top = others.sort(descending=True).values
                # exactly r other tokens above the true one; far below the top 10 when "absent"
                logits[i, k, tok] = 2.0 if r == 0 else (top[r - 1] + top[r]) / 2 if r < 10 else -1.0
        return logits.permute(1, 0, 2).reshape(self.num_heads, *hidden.shape[:-1], self.V)


def _prompts(n, length=5):
    return [torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]


def test_greedy_continuations_equal_plain_greedy_decoding_batched_or_not():
    model = tiny_model(0)
    prompts = _prompts(4) + [[3, 1, 4]]
    seqs = continuations(model, prompts, max_new_tokens=20)
    assert seqs == [p + generate(model, p, max_new_tokens=20)[0] for p in prompts]


def test_oracle_heads_measure_top1_accuracy_one_and_random_heads_something_small():
    model = tiny_model(0)
    prompts = _prompts(4)
    seqs = continuations(model, prompts, max_new_tokens=30)
    oracle = LookupHeads(model, seqs)
    acc = measure_head_accuracy(model, oracle, seqs, prompt_lens=5, top_k=10)
    assert acc.shape == (4, 10)
    assert acc.dtype == torch.float64 and acc[:, 0].tolist() == [1.0] * 4 and acc[:, 1:].sum() == 0
    rand = measure_head_accuracy(model, random_heads(model), torch.tensor(seqs), prompt_lens=5, top_k=10)
    assert rand[:, 0].mean() < 0.3


def test_measured_accuracy_counts_ranks_and_only_positions_with_a_target():
    model = tiny_model(1)
    seqs = continuations(model, _prompts(6), max_new_tokens=40)
    heads = LookupHeads(model, seqs, true_rank_probs=(0.5, 0.3), seed=1)
    acc = measure_head_accuracy(model, heads, seqs, prompt_lens=5, top_k=10, batch_size=4, chunk=16)
    # 6 sequences x ~40 positions per head: the measured rates sit near 0.5 / 0.3 / 0 / 0.2 absent
    assert torch.allclose(acc[:, 0], torch.full((4,), 0.5, dtype=acc.dtype), atol=0.12)
    assert torch.allclose(acc[:, 1], torch.full((4,), 0.3, dtype=acc.dtype), atol=0.12)
    assert acc[:, 2:].sum() == 0


def test_measured_accuracy_predicts_measured_tokens_per_step():
    model = tiny_model(2)
    prompts = _prompts(6)
    seqs = continuations(model, prompts, max_new_tokens=44)  # 40 decoded + room for 4 heads
    heads = LookupHeads(model, seqs, true_rank_probs=(0.55, 0.2, 0.1), seed=2)
    acc = measure_head_accuracy(model, heads, seqs, prompt_lens=5)
    tree, expected = build_tree(acc, 8)
    emitted = steps = 0
    for p, s in zip(prompts, seqs):
        out, stats = medusa_generate(model, heads, p, tree=tree, max_new_tokens=40)
        assert out == s[5:45]  # still exactly greedy
        emitted, steps = emitted + sum(stats.step_tokens), steps + stats.steps
    measured = emitted / steps
    assert 1.5 < expected and 0.8 < measured / expected < 1.2


# ---- saving, cost, budget choice ---------------------------------------------------------------


def test_accuracy_survives_a_save_and_load_round_trip(tmp_path):
    path = save_accuracy(tmp_path, VICUNA, meta={"measured_on": "hand-written", "num_prompts": 0})
    assert torch.allclose(load_accuracy(tmp_path), VICUNA.double(), atol=1e-6)
    saved = json.loads(open(path).read())
    assert saved["top_k"] == 10 and saved["num_heads"] == 4 and saved["measured_on"] == "hand-written"
    assert [p.name for p in tmp_path.iterdir()] == ["heads_accuracy.json"]  # no temporary left behind


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", '{"acc": []}', '{"acc": [[0.5], [0.5, 0.2]]}', '{"acc": [[0.5, "x"]]}',
    '{"acc": [[1.5]]}', '{"acc": [[0.5, 0.2]], "top_k": 3}', '{"acc": [[true]]}',
])
def test_a_bad_accuracy_file_gives_a_clear_error(tmp_path, content):
    (tmp_path / "heads_accuracy.json").write_text(content)
    with pytest.raises(ValueError, match="heads_accuracy.json"):
        load_accuracy(tmp_path)


def test_a_missing_accuracy_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match="medusa_mini.cli.measure --ckpt"):
        load_accuracy(tmp_path)


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


# ---- the commands ------------------------------------------------------------------------------


def _checkpoint(directory):
    """A one-layer GPT with three heads, its tokenizer and prompts.json, as train_tiny.py leaves them."""
    text = "the cat sat on the mat and the dog sat on the log. " * 40
    enc = make_encoding(train_bpe(text, vocab_size=300))
    save_tokenizer(enc, directory)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    heads = MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=300), lm_head_weight=model.lm_head.weight)
    save_checkpoint(directory, model, heads=heads)
    prompts = ["the cat sat", "on the mat and", "the dog", "sat on the log. the"]
    (directory / "prompts.json").write_text(json.dumps({"prompts": prompts}))


def test_recompute_command_saves_the_accuracy_and_prints_the_table(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert measure.main(["--ckpt", str(tmp_path), "--prompts", "3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "top-1" in out and "64 nodes:" in out
    assert "-- greedy acceptance" in out and "-- rejection sampling at T=0.8" in out
    assert load_accuracy(tmp_path).shape == (3, 10) and load_accuracy(tmp_path, sampled=True).shape == (3, 10)
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert saved["num_prompts"] == 3 and saved["sampled_temperature"] == 0.8


def test_sweep_command_compares_expected_and_measured_and_stays_lossless(tmp_path, capsys):
    _checkpoint(tmp_path)
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
    _checkpoint(tmp_path)
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


@pytest.mark.parametrize("command, prog", [
    (measure.main, "python -m medusa_mini.cli.measure"), (sweep.main, "python benchmarks/sweep.py"),
])
def test_commands_turn_bad_input_into_one_line_and_exit_status_2(tmp_path, capsys, command, prog):
    with pytest.raises(SystemExit) as exc:
        command(["--ckpt", str(tmp_path / "missing")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1
