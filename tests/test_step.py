"""One Medusa step (step.py, paper §2): propose -> verify -> accept -> keep the accepted path."""

import math
from collections import Counter

import pytest
import torch
from conftest import random_heads, tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from medusa_mini.acceptance import PathChoice, greedy_accept
from medusa_mini.decoding import prefill
from medusa_mini.model import KVCache
from medusa_mini.sampling import Sampling
from medusa_mini.step import (
    accept,
    keep_path,
    medusa_step,
    propose,
    tree_candidates,
    verify,
)
from medusa_mini.tree import Tree, preset

#   0 root ─┬─ 1 (0,) ─┬─ 3 (0,0) ── 5 (0,0,0)
#           │          └─ 4 (0,1)
#           └─ 2 (1,)
TREE = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
V = 64


def test_propose_fills_each_node_with_its_heads_guess_of_its_rank():
    head_logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))  # [K, V]
    ranked = head_logits.topk(2, dim=-1).indices  # [K, 2]
    tokens, drawn = propose(TREE, 7, head_logits, sampling=Sampling(), generator=None)
    assert drawn is None
    want = [7] + [ranked[len(c) - 1, c[-1]].item() for c in TREE.choices]
    assert tokens.tolist() == want


def test_only_rejection_sampling_with_sampled_drafts_draws_its_candidates():
    head_logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    for sampling, draws in [(Sampling(), False), (Sampling(acceptance="typical", temperature=0.8), False),
                            (Sampling(temperature=0.8, draft="topk"), False), (Sampling(temperature=0.8), True)]:
        tokens, drawn = propose(TREE, 7, head_logits, sampling=sampling, generator=gen)
        assert (drawn is not None) == draws == sampling.draws_candidates
        if draws:  # node i holds the rank(i)-th token drawn from head(i)'s q
            assert tokens.tolist() == tree_candidates(TREE, 7, head_logits, draft=drawn).tolist()


def test_verify_scores_every_node_as_if_its_path_were_the_only_continuation():
    model = tiny_model(3)
    prompt = torch.tensor([5, 9, 2, 11])
    cache = KVCache(model.config, max_len=32)
    prefill(model, prompt, cache)
    tokens = torch.tensor([4, 8, 15, 16, 23, 42])  # [N]
    logits, _ = verify(model, cache, TREE, tokens)  # [N, V]
    for node in range(TREE.num_nodes):
        path = [node]
        while path[-1] != 0:
            path.append(TREE.parents[path[-1]])
        seq = torch.cat([prompt, tokens[path[::-1]]])  # the prompt, then the root-to-node path alone
        want, _ = model(seq[None])
        torch.testing.assert_close(logits[node], want[0, -1], atol=1e-4, rtol=1e-4)


def test_keep_path_leaves_the_cache_as_if_only_the_accepted_path_had_been_fed():
    model = tiny_model(4)
    prompt = torch.tensor([1, 2, 3])
    tokens = torch.tensor([4, 8, 15, 16, 23, 42])
    cache = KVCache(model.config, max_len=32)
    prefill(model, prompt, cache)
    verify(model, cache, TREE, tokens)
    # Accepted: root -> 1 -> 4; a static-shape path repeats its last node up to depth + 1 entries.
    keep_path(cache, PathChoice(nodes=torch.tensor([0, 1, 4, 4]), accepted=torch.tensor(2), bonus=torch.tensor(0)),
              start=3)
    assert cache.length == 6
    ref = KVCache(model.config, max_len=32)
    prefill(model, torch.cat([prompt, tokens[[0, 1, 4]]]), ref)
    for got, want in zip(cache.k + cache.v, ref.k + ref.v):
        torch.testing.assert_close(got[..., :6, :], want[..., :6, :], atol=1e-5, rtol=1e-5)


