"""What is lossless, and the deliberate bugs that break it: each lossless claim (and typical acceptance's
nucleus) is paired with tests that patch a mistake into the engine and assert that the claim's own check
then fails. The apparatus (exact distributions, the bound, heads that know the future) is in lossless.py.

Greedy Medusa writes plain greedy's tokens in every row of a ragged batch (in bfloat16 it may part only at
a near-tie); plain and rejection sampling emit exactly the backbone's distribution, enumerated on a 4-token
vocabulary; typical acceptance does not (the paper's trade) but never leaves the nucleus. Top-p breaks ties
by token id, in a batch as alone; an end token stops every rule; a temperature too small for float32 is greedy."""

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

from conftest import RULES, ContinuationHeads, random_heads, tiny_model
from lossless import FutureHeads, FutureHydraHeads, V, deepest, exact_sequence_probs, failures, sample_rows, small_model
from medusa_mini import KVCache, Tree, acceptance, chain, compact_kv_cache, preset, step
from medusa_mini import reference as ref
from medusa_mini.acceptance import accept, path_accept, rejection_accept_topk, typical_accept
from medusa_mini.decoding import generate, generate_batch, medusa_generate, medusa_generate_batch, prefill
from medusa_mini.proposal import Drawn, PromptLookup
from medusa_mini.sampling import Sampling, inverse_cdf, sampling_probs
from medusa_mini.step import plain_step, verify

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models gain nothing from threads

# Every token at depth 1, so the root always has a matching child, and two children under each.
DEEP_TREE = Tree.from_choices([(r,) for r in range(V)] + [(r, c) for r in range(V) for c in range(2)])
# Depth 3 with rank gaps: rank 2 without rank 1, so a node's second candidate is the draft's third draw.
GAP_TREE = Tree.from_choices([(0,), (2,), (0, 0), (0, 2), (2, 0), (0, 0, 0), (0, 0, 1)])
GREEDY_TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
PROMPTS = [[1, 2], [3, 0, 1], [2], [0, 3, 3, 1], [3], [0], [1, 1, 2], [2, 0]]  # a ragged batch


# ---- greedy: plain greedy's tokens, with heads that know the future ------------------------------------


def greedy_mismatches(model, drafter) -> tuple[int, int]:
    """(rows of PROMPTS whose greedy Medusa tokens are not plain greedy's, the deepest accepted node)."""
    rows = medusa_generate_batch(model, drafter, PROMPTS, tree=GREEDY_TREE, max_new_tokens=12)
    want = [tokens for tokens, _ in generate_batch(model, PROMPTS, max_new_tokens=12)]
    return sum(got != w for (got, _), w in zip(rows, want)), deepest(rows)


@pytest.mark.parametrize("drafter", [FutureHeads(), FutureHydraHeads()], ids=["future-medusa", "future-hydra"])
def test_greedy_medusa_with_heads_that_know_the_future_equals_plain_greedy_in_every_row_of_a_ragged_batch(drafter):
    """They fill whole paths: the deepest accepted node is the tree's depth. (Random heads over a draft vocabulary,
    and prompt lookup: tests/test_decoding.py, on every tree.)"""
    assert greedy_mismatches(small_model(3), drafter) == (0, GREEDY_TREE.depth)


def verify_on(wrong):
    """`verify` on wrong(tree) for the step's tree, placed anew (its positions may pass the context: clamped)."""
    return lambda *args, tree, **kwargs: verify(*args, tree=wrong(tree), **{**kwargs, "clamp": True, "placed": None})


