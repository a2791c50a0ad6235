"""Exactness you can trust: the guarantees Medusa decoding makes, checked where they are hardest to meet.

- Rejection sampling is lossless *at depth*: on a 4-token vocabulary the engine emits sequences of four
  tokens whose joint distribution, and the marginals of the third and fourth token, match the backbone's
  exact distribution, enumerated from plain forward passes, while the first step accepts candidates at
  depth two (each test counts how often, and states its deepest accepted node). Medusa heads with top-k
  and with sampled drafts, after top-p, rows of different prompts in one batch, and dependent (hydra) heads. The
  bound is rigorous (an honest sampler crosses it with probability < 1e-4 per comparison, `tv_bound`),
  and the same bound rejects deliberately biased samplers, so it has teeth.
- Greedy decoding is exact in float32 and, up to near-ties, in bfloat16: the verify pass's root logits
  are a plain step's logits to within a few units in the last place.
- Typical acceptance respects top-p; top-p breaks ties by token id in a batch as alone; an end token
  stops generation under every rule, at the prefill too; hydra rows in a batch decode as they would
  alone; typical acceptance decides each row of a batch as it would alone, given the same logits.

The heads here know the future: they read each row's emitted tokens (`on_step`) and return the
backbone's own logits further ahead, so candidates are often right and paths are long. Which heads
propose never changes what a lossless rule emits, only how fast; so heads that help are fair.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import medusa_mini.acceptance as acceptance
import medusa_mini.reference as ref
from conftest import ContinuationHeads, random_heads, tiny_model
from distributions import exact_sequence_probs, expected_tv, total_variation
from test_hydra import random_hydra
from medusa_mini.acceptance import Accepted, path_accept, typical_accept_paths
from medusa_mini.decoding import generate, medusa_generate, medusa_generate_batch, prefill
from medusa_mini.heads import HeadsConfig
from medusa_mini.model import KVCache
from medusa_mini.sampling import Sampling, sampling_probs, typical_threshold
from medusa_mini.step import verify
from medusa_mini.tree import Tree, preset

V, N_NEW, T = 4, 4, 0.8  # vocabulary, new tokens per sequence (4^4 = 256 sequences), temperature
# Every token at depth 1 (so the root always has a matching child) and two children under each: the
# first step of a 4-token run can accept two candidates, and at depth 2 it may also reject.
DEEP_TREE = Tree.from_choices([(r,) for r in range(V)] + [(r, c) for r in range(V) for c in range(2)])
FALSE_ALARM = 1e-4  # the chance that an honest sampler's TV crosses the bound, per comparison (below)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models gain nothing from threads; on a shared machine their spinning costs 4x."""
    yield


def small_model(seed: int):
    """tiny_model on the 4-token vocabulary, its position embeddings as large as its token embeddings
    (tiny_model leaves them near zero), so a node scored at the wrong position or seeing the wrong
    tokens gets a visibly different p: the deep tests then catch such a verify pass."""
    model = tiny_model(seed, vocab_size=V, block_size=16)
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


# ---- heads that know the future ----------------------------------------------------------------


