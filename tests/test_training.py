"""Training rules (paper §2.2): head targets, Medusa-1 freezes the backbone, Medusa-2 trains both."""

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from medusa_mini.heads import HeadsConfig, MedusaHeads
from medusa_mini.model import GPT, GPTConfig
from medusa_mini.training import (
    IGNORE,
    MedusaLM,
    chunked_head_loss,
    cosine_lr,
    head_chunk_size,
    head_targets,
    head_weights,
    lambda_schedule,
    medusa_head_losses,
    sample_continuations,
    stacked_head_targets,
)


def test_head_k_at_position_t_targets_token_t_plus_k_plus_1():
    tokens = torch.arange(10)[None]  # token i is the number i
    y = tokens[:, 1:]  # y[:, t] = token t + 1
    for k in (1, 2, 3):
        tgt, mask = head_targets(y, k)
        T = y.shape[1]
        for t in range(T):
            assert mask[0, t].item() == (t + k < T)
            if mask[0, t]:
                assert tgt[0, t].item() == t + k + 1


def test_head_targets_respect_a_validity_mask():
    y = torch.arange(1, 9)[None]
    valid = torch.zeros(1, 8, dtype=torch.bool)
    valid[:, 5:] = True  # only y[5:] (tokens 6..8) may be trained on
    tgt, mask = head_targets(y, 2, valid)
    assert mask[0].tolist() == [False, False, False, True, True, True, False, False]
    assert tgt[0, mask[0]].tolist() == [6, 7, 8]


def test_a_perfect_head_has_near_zero_loss_and_full_accuracy():
    y = torch.randint(0, 7, (2, 6), generator=torch.Generator().manual_seed(0))
    K, V = 2, 7
    logits = torch.full((K, 2, 6, V), -20.0)
    for k in range(K):
        tgt, mask = head_targets(y, k + 1)
        logits[k].scatter_(-1, tgt[..., None], 20.0)
    losses, accs = medusa_head_losses(logits, y)
    assert all(l.item() < 1e-6 for l in losses) and accs == [1.0, 1.0]


def test_strided_head_positions_use_the_matching_targets():
    y = torch.randint(0, 7, (2, 9), generator=torch.Generator().manual_seed(1))
    full = torch.randn(3, 2, 9, 7, generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([1, 4, 7])
    strided, _ = medusa_head_losses(full[:, :, pos], y, positions=pos)
    for k in range(3):
        tgt, mask = head_targets(y, k + 1)
        keep = torch.zeros_like(mask)
        keep[:, pos] = True
        m = mask & keep
        want = torch.nn.functional.cross_entropy(full[k][m], tgt[m])
        torch.testing.assert_close(strided[k], want)


def test_head_k_is_weighted_by_decay_to_the_k():
    assert head_weights(3, decay=0.8) == pytest.approx([0.8, 0.64, 0.512])
    assert head_weights(4, decay=1.0) == [1.0, 1.0, 1.0, 1.0]  # official Medusa-1: the plain sum


def test_medusa_2_heads_weight_ramps_linearly_to_lambda0_over_the_first_30_percent():
    # 100 steps, ramp 0.3: 30 ramp steps; step s weighs 0.2 * (s + 1) / 30, then 0.2
    got = [lambda_schedule(s, 100, lambda0=0.2) for s in (0, 14, 28, 29, 30, 99)]
    assert got == pytest.approx([0.2 / 30, 0.1, 0.2 * 29 / 30, 0.2, 0.2, 0.2])
    assert lambda_schedule(1, 10, lambda0=0.5, ramp=0.5) == pytest.approx(0.5 * 2 / 5)
    assert lambda_schedule(0, 2, lambda0=0.5) == 0.5  # fewer steps than one ramp step: no ramp


def test_learning_rate_warms_up_linearly_then_decays_along_a_cosine_to_a_tenth():
    # 105 steps, warm-up 5% = 5 steps: lr * (s + 1) / 5; then 0.1 + 0.9 * (1 + cos(pi * (s - 5) / 100)) / 2
    got = [cosine_lr(s, 105, lr=2.0) for s in (0, 2, 4, 5, 30, 55, 80, 104, 105, 500)]
    want = [0.4, 1.2, 2.0, 2.0, 2 * 0.8681980515, 2 * 0.55, 2 * 0.2318019485, 2 * 0.1002220478, 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-7)


def _tied_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32))


def _step(module, **kw):
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    loss, metrics = module(x[:, :-1], x[:, 1:], **kw)
    loss.backward()
    opt.step()
    return metrics


def test_medusa_1_head_losses_never_reach_the_backbone():
    model = _tied_model()  # left trainable on purpose: detach_backbone alone must shield it
    heads = MedusaHeads(HeadsConfig(num_heads=2, n_embd=32, vocab_size=50), lm_head_weight=model.lm_head.weight)
    heads_before = [p.clone() for p in heads.parameters()]
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(3))
    loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=1.0,
                                            detach_backbone=True)
    loss.backward()
    assert "lm" not in metrics and len(metrics["heads"]) == 2
    # The body gets nothing; the shared lm_head (tied to wte) is frozen by requires_grad in the heads stage.
    assert all(p.grad is None for name, p in model.named_parameters() if name != "transformer.wte.weight")
    torch.optim.SGD(heads.parameters(), lr=0.1).step()
    assert any(not torch.equal(a, b) for a, b in zip(heads_before, heads.parameters()))


def test_medusa_2_head_losses_reach_the_backbone():
    model = _tied_model()
    heads = MedusaHeads(HeadsConfig(num_heads=2, n_embd=32, vocab_size=50), lm_head_weight=model.lm_head.weight)
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    only_heads, _ = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=0.8)
    only_heads.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


