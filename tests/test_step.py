"""The engine's Medusa step (step.py, paper §2) for B rows: propose -> verify -> accept -> keep the path;
and the proposals it verifies (proposal.py): the heads' and prompt lookup's."""

import pytest
import torch

from conftest import RULES, random_heads, tiny_model
from device_rules import CudaRules
from medusa_mini import Accepted, KVCache, PromptLookup, Sampling, Tree, build_tree, chain, preset
from medusa_mini.decoding import prefill
from medusa_mini.proposal import chain_length, lookup
from medusa_mini.step import keep_path, medusa_step, place_tree, plain_step, usable_nodes, verify

#   0 root ─┬─ 1 (0,) ─┬─ 3 (0,0) ── 5 (0,0,0)
#           │          └─ 4 (0,1)
#           └─ 2 (1,)
TREE = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])


def test_usable_nodes_are_those_whose_tokens_fit_before_each_rows_stop():
    """A node at depth d emits d + 1 tokens after the root; a row whose cache holds `start` tokens stops
    at `stop_at`, so it may use depths up to stop_at - 2 - start. A finished row (stop_at 0) uses none."""
    usable = usable_nodes(TREE.tensors(), torch.tensor([10, 12, 9, 11, 3]), torch.tensor([20, 15, 11, 11, 0]))
    assert usable.tolist() == [[d <= most for d in TREE.depths] for most in (8, 1, 0, -2, -5)]  # stop_at - 2 - start


def test_verify_scores_every_node_as_if_its_path_were_the_only_continuation_in_every_row():
    model, prompts = tiny_model(3), [[5, 9, 2, 11], [1, 2]]  # rows of different lengths
    cache = KVCache(model.config, batch_size=2, max_len=32)
    prefill(model, torch.tensor([prompts[0], prompts[1] + [0, 0]]), cache, lengths=[4, 2])
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42], [3, 1, 4, 1, 5, 9]])  # [B, N]
    with torch.no_grad():
        logits, _ = verify(model, cache, tokens, tree=TREE.tensors())  # [B, N, V]
        for b, prompt in enumerate(prompts):
            for node in range(TREE.num_nodes):
                seq = torch.tensor(prompt + tokens[b, TREE.path(node)].tolist())  # the prompt, then the path alone
                torch.testing.assert_close(logits[b, node], model(seq[None])[0][0, -1], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_keep_path_leaves_each_rows_cache_as_if_only_its_accepted_path_had_been_fed():
    """Row 0 accepted root -> 1 -> 4, row 1 root -> 2, row 2 is inactive (finished): it keeps its length."""
    model, prompts = tiny_model(4), [[1, 2, 3], [7, 8], [6, 6, 6]]
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42], [5, 6, 7, 8, 9, 10], [1, 1, 1, 1, 1, 1]])
    cache = KVCache(model.config, batch_size=3, max_len=32)
    prefill(model, torch.tensor([prompts[0], prompts[1] + [0], prompts[2]]), cache, lengths=[3, 2, 3])
    placed = place_tree(cache, TREE.tensors())  # [B, N, 2D + 5]
    verify(model, cache, tokens, tree=TREE.tensors(), placed=placed)
    assert cache.lengths.tolist() == [3, 2, 3]  # the nodes are written past each row's length, tentatively
    assert placed[:, :, 0].tolist() == [list(range(L, L + TREE.num_nodes)) for L in (3, 2, 3)]  # each node's slot
    keep_path(cache, Accepted(torch.tensor([4, 2, 0]), torch.tensor([0, 0, 0])), placed=placed,
              active=torch.tensor([True, True, False]))
    assert cache.lengths.tolist() == [6, 4, 3]
    for b, kept in enumerate(([0, 1, 4], [0, 2])):
        seq = prompts[b] + tokens[b, kept].tolist()
        prefill(model, torch.tensor([seq]), alone := KVCache(model.config, max_len=len(seq)))  # exactly full
        torch.testing.assert_close(cache.kv[:, :, b, :, : len(seq)], alone.kv[:, :, 0], atol=1e-5, rtol=1e-5)


# ---- prompt lookup -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ([3, 9, 2, 3, 7, 2, 3], [7, 2, 3]),  # no earlier [7, 2, 3]: the 2-gram [2, 3], not the 1-gram [3]
    ([5, 6, 7, 6, 9, 1, 6], [7, 6, 9, 1]),  # only the 1-gram [6]: its first occurrence, then 4 tokens
    ([4, 5, 6, 7], []),  # nothing repeats: no continuation
    ([3, 3, 3], [3]),  # the 2-gram [3, 3]: a continuation may run into the tail itself, and stops at the text's end
    ([3], []),  # a single token: no earlier occurrence possible
    ([1, 2, 3, 8, 0, 1, 2, 3, 9, 0, 1, 2, 3], [8, 0, 1, 2])])  # [0, 1, 2, 3] repeats too, but max_ngram is 3
def test_lookup_continues_the_first_earlier_occurrence_of_the_longest_repeated_tail(text, want):
    assert lookup(text, max_ngram=3, length=4) == want


