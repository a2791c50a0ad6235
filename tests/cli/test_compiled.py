"""`--compile` makes the eager tokens, each step shape captured in the warm-up; a backend that replays each
captured graph under CUDA graphs' rules (`GraphReplay`) checks it on a CPU in milliseconds."""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial

import pytest
import torch

import decode
from conftest import RULES, random_heads, tiny_model
from medusa_mini.cli.compiled import StaticCaches, compile_steps, warm_up
from medusa_mini.decoding import medusa_generate_batch
from medusa_mini.step import Steps, draft_drawn, verify, verify_and_accept
from medusa_mini.tree import Tree

TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
EVERY_RULE = (RULES["greedy"], RULES["typical"], RULES["rejection"])


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


def warmed_up(seed: int, *, backend=None, kind: str = "medusa", rows: int = 1, rules=()):
    """A tiny model, heads of `kind`, its steps compiled (replayed as CUDA graphs, by `backend`) and its
    static caches, warmed up for TREE under `rules` (by default the plain step alone)."""
    torch.compiler.reset()  # graphs are cached per function, across models: start afresh
    model, steps = tiny_model(seed), compile_steps("cpu", backend=backend or GraphReplay())
    heads = random_heads(model, seed=seed, kind=kind)
    proposer = heads.proposer(model, TREE)
    warm_up(model, steps, caches := StaticCaches(model), rows=rows, plain=[RULES["greedy"]],
            proposers=[(proposer, rule) for rule in rules])
    return model, heads, steps, caches


def test_the_warm_up_runs_every_shape_three_times_so_cuda_graphs_record_and_replay_before_any_timing():
    """Under CUDA graphs a shape's first call runs eagerly, the second records, the third replays: a shape
    called fewer times in the warm-up would be recorded inside the first timed generation."""
    model, calls = tiny_model(0), []

    def counting(name, real):
        return lambda *args, **kw: calls.append((name, args[2].shape, kw.get("sampling"))) or real(*args, **kw)

    def drawing(*args, **kw):
        calls.append(("draw", kw["tree"].depth, kw["temperature"]))
        return draft_drawn(*args, **kw)

    steps = Steps(plain=counting("plain", Steps.plain), verify=counting("verify", Steps.verify),
                  verify_and_accept=counting("accept", verify_and_accept), draft_drawn=drawing, static=True)
    proposer = random_heads(model, seed=0).proposer(model, TREE)
    warm_up(model, steps, StaticCaches(model), rows=2, plain=[RULES["greedy"], RULES["rejection"]],
            proposers=[(proposer, r) for r in EVERY_RULE])
    # the plain step per rule (it chooses its token in its graph), one verify_and_accept per rule, one drawing graph
    shapes = list(dict.fromkeys(calls))
    assert proposer.trees() == [TREE]  # a static step never cuts the tree: one graph serves every step
    assert len(shapes) == 2 + 3 + 1 and all(calls.count(s) == 3 for s in shapes)
    assert {name for name, *_ in calls} == {"plain", "accept", "draw"}  # no rule verifies on its own


@torch.no_grad()
def test_graph_replay_poisons_a_steps_outputs_when_a_step_runs_again():
    """What catches a decoding loop that reads a step's logits or hidden state after the next step."""
    model, _, steps, caches = warmed_up(7)  # the verify compiles at its first call
    _, logits, hidden = steps.plain(model, caches(1, model.config.block_size), torch.tensor([[3]]))
    t = TREE.tensors("cpu")
    steps.verify(model, caches(1, model.config.block_size + TREE.num_nodes), torch.zeros(1, TREE.num_nodes,
                 dtype=torch.long), depths=t.depths, ancestor_mask=t.ancestor_mask)
    assert logits.isnan().all() and hidden.isnan().all()


