"""Medusa heads (paper §2.1.1): residual blocks that start as the identity, then the vocabulary."""

import pytest
import torch
from conftest import tiny_model

from medusa_mini.heads import HeadsConfig, MedusaHeads


def make(model, **kw):
    cfg = HeadsConfig(num_heads=3, n_embd=model.config.n_embd, vocab_size=model.config.vocab_size, **kw)
    return MedusaHeads(cfg, lm_head_weight=model.lm_head.weight)


def test_fresh_heads_start_as_the_backbones_next_token_prediction():
    model = tiny_model()
    x = torch.randn(5, model.config.n_embd)
    for own in (False, True):
        logits = make(model, own_lm_head=own)(x, model.lm_head)  # [K, 5, V]
        # zero-initialised W: x + SiLU(0) = x, so every head reproduces lm_head(x)
        for k in range(3):
            torch.testing.assert_close(logits[k], model.lm_head(x), atol=1e-5, rtol=0)


def test_heads_share_the_backbones_lm_head_by_default_or_own_separate_copies():
    model = tiny_model()
    shared, own = make(model), make(model, own_lm_head=True)
    assert shared.lm_heads is None and all("lm_head" not in name for name in shared.state_dict())  # the backbone's
    assert own.lm_heads.shape == (3, model.config.vocab_size, model.config.n_embd)
    with torch.no_grad():
        own.lm_heads[1].zero_()
    out = own(torch.randn(2, model.config.n_embd), model.lm_head)
    assert torch.all(out[1] == 0) and not torch.all(out[0] == 0)


def _randomised(model, **kw):
    heads = make(model, **kw)
    with torch.no_grad():
        for b in heads.blocks:
            b.linear.weight.normal_(std=0.3)
            b.linear.bias.normal_(std=0.3)
    return heads.eval()


@pytest.mark.parametrize("own", [False, True], ids=["shared-lm-head", "own-lm-heads"])
def test_decoding_runs_the_k_blocks_as_one_batched_matmul_with_the_same_result(own):
    """Any leading dims, each head applied position by position."""
    model = tiny_model()
    heads = _randomised(model, own_lm_head=own)
    for shape in ((model.config.n_embd,), (1, model.config.n_embd), (2, 5, model.config.n_embd)):
        x = torch.randn(*shape)
        per_block = heads(x, model.lm_head)  # grad enabled: one block at a time (the training path)
        with torch.no_grad():
            batched = heads(x, model.lm_head)  # decoding: stacked weights, one baddbmm
        assert batched.shape == (3, *shape[:-1], model.config.vocab_size)
        torch.testing.assert_close(batched, per_block.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[:, 1, 4], heads(x[1, 4], model.lm_head).detach(), atol=1e-5, rtol=0)


def test_batched_decoding_sees_every_change_to_the_weights():
    model = tiny_model()
    heads = _randomised(model)
    x = torch.randn(4, model.config.n_embd)
    with torch.no_grad():
        before = heads(x, model.lm_head)
        heads.blocks[1].linear.weight.mul_(-1.0)  # an in-place update, as an optimizer step makes
        after = heads(x, model.lm_head)
    torch.testing.assert_close(after[0], before[0])  # untouched heads stay as they were
    assert not torch.allclose(after[1], before[1])
    torch.testing.assert_close(after, heads(x, model.lm_head).detach(), atol=1e-5, rtol=1e-5)
    other = _randomised(model)
    heads.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(heads(x, model.lm_head), other(x, model.lm_head), atol=1e-5, rtol=1e-5)


def test_the_first_num_heads_alone_give_those_heads_logits():
    """A tree of depth D reads heads 1..D only: the rest cost a vocabulary projection each for nothing."""
    model = tiny_model()
    x = torch.randn(2, model.config.n_embd)
    for own in (False, True):
        heads = _randomised(model, own_lm_head=own)
        full = heads(x, model.lm_head).detach()  # [3, 2, V]
        for num in (1, 2, 3):
            for grad in (True, False):  # the training path and decoding's batched one
                with torch.set_grad_enabled(grad):
                    part = heads(x, model.lm_head, num=num)
                assert part.shape == (num, 2, model.config.vocab_size)
                torch.testing.assert_close(part.detach(), full[:num], atol=1e-5, rtol=1e-5)
