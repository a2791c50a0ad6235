"""The engine's decoding end to end on tiny random models: Medusa is lossless in every row of a batch,
makes the reference's decisions, and stops cleanly."""

import pytest
import torch
from conftest import ContinuationHeads, random_heads, tiny_model
from distributions import empirical_rows, exact_sequence_probs, expected_tv, total_variation

from medusa_mini import reference as ref
from medusa_mini.decoding import generate, generate_batch, medusa_generate, medusa_generate_batch
from medusa_mini.model import KVCache
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree, chain, preset

TREES = {
    "chain": chain(4),
    "wide": Tree.from_choices([(r,) for r in range(8)] + [(0, r) for r in range(4)]),
    "deep": Tree.from_choices([(0,) * d for d in range(1, 5)] + [(1,), (1, 0), (0, 1), (0, 1, 0)]),
    "cpu": preset("cpu"),
    "gpu": preset("gpu"),
}


@pytest.mark.parametrize("heads_kind", ["random", "oracle"])
@pytest.mark.parametrize("tree_name", TREES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_medusa_equals_plain_greedy(heads_kind, tree_name, seed):
    """With random heads, and with an oracle whose rank-0 path is always right, so that every step
    accepts the tree's full depth."""
    model = tiny_model(seed)
    prompt = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    want, plain = generate(model, prompt, max_new_tokens=40)
    heads = (ContinuationHeads(model, prompt, max_new_tokens=40) if heads_kind == "oracle"
             else random_heads(model, seed=seed))
    got, stats = medusa_generate(model, heads, prompt, tree=TREES[tree_name], max_new_tokens=40)
    assert got == want and sum(stats.step_tokens) == plain.steps == 39 and plain.tokens_per_step == 1.0
    if heads_kind == "oracle":
        depth = TREES[tree_name].depth
        assert max(stats.accepted_nodes) == depth and stats.tokens_per_step > 0.8 * (depth + 1)


def test_untrained_heads_still_decode_correctly_but_accept_only_what_their_accuracy_predicts():
    """Random heads rarely guess the backbone's token: their accuracy, measured on the very text decoded,
    forecasts barely more than one token a step (the product rule), and decoding makes that forecast and
    exactly the reference's steps."""
    from medusa_mini.tree import expected_tokens_per_step
    from medusa_mini.tune.acceptance_tables import measure_head_accuracy

    model, prompt, tree = tiny_model(3), [1, 2, 3], preset("cpu")
    heads = random_heads(model, seed=3)
    want, _ = generate(model, prompt, max_new_tokens=60)
    got, stats = medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=60)
    assert got == want
    assert stats.steps == ref.medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=60)[1]
    acc = measure_head_accuracy(model, heads, [prompt + want], prompt_lens=len(prompt), top_k=tree.max_rank + 1)
    forecast = expected_tokens_per_step(acc, tree)
    assert 1.0 < forecast < 1.1 and stats.accepted_nodes.count(0) < stats.steps  # little, but not nothing
    assert stats.tokens_per_step == pytest.approx(forecast, abs=0.02)


@pytest.mark.slow
@torch.no_grad()
def test_plain_sampling_matches_the_same_exact_distribution():
    V, n, M, T = 4, 3, 2000, 0.8
    model = tiny_model(11, vocab_size=V, block_size=16)
    exact = exact_sequence_probs(model, [1, 2], n, temperature=T)
    gen = torch.Generator().manual_seed(1)
    plain = empirical_rows(lambda i, rows: generate_batch(model, [[1, 2]] * rows, max_new_tokens=n,
                                                          sampling=Sampling(temperature=T), generator=gen), M, batches=4)
    assert total_variation(plain, exact) < 2.5 * expected_tv(exact, M)


@pytest.mark.parametrize("tree_name, rule", [("chain", "greedy"), ("gpu", "greedy"), ("gpu", "typical"),
                                             ("gpu", "rejection")])
def test_generation_stops_cleanly_at_the_context_limit(tree_name, rule):
    model = tiny_model(2, block_size=24)
    prompt = list(range(1, 11))
    want, s1 = generate(model, prompt, max_new_tokens=100)
    oracle = ContinuationHeads(model, prompt, max_new_tokens=100)
    sampling = Sampling() if rule == "greedy" else Sampling(acceptance=rule, temperature=0.7)
    got, s2 = medusa_generate(model, oracle, prompt, tree=TREES[tree_name], max_new_tokens=100, sampling=sampling,
                              generator=torch.Generator().manual_seed(0))
    assert len(got) == 24 - len(prompt) and s1.stop_reason == s2.stop_reason == "context"
    assert got == want or rule != "greedy"  # greedy: plain greedy's tokens up to the context


def test_streaming_callback_receives_every_token_in_order_step_by_step():
    model = tiny_model(6)
    seen = []
    oracle = ContinuationHeads(model, [4, 4], max_new_tokens=25)
    out, stats = medusa_generate(model, oracle, [4, 4], tree=preset("cpu"), max_new_tokens=25, on_step=seen.append)
    assert [t for chunk in seen for t in chunk] == out
    assert [len(c) for c in seen[1:]] == stats.step_tokens and len(seen[0]) == 1  # prefill's token first


def test_heads_and_tree_that_do_not_fit_are_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="depth 4 but the model has 2 Medusa heads"):
        medusa_generate(model, random_heads(model, num_heads=2), [1], tree=chain(4), max_new_tokens=5)


