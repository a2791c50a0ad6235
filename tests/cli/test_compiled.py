"""`--compile`: the plain step and the tree verify captured once each, the prefill eager, same tokens.

A backend that replays each captured graph under CUDA graphs' rules (`GraphReplay`) checks the capture
on a CPU in milliseconds; inductor and CUDA graphs compile the same captured graphs.
"""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import torch

import decode
from medusa_mini.cli.compiled import CompiledSteps, compile_steps, step_cache, warm_up
from medusa_mini.decoding import generate, generate_batch, medusa_generate, medusa_generate_batch
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree
from tests.conftest import random_heads, save_tiny, tiny_model

TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


def poison(t: torch.Tensor) -> None:
    """Make a stale output unmistakable: NaN, the smallest integer, or every boolean flipped."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(torch.iinfo(t.dtype).min)


class GraphReplay:
    """A torch.compile backend that runs each captured graph as a CUDA graph would replay it, on a CPU.

    - Outputs: each graph returns the same buffers at every call (a CUDA graph's outputs live in its
      memory pool), and every call first poisons every graph's earlier outputs (one pool): a read of a
      step's logits or hidden state after the next step sees NaN instead of the old values.
    - Static inputs (parameters, and tensors marked with mark_static_address: the KV cache and its
      lengths) must keep the address of their first call: a CUDA graph replays on recorded addresses.
    - Other inputs are copied in (into the graph's own input buffers, as a CUDA graph does), and a graph
      must not write into them: under CUDA graphs the write would miss the caller's tensor (inductor
      then skips the graph, and the step runs without CUDA graphs).
    """

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.pool: list[torch.Tensor] = []  # every graph's output buffers

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        static = [getattr(t, "_dynamo_static_input_type", None) is not None for t in example_inputs]
        addresses: dict[int, int] = {}
        outputs: list[torch.Tensor] = []
        self.graphs.append(gm)

        def replay(*args):
            for t in self.pool:
                poison(t)
            inputs = list(args)
            for i, t in enumerate(args):
                if static[i]:
                    assert addresses.setdefault(i, t.data_ptr()) == t.data_ptr(), (
                        f"{names[i]} moved: a CUDA graph would replay on the address it recorded")
                else:
                    inputs[i] = t.clone()
            versions = [t._version for t in inputs]
            result = gm(*inputs)
            for i, t in enumerate(inputs):
                assert static[i] or t._version == versions[i], (
                    f"the graph writes into {names[i]}, which is not static: a CUDA graph would write its own copy")
            flat = list(result) if isinstance(result, (tuple, list)) else [result]
            if not outputs:
                outputs.extend(torch.empty_like(o) for o in flat)
                self.pool.extend(outputs)
            for buffer, o in zip(outputs, flat):
                buffer.copy_(o)
            return tuple(outputs) if isinstance(result, (tuple, list)) else outputs[0]

        return replay


def compiled_and_eager(seed: int):
    """A tiny model with its steps compiled (replayed as CUDA graphs), an eager copy, heads, the graphs."""
    torch.compiler.reset()
    model = tiny_model(seed)
    heads = random_heads(model, seed=seed)
    eager = copy.deepcopy(model)
    backend = GraphReplay()
    return compile_steps(model, backend=backend), eager, heads, backend.graphs


def test_compiled_steps_make_the_eager_tokens_and_compile_nothing_after_the_warm_up():
    model, eager, heads, graphs = compiled_and_eager(3)
    assert isinstance(model, CompiledSteps)
    seconds = warm_up(model, TREE)
    # One graph for the 1-token step, one per truncation of the tree (depth 0..3).
    assert seconds > 0 and len(graphs) == 1 + (TREE.depth + 1)
    captured = len(graphs)
    block = model.config.block_size
    for prompt in ([5], [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]):  # three prompt lengths: prefills stay eager
        want, _ = medusa_generate(eager, heads, prompt, tree=TREE, max_new_tokens=12)
        got, _ = medusa_generate(model, heads, prompt, tree=TREE, max_new_tokens=12,
                                 cache=step_cache(model, block + TREE.num_nodes))
        assert got == want
        want, _ = generate(eager, prompt, max_new_tokens=12)
        got, _ = generate(model, prompt, max_new_tokens=12, cache=step_cache(model, block))
        assert got == want
    assert len(graphs) == captured, "a generation met a step shape that the warm-up did not compile"


def test_compiled_rejection_sampling_draws_the_same_tokens_with_the_same_seed():
    model, eager, heads, _ = compiled_and_eager(4)
    warm_up(model, TREE)
    s, block = Sampling(acceptance="rejection", temperature=0.8), model.config.block_size
    runs = [medusa_generate(m, heads, [3, 1, 4, 1, 5], tree=TREE, max_new_tokens=16, sampling=s,
                            generator=torch.Generator().manual_seed(7), cache=step_cache(m, block + TREE.num_nodes))[0]
            for m in (eager, model)]
    assert runs[0] == runs[1]
    runs = [generate(m, [3, 1, 4, 1, 5], max_new_tokens=16, sampling=s, generator=torch.Generator().manual_seed(7),
                     cache=step_cache(m, block))[0] for m in (eager, model)]
    assert runs[0] == runs[1]


def test_compiled_steps_decode_a_batch_of_two_prompts_as_eager_steps_do():
    """Rows of different lengths, one of which stops first (it meets the context) while the other goes on."""
    model, eager, heads, graphs = compiled_and_eager(6)
    warm_up(model, TREE, batch_size=2)
    captured, block = len(graphs), model.config.block_size
    prompts = [list(range(1, 56)), [5, 6, 7]]
    want = medusa_generate_batch(eager, heads, prompts, tree=TREE, max_new_tokens=12)
    got = medusa_generate_batch(model, heads, prompts, tree=TREE, max_new_tokens=12,
                                cache=step_cache(model, block + TREE.num_nodes, batch_size=2))
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert [stats.stop_reason for _, stats in got] == ["context", "max_new_tokens"]
    want = generate_batch(eager, prompts, max_new_tokens=12)
    got = generate_batch(model, prompts, max_new_tokens=12, cache=step_cache(model, block, batch_size=2))
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert len(graphs) == captured


@torch.no_grad()
def test_graph_replay_poisons_a_steps_outputs_when_any_step_runs_again():
    """What catches a decoding loop that reads a step's logits or hidden state after the next step."""
    model, _, _, _ = compiled_and_eager(7)
    warm_up(model, TREE)
    cache = step_cache(model, model.config.block_size)
    cache.lengths = 0
    logits, hidden = model(torch.tensor([[3]]), cache=cache)
    kept = logits.clone()
    again, _ = model(torch.tensor([[4]]), cache=cache)
    assert again is logits and not torch.equal(again, kept)  # one buffer, now the second step's
    verify_cache = step_cache(model, model.config.block_size + TREE.num_nodes)
    verify_cache.lengths = 0
    model(torch.zeros(1, TREE.num_nodes, dtype=torch.long), cache=verify_cache,
          attn_mask=TREE.tensors("cpu").ancestor_mask, pos=torch.zeros(1, TREE.num_nodes, dtype=torch.long))
    assert logits.isnan().all() and hidden.isnan().all()  # another graph ran: the pool is reused


