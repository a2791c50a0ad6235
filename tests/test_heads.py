"""Draft heads (heads.py, paper §2.1.1): Medusa's read h_t alone, dependent (hydra) ones also the tokens
before their target; both guess among a draft vocabulary. That greedy decoding with either kind is plain
greedy is in tests/test_decoding.py; here, what each kind computes and how it fills a tree."""

import pytest
import torch

from benchmarks.bench_step import count_ops
from conftest import random_heads, tiny_model
from medusa_mini import Tree, chain, medusa_generate, preset, reference
from medusa_mini.heads import IGNORE, HeadsConfig, frequency_order, make_heads, next_tokens
from medusa_mini.sampling import Sampling, gumbel_top_k, q_log_probs
from medusa_mini.training import MedusaLM, self_distill

KINDS, C, V = ["medusa", "hydra"], 32, 64
TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)])


def randint(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(V, shape, generator=torch.Generator().manual_seed(seed))


def shuffled(seed: int = 0) -> torch.Tensor:
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))


def propose(heads, model, tree, root, hidden, sampling=Sampling(), generator=None):
    proposer = heads.proposer(model, tree)
    return proposer.propose(torch.tensor([root]), hidden[None], history=[[root]], sampling=sampling,
                            u=proposer.uniforms(sampling, 1, generator, device="cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_head_k_is_the_lm_head_over_h_plus_silu_of_its_linear_layer_reading_no_token_after_its_kth(kind):
    """Head k: lm_head(h + SiLU(W_k h + b_k)); a dependent (hydra) head's W_k reads [h; e(x_{t+1}); ...; e(x_{t+k})].
    Fresh heads start as the backbone's next-token prediction: W = 0, so h + SiLU(0) = h."""
    model, h, following = tiny_model(4), torch.randn(C), torch.tensor([5, 9, 13, 17])
    fresh = make_heads(HeadsConfig(num_heads=4, n_embd=C, vocab_size=V, kind=kind))
    torch.testing.assert_close(fresh(h, model, following=following), model.lm_head(h).expand(4, V), atol=1e-6, rtol=0)
    heads = random_heads(model, kind=kind, seed=4)
    got = heads(h, model, following=following)  # [K, V]
    for k, block in enumerate(heads.blocks, start=1):
        read = h if kind == "medusa" else torch.cat([h, *model.transformer.wte(following[:k])])
        want = model.lm_head(h + torch.nn.functional.silu(block.linear.weight @ read + block.linear.bias))
        torch.testing.assert_close(got[k - 1], want)


@pytest.mark.parametrize("kind, num", [(kind, num) for kind in KINDS for num in (0, 1, 2)])
def test_the_first_num_heads_alone_give_those_heads_logits_for_any_leading_dims(kind, num):
    """A tree of depth D asks heads 1..D only (none for the root alone): each other head costs a projection."""
    model = tiny_model(2)
    heads, h, following = random_heads(model, num_heads=3, kind=kind), torch.randn(2, 5, C), randint(2, 5, 3)
    full = heads(h, model, following=following)
    torch.testing.assert_close(heads(h, model, following=following, num=num), full[:num])
    torch.testing.assert_close(heads(h[1, 4], model, following=following[1, 4]), full[:, 1, 4])


@pytest.mark.parametrize("kind", KINDS)
def test_over_a_draft_vocabulary_the_heads_give_the_full_logits_of_its_tokens(kind):
    heads, h, following = random_heads(model := tiny_model(3), kind=kind), torch.randn(3, C), randint(3, 4)
    full, other = heads(h, model, following=following), make_heads(heads.config)  # [K, 3, V]; heads of one config
    heads.use_draft_vocabulary(shuffled(), 10)
    assert other.config.draft_vocab_size == 0 and other.draft_ids.numel() == V  # the other's whole vocabulary kept
    torch.testing.assert_close(heads(h, model, following=following), full[..., heads.draft_ids])
    heads.use_draft_vocabulary(shuffled(), V)  # the whole vocabulary again
    assert heads.config.draft_vocab_size == 0 and heads.draft_ids.tolist() == list(range(V))
    torch.testing.assert_close(heads(h, model, following=following), full)


def test_the_draft_vocabulary_is_the_most_frequent_tokens_and_targets_outside_it_are_ignored():
    ties_by_id = [5, 3, 7, 1, 0, 2, 4, 6, *range(8, 100)]  # a sort that is not stable reorders ties among 100 tokens
    assert frequency_order(torch.tensor([[3, 5, 5, 1], [5, 3, 7, 7]]), 100).tolist() == ties_by_id
    heads, targets = random_heads(tiny_model()), torch.tensor([[63, 60, 5, IGNORE], [61, 0, 62, 63]])
    heads.use_draft_vocabulary(torch.arange(V).flip(0).roll(1), 4)  # draft ids 0, 61, 62, 63
    assert heads.draft_index(targets).tolist() == [[3, IGNORE, IGNORE, IGNORE], [1, 0, 2, 3]]


def test_heads_refuse_what_they_cannot_do_and_a_refused_draft_vocabulary_changes_nothing(model):
    pytest.raises(ValueError, random_heads(model, kind="hydra"), torch.randn(1, C), model).match("following=")
    assert make_heads(HeadsConfig(num_heads=1, n_embd=1, vocab_size=1)).num_heads == 1  # the least of each size
    assert make_heads(HeadsConfig(vocab_size=V, draft_vocab_size=3)).draft_ids.tolist() == [0, 1, 2]  # before an order
    heads = random_heads(model, num_heads=2)
    pytest.raises(ValueError, heads.proposer, model, chain(4)).match("depth 4 but the model has 2 heads")
    with pytest.raises(ValueError, match=f"width {C}, {V} tokens, torch.float32 on cpu cannot draft for a backbone of "
                                         f"width {C}, {V + 1} tokens, torch.float32"):  # not a matmul's shape error
        heads.proposer(tiny_model(vocab_size=V + 1), chain(2))
    pytest.raises(ValueError, random_heads(model).double().proposer, model, chain(2)).match("float64 on cpu cannot")
    pytest.raises(ValueError, random_heads(model).to("meta").proposer, model, chain(2)).match("on meta cannot draft")
    with pytest.raises(ValueError, match="depth 4 but the model has 2 heads"):  # the reference's loop too
        reference.medusa_generate(model, heads, [1, 2], tree=chain(4), max_new_tokens=4)
    pytest.raises(ValueError, heads.use_draft_vocabulary, torch.zeros(V).long(), 8).match("every token id once")
    heads.use_draft_vocabulary(shuffled(), 2)
    pytest.raises(ValueError, heads.proposer, model, Tree.from_choices([(0,), (1,), (2,)])).match("rank 2; the draft")
    pytest.raises(ValueError, heads.use_draft_vocabulary, shuffled(1), V + 1).match("draft_vocab_size")
    assert heads.config.draft_vocab_size == 2 and heads.draft_ids.tolist() == sorted(shuffled()[:2].tolist())
    assert heads.vocab_order.equal(shuffled())  # the order a checkpoint saves, untouched by the refusal


@pytest.mark.parametrize("drawn", [False, True], ids=["top-k", "drawn"])
@pytest.mark.parametrize("tree", [TREE, preset("cpu"), chain(3)], ids=["small", "cpu", "chain"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_node_holds_its_rank_of_its_parents_q_top_k_or_drawn_from_the_draft_vocabulary(kind, tree, drawn):
    """Node i holds rank ranks[i] of q(. | its parent's path), a token of the draft vocabulary (hydra's q
    reads the path drafted above the node, Medusa's the depth alone): of its top-k, filled depth by depth; or
    of distinct draws from it with its own uniforms, each node keeping the q its children were drawn from."""
    heads, hidden, T = random_heads(model := tiny_model(2), kind=kind, seed=2, draft=16), torch.randn(C), 0.8
    sampling, gen = (Sampling(temperature=T), torch.Generator().manual_seed(0)) if drawn else (Sampling(), None)
    proposal = propose(heads, model, tree, 7, hidden, sampling, gen)
    u = heads.proposer(model, tree).uniforms(sampling, 1, gen.manual_seed(0), device="cpu") if drawn else None  # its u
    tokens, per_node = proposal.tokens[0].tolist(), proposal.drawn.per_node(0) if drawn else [None] * tree.num_nodes
    assert tokens[0] == 7 and set(tokens[1:]) <= set(heads.draft_ids.tolist())
    for node, (kids, draws) in enumerate(zip(tree.children, per_node)):
        assert not drawn or (draws is None) == (not kids)
        if not kids:
            continue
        path = [tokens[j] for j in tree.path(node)]  # q(. | path) [M]: head len(path) reads it, never the 0s after
        q = heads(hidden, model, following=torch.tensor(path + [0] * (heads.num_heads - len(path))))[len(path) - 1]
        if drawn:
            torch.testing.assert_close(draws[0], q_log_probs(q, heads.draft_ids, temperature=T, vocab_size=V))
            assert draws[1] == gumbel_top_k(draws[0], len(draws[1]), u[0, proposal.drawn.q_index[node]]).tolist()
        ranked = draws[1] if drawn else heads.draft_ids[q.topk(tree.max_rank + 1).indices].tolist()
        assert [tokens[c] for c in kids] == [ranked[tree.ranks[c]] for c in kids]


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_argmaxes_along_the_chain_the_heads_drafted_are_that_chain(kind):
    """Training feeds the true next tokens (`next_tokens`), decoding the drafted ones. Along a chain the
    heads drafted themselves the two paths are one, so the teacher-forced argmaxes are that chain."""
    heads, prompt = random_heads(model := tiny_model(5), kind=kind, seed=5, draft=16), [3, 1, 4, 1, 5]
    logits, hidden = model(torch.tensor([prompt]))  # hidden [1, 5, C]
    root = int(logits[0, -1].argmax())
    drafted = propose(heads, model, chain(4), root, hidden[0, -1]).tokens[0].tolist()  # root, then 4 guesses
    y = torch.tensor([prompt[1:] + drafted])  # y[:, t] = token t + 1
    teacher = heads(hidden, model, following=next_tokens(y, 4)[:, :5])  # [K, 1, 5, M]
    assert heads.draft_ids[teacher[:, 0, -1].argmax(-1)].tolist() == drafted[1:]


def test_dependent_heads_learn_more_and_accept_more_than_medusa_heads_trained_the_same_way():
    """Medusa-1 on the frozen backbone's own greedy text (self-distillation); the backbone stays untouched."""
    model = tiny_model(6).requires_grad_(False)
    backbone, prompts = {k: v.clone() for k, v in model.state_dict().items()}, randint(24, 4)
    seqs, losses, tokens_per_step = self_distill(model, prompts, max_new_tokens=40, temperature=0.0), {}, {}  # [24, 44]
    for kind in KINDS:
        torch.manual_seed(0)
        heads = make_heads(HeadsConfig(num_heads=3, n_embd=C, vocab_size=V, kind=kind))
        lm, opt = MedusaLM(model, heads), torch.optim.Adam(heads.parameters(), lr=5e-2)
        for _ in range(40):
            loss, _ = lm(seqs[:, :-1], seqs[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.setdefault(kind, []).append(loss.item())
        runs = [medusa_generate(model, heads.eval(), p, tree=chain(3), max_new_tokens=30) for p in prompts[:8].tolist()]
        tokens_per_step[kind] = sum(sum(s.step_tokens) for _, s in runs) / sum(s.steps for _, s in runs)
    assert losses["hydra"][-1] < 0.5 * losses["hydra"][0] and losses["hydra"][-1] < losses["medusa"][-1]
    assert all(torch.equal(backbone[k], v) for k, v in model.state_dict().items())  # nothing wrote to it in place
    assert tokens_per_step["hydra"] > tokens_per_step["medusa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_a_heads_call_in_decoding_copies_no_weight(kind, dtype):
    """Weights are made once per generation (the blocks stacked, the draft vocabulary's rows gathered), never
    copied at a call (a copy at every call once cost a bfloat16 CPU 10 ms of 13)."""
    model = tiny_model(3).to(dtype)
    logits_of = random_heads(model, kind=kind, seed=3, draft=16).to(dtype).proposer(model, TREE).logits_of
    hidden, path = torch.randn(2, C, dtype=dtype), randint(2, 1, 2)
    with torch.no_grad():
        ops = count_ops(lambda: logits_of(hidden, 3) if kind == "medusa" else logits_of(2, hidden[:, None], path))
    assert ops and not {"aten::copy_", "aten::clone", "aten::index", "aten::_to_copy"} & set(ops), ops
    if kind == "medusa":  # the blocks' matmul, SiLU, the residual add, the projection
        assert sorted(ops) == ["aten::add", "aten::addmm", "aten::mm", "aten::silu"]