def test_self_distillation_at_temperature_zero_writes_the_greedy_continuation():
    from medusa_mini.decoding import generate

    model = tiny_model(2)
    prompts = torch.tensor([[1, 2, 3], [7, 8, 9]])
    out = sample_continuations(model, prompts, max_new_tokens=10, temperature=0.0)
    assert out.shape == (2, 13)
    for b in range(2):
        assert out[b, 3:].tolist() == generate(model, prompts[b].tolist(), max_new_tokens=10)[0]


def test_self_distillation_sampling_is_seeded_and_never_exceeds_the_context():
    model = tiny_model(2, block_size=16)
    prompts = torch.tensor([[1, 2, 3, 4]] * 3)
    a = sample_continuations(model, prompts, max_new_tokens=50, temperature=1.0, generator=torch.Generator().manual_seed(0))
    b = sample_continuations(model, prompts, max_new_tokens=50, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (3, 16)


def _heads_setup(seed=0, *, V=50, C=32, K=3):
    torch.manual_seed(seed)
    lm_head = torch.nn.Linear(C, V, bias=False)
    heads = MedusaHeads(HeadsConfig(num_heads=K, n_embd=C, vocab_size=V), lm_head_weight=lm_head.weight)
    for block in heads.blocks:  # zero-initialised blocks would hide a wrong gradient
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    return heads, lm_head


def test_stacked_targets_mark_what_head_targets_masks_as_ignored():
    y = torch.randint(0, 9, (2, 7), generator=torch.Generator().manual_seed(0))
    valid = torch.rand(2, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    targets = stacked_head_targets(y, 3, valid=valid)  # [K, B, T]
    for k in range(3):
        tgt, mask = head_targets(y, k + 1, valid)
        assert torch.equal(targets[k] != IGNORE, mask) and torch.equal(targets[k][mask], tgt[mask])


@pytest.mark.parametrize("chunk", [1, 5, 16, 29, 1000])  # 29 does not divide 2 x 20 = 40 positions: ragged
def test_chunked_head_loss_equals_the_plain_masked_loss_in_values_and_gradients(chunk):
    heads, lm_head = _heads_setup()
    h = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)  # [B, T, C]
    y = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[:, :6] = False  # ignored positions inside the rows, as the heads stage's prompts are
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
    heads, lm_head = _heads_setup()
    h = torch.randn(1, 3, 32)
    targets = torch.full((3, 1, 3), IGNORE)
    loss, acc = chunked_head_loss(heads, lm_head, h, targets, chunk_size=2)
    assert loss.tolist() == [0.0, 0.0, 0.0] and acc.tolist() == [0.0, 0.0, 0.0]


def test_default_chunks_keep_the_cpu_preset_whole_and_bound_gpt2_vocabulary():
    positions_cpu_heads = 32 * (32 + 96 - 1)  # cpu preset: heads batch x (prompt + distilled tokens - 1)
    assert head_chunk_size(4, 2048) >= positions_cpu_heads  # one chunk: no recomputation
    size = head_chunk_size(4, 50257)
    assert size < 32 * (32 + 128 - 1) and 4 * size * 50257 <= 2**26  # gpt2 preset: several bounded chunks


def test_training_metrics_stay_on_the_device_and_equal_the_per_step_reads():
    """MedusaLM returns tensors; read at a log step they are the numbers the .item() per step gave."""
    model = _tied_model()
    heads = MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=50), lm_head_weight=model.lm_head.weight)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    x = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(5))
    for stride in (1, 3):
        _, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], lm_weight=1.0, heads_weight=0.5, decay=0.8,
                                            heads_stride=stride, heads_offset=1)
        assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
        logits, hidden = model(x[:, :-1])
        pos = torch.arange(1, 16, stride) if stride > 1 else None
        h = hidden[:, pos] if pos is not None else hidden
        losses, accs = medusa_head_losses(heads(h, model.lm_head), x[:, 1:], positions=pos)
        lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        assert metrics["lm"].item() == lm.item()
        assert metrics["acc"].tolist() == accs
        assert [round(v, 5) for v in metrics["heads"].tolist()] == [round(l.item(), 5) for l in losses]


class _ValueReads(TorchDispatchMode):
    """Records the operators that must copy a value to the host (a GPU would stall on each)."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.reads.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage", ["joint", "heads"])
def test_a_training_step_never_reads_a_value_from_the_device(stage):
    model = _tied_model()
    heads = MedusaHeads(HeadsConfig(num_heads=2, n_embd=32, vocab_size=50), lm_head_weight=model.lm_head.weight)
    x = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(6))
    valid = torch.ones(4, 16, dtype=torch.bool)
    valid[:, :5] = False
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
    from medusa_mini.hydra import HydraHeads, next_tokens, teacher_forced_logits

    model = _tied_model()
    heads = HydraHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=50, kind="hydra"))
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    x = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(6))
    y = x[:, 1:]
    _, hidden = model(x[:, :-1])
    want, want_acc = medusa_head_losses(teacher_forced_logits(heads, hidden, y, model), y)
    got, acc = chunked_head_loss(heads, model.lm_head, hidden, stacked_head_targets(y, 3),
                                 tokens=next_tokens(y, 3), wte=model.transformer.wte, chunk_size=chunk)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=1e-6)
    assert acc.tolist() == want_acc
    _, metrics = MedusaLM(model, heads)(x[:, :-1], y, lm_weight=0.0, heads_weight=1.0, decay=0.8,
                                        heads_chunk=chunk)
    torch.testing.assert_close(metrics["heads"], torch.stack(want).detach(), rtol=1e-6, atol=1e-6)
