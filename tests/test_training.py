"""Training rules (paper §2.2): head targets, Medusa-1 freezes the backbone, Medusa-2 trains both."""

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.hydra import HydraHeads, next_tokens, teacher_forced_logits
from medusa_mini.model import GPT, GPTConfig
from medusa_mini.training import (IGNORE, MedusaLM, chunked_head_loss, cosine_lr, head_chunk_size, head_targets,
                                  head_weights, lambda_schedule, medusa_head_losses, sample_continuations,
                                  stacked_head_targets)


def _setup(num_heads=3, kind="medusa"):
    """A 2-layer GPT (vocabulary 50, width 32) and its heads, with random blocks: zero-initialised ones
    would hide a wrong gradient."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32))
    cfg = HeadsConfig(num_heads=num_heads, n_embd=32, vocab_size=50, kind=kind)
    heads = HydraHeads(cfg) if kind == "hydra" else MedusaHeads(cfg, lm_head_weight=model.lm_head.weight)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    return model, heads


def _tokens(seed, shape=(4, 17)):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


def test_head_k_at_position_t_targets_token_t_plus_k_plus_1_where_valid():
    y = torch.arange(1, 10)[None]  # token i is the number i; y[:, t] = token t + 1
    for k in (1, 2, 3):
        tgt, mask = head_targets(y, k)
        assert mask[0].tolist() == [t + k < 9 for t in range(9)]
        assert tgt[0, mask[0]].tolist() == list(range(k + 1, 10))
    tgt, mask = head_targets(y, 2, torch.arange(9)[None] >= 5)  # only y[5:] (tokens 6..9) may be trained on
    assert mask[0].tolist() == [False, False, False, True, True, True, True, False, False]
    assert tgt[0, mask[0]].tolist() == [6, 7, 8, 9]


def test_strided_head_positions_use_the_matching_targets():
    y = _tokens(1, (2, 9)) % 7
    full = torch.randn(3, 2, 9, 7, generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([1, 4, 7])
    strided, _ = medusa_head_losses(full[:, :, pos], y, positions=pos)
    for k in range(3):
        tgt, mask = head_targets(y, k + 1)
        m = mask & torch.isin(torch.arange(9), pos)
        torch.testing.assert_close(strided[k], torch.nn.functional.cross_entropy(full[k][m], tgt[m]))


def test_schedules():
    assert head_weights(3, decay=0.8) == pytest.approx([0.8, 0.64, 0.512])
    assert head_weights(4, decay=1.0) == [1.0, 1.0, 1.0, 1.0]  # official Medusa-1: the plain sum
    # Medusa-2's λ, 100 steps, ramp 0.3: 30 ramp steps; step s weighs 0.2 * (s + 1) / 30, then 0.2
    got = [lambda_schedule(s, 100, lambda0=0.2) for s in (0, 14, 28, 29, 30, 99)]
    assert got == pytest.approx([0.2 / 30, 0.1, 0.2 * 29 / 30, 0.2, 0.2, 0.2])
    assert lambda_schedule(1, 10, lambda0=0.5, ramp=0.5) == pytest.approx(0.5 * 2 / 5)
    assert lambda_schedule(0, 2, lambda0=0.5) == 0.5  # fewer steps than one ramp step: no ramp
    # lr, 105 steps, warm-up 5% = 5 steps: lr * (s + 1) / 5; then 0.1 + 0.9 * (1 + cos(pi * (s - 5) / 100)) / 2
    got = [cosine_lr(s, 105, lr=2.0) for s in (0, 2, 4, 5, 30, 55, 80, 104, 105, 500)]
    want = [0.4, 1.2, 2.0, 2.0, 2 * 0.8681980515, 2 * 0.55, 2 * 0.2318019485, 2 * 0.1002220478, 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize("medusa", [1, 2])
def test_head_losses_reach_the_backbone_in_medusa_2_only(medusa):
    model, heads = _setup(2)  # the backbone left trainable on purpose: detach_backbone alone must shield it
    x = _tokens(3)
    loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=0.8,
                                            detach_backbone=medusa == 1)
    loss.backward()
    assert ("lm" in metrics) == (medusa == 2) and len(metrics["heads"]) == 2
    assert all(b.linear.weight.grad.abs().sum() > 0 for b in heads.blocks)
    # The shared lm_head (tied to wte) is frozen by requires_grad in the heads stage.
    body = [p.grad for name, p in model.named_parameters() if name != "transformer.wte.weight"]
    assert all(g is None for g in body) if medusa == 1 else model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


def test_self_distillation_is_greedy_at_temperature_zero_seeded_and_within_the_context():
    from medusa_mini.decoding import generate

    model = tiny_model(2, block_size=16)
    prompts = torch.tensor([[1, 2, 3, 4], [7, 8, 9, 10]])
    out = sample_continuations(model, prompts, max_new_tokens=10, temperature=0.0)
    assert out[:, 4:].tolist() == [generate(model, p, max_new_tokens=10)[0] for p in prompts.tolist()]
    a, b = (sample_continuations(model, prompts, max_new_tokens=50, temperature=1.0,
                                 generator=torch.Generator().manual_seed(0)) for _ in range(2))
    assert torch.equal(a, b) and a.shape == (2, 16)


@pytest.mark.parametrize("chunk", [1, 5, 16, 29, 1000])  # 29 does not divide 2 x 20 = 40 positions: ragged
def test_chunked_head_loss_equals_the_plain_masked_loss_in_values_and_gradients(chunk):
    model, heads = _setup()
    lm_head = model.lm_head
    h = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)  # [B, T, C]
    y = _tokens(3, (2, 20))
    valid = torch.arange(20).expand(2, 20) >= 6  # ignored positions inside the rows, as the heads stage's prompts
    weights = torch.tensor([1.0, 0.8, 0.64])

    def grads(losses):
        return torch.autograd.grad((weights * losses).sum(), [h, *heads.parameters(), lm_head.weight])

    want, want_acc = medusa_head_losses(heads(h, lm_head), y, valid=valid)
    want = torch.stack(want)
    got, acc = chunked_head_loss(heads, lm_head, h, stacked_head_targets(y, 3, valid=valid), chunk_size=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert acc.tolist() == want_acc and not acc.requires_grad
    for g, w in zip(grads(got), grads(want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_a_head_without_any_target_has_zero_loss_and_accuracy_not_nan():
    model, heads = _setup()
    loss, acc = chunked_head_loss(heads, model.lm_head, torch.randn(1, 3, 32), torch.full((3, 1, 3), IGNORE), chunk_size=2)
    assert loss.tolist() == [0.0, 0.0, 0.0] and acc.tolist() == [0.0, 0.0, 0.0]


def test_default_chunks_keep_the_cpu_preset_whole_and_bound_gpt2_vocabulary():
    assert head_chunk_size(4, 2048) >= 32 * (32 + 96 - 1)  # cpu preset's heads batch x positions: one chunk
    size = head_chunk_size(4, 50257)
    assert size < 32 * (32 + 128 - 1) and 4 * size * 50257 <= 2**26  # gpt2 preset: several bounded chunks


@pytest.mark.parametrize("stride", [1, 3])
def test_training_metrics_stay_on_the_device_and_equal_the_per_step_reads(stride):
    model, heads = _setup()
    x = _tokens(5)
    _, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=1.0, heads_weight=0.5, decay=0.8,
                                        heads_stride=stride, heads_offset=1)
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
    logits, hidden = model(x[:, :-1])
    pos = torch.arange(1, 16, stride) if stride > 1 else None
    losses, accs = medusa_head_losses(heads(hidden if pos is None else hidden[:, pos], model.lm_head), x[:, 1:],
                                      positions=pos)
    assert metrics["lm"].item() == torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()
    assert metrics["acc"].tolist() == accs
    torch.testing.assert_close(metrics["heads"], torch.stack(losses).detach(), rtol=0, atol=1e-5)


class _ValueReads(TorchDispatchMode):
    """Records the operators that copy a value to the host (a GPU would stall on each)."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")

    def __enter__(self):
        self.reads = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage", ["joint", "heads"])
