"""Measuring head acceptance: the greedy table counts hits; the sampled table is rejection sampling's
acceptance rate for candidates drawn from the heads, over continuations sampled at T."""

import itertools
import json

import pytest
import torch
from conftest import random_heads, save_tiny, tiny_model

import decode
from medusa_mini.cli.compare import format_compare
from medusa_mini.decoding import generate, medusa_generate
from medusa_mini.io.loading import load_for_decoding
from medusa_mini.sampling import Sampling, sampling_probs
from medusa_mini.tree import Tree, build_tree
from medusa_mini.tune.acceptance_tables import (
    continuations,
    load_accuracy,
    load_greedy_ranks,
    measure_head_accuracy,
    sampled_temperature,
    save_accuracy,
)
from medusa_mini.tune.replay import greedy_ranks, replay_ceiling, replay_greedy
from medusa_mini.tune.trees import resolve_trees

VICUNA = torch.tensor([[a * 0.45**r for r in range(10)] for a in (0.56, 0.32, 0.20, 0.15)])


class EchoHeads:
    """Every head guesses what the backbone would say next at its own position: often right in a
    model that repeats itself, so the tables below are not all zeros."""

    num_heads = 3

    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        return lm_head(hidden)[None].expand(self.num_heads, *hidden.shape[:-1], -1)