GREEDY_BUGS = {  # name: the module attribute to patch, and the wrong value
    "nodes_sit_at_their_slot_not_their_depth": (step, "verify", verify_on(  # node i at slot and position length + i
        lambda tree: replace(tree, offsets=tree.offsets[:, [0, 0, *range(2, tree.offsets.shape[1])]]))),
    "nodes_see_a_causal_mask_not_the_tree_mask": (step, "verify", verify_on(
        lambda tree: replace(tree, mask_table=torch.full_like(tree.mask_table, -torch.inf).triu(2)))),  # causal
    # the path's K/V taken from the prefix's first slots: slots counted from 0, not from each row's root
    "the_cache_keeps_node_indices_not_the_paths_slots": (step, "compact_kv_cache", lambda cache, keep, *, to, **kw:
                                                         compact_kv_cache(cache, keep - to[:, :1], to=to, **kw)),
    "children_are_judged_at_themselves_not_their_parent": (acceptance, "path_accept", lambda tree, tokens, y, **kw:
        path_accept(replace(tree, parent_index=torch.arange(len(tree.parent_index))), tokens, y, **kw))}


@pytest.mark.parametrize("bug", GREEDY_BUGS)
def test_the_greedy_equality_check_fails_when(bug, monkeypatch):
    monkeypatch.setattr(*GREEDY_BUGS[bug])
    assert greedy_mismatches(small_model(3), FutureHeads())[0] > 0


# ---- rejection sampling: the backbone's exact distribution ----------------------------------------------


@dataclass(frozen=True)
class Case:
    """A setting of rejection sampling (drafter None: plain sampling) on small_model(model): `rows` rows
    per prompt in one batch, and the deepest node they must accept."""

    drafter: object
    sampling: Sampling
    rows: int
    deepest: int
    tree: Tree = DEEP_TREE
    prompts: tuple = ((1, 2),)
    n: int = 4  # new tokens: V^n sequences
    model: int = 11  # small_model's seed
    block_size: int = 16
    max_new_tokens: int = 0  # 0: n; more where the context ends the rows first
    eos_id: int | None = None

    def run(self):
        """Per prompt: (its rows' (tokens, stats), its exact distribution)."""
        model, prompts = small_model(self.model, block_size=self.block_size), [list(p) for p in self.prompts]
        rows = sample_rows(model, self.drafter, prompts, rows=self.rows, seed=0, tree=self.tree, eos_id=self.eos_id,
                           sampling=self.sampling, max_new_tokens=self.max_new_tokens or self.n)
        exact = [exact_sequence_probs(model, p, self.n, temperature=self.sampling.temperature,
                                      top_p=self.sampling.top_p, eos_id=self.eos_id) for p in prompts]
        return list(zip(rows, exact))


def rejection(temperature=0.8, **settings):
    return Sampling(acceptance="rejection", temperature=temperature, **settings)


# q = softmax(gamma x logits / T): gamma 20 makes each head's draws nearly its top-k, so a node's later
# candidates are tried against a q far from the whole one; gamma 2 keeps q sharper than p, so tries fail.
CASES = {"plain-top-p-eos": Case(None, Sampling(temperature=0.8, top_p=0.8), rows=2000, deepest=0, n=3, eos_id=3),
    "top-k-top-p": Case(FutureHeads(gamma=2.0), rejection(top_p=0.8, candidates="topk"), rows=1500, deepest=2),
    "drawn-depth-3-rank-gap": Case(FutureHeads(gamma=20.0), rejection(), rows=700, deepest=3, tree=GAP_TREE, n=5),
    "drawn-top-p-eos": Case(FutureHeads(gamma=2.0), rejection(top_p=0.8), rows=600, deepest=2, tree=GAP_TREE, eos_id=0),
    # p's favourite first token here is 2 (0.37 at T = 1.5): the draft vocabulary leaves it out
    "drawn-draft-vocabulary-T1.5": Case(FutureHeads(gamma=2.0, draft_ids=torch.tensor([0, 1, 3])),
                                        rejection(1.5), rows=700, deepest=2, tree=GREEDY_TREE),
    "hydra-ragged-batch": Case(FutureHydraHeads(gamma=20.0), rejection(), rows=500, deepest=2, model=15,
                               prompts=((2, 1), (3, 0, 1))),
    "cut-by-the-context": Case(FutureHeads(gamma=2.0), rejection(candidates="topk"), rows=800, deepest=2,
                               tree=GAP_TREE, block_size=6, max_new_tokens=8),
    # A 4-token continuation is verified on a chain of 4, one node deeper than the 5 new tokens allow.
    "prompt-lookup": Case(PromptLookup(), rejection(), rows=800, deepest=3, tree=chain(4), n=5,
                          prompts=((0, 3, 0, 2, 2, 2, 2, 0, 3),))}