def test_graph_replay_refuses_a_kv_cache_at_a_new_address():
    model, _, _, _ = compiled_and_eager(8)
    warm_up(model, TREE)
    with pytest.raises(AssertionError, match="moved"):
        generate(model, [1, 2, 3], max_new_tokens=3)  # no cache given: a new one, not the one captured


def test_graph_replay_refuses_a_graph_that_writes_into_an_input_that_is_not_static(monkeypatch):
    """Why the compiled steps' caches are marked static (`CompiledSteps.cache`)."""
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: None)
    model, _, _, _ = compiled_and_eager(9)
    with pytest.raises(AssertionError, match="writes into l_cache"):
        warm_up(model, TREE)


def test_warm_up_and_every_generation_share_one_cache_per_size():
    model, _, _, _ = compiled_and_eager(5)
    block = model.config.block_size
    assert step_cache(tiny_model(5), block) is None  # an eager model makes its own caches
    warm_up(model, TREE)
    plain, tree_cache = step_cache(model, block), step_cache(model, block + TREE.num_nodes)
    assert set(model.caches.values()) == {plain, tree_cache}
    assert step_cache(model, block) is plain and plain.max_len == block  # the same tensors every time


def test_warm_up_refuses_a_model_that_is_not_compiled():
    with pytest.raises(ValueError, match="compile_steps"):
        warm_up(tiny_model(0), TREE)


