"""The engine's Medusa step (step.py, paper §2) for B rows: propose -> verify -> accept -> keep the path."""

import pytest
import torch
from conftest import ContinuationHeads, random_heads, tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from medusa_mini import reference as ref
from medusa_mini.acceptance import Accepted
from medusa_mini.decoding import prefill
from medusa_mini.model import KVCache
from medusa_mini.proposal import MedusaProposer
from medusa_mini.sampling import Sampling
from medusa_mini.step import keep_path, medusa_step, usable_nodes, verify
from medusa_mini.tree import Tree, preset

#   0 root ─┬─ 1 (0,) ─┬─ 3 (0,0) ── 5 (0,0,0)
#           │          └─ 4 (0,1)
#           └─ 2 (1,)
TREE = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
V = 64


def test_the_medusa_proposer_fills_each_row_as_the_reference_does_and_only_sampled_drafts_draw():
    """Every rule's candidates are the reference's; only rejection sampling with sampled drafts draws
    them (one row then: a batch reads the generator in another order than one row at a time)."""
    model, heads = tiny_model(1), random_heads(tiny_model(1), num_heads=3)
    proposer, roots = MedusaProposer(model, heads, TREE), [7, 9]
    for sampling in [Sampling(), Sampling(acceptance="typical", temperature=0.8), Sampling(temperature=0.8, draft="topk"),
                     Sampling(temperature=0.8)]:
        rows = 1 if sampling.draws_candidates else 2
        hidden = torch.randn(rows, 32, generator=torch.Generator().manual_seed(1))  # [B, C]
        got = proposer.propose(torch.tensor(roots[:rows]), hidden, max_depth=3, sampling=sampling,
                               generator=torch.Generator().manual_seed(0))
        for b in range(rows):
            want, drafts = ref.propose(heads(hidden[b : b + 1], model.lm_head)[:, 0], TREE, roots[b],
                                       sampling=sampling, generator=torch.Generator().manual_seed(0))
            assert got.tokens[b].tolist() == want
        assert (got.draft is not None) == (drafts is not None) == sampling.draws_candidates


def test_near_the_end_the_proposal_holds_the_shallow_part_of_the_tree_and_asks_only_its_heads():
    model, heads = tiny_model(0), random_heads(tiny_model(0), num_heads=3)
    asked = []

    def counting(hidden, lm_head, *, num=None):
        asked.append(num)
        return heads(hidden, lm_head, num=num)

    counting.config = heads.config
    proposer = MedusaProposer(model, counting, TREE)
    hidden = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
    for depth, want in ((3, TREE), (5, TREE), (1, TREE.truncated(1))):
        proposal = proposer.propose(torch.tensor([7]), hidden, max_depth=depth, sampling=Sampling(), generator=None)
        assert proposal.tree == want and proposal.tokens.shape == (1, want.num_nodes)
    root_only = proposer.propose(torch.tensor([7]), hidden, max_depth=0, sampling=Sampling(), generator=None)
    assert root_only.tokens.tolist() == [[7]] and root_only.tree.num_nodes == 1
    assert asked == [3, 3, 1]  # the root alone needs no head


def test_usable_nodes_are_those_whose_tokens_fit_before_each_rows_stop():
    """A node at depth d emits d + 1 tokens after the root; a row whose cache holds `start` tokens stops
    at `stop_at`, so it may use depths up to stop_at - 2 - start. A finished row uses none."""
    usable = usable_nodes(TREE, torch.tensor([10, 10, 10, 10]), torch.tensor([20, 13, 12, 11]))
    depths = TREE.depth_list  # [0, 1, 1, 2, 2, 3]
    assert usable.tolist() == [[True] * 6, [d <= 1 for d in depths], [d == 0 for d in depths], [False] * 6]


def test_verify_scores_every_node_as_if_its_path_were_the_only_continuation_in_every_row():
    model = tiny_model(3)
    prompts = [[5, 9, 2, 11], [1, 2]]  # rows of different lengths
    cache = KVCache(model.config, batch_size=2, max_len=32)
    prefill(model, torch.tensor([prompts[0], prompts[1] + [0, 0]]), cache, lengths=[4, 2])
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42], [3, 1, 4, 1, 5, 9]])  # [B, N]
    logits, _ = verify(model, cache, TREE, tokens)  # [B, N, V]
    for b, prompt in enumerate(prompts):
        for node in range(TREE.num_nodes):
            path, j = [], node
            while j != -1:
                path.append(j)
                j = TREE.parents[j]
            seq = torch.tensor(prompt + tokens[b, path[::-1]].tolist())  # the prompt, then the path alone
            want, _ = model(seq[None])
            torch.testing.assert_close(logits[b, node], want[0, -1], atol=1e-4, rtol=1e-4)