@pytest.mark.parametrize("case", CASES)
def test_plain_and_rejection_sampling_emit_exactly_the_backbones_distribution(case):
    """Each prompt's sequences pass `lossless.failures` against its exact distribution, and the deepest
    accepted node is the case's: none in plain sampling, the baseline; 3 on the depth-3 tree given 5 tokens;
    2 where 4 tokens (the budget) or a 6-token context cut that tree to depth 2."""
    runs = CASES[case].run()
    for rows, exact in runs:
        assert failures(rows, exact) == [] and deepest(rows) == CASES[case].deepest
    stats = [s for rows, _ in runs for _, s in rows]
    assert case != "cut-by-the-context" or {s.stop_reason for s in stats} == {"context"}
    if case == "drawn-top-p-eos":  # an end token accepted inside a path, in over 10 rows
        inside = [s.stop_reason == "eos" and s.steps > 0 and s.step_tokens[-1] <= s.accepted_nodes[-1] for s in stats]
        assert sum(inside) > 10


def accepts_without_top_p(tree, tokens, logits, *, sampling, **kwargs):
    return accept(tree, tokens, logits, sampling=replace(sampling, top_p=1.0), **kwargs)


def typical_judges_by_p_without_top_p(tree, tokens, logits, *, sampling, u, usable=None):
    """Candidates judged by p without top-p; the bonus still drawn from p with it."""
    judged = typical_accept(tree, tokens, logits, sampling=replace(sampling, top_p=1.0), u=u, usable=usable)
    p = sampling.probs(logits)  # [B, N, V]
    return judged._replace(bonus=inverse_cdf(p.gather(1, judged.last[:, None, None].expand_as(p[:, :1]))[:, 0], u))


def a_siblings_q(drawn, nodes, at=Drawn.at):
    """`Drawn.at` with each inner node's children (DEEP_TREE's depth 1) tried against the next one's q."""
    inner = [i for i, q in enumerate(drawn.q_index.tolist()) if q >= 0 and i > 0]
    sibling = dict(zip(inner, inner[1:] + inner[:1]))
    moved = torch.tensor([sibling.get(i, i) for i in range(len(drawn.q_index))])
    return at(drawn, moved[nodes])[0], at(drawn, nodes)[1]


def residuals_changed(change, dists_of=acceptance.try_distributions):
    """`try_distributions` with its residuals r [B, N - 1, V] replaced by change(r, p, q, tries)."""
    def changed(p, q, tries):
        dists = dists_of(p, q, tries)
        r = dists[:, p.shape[1] : 2 * p.shape[1] - 1]
        r.copy_(change(r, p, q, tries))
        return dists
    return changed