@torch.no_grad()
def last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """The backbone's logits after each sequence: [len(seqs), V], one padded forward (causal: the
    padding after a sequence never reaches its last position)."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    logits, _ = model(ids, logits_at=torch.tensor([len(s) - 1 for s in seqs]))
    return logits[:, 0]


class FutureHeads:
    """Medusa heads that read each row's emitted tokens (call `on_step(row, tokens)`) and guess ahead
    along the backbone's greedy continuation: head k returns gamma x the backbone's logits after the
    root and the k - 1 greedy tokens that follow it (gamma = 1: head 1's q is p at the root)."""

    KIND = "medusa"

    def __init__(self, model, prompts, *, num_heads: int = 2, gamma: float = 1.0) -> None:
        self.model, self.seqs, self.gamma = model, [list(p) for p in prompts], gamma
        self.config = HeadsConfig(num_heads=num_heads, n_embd=model.config.n_embd,
                                  vocab_size=model.config.vocab_size, kind=self.KIND)

    def on_step(self, row: int, tokens: list[int]) -> None:
        self.seqs[row] += tokens

    def __call__(self, hidden, lm_head, *, num=None):
        assert hidden.shape[0] == len(self.seqs)
        seqs, out = [list(s) for s in self.seqs], []
        for _ in range(num or self.config.num_heads):
            logits = last_logits(self.model, seqs)  # [B, V]
            out.append(self.gamma * logits)
            for s, t in zip(seqs, logits.argmax(dim=-1).tolist()):
                s.append(t)
        return torch.stack(out)  # [K', B, V]


class FutureHydraHeads(FutureHeads):
    """Dependent heads that know the future: head k, given the root and the drafted path, returns gamma x
    the backbone's logits after exactly that path, so each node's children come from its own q."""

    KIND = "hydra"

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_logits(self, k, hidden, tokens, *, lm_head, wte):
        B, M = tokens.shape[:2]  # tokens [B, M, d]: the root, then each parent's drafted path
        paths = tokens[..., :k].tolist()
        seqs = [self.seqs[b][:-1] + paths[b][m] for b in range(B) for m in range(M)]  # seqs[b] ends with the root
        return self.gamma * last_logits(self.model, seqs).view(B, M, -1)  # [B, M, V]


# ---- sampling many rows and comparing ------------------------------------------------------------


def sample_rows(model, heads_for, prompts, *, batches: int, sampling, seed: int, tree: Tree = DEEP_TREE):
    """`batches` runs of medusa_generate_batch over `prompts` (fresh heads_for(prompts) each run).

    Returns per row index, the emitted sequences of every run, and the deepest accepted node of every
    row of every run (the max over its steps of `stats.accepted_nodes`)."""
    gen = torch.Generator().manual_seed(seed)
    outs: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    deepest: list[int] = []
    for _ in range(batches):
        heads = heads_for(prompts)
        got = medusa_generate_batch(model, heads, prompts, tree=tree, max_new_tokens=N_NEW,
                                    sampling=sampling, generator=gen, on_step=heads.on_step)
        for b, (tokens, stats) in enumerate(got):
            outs[b].append(tuple(tokens))
            deepest.append(max(stats.accepted_nodes, default=0))
    return outs, deepest


def pooled(outs, rows=None) -> list[tuple[int, ...]]:
    """The sequences of the given row indices (default all), pooled."""
    return [s for b, seqs in enumerate(outs) if rows is None or b in rows for s in seqs]


def marginal(dist, pick):
    out: dict = {}
    for seq, p in dist.items():
        out[pick(seq)] = out.get(pick(seq), 0.0) + p
    return out


VIEWS = {  # what is compared: the whole sequence, and the tokens only deep acceptance emits
    "joint": lambda s: s,
    "token 3": lambda s: s[2],
    "token 4": lambda s: s[3],
    "tokens 3-4": lambda s: s[2:4],
    "tokens 2-3": lambda s: s[1:3],  # the tokens the depth-1 and depth-2 tries decide
}


def tv_bound(exact: dict, M: int) -> float:
    """What the TV between M honest samples and `exact` exceeds with probability < FALSE_ALARM: its mean
    is at most `expected_tv` (Jensen), and one sample moves it by at most 1/M, so by McDiarmid's
    inequality P(TV > mean + t) <= exp(-2 M t^2). Rigorous for any number of outcomes, large or small."""
    return expected_tv(exact, M) + math.sqrt(math.log(1 / FALSE_ALARM) / (2 * M))


def distances(seqs, exact) -> dict[str, tuple[float, float]]:
    """Per view: (TV of the samples from the exact distribution, `tv_bound`)."""
    found, out = {s: c / len(seqs) for s, c in Counter(seqs).items()}, {}  # the samples' frequencies
    for name, pick in VIEWS.items():
        want = marginal(exact, pick)
        out[name] = (total_variation(marginal(found, pick), want), tv_bound(want, len(seqs)))
    return out


def assert_matches(seqs, exact) -> None:
    for name, (tv, bound) in distances(seqs, exact).items():
        assert tv < bound, f"{name}: TV {tv:.4f} >= bound {bound:.4f}"


def assert_detected(seqs, exact) -> None:
    """A biased sampler lands outside the same bound on at least one view."""
    found = distances(seqs, exact)
    assert any(tv > bound for tv, bound in found.values()), found


# ---- biased samplers: the same engine with one step of the rule done wrong -------------------------


def one_uniform_per_row(tree, tokens, logits, *, sampling, generator, usable=None) -> Accepted:
    """Top-k rejection sampling that reuses ONE uniform number at every node of a row: each node's y
    alone is still a draw from its p, but the draws along a path are coupled (no fresh randomness per
    depth), which skews the later tokens and the joint."""
    p = sampling.probs(logits)  # [B, N, V]
    u = torch.rand(p.shape[0], generator=generator)  # [B]
    cdf = p.cumsum(dim=-1)
    y = torch.searchsorted(cdf, (u[:, None] * cdf[..., -1])[..., None], right=True)[..., 0].clamp(max=p.shape[-1] - 1)
    return path_accept(tree, tokens, y, usable=usable)


def accept_the_first_draw(p, candidates, draft, u):
    """Sampled drafts accepted without the test: the first drawn candidate always passes (emits q, not p)."""
    return (0, p) if candidates else (None, p)


# ---- rejection sampling is lossless at depth two ---------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("draft,rows,top_p", [("topk", 3000, 1.0), ("sampled", 1000, 1.0), ("topk", 3000, 0.8)],
                         ids=["topk", "sampled", "topk-top-p"])