def test_a_training_step_never_reads_a_value_from_the_device(stage):
    model, heads = _setup(2)
    x = _tokens(6)
    valid = torch.arange(16).expand(4, 16) >= 5
    kw = (dict(lm_weight=1.0, heads_weight=0.2, decay=0.8, heads_stride=3, heads_offset=2) if stage == "joint"
          else dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True, valid=valid, heads_chunk=5))
    with _ValueReads() as mode:
        loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], **kw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in heads.parameters()], 1.0)
    assert mode.reads == []
    with _ValueReads() as mode:  # the check can fail: the plain masked loss reads the device
        medusa_head_losses(heads(torch.randn(4, 16, 32), model.lm_head), x[:, 1:], valid=valid)
    assert "aten::_local_scalar_dense" in mode.reads  # its .item() per head


@pytest.mark.parametrize("chunk", [None, 7])
def test_dependent_heads_train_through_the_same_chunked_loss_on_their_teacher_forced_logits(chunk):
    """Hydra heads read x_{t+1..t+k} (hydra.next_tokens); chunking must hand each chunk its own tokens."""
    model, heads = _setup(kind="hydra")
    x = _tokens(6, (2, 13))
    y = x[:, 1:]
    _, hidden = model(x[:, :-1])
    want, want_acc = medusa_head_losses(teacher_forced_logits(heads, hidden, y, model), y)
    got, acc = chunked_head_loss(heads, model.lm_head, hidden, stacked_head_targets(y, 3),
                                 tokens=next_tokens(y, 3), wte=model.transformer.wte, chunk_size=chunk)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=1e-6)
    assert acc.tolist() == want_acc
    _, metrics = MedusaLM(model, heads)(x[:, :-1], y, lm_weight=0.0, heads_weight=1.0, decay=0.8, heads_chunk=chunk)
    torch.testing.assert_close(metrics["heads"], torch.stack(want).detach(), rtol=1e-6, atol=1e-6)
