"""The backbone and its static KV cache: cached forwards are exact (the tree-masked verify pass and
keeping the accepted path are checked against plain forwards in tests/test_step.py)."""

import pytest
import torch

from medusa_mini.model import GPT, GPTConfig, KVCache
from medusa_mini.tree import Tree


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
    """Reading only the slots in use (`attended`, eager decoding); the whole cache (a captured step): below."""
    rows, cache = [[5, 9, 11, 2, 40, 7], [3, 1]], KVCache(model.config, batch_size=2)
    model(torch.tensor([rows[0], rows[1] + [0] * 4]), cache=cache, attended=6)  # the short row padded at its end
    cache.lengths = torch.tensor([6, 2])  # the padding's slots are given back
    more = torch.tensor([[17, 23], [42, 8]])
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


@torch.no_grad()
@pytest.mark.parametrize("kind", ["plain step", "tree verify"])
def test_a_decode_step_is_one_captured_graph_with_eager_logits_at_every_length(kind):
    """Static shapes: one graph, captured once, serves every cache length with the eager logits and KV cache."""
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    t, tree_verify = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]).tensors(), kind == "tree verify"
    new_mask, depths = (t.ancestor_mask, t.depths) if tree_verify else (None, torch.zeros(1, dtype=torch.long))
    tokens = torch.randint(0, 64, (1, depths.numel()), generator=torch.Generator().manual_seed(0))

    def step(cache: KVCache) -> torch.Tensor:
        return model(tokens, pos=cache.lengths[:, None] + depths, cache=cache, attn_mask=new_mask,
                     advance=not tree_verify)[0]  # a verify's nodes are tentative: the length stays

    # fullgraph: a graph break is an error; the backend records each graph and runs it eagerly (a recompile: 2 graphs)
    graphs = []
    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
    for prefix in (3, 7, 12):
        eager_cache, graph_cache = KVCache(model.config), KVCache(model.config)
        for cache in (eager_cache, graph_cache):
            model(torch.arange(prefix)[None], cache=cache)
        torch.testing.assert_close(compiled(graph_cache), step(eager_cache), atol=1e-5, rtol=0)
        torch.testing.assert_close(graph_cache.kv, eager_cache.kv, atol=1e-5, rtol=0)
        assert graph_cache.lengths.tolist() == eager_cache.lengths.tolist() == [prefix + (not tree_verify)]
    assert len(graphs) == 1