def test_rejection_sampling_preserves_the_distribution_of_sequences_accepted_at_depth_two(draft, rows, top_p,
                                                                                          monkeypatch):
    """Medusa heads on a fixed tree: four new tokens, the first step accepting two candidates in most
    rows. The joint of all four tokens and the marginals of tokens 3 and 4 (when the first step goes
    that deep: the depth-2 candidate and the bonus after it) match the exact distribution, after top-p
    too (never a sequence top-p rules out); the same rule done wrong fails the same bound.
    (Sampled drafts walk each row on the host, so they get fewer rows.)"""
    model = small_model(11)
    prompt = [1, 2]
    exact = exact_sequence_probs(model, prompt, N_NEW, temperature=T, top_p=top_p)
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert (min(exact.values()) == 0) == (top_p < 1)  # top-p really rules sequences out
    sampling = Sampling(acceptance="rejection", temperature=T, draft=draft, top_p=top_p)
    # Sampled drafts come from q = softmax(2 x logits / T), sharper than p: tries do fail, and
    # accepting a draw without the test (which emits q) is a visible bias.
    heads_for = lambda prompts: FutureHeads(model, prompts, gamma=2.0)  # noqa: E731
    outs, deepest = sample_rows(model, heads_for, [prompt] * rows, batches=2, sampling=sampling, seed=0)
    assert max(deepest) == 2  # the deepest accepted node: depth two, the most a 4-token run can use
    assert sum(d == 2 for d in deepest) > 0.6 * len(deepest)  # and most rows got there
    assert_matches(pooled(outs), exact)
    assert all(exact[s] > 0 for s in pooled(outs))

    # Teeth: half the samples, the same bound, one step of the rule done wrong.
    if draft == "topk":
        monkeypatch.setattr(acceptance, "rejection_accept_topk", one_uniform_per_row)
    else:
        monkeypatch.setattr(acceptance, "try_children", accept_the_first_draw)
    outs, _ = sample_rows(model, heads_for, [prompt] * rows, batches=1, sampling=sampling, seed=0)
    assert_detected(pooled(outs), exact)


@torch.no_grad()
@pytest.mark.parametrize("draft,rows", [("topk", 1500), ("sampled", 500)])
def test_batched_rejection_sampling_gives_every_row_its_own_prompts_distribution_at_depth_two(draft, rows):
    """Prompts of two lengths interleaved in one batch: rows keep different cache lengths and accept
    different paths, and each row's sequences follow its own prompt's exact distribution."""
    model = small_model(11)
    prompts = [[1, 2], [3, 0, 1]]
    exact = [exact_sequence_probs(model, p, N_NEW, temperature=T) for p in prompts]
    assert total_variation(exact[0], exact[1]) > 0.2  # the prompts' distributions differ
    sampling = Sampling(acceptance="rejection", temperature=T, draft=draft)
    heads_for = lambda prompts: FutureHeads(model, prompts, gamma=2.0)  # noqa: E731
    outs, deepest = sample_rows(model, heads_for, prompts * rows, batches=2, sampling=sampling, seed=1)
    assert max(deepest) == 2 and sum(d == 2 for d in deepest) > 0.6 * len(deepest)
    for b in range(2):
        rows_b = set(range(b, 2 * rows, 2))
        assert_matches(pooled(outs, rows_b), exact[b])
        assert_detected(pooled(outs, rows_b), exact[1 - b])  # teeth: rows mixed up would show