SAMPLING_BUGS = {  # name: (the case whose check must fail, the module attribute to patch, the wrong value)
    "the_plain_step_draws_from_p_without_top_p": ("plain-top-p-eos", Sampling, "probs", lambda sampling, logits:
                                                  sampling_probs(logits, temperature=sampling.temperature)),
    # each node's y still a draw from its p, but the draws along a path coupled, not fresh at each depth
    "top_k_draws_share_one_uniform_per_row": ("top-k-top-p", acceptance, "rejection_accept_topk", lambda *a, u, **kw:
                                              rejection_accept_topk(*a, u=u[:, :1].expand_as(u), **kw)),
    "q_keeps_earlier_draws": ("drawn-depth-3-rank-gap", acceptance, "without_earlier_draws",
                              lambda log_q, draws, *, bounds: log_q.softmax(dim=-1)),
    "the_first_draw_is_accepted_untested": ("drawn-depth-3-rank-gap", acceptance, "try_accepts",
                                            lambda p_x, q_x, u, *, live: torch.ones_like(live)),
    "drawn_candidates_are_judged_by_p_without_top_p": ("drawn-top-p-eos", step, "accept", accepts_without_top_p),
    "top_k_candidates_are_judged_by_p_without_top_p": ("top-k-top-p", step, "accept", accepts_without_top_p),
    # each candidate tried against p itself, and the bonus drawn from p
    "the_residual_is_not_updated_after_a_miss": ("drawn-draft-vocabulary-T1.5", acceptance, "try_distributions",
                                                 residuals_changed(lambda r, p, q, tries: p[:, tries.parents])),
    "the_residual_leaves_out_tokens_outside_the_draft_vocabulary": ("drawn-draft-vocabulary-T1.5", acceptance,
        "try_distributions", residuals_changed(lambda r, p, q, tries: r * (q > 0))),
    "a_row_tries_its_draws_against_another_rows_q": ("hydra-ragged-batch", Drawn, "at", lambda d, nodes, at=Drawn.at: (
        at(d, nodes)[0].roll(1, dims=0), at(d, nodes)[1])),  # `Drawn.at` giving row b its own draws with row b - 1's q
    "children_are_tried_against_a_siblings_q": ("hydra-ragged-batch", Drawn, "at", a_siblings_q)}


@pytest.mark.parametrize("bug", SAMPLING_BUGS)
def test_the_exact_distribution_check_fails_when(bug, monkeypatch):
    case, *patch = SAMPLING_BUGS[bug]
    monkeypatch.setattr(*patch)
    assert any(failures(rows, exact) for rows, exact in CASES[case].run())


def test_typical_acceptance_fails_the_exact_distribution_check():
    """The documented trade (§2.3.1): typical acceptance favours likely candidates, so its sequences drift
    from the backbone's distribution past the bound every rejection case stays within."""
    typical = Sampling(acceptance="typical", temperature=1.0, epsilon=0.3, delta=0.6)
    [(rows, exact)] = Case(FutureHeads(), typical, rows=1000, deepest=1, n=3).run()
    assert failures(rows, exact)


# ---- typical acceptance respects top-p ---------------------------------------------------------------


# Heads whose q is p: their likeliest candidates pass typical acceptance, inside the nucleus and out. The
# second guess's branch is the deeper, so typical acceptance takes that guess wherever it passes, in the nucleus or out.
TYPICAL_TOP_P = Case(FutureHeads(), Sampling(acceptance="typical", temperature=1.0, top_p=0.6), rows=400, n=6,
                     deepest=2, tree=Tree.from_choices([(0,), (1,), (1, 0)]))


@pytest.mark.parametrize("mistake", [None, (step, "accept", accepts_without_top_p),  # the bonus drawn without top-p too
                                     (acceptance, "typical_accept", typical_judges_by_p_without_top_p)],
                         ids=["engine", "accept-without-top-p", "typical-judges-by-p-without-top-p"])
def test_typical_medusa_with_top_p_emits_only_nucleus_tokens_and_the_check_fails_when_it_reads_p_without_top_p(
        mistake, monkeypatch):
    """Rows emitting a token of probability 0 under top-p given everything before it (their sequence has probability
    0): none in the engine, some with either mistake; the rows accept candidates as deep as the tree. The reference's
    typical walk decides as the engine with top-p (tests/test_acceptance.py)."""
    if mistake:
        monkeypatch.setattr(*mistake)
    [(rows, exact)] = TYPICAL_TOP_P.run()
    outside = sum(exact.get(tuple(tokens), 0.0) == 0 for tokens, _ in rows)
    assert deepest(rows) == TYPICAL_TOP_P.deepest and (outside > 0) == (mistake is not None)