@pytest.mark.parametrize("rule", ["greedy", "typical", "rejection-topk"])
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_compiled_step_with_top_k_candidates_drafts_the_next_tree_in_its_graph(monkeypatch, kind, rule):
    """Compiled, every rule that verifies the heads' top-k runs the heads in `verify_and_accept`'s graph, so
    they launch nothing of their own: the eager proposer fills only the first tree; every step verifies the
    whole tree, whose first nodes are the tree the eager step verifies (cut near the end), and the tokens
    are the eager ones (typical: the same draws), for a ragged batch."""
    backend = GraphReplay()
    model, heads, steps, caches = warmed_up(5, backend=backend, kind=kind, rows=2, rules=(RULES[rule],))
    graphs, proposer_type, proposed, verified = len(backend.graphs), type(heads.proposer(model, TREE)), [], []
    propose = proposer_type.propose
    monkeypatch.setattr(proposer_type, "propose", lambda *a, **kw: proposed.append(1) or propose(*a, **kw))

    def recording(verify):  # what each step verifies: its tokens [B, N]
        return lambda model, cache, tokens, **kw: verified.append(tokens.tolist()) or verify(model, cache, tokens, **kw)

    def run(**kw):
        return medusa_generate_batch(model, heads, [[1, 2, 3], [4, 5]], tree=TREE, max_new_tokens=30,
                                     sampling=RULES[rule], generator=torch.Generator().manual_seed(3), **kw)

    compiled = run(steps=dataclasses.replace(steps, verify_and_accept=recording(steps.verify_and_accept)), cache=caches)
    drafted_eagerly, trees = len(proposed), verified[:]
    verified.clear()
    eager = run(steps=Steps(verify=recording(verify)))
    assert [out for out, _ in compiled] == [out for out, _ in eager] and len(trees) == len(verified)
    assert all(len(whole) == TREE.num_nodes and whole[: len(cut)] == cut
               for step, eager_step in zip(trees, verified) for whole, cut in zip(step, eager_step))
    assert any(len(step[0]) < TREE.num_nodes for step in verified)  # the eager steps cut the tree near the end
    assert len(proposed) - drafted_eagerly == len(verified) > 1 + TREE.depth  # eager: every step proposes
    assert drafted_eagerly == 1  # compiled: the first tree alone
    assert len(backend.graphs) == graphs  # the warm-up recorded the drafting graph


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_compiled_step_draws_and_tries_candidates_in_its_graphs_with_the_eager_draws(kind, monkeypatch):
    """Rejection sampling of candidates drawn from q, compiled: the heads draw the first tree in
    `draft_drawn`'s graph, and every step after it tries them and draws the next tree in
    `verify_and_accept`'s, one graph a step, with the uniforms drawn before, the eager proposer's numbers
    in the eager order; every step of a ragged batch goes through the recorded graphs on the whole tree
    (the eager steps cut it near the end), the eager proposer draws nothing, and the tokens are the eager
    ones, draw for draw."""
    backend, rule = GraphReplay(), RULES["rejection"]
    model, heads, steps, caches = warmed_up(6, backend=backend, kind=kind, rows=2, rules=(rule,))
    graphs, calls, drawn_eagerly, drawn_depths = len(backend.graphs), [], [], []
    proposer_type = type(heads.proposer(model, TREE))
    propose = proposer_type.propose
    monkeypatch.setattr(proposer_type, "propose", lambda *a, **kw: (p := propose(*a, **kw), drawn_eagerly.append(
        p.draft is not None))[0])
    counted = dataclasses.replace(steps, verify_and_accept=lambda *a, **kw: calls.append(1) or
                                  steps.verify_and_accept(*a, **kw),
                                  draft_drawn=lambda *a, **kw: drawn_depths.append(kw["tree"].depth) or
                                  steps.draft_drawn(*a, **kw))

    def run(**kw):
        return medusa_generate_batch(model, heads, [[1, 2, 3], [4, 5]], tree=TREE, max_new_tokens=30,
                                     sampling=rule, generator=torch.Generator().manual_seed(4), **kw)

    compiled = run(steps=counted, cache=caches)
    assert not any(drawn_eagerly) and drawn_depths == [TREE.depth]  # the first tree; the graph draws the rest
    eager = run()
    assert [out for out, _ in compiled] == [out for out, _ in eager] and sum(drawn_eagerly) > 1
    assert len(calls) == max(st.steps for _, st in compiled)
    assert sum(sum(st.accepted_nodes) for _, st in compiled) > 0  # the walk accepted candidates, not only bonuses
    assert len(backend.graphs) == graphs  # the warm-up recorded every graph the run replays


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


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler on a CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inductor_writes_and_compacts_the_kv_cache_in_place_never_copying_it_whole(tmp_path, monkeypatch, dtype):
    """A compiled step writes each new key into the cache where it lies and keeps the path as the eager one
    does, bit for bit: a scatter_ inductor applies to a copy of the whole cache tensor, then copies back (two full copies per
    layer and kind, every step); an index_put_ through an int16 view of a half-precision cache it writes
    back as converted numbers. The generated code must allocate no buffer of a cache tensor's shape."""
    from torch._inductor.utils import run_and_get_code

    from medusa_mini.model import KVCache, compact_kv_cache
    from medusa_mini.step import plain_step

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # generate the code, not a cached copy
    torch._dynamo.reset()
    model = tiny_model(block_size=80).to(dtype).eval()
    eager, compiled = (KVCache(model.config, batch_size=2, max_len=80, dtype=dtype) for _ in range(2))
    for cache in (eager, compiled):
        cache.lengths = torch.tensor([5, 9])
    whole = "empty_strided_cpu((2, 2, 80, 16)"  # [B, nh, max_len, hs]
    tokens = torch.tensor([[3, 1, 4], [1, 5, 9]])
    # Row b's accepted slots from start[b], and where they go: [start[b], start[b] + 3), overlapping them.
    keep, start, count = torch.tensor([[5, 7, 8], [9, 10, 12]]), torch.tensor([5, 9]), torch.tensor([2, 3])
    with torch.no_grad():
        plain_step(model, eager, tokens)
        _, code = run_and_get_code(torch.compile(plain_step, fullgraph=True), model, compiled, tokens)
        assert code and not any(whole in c for c in code)
        for a, b in zip(eager.k + eager.v, compiled.k + compiled.v):  # the same values: compaction only moves them
            a.copy_(torch.randn(a.shape, generator=torch.Generator().manual_seed(0)))
            b.copy_(a)
        compact_kv_cache(eager, keep, start=start, count=count)
        _, code = run_and_get_code(torch.compile(compact_kv_cache, fullgraph=True), compiled, keep, start=start,
                                   count=count)
        assert code and not any(whole in c for c in code)
    for a, b in zip(eager.k + eager.v + [eager.length_buffer], compiled.k + compiled.v + [compiled.length_buffer]):
        assert torch.equal(a, b)
    torch._dynamo.reset()