def sibling_q(per_node):
    """`Draft.per_node` with the depth-1 nodes' q rotated: each node's children tried against a
    sibling's q (the draws stay the node's own): the mistake dependent heads invite."""

    def wrong(self, b, samples):
        nodes = per_node(self, b, samples)  # per node: (log q of its children, their draws in order)
        swapped = list(nodes)
        for i in range(1, V + 1):  # DEEP_TREE's depth-1 nodes: node i takes node i + 1's q (cyclically)
            swapped[i] = (nodes[i % V + 1][0], nodes[i][1])
        return swapped

    return wrong


@torch.no_grad()
@pytest.mark.parametrize("draft,rows", [("topk", 3000), ("sampled", 1000)])
def test_rejection_sampling_with_dependent_heads_preserves_the_distribution_at_depth_two(draft, rows, monkeypatch):
    """Hydra heads: a depth-1 node's children come from that node's own q (the exact conditional,
    sharpened); acceptance at depth two tries them against exactly that q, so the sequences stay
    exactly the backbone's; trying them against a sibling's q fails the same bound."""
    from medusa_mini.proposal import Draft

    model = small_model(15)  # a model whose siblings' conditionals differ: the wrong q shows
    prompt = [2, 1]
    exact = exact_sequence_probs(model, prompt, N_NEW, temperature=T)
    sampling = Sampling(acceptance="rejection", temperature=T, draft=draft)
    heads_for = lambda prompts: FutureHydraHeads(model, prompts, gamma=2.0)  # noqa: E731
    outs, deepest = sample_rows(model, heads_for, [prompt] * rows, batches=2, sampling=sampling, seed=2)
    assert max(deepest) == 2 and sum(d == 2 for d in deepest) > 0.6 * len(deepest)
    assert_matches(pooled(outs), exact)
    # Teeth. Sampled drafts: with as many samples (siblings' q differ less than p and q do).
    if draft == "topk":
        monkeypatch.setattr(acceptance, "rejection_accept_topk", one_uniform_per_row)
    else:
        monkeypatch.setattr(Draft, "per_node", sibling_q(Draft.per_node))
    outs, _ = sample_rows(model, heads_for, [prompt] * rows, batches=1 if draft == "topk" else 2,
                          sampling=sampling, seed=2)
    assert_detected(pooled(outs), exact)


# ---- greedy: exact in float32, a few bfloat16 ulps in bfloat16 ---------------------------------------


@torch.no_grad()
def root_logit_gap(model, prompt: list[int], tree: Tree, seed: int) -> tuple[float, float, float]:
    """After the same prefill, a plain one-token step and a verify pass of N nodes: (max |difference of
    the root's logits|, max |plain logits|, max |root's - first child's logits|, a different context)."""
    dtype = model.lm_head.weight.dtype
    ids = torch.tensor([prompt])

    def prefilled():
        cache = KVCache(model.config, batch_size=1, max_len=model.config.block_size + tree.num_nodes, dtype=dtype)
        logits, _ = prefill(model, ids, cache)
        return cache, logits

    cache, logits = prefilled()
    root = logits.argmax(dim=-1)  # [1]
    plain, _ = model(root[:, None], cache=cache)  # [1, 1, V]: one token
    cache, _ = prefilled()
    others = torch.randint(0, model.config.vocab_size, (1, tree.num_nodes - 1),
                           generator=torch.Generator().manual_seed(seed))
    tree_logits, _ = verify(model, cache, tree, torch.cat([root[:, None], others], dim=1))  # [1, N, V]
    plain, at_root, at_child = plain[0, 0].float(), tree_logits[0, 0].float(), tree_logits[0, 1].float()
    return (plain - at_root).abs().max().item(), plain.abs().max().item(), (at_root - at_child).abs().max().item()