def lower_ids_nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    """The spec, in Python: order by probability, ties by token id; keep while the mass before < top_p."""
    order = sorted(range(len(p)), key=lambda t: (-float(p[t]), t))
    before = itertools.accumulate((float(p[t]) for t in order), initial=0.0)  # non-decreasing
    return {t for t, mass in zip(order, before) if mass < top_p}


def test_top_p_with_ties_at_the_cut_keeps_the_lower_token_ids_in_a_batch_as_alone():
    """Tokens 1, 3, 4 tie and top-p keeps two; 64 and 2048 tokens all tie, half kept. Every row of the batch
    is its own result alone and keeps the lower ids (on 64 tied tokens an unstable sort, torch's at least,
    keeps others); keeping the higher ids would differ on every row: each has its tie at the cut."""
    short = torch.tensor([[3.0, 1.0, 0.0, 1.0, 1.0, -2.0], [0.0, 1.0, 1.0, 3.0, -1.0, 1.0]])
    p = short.softmax(dim=-1)
    top_p = float(p[0, 0] + 1.5 * p[0, 1])  # between one and two tied tokens' mass after the top one
    for logits, cut in [(short, top_p), (torch.zeros(3, 64), 0.5), (torch.zeros(2, 2048), 0.5)]:
        batch = sampling_probs(logits, temperature=1.0, top_p=cut)
        for b in range(logits.shape[0]):
            alone = sampling_probs(logits[b : b + 1], temperature=1.0, top_p=cut)[0]
            assert torch.equal(batch[b], alone)
            kept, probs = set(alone.nonzero().flatten().tolist()), logits[b].softmax(dim=-1)
            assert kept == lower_ids_nucleus(probs, cut)
            assert kept != {len(probs) - 1 - t for t in lower_ids_nucleus(probs.flip(0), cut)}  # the higher ids


@pytest.mark.parametrize("rule", RULES)
def test_an_end_token_at_the_prefill_or_inside_a_path_stops_generation_after_it_in_the_engine_and_the_reference(rule):
    """Run once without an end token, streamed: the prefill's token, then each step's tokens. As end token
    take the prefill's token, then a token first emitted in the middle of a step. With either, the same
    seed emits exactly the run's tokens up to and including it."""
    model = tiny_model(2)
    for seed, prompt in enumerate([[1, 2, 3], [5, 6], [9, 8, 7, 6], [4, 4]]):
        heads, steps = ContinuationHeads(model, prompt, max_new_tokens=40, seed=seed), []

        def run(generate, eos_id=None, **kw):
            return generate(model, heads, prompt, tree=preset("cpu"), max_new_tokens=30, sampling=RULES[rule],
                            generator=torch.Generator().manual_seed(seed), eos_id=eos_id, **kw)
        full, stats = run(medusa_generate, on_step=steps.append)
        assert [t for s in steps for t in s] == full and [len(s) for s in steps] == [1, *stats.step_tokens]
        starts = list(itertools.accumulate(map(len, steps), initial=0))  # where each step's tokens begin
        mid = [starts[i] + j for i, s in enumerate(steps) for j in range(len(s) - 1)
               if full.index(s[j]) == starts[i] + j]  # first emitted here, with tokens after it in its step
        if mid:
            whole, _ = run(ref.medusa_generate)
            for end in (full[0], full[mid[0]]):
                got, stats = run(medusa_generate, eos_id=end)
                assert got == full[: full.index(end) + 1] and stats.stop_reason == "eos"
                assert (stats.steps == 0) == (end == full[0]) == (stats.tokens_per_step == 0)  # no step, 0 a step
                assert run(ref.medusa_generate, eos_id=end) == (whole[: whole.index(end) + 1], stats.steps)
            return
    pytest.fail("no run emitted a token in the middle of a step: the test checked nothing")