def test_compiling_wraps_the_model_once_and_leaves_it_eager():
    model = tiny_model(0)
    compiled = compile_steps(model, backend="eager")
    assert compile_steps(compiled, backend="eager") is compiled and compiled.model is model
    assert "forward" not in vars(model) and compiled.config is model.config  # the model's attributes show through


def test_decode_compile_reports_the_compilation_apart_from_the_timings(tmp_path, capsys, monkeypatch):
    torch.compiler.reset()
    save_tiny(tmp_path, with_heads=True)
    backend = GraphReplay()
    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    argv = ["--ckpt", str(tmp_path), "--compare", "--max-new-tokens", "6", "--num-prompts", "2", "--tree", "cpu"]
    assert decode.main([*argv, "--compile", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "compiled the plain step and the verify steps in" in captured.err
    assert result["compile_warmup_s"] > 0 and backend.graphs
    by_key = {row["key"]: row for row in result["rows"]}
    assert by_key["medusa_greedy"]["same_as_plain_greedy"]
    assert decode.main([*argv, "--json"]) == 0  # the same tokens without compiling
    eager = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in eager["rows"]] == [r["tokens"] for r in result["rows"]]
    assert eager["compile_warmup_s"] is None
    # Another model in the same process: graphs are cached per code object, so the first model's graphs
    # (recorded on its addresses) would serve it. decode.py runs one model per process; start afresh.
    torch.compiler.reset()
    assert decode.main([*argv, "--compile"]) == 0
    assert "compiled steps (compilation" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [[], ["--method", "rejection", "--temperature", "0.8", "--seed", "3"],
                                   ["--batch-size", "2"], ["--method", "plain", "--batch-size", "2"]],
                         ids=["greedy", "rejection", "greedy-batch-2", "plain-batch-2"])
def test_decode_prints_the_eager_tokens_with_its_steps_replayed_as_cuda_graphs(tmp_path, capsys, monkeypatch, flags):
    torch.compiler.reset()
    save_tiny(tmp_path, with_heads=True)
    backend = GraphReplay()
    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    argv = ["--ckpt", str(tmp_path), "--max-new-tokens", "10", "--num-prompts", "2", "--tree", "cpu", "--json", *flags]
    runs = []
    for compiled in (False, True):
        assert decode.main(argv + ["--compile"] * compiled) == 0
        runs.append([json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1] and len(runs[0]) == 2 and backend.graphs


def test_decode_warms_up_a_last_batch_smaller_than_the_others(tmp_path, capsys, monkeypatch):
    """Three prompts two at a time: the last batch has one row, other shapes, which the warm-up must compile
    too, or the first timed generation pays for them (under CUDA graphs: records them)."""
    torch.compiler.reset()
    save_tiny(tmp_path, with_heads=True)
    backend, after_warm_up = GraphReplay(), []
    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    monkeypatch.setattr(decode, "warm_up", lambda *args, **kw: (warm_up(*args, **kw), after_warm_up.append(
        len(backend.graphs)))[0])
    argv = ["--ckpt", str(tmp_path), "--max-new-tokens", "6", "--num-prompts", "3", "--tree", "cpu", "--json",
            "--batch-size", "2", "--compile"]
    assert decode.main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert len(backend.graphs) == after_warm_up[-1]
