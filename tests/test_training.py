"""Training rules (paper §2.2): head targets, Medusa-1 freezes the backbone, Medusa-2 trains both, the
chunked heads loss is the plain one (that a step never reads the device: test_meta_device.py)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import random_heads, tiny_model
from medusa_mini import GPT, GPTConfig, generate, training
from medusa_mini.heads import IGNORE, next_tokens
from medusa_mini.training import MedusaLM, chunked_head_loss, cosine_lr, lambda_schedule, self_distill


def _setup(num_heads=3, kind="medusa", draft=0):
    """A GPT and its heads, with random blocks: zero-initialised ones would hide a wrong gradient."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32))
    return model, random_heads(model, num_heads=num_heads, kind=kind, draft=draft)


def test_head_weights_lambda_and_learning_rate_follow_their_schedules():
    assert training.head_weights(4, decay=1.0) == [1.0, 1.0, 1.0, 1.0]  # official Medusa-1: the plain sum
    # Medusa-2's λ, 100 steps, ramp 0.3: 30 ramp steps; step s weighs 0.2 * (s + 1) / 30, then 0.2
    got = [lambda_schedule(s, 100, lambda0=0.2) for s in (0, 14, 28, 29, 30, 99)]
    assert got == pytest.approx([0.2 / 30, 0.1, 0.2 * 29 / 30, 0.2, 0.2, 0.2])
    assert lambda_schedule(1, 10, lambda0=0.5, ramp=0.5) == pytest.approx(0.5 * 2 / 5)
    assert lambda_schedule(0, 2, lambda0=0.5) == cosine_lr(0, 2, lr=0.5) == cosine_lr(1, 2, lr=0.5) == 0.5  # no ramp
    # lr, 105 steps, warm-up 5% = 5 steps: lr * (s + 1) / 5; then 0.1 + 0.9 * (1 + cos(pi * (s - 5) / 100)) / 2
    got = [cosine_lr(s, 105, lr=2.0) for s in (0, 2, 4, 5, 30, 55, 80, 104, 105, 500)]
    want = [0.4, 1.2, 2.0, 2.0, 2 * 0.8681980515, 2 * 0.55, 2 * 0.2318019485, 2 * 0.1002220478, 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize("medusa", [1, 2])
def test_head_losses_reach_the_backbone_body_in_medusa_2_only_and_the_shared_lm_head_in_both(medusa):
    model, heads = _setup(2)  # the backbone left trainable on purpose: detach_backbone alone must shield it
    x = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(3))
    loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=0.8,
                                            detach_backbone=medusa == 1)
    loss.backward()
    assert ("lm" in metrics) == (medusa == 2) and len(metrics["heads"]) == 2
    assert model.transformer.wte.weight.grad is not None  # the heads project through it: the heads stage freezes it
    body = [p.grad for name, p in model.named_parameters() if name != "transformer.wte.weight"]
    assert all(g is None for g in body) if medusa == 1 else model.transformer.h[0].attn.c_attn.weight.grad.abs().sum()


def test_self_distillation_is_greedy_at_temperature_zero_seeded_and_within_the_context():
    model, prompts = tiny_model(2, block_size=16), torch.tensor([[1, 2, 3, 4], [7, 8, 9, 10]])
    out = self_distill(model, prompts, max_new_tokens=10, temperature=0.0)
    assert out[:, :4].equal(prompts) and self_distill(model, prompts, max_new_tokens=0, temperature=0.0).equal(prompts)
    assert out[:, 4:].tolist() == [generate(model, p, max_new_tokens=10)[0] for p in prompts.tolist()]
    a, b, c = (self_distill(model, prompts, max_new_tokens=50, temperature=1.0,
                            generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1))
    assert a.equal(b) and not a.equal(c) and a.shape == (2, 16)


def test_a_head_without_any_target_or_position_has_zero_loss_and_accuracy_not_nan():
    model, heads = _setup()
    for T in (3, 0):  # 0: a --heads-stride beyond the window's end leaves a step no position
        loss, acc = chunked_head_loss(heads, model, torch.randn(1, T, 32), torch.full((3, 1, T), IGNORE),
                                      following=torch.zeros(1, T, 3, dtype=torch.long), chunk_size=2)
        assert loss.tolist() == [0.0, 0.0, 0.0] and acc.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind, stride, draft, chunk, lm", [("medusa", 1, 0, None, 1.0), ("medusa", 1, 0, 3, 0.0),
                         ("hydra", 1, 20, 7, 0.0), ("medusa", 3, 20, 29, 0.5), ("hydra", 3, 0, None, 1.0)])
def test_heads_loss_chunked_strided_frozen_or_over_a_draft_vocabulary_is_the_plain_one(kind, stride, draft, chunk, lm):
    """Values, top-1 and gradients: head k at t against token t+k+1 where `valid` (prompts are no targets), at every
    stride-th position from the offset, over a draft vocabulary (as the token's index there); Hydra heads read the
    true next tokens, each chunk its own (29: ragged); lm < 1: the heads train on detached states."""
    model, heads = _setup(kind=kind, draft=draft)
    module, x = MedusaLM(model, heads), torch.randint(0, 50, (4, 21), generator=torch.Generator().manual_seed(5))
    y, valid = x[:, 1:], torch.arange(20).expand(4, 20) >= 2
    loss, metrics = module(x[:, :-1], y, valid=valid, lm_weight=lm, heads_weight=0.5, decay=0.8, heads_stride=stride,
                           heads_offset=1, heads_chunk=chunk, detach_backbone=lm != 1)
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
    logits, hidden = model(x[:, :-1])
    hidden = hidden if lm == 1 else hidden.detach()  # lm < 1: the heads' loss never reaches the backbone
    index = torch.full((50,), IGNORE).index_put_((heads.draft_ids,), torch.arange(heads.draft_ids.numel()))[y]
    assert not draft or (index < 0).any()  # some tokens lie outside the draft vocabulary
    head_logits, losses, accs = heads(hidden, model, following=next_tokens(y, 3)), [], []  # [K, B, T, M]
    K, B, T, _ = head_logits.shape
    for k in range(1, K + 1):  # the heads' loss written plainly: head k at (b, t) against index[b, t + k] where kept
        kept = [(head_logits[k - 1, b, t], index[b, t + k]) for b in range(B) for t in range(T - k)
                if (stride == 1 or t % stride == 1) and valid[b, t + k] and index[b, t + k] >= 0]
        got, want = map(torch.stack, zip(*kept))  # [n, M], [n]
        losses.append(F.cross_entropy(got, want))
        accs.append((got.argmax(-1) == want).float().mean())
    losses, accs, ce = torch.stack(losses), torch.stack(accs), F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert metrics.get("lm", ce).item() == ce.item() and metrics["acc"].tolist() == accs.tolist()
    torch.testing.assert_close(metrics["heads"], losses.detach(), rtol=0, atol=1e-5)
    want = lm * ce + 0.5 * (torch.tensor([0.8, 0.64, 0.512]) * losses).sum()
    params = list((module if lm else heads).parameters())
    for g, w in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
