"""The engine's decoding end to end on tiny models: with any drafter (Medusa or hydra heads, a draft
vocabulary, prompt lookup) greedy Medusa is plain greedy in every row of a batch; the engine makes the
reference's decisions and stops cleanly (compiled-style steps: tests/test_meta_device.py)."""

import numpy as np
import pytest
import torch

from conftest import RULES, ContinuationHeads, random_heads, tiny_model
from medusa_mini import KVCache, PromptLookup, Sampling, Tree, chain, preset, step
from medusa_mini import reference as ref
from medusa_mini.decoding import generate, generate_batch, medusa_generate, medusa_generate_batch, prefill

TREES = {"chain": chain(4), "one": chain(1), "cpu": preset("cpu"), "gpu": preset("gpu"),  # one: head 1 alone, one level
    "wide": Tree.from_choices([(r,) for r in range(8)] + [(0, r) for r in range(4)]),
    "deep": Tree.from_choices([(0,) * d for d in range(1, 5)] + [(1,), (1, 0), (0, 1), (0, 1, 0)])}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_decoding_emits_the_backbones_own_next_tokens_drawn_in_order_from_one_generator(temperature):
    """Token after token, the argmax, or the draw `next_token` makes from the generator's next uniform, of
    the logits a whole-sequence forward without a cache gives."""
    model, sampling = tiny_model(4), Sampling(temperature=temperature)
    ids, gen = [3, 1, 4], torch.Generator().manual_seed(2)
    for _ in range(6):
        logits = model(torch.tensor([ids]))[0][0, -1]
        ids.append(int(sampling.next_token(logits, sampling.uniforms((), gen, device="cpu"))))
    got = generate(model, [3, 1, 4], max_new_tokens=np.int64(6), sampling=sampling, generator=gen.manual_seed(2))[0]
    assert got == ids[3:]


@pytest.mark.parametrize("prompts, max_new_tokens, message", [
    ([[]], 5, "empty"), ([list(range(64))], 5, "must be shorter"), ([[3, 64]], 5, "0 to 63"),
    ([[5, -1]], 5, "outside the vocabulary"), ([[2], [1, 2]], -1, "an integer >= 0"), ([[2]], 5.0, "an integer"),
    ([1, 2, 3], 5, "not one id; the batch functions take a list"), ([torch.ones(2, 3)], 5, r"shape \[2, 3\]"),
    ([[0.5, 2.7]], 5, "integer token ids, not torch.float"), ([np.array([True])], 5, "not torch.bool"),
    (["the cat"], 5, r"not text: encode it first \(enc.encode_ordinary\('the cat'\)\)")])
def test_bad_prompts_and_budgets_are_a_clear_error_and_a_flat_list_is_not_a_batch_of_one_id_prompts(
        model, prompts, max_new_tokens, message):
    pytest.raises(ValueError, generate_batch, model, prompts, max_new_tokens=max_new_tokens).match(message)
    with pytest.raises(ValueError, match=message):
        medusa_generate_batch(model, random_heads(model), prompts, tree=chain(2), max_new_tokens=max_new_tokens)


def test_a_drafter_tree_or_sampling_of_another_type_is_a_type_error_naming_what_to_pass(model):
    for drafter, bad, needle in ((h := random_heads(model), None, "not None"), (h, "cpu", "not 'cpu'"),
                                 (None, chain(2), "drafter is"), (h, chain(2), "a Sampling, .* not 'greedy'")):
        with pytest.raises(TypeError, match=needle):  # not an AttributeError from deep inside
            medusa_generate(model, drafter, [1], max_new_tokens=2, tree=bad, sampling="greedy")


