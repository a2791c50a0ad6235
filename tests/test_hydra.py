"""Dependent draft heads (hydra.py): head k reads h_t and the k tokens before its target; the tree is
filled node by node from each node's own q; verification and acceptance stay Medusa's, so greedy is
still plain greedy and rejection sampling still lossless (tests/test_decoding.py)."""

import itertools

import pytest
import torch
from conftest import tiny_model

from medusa_mini.decoding import generate, medusa_generate, prefill
from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.hydra import HydraHeads, HydraProposer, make_heads, teacher_forced_logits
from medusa_mini.model import KVCache
from medusa_mini.proposal import draft_log_probs
from medusa_mini.sampling import Sampling
from medusa_mini.training import MedusaLM, sample_continuations
from medusa_mini.tree import Tree, chain, preset

TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)])


def random_hydra(model, *, num_heads: int = 3, seed: int = 0, std: float = 0.5) -> HydraHeads:
    torch.manual_seed(seed)
    cfg = model.config
    heads = make_heads(HeadsConfig(num_heads=num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, kind="hydra"))
    with torch.no_grad():  # zero-initialised heads all agree with the backbone; make them differ
        for block in heads.blocks:
            torch.nn.init.normal_(block.linear.weight, std=std)
    return heads.eval()


class Context:
    """What filling a tree reads: the heads, the hidden state after a prompt [C], the shared modules."""

    def __init__(self, model, heads, prompt) -> None:
        cache = KVCache(model.config, max_len=model.config.block_size)
        _, hidden = prefill(model, torch.tensor([prompt]), cache)
        self.model, self.heads, self.hidden = model, heads, hidden[0]
        self.lm_head, self.wte = model.lm_head, model.transformer.wte

    def fill(self, tree, root, sampling=Sampling(), generator=None):
        """The proposer's tokens [N] and draft for one row."""
        proposal = HydraProposer(self.model, self.heads, tree).propose(
            torch.tensor([root]), self.hidden[None], max_depth=tree.depth, sampling=sampling, generator=generator)
        return proposal.tokens[0], proposal.draft


def test_fresh_hydra_heads_start_as_the_backbones_next_token_prediction():
    model = tiny_model(0)
    heads = make_heads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=64, kind="hydra"))
    h = torch.randn(5, 32)
    out = heads(h, model.lm_head, tokens=torch.randint(64, (5, 3)), wte=model.transformer.wte)  # [K, 5, V]
    assert torch.allclose(out, model.lm_head(h)[None].expand(3, -1, -1), atol=1e-6)


def test_head_k_reads_exactly_the_k_tokens_before_its_target():
    model = tiny_model(1)
    heads = random_hydra(model, num_heads=4)
    h = torch.randn(32)
    tokens = torch.tensor([5, 9, 13, 17])
    for k in range(1, 5):
        base = heads.head_logits(k, h, tokens, lm_head=model.lm_head, wte=model.transformer.wte)
        for j in range(4):
            changed = tokens.clone()
            changed[j] = (changed[j] + 1) % 64
            out = heads.head_logits(k, h, changed, lm_head=model.lm_head, wte=model.transformer.wte)
            assert torch.equal(out, base) == (j >= k), (k, j)  # x_{t+1..t+k} matter, later ones do not


def q_below(ctx, tree, tokens, node):
    """The logits of q(. | the path from the root to `node`), the head of depth len(path) reading the path."""
    path = []
    while node != -1:
        path.insert(0, int(tokens[node]))
        node = tree.parents[node]
    return ctx.heads.head_logits(len(path), ctx.hidden, torch.tensor(path), lm_head=ctx.lm_head, wte=ctx.wte)


def node_walk(tree, root, ctx, width):
    """The definition, one node at a time: a node's children are the top-k of q(. | its path)."""
    tokens = [root]
    for i in range(1, tree.num_nodes):
        tokens.append(q_below(ctx, tree, tokens, tree.parents[i]).topk(width).indices[tree.choices[i - 1][-1]].item())
    return tokens