@torch.no_grad()
def test_the_verify_pass_gives_the_root_a_plain_steps_logits_in_float32_and_to_a_few_ulps_in_bfloat16(
        record_property):
    """Greedy Medusa is exact because the root's logits in the tree pass (N nodes) are a plain one-token
    step's. In float32 they agree to ~1e-6 (matmuls of other shapes add in other orders); in bfloat16
    (8 significant bits, eps = 2^-7) to within a few units in the last place of the largest logit, so
    greedy Medusa can part from plain greedy only where the top two logits are that close: a near-tie."""
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        gaps, scales = [], []
        for seed, tree in enumerate([preset("cpu"), preset("gpu"), DEEP_TREE]):
            model = tiny_model(seed, vocab_size=64, block_size=64).to(dtype)
            prompt = [(7 * seed + 3 * i + 1) % 64 for i in range(5 + 4 * seed)]
            gap, scale, other_context = root_logit_gap(model, prompt, tree, seed)
            gaps.append(gap)
            scales.append(scale)
            assert other_context > 0.5  # teeth: another context moves the logits far beyond either bound
        worst[dtype] = (max(gaps), max(scales))
        record_property(f"max_root_logit_difference_{str(dtype).split('.')[-1]}", max(gaps))
    gap32, _ = worst[torch.float32]
    gap16, scale16 = worst[torch.bfloat16]
    print(f"\nroot logits, verify vs plain step: float32 {gap32:.3g}, bfloat16 {gap16:.3g} (|logits| <= {scale16:.3g})")
    assert gap32 <= 1e-5
    bound16 = 4 * torch.finfo(torch.bfloat16).eps * scale16  # >= four ulps at the largest logit
    assert gap16 <= bound16

    # Greedy Medusa in bfloat16, accepting whole paths: plain greedy's tokens, or a near-tie where they part.
    model = tiny_model(7, vocab_size=64, block_size=64).to(torch.bfloat16)
    prompt = [3, 1, 4, 1, 5]
    heads = ContinuationHeads(model, prompt, max_new_tokens=40)
    got, stats = medusa_generate(model, heads, prompt, tree=preset("cpu"), max_new_tokens=40)
    want, _ = generate(model, prompt, max_new_tokens=40)
    assert max(stats.accepted_nodes) >= 2
    if got != want:
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = model(torch.tensor([prompt + want[:i]]))[0][0, -1].float().topk(2).values
        assert top2[0] - top2[1] <= 2 * bound16, f"parted at token {i} without a near-tie"


# ---- typical acceptance respects top-p ---------------------------------------------------------------


def nucleus_case():
    """One node distribution p = (0.5, 0.3, 0.12, 0.05, 0.03) at every node; top_p = 0.75 keeps tokens
    0 and 1. The tree: node 1 = token 2 (outside the nucleus, but p = 0.12 clears the bar of p without
    top-p), node 2 = token 0, node 3 = token 0 below node 1. Read without top-p, node 3 (depth 2) wins."""
    parents = [-1, 0, 0, 1]
    tokens = [4, 2, 0, 0]
    p = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = p.log().expand(len(parents), -1).clone()  # [N, V]
    sampling = Sampling(acceptance="typical", temperature=1.0, top_p=0.75)
    return Tree.from_choices([(0,), (1,), (0, 0)]), parents, tokens, logits, sampling


def test_typical_acceptance_never_accepts_or_emits_a_token_outside_the_nucleus():
    tree, parents, tokens, logits, sampling = nucleus_case()
    nucleus = set(sampling.probs(logits[0]).nonzero().flatten().tolist())
    assert nucleus == {0, 1}
    # Teeth: the same candidates judged by p without top-p (the old rule) go through token 2.
    full = Sampling(acceptance="typical", temperature=1.0, top_p=1.0, epsilon=sampling.epsilon, delta=sampling.delta)
    p_full = full.probs(logits[0])
    assert p_full[2] > typical_threshold(p_full, epsilon=full.epsilon, delta=full.delta)
    assert ref.typical_accept(parents, tokens, logits, sampling=full, generator=None)[0] == [0, 1, 3]
    for seed in range(20):
        path, bonus = ref.typical_accept(parents, tokens, logits, sampling=sampling,
                                         generator=torch.Generator().manual_seed(seed))
        assert path == [0, 2] and bonus in nucleus
        got = typical_accept_paths(tree.tensors("cpu"), torch.tensor([tokens]), logits[None], sampling=sampling,
                                   generator=torch.Generator().manual_seed(seed))
        assert got.nodes[0, : got.count[0] + 1].tolist() == [0, 2] and int(got.bonus[0]) == bonus


