"""The backbone and its static KV cache: cached forwards are exact (the tree-masked verify pass and
keeping the accepted path are checked against plain forwards in tests/test_step.py)."""

import pytest
import torch

from medusa_mini.model import GPT, GPTConfig, KVCache


def test_parameter_names_and_initial_values_follow_gpt2():
    torch.manual_seed(0)
    model, modules = GPT(GPTConfig(n_layer=2)), ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    block = [f"transformer.h.{i}.{m}.{p}" for i in range(2) for m in modules for p in ("weight", "bias")]
    assert list(model.state_dict()) == ["transformer.wte.weight", "transformer.wpe.weight", *block,
                                        "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    h = model.transformer.h[0]  # N(0, 0.02), the residual stream's projections (c_proj) over √(2 n_layer), biases 0
    for w, std in ((model.transformer.wpe.weight, 0.02), (h.mlp.c_fc.weight, 0.02), (h.mlp.c_proj.weight, 0.02 / 2),
                   (h.attn.c_proj.weight, 0.02 / 2), (h.attn.c_attn.bias, 0.0)):
        assert abs(w.mean()) < 1e-3 and abs(w.std() - std) < 1e-3


@torch.no_grad()
def test_cached_decoding_matches_a_forward_without_cache_in_rows_of_their_own_lengths_and_positions(model):
    """Reading only the slots in use (`attended`, eager decoding); the whole cache (a graph's): cli/test_compiled.py."""
    rows, cache = [[5, 9, 11, 2, 40, 7], [3, 1]], KVCache(model.config, batch_size=2)
    model(torch.tensor([rows[0], rows[1] + [0] * 4]), cache=cache, attended=6)  # the short row padded at its end
    cache.lengths, more = torch.tensor([6, 2]), torch.tensor([[17, 23], [42, 8]])  # the padding's slots given back
    got = [model(more[:, j : j + 1], cache=cache, attended=7 + j)[0][:, 0] for j in range(2)]  # [B, V] each
    assert cache.lengths.tolist() == [8, 4]
    for b in range(2):
        want = model(torch.tensor([rows[b] + more[b].tolist()]))[0][0, len(rows[b]):]  # the row alone, no cache
        torch.testing.assert_close(torch.stack([g[b] for g in got]), want, atol=1e-5, rtol=0)


def test_an_overfilled_cache_or_context_a_cache_outside_no_grad_and_a_width_heads_do_not_divide_are_clear_errors(model):
    """A cache stores values for decoding; writing a graph into it would keep every step's graph alive."""
    pytest.raises(ValueError, model, torch.zeros(1, 65).long()).match("65 tokens do not fit the context of 64")
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache full"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=KVCache(model.config, max_len=4))
    pytest.raises(RuntimeError, model, torch.tensor([[1, 2]]), cache=KVCache(model.config)).match("torch.no_grad")
    pytest.raises(ValueError, GPTConfig, n_embd=30, n_head=4).match("divisible")