@pytest.mark.parametrize("tree", [TREE, preset("cpu"), chain(3)], ids=["small", "cpu", "chain"])
def test_depth_by_depth_filling_equals_the_node_by_node_definition(tree):
    model = tiny_model(2)
    heads = random_hydra(model, num_heads=4)
    ctx = Context(model, heads, [3, 1, 4])
    tokens, drawn = ctx.fill(tree, 7)
    assert drawn is None
    assert tokens.tolist() == node_walk(tree, 7, ctx, tree.max_rank + 1)


def test_siblings_differ_by_their_parents_unlike_medusa():
    model = tiny_model(3)
    heads = random_hydra(model)
    with torch.no_grad():  # let the drafted tokens, not h_t, dominate the guess
        for block in heads.blocks:
            block.linear.weight[:, 32:] *= 10
    ctx = Context(model, heads, [2, 7])
    tree = Tree.from_choices([(r,) for r in range(4)] + [(r, 0) for r in range(4)])
    tokens, _ = ctx.fill(tree, 5)
    second = [tokens[tree.choices.index((r, 0)) + 1].item() for r in range(4)]
    assert len(set(second)) > 1  # Medusa's head 2 would put one token under every first guess


def test_sampled_drafts_draw_each_nodes_children_from_its_own_q():
    model = tiny_model(4)
    heads = random_hydra(model)
    ctx = Context(model, heads, [1, 2, 3])
    T = 0.8
    tokens, drawn = ctx.fill(TREE, 7, Sampling(temperature=T), torch.Generator().manual_seed(0))
    assert drawn is not None
    for node, kids in enumerate(TREE.children):
        if not kids:
            assert drawn.rows[node] == -1
            continue
        log_q, samples = drawn.per_node(0, drawn.samples.tolist())[node]
        assert torch.allclose(log_q, draft_log_probs(q_below(ctx, TREE, tokens, node), temperature=T), atol=1e-5)
        assert len(set(samples)) == len(samples)  # without replacement
        assert [tokens[c].item() for c in kids] == [samples[TREE.choices[c - 1][-1]] for c in kids]


