"""`--compile` makes the eager tokens, each step shape captured in the warm-up; a backend that replays each
captured graph under CUDA graphs' rules (`GraphReplay`) checks it on a CPU in milliseconds."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import torch

import decode
from conftest import random_heads, tiny_model
from medusa_mini.cli.compiled import StaticCaches, compile_steps, warm_up
from medusa_mini.decoding import medusa_generate_batch
from medusa_mini.step import Steps, verify
from medusa_mini.tree import Tree

TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


class GraphReplay:
    """A torch.compile backend that runs each captured graph as a CUDA graph would replay it, on a CPU:
    every graph returns the same output buffers at every call, and every call first fills all graphs'
    outputs with garbage (one memory pool: a new call frees the last one's outputs); static inputs
    (parameters, tensors marked static: the KV cache) must keep their first address; other inputs are
    copied in, so a graph must not write into them."""

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
            for t in self.pool:  # NaN, or an integer no index or token can be
                t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)
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
            if not outputs:
                outputs.extend(torch.empty_like(o) for o in result)
                self.pool.extend(outputs)
            for buffer, o in zip(outputs, result):
                buffer.copy_(o)
            return tuple(outputs)

        return replay


def warmed_up(seed: int, *, backend=None, kind: str = "medusa", rows: int = 1):
    """A tiny model, heads of `kind`, its steps compiled (replayed as CUDA graphs, by `backend`) and its
    static caches, warmed up for TREE."""
    torch.compiler.reset()  # graphs are cached per function, across models: start afresh
    model, steps = tiny_model(seed), compile_steps("cpu", backend=backend or GraphReplay())
    heads = random_heads(model, seed=seed, kind=kind)
    proposer = heads.proposer(model, TREE)
    warm_up(model, steps, caches := StaticCaches(model), rows=rows, plain=True, verify=[proposer], greedy=[proposer])
    return model, heads, steps, caches


@torch.no_grad()
def test_graph_replay_poisons_a_steps_outputs_when_a_step_runs_again():
    """What catches a decoding loop that reads a step's logits or hidden state after the next step."""
    model, _, steps, caches = warmed_up(7)
    logits, hidden = steps.plain(model, caches(1, model.config.block_size), torch.tensor([[3]]))
    t = TREE.tensors("cpu")
    steps.verify(model, caches(1, model.config.block_size + TREE.num_nodes), torch.zeros(1, TREE.num_nodes,
                 dtype=torch.long), depths=t.depths, ancestor_mask=t.ancestor_mask)
    assert logits.isnan().all() and hidden.isnan().all()


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_compiled_greedy_step_drafts_the_next_tree_in_its_graph(monkeypatch, kind):
    """Compiled, greedy decoding runs the heads in the greedy verify's graph, so they launch nothing of
    their own: the eager proposer fills only the first tree and those cut short near the end, every step
    verifies the tree the eager proposer would have filled, and the tokens are the eager ones, for a
    ragged batch."""
    backend = GraphReplay()
    model, heads, steps, caches = warmed_up(5, backend=backend, kind=kind, rows=2)
    graphs, proposer_type, proposed, verified = len(backend.graphs), type(heads.proposer(model, TREE)), [], []
    propose = proposer_type.propose
    monkeypatch.setattr(proposer_type, "propose", lambda *a, **kw: proposed.append(1) or propose(*a, **kw))

    def recording(verify):  # what each step verifies: its tokens [B, N]
        return lambda model, cache, tokens, **kw: verified.append(tokens.tolist()) or verify(model, cache, tokens, **kw)

    run = partial(medusa_generate_batch, model, heads, [[1, 2, 3], [4, 5]], tree=TREE, max_new_tokens=30)
    compiled = run(steps=dataclasses.replace(steps, greedy_verify=recording(steps.greedy_verify)), cache=caches)
    drafted_eagerly, trees = len(proposed), verified[:]
    verified.clear()
    eager = run(steps=Steps(verify=recording(verify)))
    assert [out for out, _ in compiled] == [out for out, _ in eager] and trees == verified
    assert len(proposed) - drafted_eagerly == len(verified) > 1 + TREE.depth  # eager: every step proposes
    assert 1 <= drafted_eagerly <= 1 + TREE.depth  # compiled: the first tree and the truncated ones
    assert len(backend.graphs) == graphs  # the warm-up recorded the drafting graph


def test_a_kv_cache_not_marked_static_is_refused_under_cuda_graphs_rules(monkeypatch):
    """Why StaticCaches marks its tensors: a CUDA graph would write into its own copy of the cache."""
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: None)
    with pytest.raises(AssertionError, match="writes into"):
        warmed_up(9)


@pytest.mark.parametrize("flags", [["--method", "rejection", "--temperature", "0.8", "--batch-size", "2"],
                                   ["--method", "plain", "--batch-size", "2"], ["--compare"]],
                         ids=["rejection-batch-2", "plain-batch-2", "compare"])
def test_decode_prints_the_eager_tokens_with_its_steps_replayed_as_cuda_graphs(ckpt, capsys, monkeypatch, flags):
    """Prompts of three lengths, one of which meets the context; two at a time, the last batch has one row.
    --compare runs every row: plain, prompt lookup and Medusa, greedy and sampled."""
    torch.compiler.reset()
    backend, after_warm_up = GraphReplay(), []

    def counted_warm_up(*args, **kw):
        seconds = warm_up(*args, **kw)
        after_warm_up.append(len(backend.graphs))
        return seconds

    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    monkeypatch.setattr(decode, "warm_up", counted_warm_up)
    argv = ["--ckpt", ckpt, "--max-new-tokens", "12", "--tree", "cpu", "--json", "--prompt", "a big dog ran",
            "--prompt", " ".join(["the cat sat on the mat"] * 6), "--prompt", "then", *flags]
    runs = []
    for compiling in (False, True):
        assert decode.main(argv + ["--compile"] * compiling) == 0
        out, err = capsys.readouterr()
        runs.append([r["tokens"] for r in json.loads(out)["rows"]] if "--compare" in flags else
                    [[json.loads(line)["tokens"] for line in out.splitlines()]])  # rows of per-prompt tokens
        assert ("compiled the plain step and the verify steps in" in err) == compiling
    assert runs[0] == runs[1] and all(len(row) == 3 and len(row[1]) == 64 - 55 for row in runs[0])
    assert backend.graphs and len(backend.graphs) == after_warm_up[-1]