class IgnoresTopP(Sampling):
    """The bug this guards against: p read without top-p."""

    def probs(self, logits):
        return sampling_probs(logits, temperature=self.temperature)


@torch.no_grad()
def outside_nucleus(model, prompt, out, sampling) -> int:
    """How many emitted tokens have probability 0 under top-p given everything before them."""
    logits, _ = model(torch.tensor([prompt + out]))
    p = sampling_probs(logits[0, len(prompt) - 1 : -1], temperature=sampling.temperature, top_p=sampling.top_p)
    return int((p[torch.arange(len(out)), torch.tensor(out)] == 0).sum())


@torch.no_grad()
def test_typical_medusa_with_top_p_emits_only_nucleus_tokens_in_the_engine_and_the_reference():
    model = tiny_model(6, vocab_size=8, block_size=48)
    heads = random_heads(model, num_heads=2, seed=6)
    tree = Tree.from_choices([(r,) for r in range(4)] + [(0, 0), (1, 0), (2, 0)])
    sampling = Sampling(acceptance="typical", temperature=1.0, top_p=0.6)
    leaky = IgnoresTopP(acceptance="typical", temperature=1.0, top_p=0.6)
    bad, accepted = 0, 0
    for seed, prompt in enumerate([[1, 2], [3, 4, 5], [7], [0, 6, 2, 1]]):
        for run in (ref.medusa_generate, medusa_generate):
            out, info = run(model, heads, prompt, tree=tree, max_new_tokens=30, sampling=sampling,
                            generator=torch.Generator().manual_seed(seed))
            assert len(out) == 30 and outside_nucleus(model, prompt, out, sampling) == 0
        accepted += sum(info.accepted_nodes)  # the engine's statistics
        out, _ = medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=30, sampling=leaky,
                                 generator=torch.Generator().manual_seed(seed))
        bad += outside_nucleus(model, prompt, out, sampling)
    assert accepted > 10  # candidates were accepted, not only drawn bonus tokens
    assert bad > 0  # teeth: reading p without top-p does emit tokens outside the nucleus


# ---- top-p ties: a batch decides as one row, by token id ---------------------------------------------


def lower_ids_nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    """The spec, in Python: order by probability, ties by token id; keep while the mass before < top_p."""
    kept, before = set(), 0.0
    for t in sorted(range(len(p)), key=lambda t: (-float(p[t]), t)):
        if before >= top_p:
            break
        kept.add(t)
        before += float(p[t])
    return kept


def higher_ids_nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    return {len(p) - 1 - t for t in lower_ids_nucleus(p.flip(0), top_p)}


def test_top_p_with_ties_at_the_cut_keeps_the_lower_token_ids_in_a_batch_as_alone():
    """Ties at the cut: tokens 1, 3, 4 share one probability and top-p keeps two of them; 64 and 2048
    tokens all tied, half kept. Every row of the batch is its own result alone and keeps the lower ids
    (on 64 tied tokens an unstable sort, torch's at least, keeps others). Keeping the higher ids is
    checked to differ on every row: every row has its tie at the cut."""
    short = torch.tensor([[3.0, 1.0, 0.0, 1.0, 1.0, -2.0], [0.0, 1.0, 1.0, 3.0, -1.0, 1.0]])
    p = short.softmax(dim=-1)
    top_p = float(p[0, 0] + 1.5 * p[0, 1])  # between one and two tied tokens' mass after the top one
    cases = [(short, top_p), (torch.zeros(3, 64), 0.5), (torch.zeros(2, 2048), 0.5)]
    for logits, cut in cases:
        batch = sampling_probs(logits, temperature=1.0, top_p=cut)
        for b in range(logits.shape[0]):
            alone = sampling_probs(logits[b : b + 1], temperature=1.0, top_p=cut)[0]
            assert torch.equal(batch[b], alone)
            kept = set(alone.nonzero().flatten().tolist())
            probs = logits[b].softmax(dim=-1)
            assert kept == lower_ids_nucleus(probs, cut)
            assert kept != higher_ids_nucleus(probs, cut)  # teeth: the tie is at the cut
    assert set(sampling_probs(short, temperature=1.0, top_p=top_p)[0].nonzero().flatten().tolist()) == {0, 1, 3}