def test_prompt_lookup_drafts_each_rows_continuation_on_a_chain_of_the_next_power_of_two_capped_at_the_full_one():
    """Nodes past a row's continuation repeat its last token (a guess like any other); none anywhere: the root alone."""
    assert [chain_length(n, 6) for n in range(8)] == [0, 1, 2, 4, 4, 6, 6, 6]
    proposer = PromptLookup(max_ngram=1).proposer(None, preset("cpu"))  # a chain of the tree's 11 nodes
    assert proposer.tree == chain(11)
    assert all(pytest.raises(ValueError, PromptLookup, max_ngram=n).match("max_ngram") for n in (0, 2.0, "2"))  # >= 1
    assert PromptLookup().proposer(None, build_tree(torch.full((4, 10), 0.9), 300)[0]).tree == chain(256)  # at most
    assert [len(PromptLookup().proposer(None, chain(n)).trees()) for n in (0, 6)] == [2, 5]  # depths 0-1; 0-2, 4, 6
    history = [[1, 2, 3, 1, 2], [4, 5, 6, 5], [7, 8, 9]]  # continuations of 3, 2 and 0 tokens
    proposal = proposer.propose(torch.tensor([2, 5, 9]), torch.zeros(3, 32), history=history, sampling=Sampling())
    assert proposal.tree == chain(4) and proposal.tokens.tolist() == [[2, 3, 1, 2, 2], [5, 6, 5, 5, 5], [9, 9, 9, 9, 9]]


@pytest.mark.parametrize("kind", ["medusa", "hydra", "prompt lookup"])
def test_every_proposal_holds_one_of_the_few_trees_its_proposer_names(kind):
    """What a compiled loop records in its warm-up (`Proposer.trees`): the heads' whole tree alone (a step
    masks what a row cannot use, it never cuts the tree); prompt lookup's chains for any continuation
    length: its 64-node chain takes 8 of them, not 65."""
    lookup = kind == "prompt lookup"
    model, tree = tiny_model(3), chain(64) if lookup else TREE
    proposer = (PromptLookup() if lookup else random_heads(model, num_heads=3, kind=kind)).proposer(model, tree)
    trees, seen = proposer.trees(), set()
    assert len(trees) == (8 if lookup else 1) == len(set(trees)) and tree in trees
    for repeat in [1, 2, *range(0, 70, 3)]:  # the text repeats its last `repeat` tokens: lookup finds that many
        text = list(range(1, 70 - repeat)) + list(range(70 - 2 * repeat, 70 - repeat)) if repeat else [1, 2, 3]
        root = torch.tensor([text[-1] % model.config.vocab_size])
        proposal = proposer.propose(root, torch.zeros(1, 32), history=[text], sampling=Sampling(), u=None)
        assert proposal.tree in trees and proposal.tokens.shape == (1, proposal.tree.num_nodes)
        seen.add(proposal.tree)
    assert seen == set(trees)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_step_sends_the_device_nothing(kind, rule):
    """No tensor is built from host data (torch.tensor(list), a list index: on a GPU a copy from pageable
    memory). The reads of device values (one, at a step's end) are counted on `meta`: test_meta_device.py."""
    model, heads, batch = tiny_model(5), random_heads(tiny_model(5), seed=2, kind=kind), 3
    cache = KVCache(model.config, batch_size=batch, max_len=64)
    logits, hidden = prefill(model, torch.tensor([[3, 1, 4, 1, 5]] * batch), cache)
    proposer, gen = heads.proposer(model, preset("cpu")), torch.Generator().manual_seed(0)
    kw = dict(history=[[3, 1, 4, 1, 5]] * batch, stop_at=torch.full((batch,), 64), sampling=RULES[rule], generator=gen)
    step = medusa_step(model, cache, proposer, logits.argmax(-1), hidden, **kw)
    with CudaRules(torch.device("cpu")) as rules:  # a second step: the tree's tensors exist
        medusa_step(model, cache, proposer, step.next_roots, step.next_hidden, **kw)
    assert rules.uploads == 0


@torch.no_grad()
def test_a_sampled_plain_step_refuses_missing_uniforms_before_writing_the_cache():
    """The plain step chooses its token in the call, from uniforms drawn before it, as a graph holds no
    generator; missing or of the wrong shape, they are refused before the forward writes the cache."""
    model, sampling = tiny_model(5), Sampling(temperature=0.8)
    cache, tokens = KVCache(model.config, batch_size=2, max_len=64), torch.tensor([[3], [4]])
    for u in (None, torch.tensor([0.5])):
        pytest.raises(ValueError, plain_step, model, cache, tokens, sampling=sampling, u=u).match("sampling.uniforms")
    assert cache.lengths.tolist() == [0, 0]
    chosen, logits, _ = plain_step(model, cache, tokens, sampling=sampling, u=torch.tensor([0.0, 0.9999]))
    p = sampling.probs(logits[:, -1])  # [2, V]: u near 0 draws p's first token of mass, near 1 its last
    nonzero = [torch.nonzero(row)[:, 0] for row in p]
    assert chosen.tolist() == [int(nonzero[0][0]), int(nonzero[1][-1])] and cache.lengths.tolist() == [1, 1]