def test_a_reused_cache_gives_the_tokens_of_a_fresh_one_and_must_be_the_one_asked_for():
    """A cache kept from one generation to the next (fixed addresses, as a CUDA graph needs) is emptied
    first, so nothing of the previous generation leaks into the next."""
    heads, tree = random_heads(model := tiny_model(7), seed=7), Tree.from_choices([(0,), (1,), (0, 0)])
    plain_cache, tree_cache = (KVCache(model.config, max_len=model.config.block_size + n) for n in (0, tree.num_nodes))
    for prompt in ([1, 2, 3, 4, 5, 6], torch.tensor([[9, 8]])):  # the second: shorter, [1, T], on a used cache
        assert generate(model, prompt, max_new_tokens=10, cache=plain_cache)[0] == \
            generate(model, prompt, max_new_tokens=10)[0]
        assert medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=10, cache=tree_cache)[0] == \
            medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=10)[0]
    pytest.raises(ValueError, generate, model, [1, 2], max_new_tokens=3, cache=tree_cache).match("slots")
    with pytest.raises(ValueError, match="slots"):  # a tree's nodes need slots past the context
        medusa_generate(model, heads, [1, 2], tree=tree, max_new_tokens=3, cache=plain_cache)
    ids = torch.tensor([[9, 8]])  # a prefill starts a generation: the used cache is emptied first
    assert prefill(model, ids, tree_cache)[0].equal(prefill(model, ids, KVCache(model.config))[0])
    pytest.raises(ValueError, generate_batch, model, [[1, 2], [3]], max_new_tokens=3, cache=plain_cache).match("1 rows")
    with pytest.raises(ValueError, match="in torch.float64 on cpu; .* in torch.float32 on cpu"):  # index_put_'s error
        generate(model, [1, 2], max_new_tokens=3, cache=KVCache(model.config, dtype=torch.float64))


PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2], list(range(1, 40))]  # different lengths, one near the end
PLAIN = {}  # plain greedy's rows of PROMPTS by model seed: the same in every test of that model


@pytest.mark.parametrize("seed", [0, 9])
@pytest.mark.parametrize("kind, tree_name", [("plain", "chain")] + [
    (kind, tree) for kind in ("medusa", "oracle", "hydra", "lookup") for tree in TREES])
def test_greedy_medusa_equals_plain_greedy_in_every_row_of_a_batch(kind, tree_name, seed):
    """Random heads, prompt lookup (a tiny model's greedy text repeats itself, so lookups find continuations, right and
    wrong), and an oracle whose rank-0 path is always right (steps accept the full depth). Rows of different lengths
    stop at different steps (the long prompt at the context). The reference, given the same Medusa heads (random or
    oracle), makes each row's tokens in as many steps. on_step(row, tokens) streams each row's tokens as they come."""
    model = tiny_model(seed)
    want = PLAIN.get(seed) or PLAIN.setdefault(seed, [generate(model, p, max_new_tokens=30) for p in PROMPTS])
    heads = (None if kind == "plain" else PromptLookup() if kind == "lookup" else
             ContinuationHeads(model, *PROMPTS, max_new_tokens=40) if kind == "oracle" else
             random_heads(model, seed=seed, kind=kind, draft=24))
    streamed, kw = [[] for _ in PROMPTS], dict(max_new_tokens=30, on_step=lambda b, tokens: streamed[b].extend(tokens))
    got = (generate_batch(model, PROMPTS, **kw) if kind == "plain" else
           medusa_generate_batch(model, heads, PROMPTS, tree=TREES[tree_name], **kw))
    assert [g[0] for g in got] == [w[0] for w in want] == streamed
    if kind in ("medusa", "oracle"):  # the reference too, step for step
        assert [ref.medusa_generate(model, heads, p, tree=TREES[tree_name], max_new_tokens=30)
                for p in PROMPTS] == [(tokens, stats.steps) for tokens, stats in got]
    assert len({g[1].steps for g in got}) > 1  # the rows did stop at different steps
    assert all(sum(s.step_tokens) == len(t) - 1 for t, s in got) and all(s.steps == len(t) - 1 for t, s in want)
    depth = TREES[tree_name].depth
    if kind == "oracle":  # each row accepts its own continuation
        assert all(max(s.accepted_nodes) == depth and s.tokens_per_step > 0.9 * (depth + 1) for _, s in got)
    if kind == "lookup":  # every row's own earlier text is right at times ([5] has nothing else to match)
        assert all(sum(stats.accepted_nodes) > 0 for _, stats in got)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("tree_name", ["cpu", "gpu"])