@pytest.mark.parametrize("prompt, message", [([], "empty"), (list(range(64)), "must be shorter")])
def test_bad_prompts_are_a_clear_error(prompt, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        generate(model, prompt, max_new_tokens=5)
    with pytest.raises(ValueError, match=message):
        medusa_generate(model, random_heads(model), prompt, tree=chain(2), max_new_tokens=5)


def test_a_reused_cache_gives_the_tokens_of_a_fresh_one_and_must_have_the_asked_size():
    """A cache kept from one generation to the next (fixed addresses, as a CUDA graph needs) is emptied
    first, so nothing of the previous generation leaks into the next."""
    model = tiny_model(7)
    heads = random_heads(model, seed=7)
    tree = Tree.from_choices([(0,), (1,), (0, 0)])
    block = model.config.block_size
    plain_cache = KVCache(model.config, max_len=block)
    tree_cache = KVCache(model.config, max_len=block + tree.num_nodes)
    for prompt in ([1, 2, 3, 4, 5, 6], [9, 8]):  # the second, shorter prompt runs on a used cache
        assert generate(model, prompt, max_new_tokens=10, cache=plain_cache)[0] == \
            generate(model, prompt, max_new_tokens=10)[0]
        assert medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=10, cache=tree_cache)[0] == \
            medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=10)[0]
    with pytest.raises(ValueError, match="slots"):
        generate(model, [1, 2], max_new_tokens=3, cache=tree_cache)


# ---- batches: each row is its own generation ------------------------------------------------------

PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2], list(range(1, 40))]  # different lengths, one near the end


def test_batched_plain_decoding_equals_each_prompt_decoded_alone():
    model = tiny_model(8)
    want = [generate(model, p, max_new_tokens=30) for p in PROMPTS]
    got = generate_batch(model, PROMPTS, max_new_tokens=30)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1].stop_reason for g in got] == [w[1].stop_reason for w in want]


@pytest.mark.parametrize("tree_name", ["chain", "cpu", "gpu"])
def test_batched_greedy_medusa_equals_each_prompts_own_plain_greedy(tree_name):
    """Rows of different lengths accept different paths and stop at different steps (the long prompt
    reaches the context first), and no row's output ever holds another's token or a padding token."""
    model = tiny_model(9)
    heads = random_heads(model, seed=9)
    want = [generate(model, p, max_new_tokens=30)[0] for p in PROMPTS]
    got = medusa_generate_batch(model, heads, PROMPTS, tree=TREES[tree_name], max_new_tokens=30)
    assert [g[0] for g in got] == want
    assert len({g[1].steps for g in got}) > 1  # the rows did stop at different steps


def test_batched_greedy_medusa_with_heads_that_know_the_continuation_accepts_per_row():
    model = tiny_model(10)
    prompts = [[2, 7, 3], [9, 1]]
    heads = [ContinuationHeads(model, p, max_new_tokens=30) for p in prompts]

    class Both:  # each row finds its own continuation; the other's heads guess at random
        config = heads[0].config

        def __call__(self, hidden, lm_head, *, num=None):
            first = heads[0](hidden, lm_head, num=num)
            return torch.where(first >= 10, first, heads[1](hidden, lm_head, num=num))

    got = medusa_generate_batch(model, Both(), prompts, tree=preset("cpu"), max_new_tokens=30)
    for (out, stats), prompt in zip(got, prompts):
        assert out == generate(model, prompt, max_new_tokens=30)[0]
        assert stats.tokens_per_step > 3.0


def test_a_row_that_meets_its_end_token_stops_while_the_others_go_on():
    model = tiny_model(1)
    alone = [generate(model, p, max_new_tokens=25)[0] for p in PROMPTS[:3]]
    eos = alone[1][5]  # row 1 meets it early; the other rows may or may not
    want = [a[: a.index(eos) + 1] if eos in a else a for a in alone]
    got = medusa_generate_batch(model, random_heads(model), PROMPTS[:3], tree=preset("cpu"), max_new_tokens=25,
                                eos_id=eos)
    assert [g[0] for g in got] == want and got[1][1].stop_reason == "eos"
    assert generate_batch(model, PROMPTS[:3], max_new_tokens=25, eos_id=eos)[1][0] == want[1]


# ---- the engine makes the reference's decisions ------------------------------------------------------


RULES = {
    "greedy": Sampling(),
    "typical": Sampling(acceptance="typical", temperature=0.8),
    "rejection-sampled": Sampling(acceptance="rejection", temperature=0.8, draft="sampled"),
    "rejection-topk": Sampling(acceptance="rejection", temperature=0.8, draft="topk"),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("tree_name", ["cpu", "gpu"])
def test_the_engine_prints_the_references_tokens_with_the_same_seed(rule, tree_name):
    """Same tokens, same steps: the static cache, the vectorised rules and the batch dimension change
    how the step is computed, not what it decides. (Sampled rules compare random draws against
    probabilities that differ in the last bits between the two attention codes: over 4 prompts of 40
    tokens on a tiny float32 model no draw lands that close.)"""
    model = tiny_model(12)
    heads = random_heads(model, seed=12)
    for seed, prompt in enumerate([[1, 2, 3], [9, 8, 7, 6, 5], [4], list(range(3, 30))]):
        settings = dict(tree=TREES[tree_name], max_new_tokens=40, sampling=RULES[rule])
        want = ref.medusa_generate(model, heads, prompt, generator=torch.Generator().manual_seed(seed), **settings)
        got, stats = medusa_generate(model, heads, prompt, generator=torch.Generator().manual_seed(seed), **settings)
        assert (got, stats.steps) == want