@pytest.mark.parametrize("tree_name", ["small", "cpu", "chain"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_medusa_with_hydra_heads_equals_plain_greedy(tree_name, seed):
    tree = {"small": TREE, "cpu": preset("cpu"), "chain": chain(4)}[tree_name]
    model = tiny_model(seed)
    heads = random_hydra(model, num_heads=4, seed=seed)
    prompt = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    want, _ = generate(model, prompt, max_new_tokens=40)
    got, stats = medusa_generate(model, heads, prompt, tree=tree, max_new_tokens=40)
    assert got == want and sum(stats.step_tokens) == 39


def test_teacher_forced_logits_are_the_logits_decoding_computes_along_the_true_path():
    model = tiny_model(5)
    heads = random_hydra(model, num_heads=3)
    x = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(0))
    y = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    _, hidden = model(x)
    out = teacher_forced_logits(heads, hidden, y, model)  # [K, B, T, V]
    for b, t, k in itertools.product(range(2), range(12), range(1, 4)):
        if t + k <= 12:  # head k at position t reads the true tokens t+1..t+k (y[t : t + k])
            want = heads.head_logits(k, hidden[b, t], y[b, t : t + k], lm_head=model.lm_head, wte=model.transformer.wte)
            assert torch.allclose(out[k - 1, b, t], want, atol=1e-5), (b, t, k)


def train_heads(model, heads, seqs, *, steps: int = 150, lr: float = 3e-2) -> list[float]:
    """Medusa-1 as train_tiny.py's heads stage runs it: the backbone frozen, the heads' loss on hidden
    states cut from the backbone, one optimizer over every parameter that still trains."""
    torch.manual_seed(0)
    module = MedusaLM(model, heads)
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=lr)
    losses = []
    heads.train()
    for _ in range(steps):
        loss, _ = module(seqs[:, :-1], seqs[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    heads.eval()
    return losses


def snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def trained():
    """A tiny frozen backbone, its greedy text, and Medusa and hydra heads trained the same way on it;
    the weights before training too."""
    model = tiny_model(6)
    for p in model.parameters():
        p.requires_grad_(False)
    prompts = torch.randint(64, (24, 4), generator=torch.Generator().manual_seed(0))
    seqs = sample_continuations(model, prompts, max_new_tokens=40, temperature=0.0)  # [24, 44]
    cfg = dict(num_heads=3, n_embd=32, vocab_size=64)
    medusa = MedusaHeads(HeadsConfig(**cfg))
    hydra = make_heads(HeadsConfig(**cfg, kind="hydra"))
    before = {"backbone": snapshot(model), "hydra": snapshot(hydra)}
    medusa_losses, hydra_losses = train_heads(model, medusa, seqs), train_heads(model, hydra, seqs)
    return model, prompts, seqs, medusa_losses, medusa, hydra_losses, hydra, before


def test_teacher_forced_training_teaches_hydra_heads_and_leaves_the_backbone_alone(trained):
    """Hydra heads read the backbone's token embedding and lm_head: shared, yet never trained here."""
    model, _, _, _, _, hydra_losses, hydra, before = trained
    assert hydra_losses[-1] < 0.5 * hydra_losses[0]
    after = snapshot(hydra)
    assert after.keys() == before["hydra"].keys() and not any(k.startswith(("wte", "lm_head")) for k in after)
    assert all(not torch.equal(before["hydra"][k], after[k]) for k in after), "every head weight trains"
    assert all(torch.equal(before["backbone"][k], v) for k, v in model.state_dict().items())


def test_dependent_heads_accept_more_than_medusa_heads_trained_the_same_way(trained):
    model, prompts, _, medusa_losses, medusa, hydra_losses, hydra, _ = trained
    assert hydra_losses[-1] < medusa_losses[-1]  # knowing the path makes the guess easier
    tps = {}
    for name, heads in (("medusa", medusa), ("hydra", hydra)):
        steps = tokens = 0
        for p in prompts[:8].tolist():
            want, _ = generate(model, p, max_new_tokens=30)
            got, stats = medusa_generate(model, heads, p, tree=chain(3), max_new_tokens=30)
            assert got == want
            steps, tokens = steps + stats.steps, tokens + sum(stats.step_tokens)
        tps[name] = tokens / steps
    assert tps["hydra"] > tps["medusa"]


def test_hydra_heads_need_the_drafted_tokens_and_medusa_code_refuses_them():
    model = tiny_model(7)
    heads = random_hydra(model)
    with pytest.raises(ValueError, match="read the tokens drafted"):
        heads(torch.randn(1, 32), model.lm_head)  # a Medusa call site: a clear error, not a shape crash
    with pytest.raises(ValueError, match="kind 'hydra'"):
        MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=64, kind="hydra"))
    with pytest.raises(ValueError, match="unknown head kind"):
        HeadsConfig(kind="eagle")
    with pytest.raises(ValueError, match="own_lm_head"):
        make_heads(HeadsConfig(kind="hydra", own_lm_head=True))


def test_the_measured_accuracy_of_hydra_heads_predicts_their_tokens_per_step(trained):
    """Along the greedy continuation the true previous tokens are exactly the tree path greedy decoding
    accepts, so the table teacher-forced heads measure is the one decoding meets, and the product rule
    on it forecasts the tokens per step of greedy decoding."""
    from medusa_mini.tree import build_tree
    from medusa_mini.tune.acceptance_tables import continuations, measure_head_accuracy

    model, prompts, _, _, _, _, hydra, _ = trained
    n, ps = 30, prompts[:6].tolist()
    seqs = continuations(model, ps, max_new_tokens=n)
    acc = measure_head_accuracy(model, hydra, seqs, prompt_lens=4)
    assert acc[:, 0].min() > 0.2  # the trained heads are often right: there are paths to accept
    tree, expected = build_tree(acc, 8)
    emitted = steps = 0
    for p, s in zip(ps, seqs):
        out, stats = medusa_generate(model, hydra, p, tree=tree, max_new_tokens=n)
        assert out == s[4:]
        emitted, steps = emitted + sum(stats.step_tokens), steps + stats.steps
    assert expected > 1.5 and 0.85 < (emitted / steps) / expected < 1.15