def test_the_engine_emits_the_references_tokens_and_steps_with_the_same_seed(rule, tree_name):
    """Same tokens, same steps: the static cache, the vectorised rules and the batch change how the step is
    computed, not what it decides. (Sampled rules compare draws with probabilities that differ in the last
    bits between the two attention codes: over 4 prompts of 40 tokens no draw lands that close.) Budget 0: none."""
    heads = random_heads(model := tiny_model(12), seed=12, draft=24)
    for seed, prompt in enumerate([[1, 2, 3], [9, 8, 7, 6, 5], [4], list(range(3, 30)), [2, 7]]):
        settings = dict(tree=TREES[tree_name], max_new_tokens=40 if seed < 4 else 0, sampling=RULES[rule])
        want = ref.medusa_generate(model, heads, prompt, generator=torch.Generator().manual_seed(seed), **settings)
        got, stats = medusa_generate(model, heads, prompt, generator=torch.Generator().manual_seed(seed), **settings,
                                     on_step=lambda tokens: tokens[0])  # never called with none: IndexError
        assert (got, stats.steps) == want


def test_a_budget_that_fills_the_context_exactly_stops_at_the_budget_and_one_more_at_the_context(model):
    for budget, reason in ((30, "max_new_tokens"), (31, "context")):
        out, stats = generate(model, list(range(1, 35)), max_new_tokens=budget)
        assert len(out) == 30 and stats.stop_reason == reason  # 34 + 30 = 64 tokens, the whole context


@pytest.mark.parametrize("rule", RULES)
def test_heads_on_a_tree_of_the_root_alone_decode_as_plain_decoding_draw_for_draw(model, rule):
    """No guess to make: a step verifies the root alone, emits its bonus, and draws what a plain step draws."""
    kw = dict(max_new_tokens=8, sampling=RULES[rule])
    got, stats = medusa_generate(model, random_heads(model), [5], tree=Tree.from_choices([]), **kw,
                                 generator=torch.Generator().manual_seed(3))
    assert got == generate(model, [5], **kw, generator=torch.Generator().manual_seed(3))[0] and stats.steps == 7


def test_prompt_lookup_verifies_the_root_alone_without_a_repeated_ngram_and_drafts_right_on_a_repeated_text(
        monkeypatch):
    """Without a repeated n-gram prompt lookup takes plain decoding's forward passes, each verifying the
    root alone; on a text whose continuation was written earlier, it emits several tokens a step."""
    model, prompt, verified = tiny_model(n_layer=1), list(range(10)), []
    # A successor model, whose greedy next token is always the last + 1 (10, 11, ...: nothing repeats): its blocks
    # and positions add nothing, and lm_head row t + 1 is token t's final hidden state.
    with torch.no_grad():
        for p in [*model.transformer.h.parameters(), model.transformer.wpe.weight]:
            p.zero_()
        model.transformer.wte.weight.normal_()
        model.lm_head.weight = torch.nn.Parameter(model.transformer.ln_f(model.transformer.wte.weight).roll(1, 0))
    monkeypatch.setattr(step, "verify", lambda model, cache, tokens, real=step.verify, **kw:
                        verified.append(tokens.shape[1]) or real(model, cache, tokens, **kw))
    out, stats = medusa_generate(model, PromptLookup(), prompt, tree=preset("cpu"), max_new_tokens=20)
    assert out == generate(model, prompt, max_new_tokens=20)[0] == list(range(10, 30))
    assert verified == [1] * 19 and stats.steps == 19  # plain decoding's passes: one a token after the prefill's
    out, stats = medusa_generate(model, PromptLookup(), list(range(20)) + list(range(6)), tree=chain(4),
                                 max_new_tokens=13)  # what follows 3, 4, 5 is written earlier
    assert out == list(range(6, 19)) and stats.tokens_per_step > 2


def test_a_row_stopped_by_its_end_token_keeps_its_cache_length_and_an_end_token_is_one_vocabulary_id():
    """Its nodes are no longer usable while the others decode: its cache stays as its last step left it, as alone."""
    model, tree, used = tiny_model(0), preset("cpu"), []
    for rows in ([[5], [3, 1, 4, 1, 5, 9]], [[5]]):  # the end token 37 ends row 0 in its first step, never row 1
        used.append(KVCache(model.config, batch_size=len(rows), max_len=model.config.block_size + tree.num_nodes))
        medusa_generate_batch(model, random_heads(model), rows, tree=tree, max_new_tokens=30, eos_id=37, cache=used[-1])
    assert used[0].lengths[0] == used[1].lengths[0]
    for eos_id in ([37, 2], 64, -1):  # a list (as Hugging Face takes), ids outside the vocabulary of 64
        pytest.raises(ValueError, generate, model, [5], max_new_tokens=3, eos_id=eos_id).match("one token id")