class FixedHeads:
    """Heads whose guesses do not depend on the hidden state: logits [K, V] for every position."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.num_heads = logits, logits.shape[0]

    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        return self.logits.reshape(self.num_heads, *[1] * (hidden.dim() - 1), -1).expand(
            self.num_heads, *hidden.shape[:-1], -1)


def _prompts(n, length=5):
    return [torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]


def test_sampled_continuations_are_seeded_and_differ_from_greedy():
    model = tiny_model(0)
    a = continuations(model, _prompts(3), max_new_tokens=12, temperature=1.0, seed=5)
    assert a == continuations(model, _prompts(3), max_new_tokens=12, temperature=1.0, seed=5)
    assert a != continuations(model, _prompts(3), max_new_tokens=12, temperature=1.0, seed=6)
    assert a != continuations(model, _prompts(3), max_new_tokens=12)


def test_the_sampled_table_becomes_the_greedy_table_as_the_temperature_falls():
    model = tiny_model(0)
    seqs = continuations(model, _prompts(6), max_new_tokens=30)  # greedy text
    greedy = measure_head_accuracy(model, EchoHeads(), seqs, prompt_lens=5, top_k=4)
    cold = measure_head_accuracy(model, EchoHeads(), seqs, prompt_lens=5, top_k=4, temperature=1e-3)
    assert greedy[:, 0].min() > 0.05  # the heads do get tokens right
    assert torch.allclose(cold, greedy, atol=1e-3)
    warm = measure_head_accuracy(model, EchoHeads(), seqs, prompt_lens=5, top_k=4, temperature=1.0)
    assert not torch.allclose(warm, greedy, atol=0.05)  # p is no longer one-hot: scores differ


@torch.no_grad()
def test_the_sampled_table_is_the_rate_at_which_rejection_sampling_accepts_the_guess():
    model, T, prompt = tiny_model(3), 0.7, [5, 17, 3, 40, 22]
    # Exact: the root r ~ p(. | prompt); the head's candidate x ~ q is accepted with min(1, p(x | prompt, r)
    # / q(x)), so on average with sum_x min(p(x | prompt, r), q(x)).
    p_root = sampling_probs(model(torch.tensor([prompt]))[0][0, -1], temperature=T)  # [V]
    rows = torch.tensor([prompt + [r] for r in range(model.config.vocab_size)])  # [V, 6]
    p_next = sampling_probs(model(rows)[0][:, -1], temperature=T)  # [V, V]: p(. | prompt, r)
    # One head whose q (its logits / T, softmaxed) is p two places ahead, sharpened a little.
    q = torch.softmax(torch.log(p_root @ p_next) * 1.5, dim=-1)  # [V]
    heads = FixedHeads(T * torch.log(q)[None])
    exact = float(p_root @ torch.minimum(p_next, q[None]).sum(-1))
    assert 0.2 < exact < 0.8  # a rate that the tolerances below can tell apart

    n = 600
    # (1) the table: continuations of 2 tokens, so the head has one position per sequence
    seqs = continuations(model, [prompt] * n, max_new_tokens=2, temperature=T, seed=0)
    table = measure_head_accuracy(model, heads, seqs, prompt_lens=5, top_k=1, temperature=T)
    # (2) decoding: how often rejection sampling accepts the 1-node tree's guess in the first step
    tree, accepted = Tree.from_choices([[0]]), 0
    for seed in range(n):
        _, stats = medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=3,
                                   sampling=Sampling(temperature=T), generator=torch.Generator().manual_seed(seed))
        accepted += stats.accepted_nodes[0]
    sigma = (exact * (1 - exact) / n) ** 0.5
    assert abs(float(table[0, 0]) - exact) < 4 * sigma
    assert abs(accepted / n - exact) < 4 * sigma


def test_both_tables_survive_a_save_and_load_round_trip(tmp_path):
    greedy = torch.tensor([[0.6, 0.2], [0.4, 0.1]], dtype=torch.float64)
    sampled = torch.tensor([[0.3, 0.15], [0.2, 0.1]], dtype=torch.float64)
    save_accuracy(tmp_path, greedy, sampled=sampled, temperature=0.8)
    assert torch.equal(load_accuracy(tmp_path), greedy)
    assert torch.equal(load_accuracy(tmp_path, sampled=True), sampled)
    assert sampled_temperature(tmp_path) == 0.8
    with pytest.raises(ValueError, match="temperature"):
        save_accuracy(tmp_path, greedy, sampled=sampled)  # a sampled table needs its temperature


def test_a_file_without_the_sampled_table_says_how_to_remeasure(tmp_path):
    save_accuracy(tmp_path, torch.tensor([[0.5]]))
    assert sampled_temperature(tmp_path) is None
    with pytest.raises(ValueError, match="no sampled table.*medusa_mini.cli.measure"):
        load_accuracy(tmp_path, sampled=True)


def test_tree_auto_gives_rejection_sampling_the_tree_of_its_own_table(tmp_path, capsys):
    ckpt = str(tmp_path / "ck")
    save_tiny(ckpt, with_heads=True)
    # Greedy guesses: head 1..4 almost always right at rank 0, so a deep chain. Sampled: only head 1
    # is ever right, at any of its ranks, so a tree one level deep.
    greedy = torch.tensor([[0.99] + [0.0] * 9] * 4, dtype=torch.float64)
    sampled = torch.zeros(4, 10, dtype=torch.float64)
    sampled[0] = 0.09
    save_accuracy(ckpt, greedy, sampled=sampled, temperature=0.8)
    ck = load_for_decoding(ckpt, device=torch.device("cpu"))
    trees = resolve_trees("auto", num_heads=4, ckpt_dir=ckpt, device=torch.device("cpu"), model=ck.model,
                          heads=ck.heads)
    assert trees.greedy.depth == 4 and trees.sampled.depth == 1
    assert trees.for_rule(Sampling(acceptance="rejection", temperature=0.8)) is trees.sampled
    assert trees.for_rule(Sampling(acceptance="typical", temperature=0.8)) is trees.greedy
    assert trees.for_rule(Sampling(acceptance="rejection", temperature=0.0)) is trees.greedy
    capsys.readouterr()
    assert decode.main(["--ckpt", ckpt, "--compare", "--json", "--max-new-tokens", "6", "--num-prompts", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["key"]: r for r in result["rows"]}
    assert result["tree_nodes"] >= 5 and result["rejection_tree_nodes"] >= 2
    assert rows["medusa_rejection"]["tokens_per_step"] <= 2.0  # one level deep: at most 2 per step
    result["rejection_tree_nodes"] = result["tree_nodes"] + 1
    assert f"rejection: {result['tree_nodes'] + 1}, from the sampled table" in format_compare(result)


def test_replaying_the_rank_strings_gives_exactly_the_tokens_per_step_of_greedy_medusa():
    from medusa_mini.tree import chain, preset

    # Greedy decoding reproduces the greedy continuation token for token, so which tree path is
    # accepted at each step is fixed by where each head ranked its target: a replay, not a forecast.
    model, n = tiny_model(2), 40
    prompts = _prompts(6)
    seqs = continuations(model, prompts, max_new_tokens=n)
    heads = LookupHeads(model, seqs, true_rank_probs=(0.55, 0.2, 0.1), seed=2)
    ranks = greedy_ranks(model, heads, seqs, prompt_lens=5)
    assert len(ranks) == 6 and all(len(r.split()) == n for r in ranks)
    acc = measure_head_accuracy(model, heads, seqs, prompt_lens=5)
    for tree in (build_tree(acc, 8)[0], preset("cpu"), chain(3), build_tree(acc, 1)[0]):
        emitted = steps = 0
        for p in prompts:
            _, stats = medusa_generate(model, heads, p, tree=tree, max_new_tokens=n)
            emitted, steps = emitted + sum(stats.step_tokens), steps + stats.steps
        assert replay_greedy(ranks, tree) == pytest.approx(emitted / steps, abs=1e-12)


def test_rank_strings_survive_a_save_and_load_round_trip(tmp_path):
    ranks = ["00-1 0--- 1200", "---- 0000"]
    save_accuracy(tmp_path, torch.tensor([[0.5, 0.1]] * 4), ranks=ranks)
    assert load_greedy_ranks(tmp_path) == ranks and load_accuracy(tmp_path).shape == (4, 2)
    save_accuracy(tmp_path, torch.tensor([[0.5, 0.1]] * 4))
    assert load_greedy_ranks(tmp_path) is None
    (tmp_path / "heads_accuracy.json").write_text('{"acc": [[0.5]], "greedy_ranks": ["0a"]}')
    with pytest.raises(ValueError, match="greedy_ranks"):
        load_greedy_ranks(tmp_path)


def test_a_chain_replays_to_one_plus_the_run_of_leading_top1_hits():
    from medusa_mini.tree import chain

    # one sequence of 3 new tokens: step 1 reads position 0 ("00--": 2 accepted, but only depth 1
    # still fits before the end), so 2 tokens in 1 step
    assert replay_greedy(["00-- 0--- ----"], chain(4)) == 2.0
    # two steps: "-" accepts nothing (1 token), then "0-" one node (2 tokens) => 3 tokens / 2 steps
    assert replay_greedy(["---- 0--- ---- ----"], chain(4)) == pytest.approx(1.5)


def _random_rank_strings(seed: int, *, sequences: int = 6, length: int = 40) -> list[str]:
    """Rank strings like greedy_ranks writes: mostly rank 0, sometimes a lower rank or a miss."""
    import random

    rng = random.Random(seed)
    symbols, weights = "0123456789-", [40, 12, 8, 5, 4, 3, 2, 2, 1, 1, 22]
    return [" ".join("".join(rng.choices(symbols, weights)[0] for _ in range(4)) for _ in range(length))
            for _ in range(sequences)]


def test_no_tree_beats_the_ceiling_of_the_heads_top_guesses():
    from medusa_mini.tree import chain, preset

    # By hand, 5 new tokens: the chain accepts one node at the first position and lands on two misses
    # (3 steps for 4 tokens); accepting nothing first lands on "00" and ends in 2 steps.
    ranks = ["0--- 00-- ---- ---- ----"]
    assert replay_greedy(ranks, chain(4)) == pytest.approx(4 / 3)
    assert replay_ceiling(ranks, below=1) == 2.0
    for seed in range(5):
        ranks = _random_rank_strings(seed)
        ceilings = [replay_ceiling(ranks, below=k) for k in range(1, 11)]
        assert ceilings == sorted(ceilings) and ceilings[-1] > ceilings[0]  # more ranks, more to accept
        full = Tree.from_choices([c for d in range(1, 5) for c in itertools.product(range(2), repeat=d)])
        for tree in (chain(4), preset("cpu"), preset("gpu"), build_tree(VICUNA, 8)[0], build_tree(VICUNA, 64)[0], full):
            assert replay_greedy(ranks, tree) <= ceilings[tree.max_rank] + 1e-12
    with pytest.raises(ValueError, match="below"):
        replay_ceiling(["0000"], below=11)


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
