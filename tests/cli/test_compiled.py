"""`--compile`: the plain step and the tree verify captured once each, the prefill eager, same tokens.

A backend that records each captured graph (and otherwise runs it eagerly) checks the capture on a
CPU in milliseconds; inductor and CUDA graphs compile the same captured graphs.
"""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import torch

import decode
from medusa_mini.cli.compiled import CompiledSteps, compile_steps, step_cache, warm_up
from medusa_mini.decoding import generate, medusa_generate
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree
from tests.conftest import random_heads, save_tiny, tiny_model

TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


def recording_backend():
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def compiled_and_eager(seed: int):
    """A tiny model with its steps compiled (recording each graph), an eager copy, heads, the graphs."""
    torch.compiler.reset()
    model = tiny_model(seed)
    heads = random_heads(model, seed=seed)
    eager = copy.deepcopy(model)
    backend, graphs = recording_backend()
    compile_steps(model, backend=backend)
    return model, eager, heads, graphs


def test_compiled_steps_make_the_eager_tokens_and_compile_nothing_after_the_warm_up():
    model, eager, heads, graphs = compiled_and_eager(3)
    assert isinstance(model.forward, CompiledSteps)
    seconds = warm_up(model, [TREE])
    # One graph for the 1-token step, one per truncation of the tree (depth 0..3).
    assert seconds >= 0 and len(graphs) == 1 + (TREE.depth + 1)
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
    warm_up(model, [TREE])
    s = Sampling(acceptance="rejection", temperature=0.8)
    runs = [medusa_generate(m, heads, [3, 1, 4, 1, 5], tree=TREE, max_new_tokens=16, sampling=s,
                            generator=torch.Generator().manual_seed(7))[0] for m in (eager, model)]
    assert runs[0] == runs[1]


def test_warm_up_and_every_generation_share_one_cache_per_size():
    model, _, _, _ = compiled_and_eager(5)
    block = model.config.block_size
    assert step_cache(tiny_model(5), block) is None  # an eager model makes its own caches
    warm_up(model, [TREE])
    plain, tree_cache = step_cache(model, block), step_cache(model, block + TREE.num_nodes)
    assert set(model.forward.caches.values()) == {plain, tree_cache}
    assert step_cache(model, block) is plain and plain.max_len == block  # the same tensors every time


def test_warm_up_refuses_a_model_that_is_not_compiled():
    with pytest.raises(ValueError, match="compile_steps"):
        warm_up(tiny_model(0), [TREE])


def test_compiling_twice_wraps_the_forward_once():
    model = tiny_model(0)
    compile_steps(model, backend="eager")
    first = model.forward
    compile_steps(model, backend="eager")
    assert model.forward is first and not isinstance(first.eager, CompiledSteps)


def test_decode_compile_reports_the_compilation_apart_from_the_timings(tmp_path, capsys, monkeypatch):
    torch.compiler.reset()
    save_tiny(tmp_path, with_heads=True)
    backend, graphs = recording_backend()
    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    argv = ["--ckpt", str(tmp_path), "--compare", "--max-new-tokens", "6", "--num-prompts", "2", "--repeat", "1",
            "--tree", "cpu"]
    assert decode.main([*argv, "--compile", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "compiled the plain step and the verify steps in" in captured.err
    assert result["compile_warmup_s"] >= 0 and graphs
    by_key = {row["key"]: row for row in result["rows"]}
    assert by_key["medusa_greedy"]["same_as_plain_greedy"]
    assert decode.main([*argv, "--json"]) == 0  # the same tokens without compiling
    eager = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in eager["rows"]] == [r["tokens"] for r in result["rows"]]
    assert eager["compile_warmup_s"] is None
    assert decode.main([*argv, "--compile"]) == 0
    assert "compiled steps (compilation" in capsys.readouterr().out