# ---- an end token stops generation, under every rule ---------------------------------------------


RULES = {
    "greedy": Sampling(),
    "typical": Sampling(acceptance="typical", temperature=0.3),
    "rejection-topk": Sampling(acceptance="rejection", temperature=0.3, draft="topk"),
    "rejection-sampled": Sampling(acceptance="rejection", temperature=0.3, draft="sampled"),
}


@torch.no_grad()
@pytest.mark.parametrize("rule", RULES)
def test_an_end_token_inside_an_accepted_path_stops_generation_after_it_in_the_engine_and_the_reference(rule):
    """Run once without an end token; pick as end token a token first emitted in the middle of a step
    (candidates accepted after it in that step). With it, the same seed emits exactly the run's tokens
    up to and including it: the candidates after it in the step are dropped."""
    model = tiny_model(2)
    tree, sampling = preset("cpu"), RULES[rule]
    for seed, prompt in enumerate([[1, 2, 3], [5, 6], [9, 8, 7, 6], [4, 4]]):
        def heads():
            return ContinuationHeads(model, prompt, max_new_tokens=40, seed=seed)

        steps: list[list[int]] = []
        full, _ = medusa_generate(model, heads(), prompt, tree=tree, max_new_tokens=30, sampling=sampling,
                                  generator=torch.Generator().manual_seed(seed), on_step=steps.append)
        starts = [0]
        for s in steps:
            starts.append(starts[-1] + len(s))
        mid = [starts[i] + j for i, s in enumerate(steps) for j in range(len(s) - 1)
               if full.index(s[j]) == starts[i] + j]  # first emitted here, with tokens after it in its step
        if not mid:
            continue
        eos = full[mid[0]]
        got, stats = medusa_generate(model, heads(), prompt, tree=tree, max_new_tokens=30, sampling=sampling,
                                     generator=torch.Generator().manual_seed(seed), eos_id=eos)
        assert got == full[: mid[0] + 1] and stats.stop_reason == "eos"
        ref_full, _ = ref.medusa_generate(model, heads(), prompt, tree=tree, max_new_tokens=30, sampling=sampling,
                                          generator=torch.Generator().manual_seed(seed))
        assert eos in ref_full
        ref_got, ref_steps = ref.medusa_generate(model, heads(), prompt, tree=tree, max_new_tokens=30,
                                                 sampling=sampling, generator=torch.Generator().manual_seed(seed),
                                                 eos_id=eos)
        assert ref_got == ref_full[: ref_full.index(eos) + 1] and ref_steps == stats.steps
        return
    pytest.fail("no run emitted a token in the middle of a step: the test checked nothing")


@torch.no_grad()
@pytest.mark.parametrize("rule", RULES)
def test_an_end_token_drawn_at_the_prefill_ends_generation_there_in_the_engine_and_the_reference(rule):
    model = tiny_model(3)
    sampling, prompt = RULES[rule], [4, 9, 1]
    first = generate(model, prompt, max_new_tokens=1, sampling=sampling,
                     generator=torch.Generator().manual_seed(5))[0][0]  # the prefill's own token
    heads = random_heads(model, seed=3)
    settings = dict(tree=preset("cpu"), max_new_tokens=20, sampling=sampling)
    full, _ = medusa_generate(model, heads, prompt, generator=torch.Generator().manual_seed(5), **settings)
    assert full[0] == first and len(full) == 20  # teeth: without the end token it goes on
    got, stats = medusa_generate(model, heads, prompt, eos_id=first, generator=torch.Generator().manual_seed(5),
                                 **settings)
    assert got == [first] and stats.steps == 0 and stats.stop_reason == "eos"
    assert ref.medusa_generate(model, heads, prompt, eos_id=first, generator=torch.Generator().manual_seed(5),
                               **settings) == ([first], 0)
    if rule == "greedy":  # in a batch, the row whose prefill ends stops; the other goes on as alone
        other = next(p for p in ([7, 7, 2, 5], [30, 1], [12, 40, 3], [55]) if generate(
            model, p, max_new_tokens=1)[0][0] != first)  # a prompt whose prefill does not end
        rows = medusa_generate_batch(model, heads, [prompt, other], eos_id=first, **settings)
        alone = medusa_generate(model, heads, other, eos_id=first, **settings)[0]
        assert rows[0][0] == [first] and rows[1][0] == alone and len(alone) > 1