def test_keep_path_leaves_each_rows_cache_as_if_only_its_accepted_path_had_been_fed():
    model = tiny_model(4)
    prompts, tokens = [[1, 2, 3], [7, 8]], torch.tensor([[4, 8, 15, 16, 23, 42], [5, 6, 7, 8, 9, 10]])
    cache = KVCache(model.config, batch_size=2, max_len=32)
    prefill(model, torch.tensor([prompts[0], prompts[1] + [0]]), cache, lengths=[3, 2])
    start = cache.lengths
    verify(model, cache, TREE, tokens)
    # Row 0 accepted root -> 1 -> 4, row 1 root -> 2; a static-shape path repeats its last node.
    keep_path(cache, Accepted(nodes=torch.tensor([[0, 1, 4, 4], [0, 2, 2, 2]]), count=torch.tensor([2, 1]),
                              bonus=torch.tensor([0, 0])), start=start)
    assert cache.lengths.tolist() == [6, 4]
    for b, kept in enumerate(([0, 1, 4], [0, 2])):
        alone = KVCache(model.config, max_len=32)
        seq = prompts[b] + tokens[b, kept].tolist()
        prefill(model, torch.tensor([seq]), alone)
        for got, want in zip(cache.k + cache.v, alone.k + alone.v):
            torch.testing.assert_close(got[b, :, : len(seq)], want[0, :, : len(seq)], atol=1e-5, rtol=1e-5)


def one_step(model, heads, prompt, tree, sampling=Sampling(), generator=None):
    cache = KVCache(model.config, max_len=64 + tree.num_nodes)
    logits, hidden = prefill(model, torch.tensor([prompt]), cache)
    root = logits.argmax(-1) if sampling.greedy else sampling.next_token(logits, generator)
    step = medusa_step(model, cache, MedusaProposer(model, heads, tree), root, hidden, sampling=sampling,
                       generator=generator)
    return cache, int(root), step


def test_a_greedy_step_emits_what_plain_greedy_would_and_accepts_the_heads_right_guesses():
    model, prompt = tiny_model(5), [3, 1, 4, 1, 5]
    heads = ContinuationHeads(model, prompt, max_new_tokens=10)
    cache, root, step = one_step(model, heads, prompt, preset("cpu"))
    seq = prompt + [root]
    for tok in step.new_tokens[0]:
        out, _ = model(torch.tensor([seq]))
        assert tok == int(out[0, -1].argmax())
        seq.append(tok)
    assert len(step.paths[0]) - 1 == preset("cpu").depth  # heads that know the continuation: all accepted
    assert cache.lengths.tolist() == [len(prompt) + len(step.paths[0])]


@pytest.mark.parametrize("rule", ["typical", "rejection"])
def test_every_rule_at_temperature_zero_is_greedy(rule):
    model, heads = tiny_model(6), random_heads(tiny_model(6), seed=1)
    for seed in range(5):
        prompt = torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = one_step(model, heads, prompt, TREE)[2].new_tokens
        got = one_step(model, heads, prompt, TREE, Sampling(acceptance=rule, temperature=0.0))[2].new_tokens
        assert got == want


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


class HiddenTransfers(TorchDispatchMode):
    """Counts what no Python method call shows: reads of one device scalar below Python (`x[i]` with a
    0-dim tensor i turns i into an int first) and tensors built from host data (torch.tensor(list),
    a list index): on a GPU the first waits for the device, the second is a copy from pageable memory."""

    def __init__(self) -> None:
        super().__init__()
        self.scalar_reads = self.host_tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.scalar_reads += func is torch.ops.aten._local_scalar_dense.default
        self.host_tensors += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(acceptance="typical", temperature=0.8)], ids=["greedy", "typical"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_greedy_or_typical_step_reads_the_device_once_and_sends_it_nothing(sampling, batch):
    """Candidates, verify, acceptance and compaction stay on the device; one .tolist() ends the step."""
    model, heads = tiny_model(5), random_heads(tiny_model(5), seed=2)
    cache = KVCache(model.config, batch_size=batch, max_len=64)
    logits, hidden = prefill(model, torch.tensor([[3, 1, 4, 1, 5]] * batch), cache)
    proposer, gen = MedusaProposer(model, heads, preset("cpu")), torch.Generator().manual_seed(0)
    step = medusa_step(model, cache, proposer, logits.argmax(-1), hidden, sampling=sampling, generator=gen)
    stop_at = torch.full((batch,), 64)
    with HostReads() as reads, HiddenTransfers() as hidden_transfers:  # a second step: the tree's tensors exist
        medusa_step(model, cache, proposer, step.next_roots, step.next_hidden, sampling=sampling, generator=gen,
                    stop_at=stop_at, max_depth=4)
    assert reads.seen == ["tolist"]
    assert hidden_transfers.scalar_reads == 0 and hidden_transfers.host_tensors == 0