@pytest.mark.parametrize("temperature", [1e-45, 1e-300])
def test_a_temperature_below_float32s_range_is_greedy_for_plain_sampling_and_every_medusa_rule(temperature):
    """p is the argmax's point mass, never NaN: plain sampling and Medusa under each rule, with random
    (so often wrong, and at such T sharply wrong) heads of both kinds, emit plain greedy's tokens."""
    model, prompts = tiny_model(4), [[1, 2, 3], [5], [9, 8, 7, 6]]
    want = [[tokens] for tokens, _ in generate_batch(model, prompts, max_new_tokens=20)]  # each prompt's one row
    medusa = itertools.product(("medusa", "hydra"), (Sampling(acceptance="typical", temperature=temperature),
                                                     rejection(temperature, candidates="topk"), rejection(temperature)))
    for kind, sampling in [("plain", Sampling(temperature=temperature)), *medusa]:
        rows = sample_rows(model, None if kind == "plain" else random_heads(model, seed=1, kind=kind), prompts, rows=1,
                           seed=0, tree=preset("cpu"), sampling=sampling, max_new_tokens=20)
        assert [[tokens for tokens, _ in r] for r in rows] == want, (kind, sampling)


@torch.no_grad()
def verify_error(model, prompt: list[int], tree: Tree) -> float:
    """After the same prefill: max |root logits of a verify pass of N nodes - a plain one-token step's|."""
    caches = [KVCache(model.config, batch_size=1, max_len=model.config.block_size + tree.num_nodes,
                      dtype=model.lm_head.weight.dtype) for _ in range(2)]
    root = prefill(model, torch.tensor([prompt]), caches[0])[0].argmax(dim=-1, keepdim=True)  # [1, 1]
    prefill(model, torch.tensor([prompt]), caches[1])
    _, plain, _ = plain_step(model, caches[0], root)  # [1, 1, V]
    others = torch.randint(model.config.vocab_size, (1, tree.num_nodes - 1), generator=torch.Generator().manual_seed(0))
    tree_logits, _ = verify(model, caches[1], torch.cat([root, others], dim=1), tree=tree.tensors())  # [1, N, V]
    return (plain[0, 0].float() - tree_logits[0, 0].float()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_medusa_parts_from_plain_greedy_only_at_a_tie_within_twice_the_measured_verify_error(dtype):
    """Greedy Medusa is exact because the root's logits in the tree pass are a plain step's, to within a few
    units in the last place (matmuls of other shapes may add in other orders). Where greedy Medusa and plain
    greedy part, plain's top two logits must be within twice the measured difference (at least one unit in the last
    place: the difference is measured at the root, a parting may come later): only a near-tie."""
    model, prompts = tiny_model(7, vocab_size=64, block_size=64).to(dtype), [[3, 1, 4, 1, 5], list(range(10, 30)), [9]]
    error = max(verify_error(model, p, tree) for p in prompts for tree in (preset("cpu"), preset("gpu"), chain(4)))
    scale = max(model(torch.tensor([p]))[0].abs().max().item() for p in prompts)
    ulp = torch.finfo(dtype).eps * scale  # a unit in the last place of the largest logit
    assert error <= 8 * ulp
    for prompt in prompts:
        heads = ContinuationHeads(model, prompt, max_new_tokens=40)
        got, stats = medusa_generate(model, heads, prompt, tree=chain(4), max_new_tokens=40)
        want, _ = generate(model, prompt, max_new_tokens=40)
        assert max(stats.accepted_nodes) >= 2
        assert got == want or dtype != torch.float32  # float32 forgives nothing: its error is far below any tie
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = model(torch.tensor([prompt + want[:i]]))[0][0, -1].float().topk(2).values
            assert top2[0] - top2[1] <= 2 * max(error, ulp), f"parted at token {i} without a near-tie"