# ---- hydra heads in a batch, typical acceptance in a batch ---------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("kind", ["random", "future"])
def test_greedy_hydra_rows_in_a_batch_each_equal_their_own_run_alone_and_plain_greedy(kind):
    model = tiny_model(5)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4], list(range(10, 22))]
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])

    def heads_for(ps):
        return random_hydra(model, seed=5) if kind == "random" else FutureHydraHeads(model, ps, num_heads=3)

    batch_heads = heads_for(prompts)
    on_step = batch_heads.on_step if kind == "future" else None
    rows = medusa_generate_batch(model, batch_heads, prompts, tree=tree, max_new_tokens=25, on_step=on_step)
    deepest = 0
    for (got, stats), prompt in zip(rows, prompts):
        h = heads_for([prompt])
        alone = medusa_generate(model, h, prompt, tree=tree, max_new_tokens=25,
                                on_step=(lambda toks, h=h: h.on_step(0, toks)) if kind == "future" else None)
        assert got == alone[0] == generate(model, prompt, max_new_tokens=25)[0]
        assert stats.accepted_nodes == alone[1].accepted_nodes
        deepest = max(deepest, max(stats.accepted_nodes))
    if kind == "future":
        assert deepest == 3  # the deepest accepted node: heads that know the future fill whole paths
    else:
        assert sum(sum(stats.accepted_nodes) for _, stats in rows) > 0  # random heads: a few candidates


@torch.no_grad()
def test_typical_acceptance_decides_each_row_of_a_batch_as_alone_given_the_same_logits():
    """End to end, a batch and a lone run consume the generator differently (the prefill draws B numbers,
    then every step B more: row b reads numbers b, B + b, ...; alone it reads 0, 1, ...), so their tokens
    are not comparable. The decision is: given identical logits and the same uniform number for its
    bonus (torch.rand(B) is B single draws in order), row b of a batch accepts the same path and draws
    the same bonus as the engine and the reference on that row alone (top-p included)."""
    tree = preset("cpu")
    t = tree.tensors("cpu")
    B, N, Vb = 6, tree.num_nodes, 16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, N, Vb, generator=g) * 2.5
    sampling = Sampling(acceptance="typical", temperature=0.9, top_p=0.9)
    p = sampling.probs(logits)
    # Candidates drawn from p at their parent: likely tokens, so paths are often long.
    tokens = torch.stack([torch.multinomial(p[:, max(par, 0)], 1, generator=g)[:, 0] for par in tree.parents], 1)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(torch.rand(B, generator=g1), torch.cat([torch.rand(1, generator=g2) for _ in range(B)]))
    got = typical_accept_paths(t, tokens, logits, sampling=sampling, generator=torch.Generator().manual_seed(1))
    deep = 0
    for b in range(B):
        def advanced():  # the generator as row b of the batch meets it: b numbers already drawn
            gen = torch.Generator().manual_seed(1)
            torch.rand(b, generator=gen)
            return gen

        alone = typical_accept_paths(t, tokens[b : b + 1], logits[b : b + 1], sampling=sampling, generator=advanced())
        want_path, want_bonus = ref.typical_accept(tree.parents, tokens[b].tolist(), logits[b], sampling=sampling,
                                                   generator=advanced())
        count = int(got.count[b])
        assert got.nodes[b, : count + 1].tolist() == alone.nodes[0, : count + 1].tolist() == want_path
        assert int(got.bonus[b]) == int(alone.bonus[0]) == want_bonus
        deep = max(deep, count)
    assert deep >= 2