def test_a_greedy_step_emits_what_plain_greedy_would():
    model, heads = tiny_model(5), random_heads(tiny_model(5), seed=2)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    cache = KVCache(model.config, max_len=64)
    logits, hidden = prefill(model, prompt, cache)
    root = int(logits.argmax())
    step = medusa_step(model, cache, preset("cpu"), root, heads(hidden[None], model.lm_head)[:, 0])
    seq = torch.cat([prompt, torch.tensor([root])])
    for tok in step.emitted():
        out, _ = model(seq[None])
        assert tok == int(out[0, -1].argmax())
        seq = torch.cat([seq, torch.tensor([tok])])
    assert cache.length == prompt.numel() + len(step.path)


@pytest.mark.parametrize("rule", ["typical", "rejection"])
def test_every_rule_at_temperature_zero_is_greedy(rule):
    tokens = torch.tensor([0, 3, 2, 1, 0, 2])
    for seed in range(10):
        logits = torch.randn(TREE.num_nodes, 5, generator=torch.Generator().manual_seed(seed))
        got = accept(TREE, tokens, logits, sampling=Sampling(acceptance=rule, temperature=0.0), generator=None)
        assert got == greedy_accept(TREE, tokens, logits)


@pytest.mark.parametrize("rule", ["greedy", "typical", "rejection"])
def test_a_root_only_tree_emits_just_the_backbones_token(rule):
    """Near the context limit the tree shrinks to its root: every rule must still produce the bonus."""
    root_only = Tree.from_choices([])
    logits = torch.log(torch.tensor([[0.1, 0.1, 0.5, 0.2, 0.1]]))  # [1, V]: argmax 2
    gen = torch.Generator().manual_seed(0)
    temperature = 0.0 if rule == "greedy" else 1.0
    bonuses = Counter()
    for _ in range(1 if rule == "greedy" else 2000):
        path, bonus = accept(root_only, torch.tensor([0]), logits,
                             sampling=Sampling(acceptance=rule, temperature=temperature), generator=gen)
        assert path == [0]
        bonuses[bonus] += 1
    if rule == "greedy":
        assert bonuses == Counter({2: 1})
    else:  # the bonus is a draw from p itself
        p = torch.softmax(logits[0], -1)
        for tok in range(5):
            assert abs(bonuses[tok] / 2000 - p[tok].item()) < 5 * math.sqrt(0.25 / 2000)


@torch.no_grad()
def test_verify_is_captured_whole_by_torch_compile_and_gives_the_eager_logits():
    """The tree's tensors are built once outside the step (`Tree.tensors`), so the captured verify
    has no graph break, and one graph serves every prefix length."""
    model = tiny_model(6)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    compiled = torch.compile(verify, fullgraph=True, backend=backend)
    tokens = torch.tensor([4, 8, 15, 16, 23, 42])
    for prompt in ([1, 2, 3], [5, 9, 2, 11, 7]):
        eager_cache, graph_cache = KVCache(model.config, max_len=32), KVCache(model.config, max_len=32)
        for cache in (eager_cache, graph_cache):
            prefill(model, torch.tensor(prompt), cache)
        want, _ = verify(model, eager_cache, TREE, tokens)
        got, _ = compiled(model, graph_cache, TREE, tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert len(graphs) == 1


class HostReads(TorchFunctionMode):
    """Records every tensor method that brings a value to the host (each a sync on a GPU)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class ScalarReads(TorchDispatchMode):
    """Counts reads of one device scalar below Python, e.g. `x[i]` with a 0-dim tensor i, which the
    indexing code turns into an int first: a sync on a GPU that no Python method call shows."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(acceptance="typical", temperature=0.8)], ids=["greedy", "typical"])
def test_a_greedy_or_typical_step_reads_the_device_once(sampling):
    """Candidates, verify, acceptance and compaction stay on the device; one .tolist() ends the step."""
    model, heads = tiny_model(5), random_heads(tiny_model(5), seed=2)
    cache = KVCache(model.config, max_len=64)
    logits, hidden = prefill(model, torch.tensor([3, 1, 4, 1, 5]), cache)
    head_logits = heads(hidden[None], model.lm_head)[:, 0]
    with HostReads() as reads, ScalarReads() as scalars:
        medusa_step(model, cache, preset("cpu"), logits.argmax(), head_logits, sampling=sampling,
                    generator=torch.Generator().manual_seed(0))
    assert reads.seen == ["tolist"] and scalars.count == 0
