"""`--compile` makes the eager tokens, each step shape captured in the warm-up; a backend that replays each
captured graph under CUDA graphs' rules (`GraphReplay`) checks it on a CPU in milliseconds."""

import json
import shutil
from functools import partial

import pytest
import torch

import decode
from conftest import RULES, random_heads, tiny_model
from medusa_mini.cli import compiled as compiled_wing
from medusa_mini.cli import runs as runs_mod
from medusa_mini.cli.compiled import compile_options, compile_steps, verify_and_accept, warm_up, with_aligned_head
from medusa_mini.decoding import generate_batch, medusa_generate_batch
from medusa_mini.model import KVCache, compact_kv_cache
from medusa_mini.proposal import PromptLookup
from medusa_mini.step import plain_step
from medusa_mini.tree import Tree, chain

TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])


class GraphReplay:
    """A torch.compile backend that runs each captured graph as a CUDA graph would replay it, on a CPU: every graph
    returns the same output buffers at every call, and every call first fills all graphs' outputs with garbage (one
    memory pool: a new call frees the last one's outputs); static inputs (parameters, tensors marked static: the KV
    cache) must keep their first address; other inputs are copied in, so a graph must not write into them."""

    def __init__(self) -> None:
        self.graphs, self.pool = [], []  # every graph captured, and every graph's output buffers

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        static = [getattr(t, "_dynamo_static_input_type", None) is not None for t in example_inputs]
        addresses, outputs = {}, []  # each static input's first address; this graph's output buffers
        self.graphs.append(gm)

        def replay(*args):
            for t in self.pool:  # NaN, or an integer no index or token can be
                t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)
            for i, t in enumerate(args):
                assert not static[i] or addresses.setdefault(i, t.data_ptr()) == t.data_ptr(), (
                    f"{names[i]} moved: a CUDA graph would replay on the address it recorded")
            inputs = [t if static[i] else t.clone() for i, t in enumerate(args)]
            versions, result = [t._version for t in inputs], gm(*inputs)  # each input's version before the call
            for i, t in enumerate(inputs):
                assert static[i] or t._version == versions[i], (
                    f"the graph writes into {names[i]}, which is not static: a CUDA graph would write its own copy")
            if not outputs:
                outputs.extend(torch.empty_like(o) for o in result)
                self.pool.extend(outputs)
            return tuple(buffer.copy_(o) for buffer, o in zip(outputs, result))  # copy_ returns the buffer

        return replay


def warmed_up(seed: int, *, kind: str = "medusa", rows: int = 1, rules=()):
    """A tiny model (its lm_head aligned, as on CUDA), heads of `kind`, its steps compiled, its static caches and the
    GraphReplay replaying them as CUDA graphs, warmed up for TREE under `rules` (by default the plain step alone)."""
    torch.compiler.reset()  # graphs are cached per function, across models: start afresh
    model = with_aligned_head(tiny_model(seed, vocab_size=50), devices=("cpu",))
    steps, heads = compile_steps("cpu", backend=(backend := GraphReplay())), random_heads(model, seed=seed, kind=kind)
    warm_up(model, steps, caches := compiled_wing.static_caches(model), plain=[RULES["greedy"]] * (not rules),
            rows=rows, proposers=[(heads.proposer(model, TREE), rule) for rule in rules])
    return model, heads, steps, caches, backend


def test_the_warm_up_runs_every_shape_three_times_so_cuda_graphs_record_and_replay_before_any_timing():
    """Under CUDA graphs a shape's first call runs eagerly, the second records, the third replays: a shape
    called fewer times in the warm-up would be recorded inside the first timed generation. One shape per
    plain rule, one verify_and_accept per Medusa rule (the whole tree, never cut), one first drawn tree."""
    model, calls, slots = tiny_model(0), [], []

    def compile(fn):  # runs fn eagerly, recording each call: its name, its third argument's shape, the rule
        def run(*args, **kw):
            slots.append(args[1].max_len) if fn.__name__ == "verify_and_accept" else None  # its cache's
            calls.append((fn.__name__, tuple(args[2].shape), kw.get("sampling", kw.get("temperature"))))
            return fn(*args, **kw)
        return run

    steps, proposer = compile_steps("cpu", compile=compile), random_heads(model, seed=0).proposer(model, TREE)
    limit = torch._dynamo.config.recompile_limit  # each shape is one more specialisation: one more allowed
    warm_up(model, steps, compiled_wing.static_caches(model), rows=2, plain=[RULES["greedy"], RULES["rejection"]],
            proposers=[(proposer, RULES[r]) for r in ("greedy", "typical", "rejection")])
    assert proposer.trees() == [TREE] and len(set(calls)) == 2 + 3 + 1 and all(calls.count(s) == 3 for s in calls)
    assert {name for name, *_ in calls} == {"plain_step", "verify_and_accept", "draft_tree"}
    assert torch._dynamo.config.recompile_limit == limit + 2 + 3  # two plain rules, three rules' trees
    calls.clear(), slots.clear()
    lookup = PromptLookup().proposer(model, chain(8))  # a chain of each length prompt lookup may verify: 0, 1, 2, 4, 8
    warm_up(model, steps, compiled_wing.static_caches(model), rows=1, proposers=[(lookup, RULES["greedy"])])
    assert sorted(shape for _, shape, _ in set(calls)) == [(1, n) for n in (1, 2, 3, 5, 9)]
    assert set(slots) == {model.config.block_size + 9}  # each on the cache decoding gives the whole chain


@torch.no_grad()
def test_graph_replay_poisons_a_steps_outputs_at_the_next_step_and_refuses_a_cache_not_marked_static(monkeypatch):
    """What catches a loop that reads a step's logits or hidden state after the next step, and a cache a CUDA graph
    would write a copy of (static_caches marks its tensors)."""
    model, _, steps, caches, _ = warmed_up(7)
    block, N = model.config.block_size, TREE.num_nodes
    token, logits, hidden = steps.plain(model, caches(1, block), torch.tensor([[3]]))
    steps.medusa.verify_and_accept(model, caches(1, block + N), torch.zeros(1, N, dtype=torch.long),
                                   tree=TREE.tensors(), stop_at=torch.tensor([block]), sampling=RULES["greedy"], u=None)
    assert logits.isnan().all() and hidden.isnan().all() and int(token[0]) >= 0  # the token was copied out
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: None)
    pytest.raises(AssertionError, warmed_up, 9).match("writes into")
    assert [compile_options(d)["mode"] for d in ("cuda", "cpu")] == ["reduce-overhead", None]  # graphs on CUDA only


def run_both(model, drafter, sampling, steps, *, tree=TREE, prompts=([1, 2, 3], [4, 5]), cache=None):
    """(eager, with `steps` and `cache`) tokens of a Medusa generation of a ragged batch, from the same seed."""
    return [[out for out, _ in medusa_generate_batch(model, drafter, list(prompts), tree=tree, max_new_tokens=30,
                                                     sampling=sampling, generator=torch.Generator().manual_seed(3),
                                                     **kw)] for kw in ({}, dict(steps=steps, cache=cache))]


@pytest.mark.parametrize("rule", RULES)
def test_the_fixed_shape_steps_make_the_eager_tokens_for_every_drafter_and_tree(rule):
    """Run eagerly, in a ragged batch whose long prompt meets the context: plain decoding and Medusa with heads
    of both kinds, prompt lookup and a tree of the root alone make the eager tokens, draw for draw."""
    model, sampling = tiny_model(15), RULES[rule]
    steps, prompts = compile_steps("cpu", compile=lambda fn: fn), ([1, 2, 3], [4, 5], list(range(1, 50)))
    plain = [generate_batch(model, list(prompts), max_new_tokens=20, sampling=sampling,
                            generator=torch.Generator().manual_seed(4), **kw) for kw in ({}, dict(steps=steps))]
    assert plain[0] == plain[1]
    for drafter in (random_heads(model, seed=15), random_heads(model, seed=15, kind="hydra"), PromptLookup()):
        for tree in (TREE, Tree.from_choices([])):
            eager, fixed = run_both(model, drafter, sampling, steps, tree=tree, prompts=prompts)
            assert eager == fixed


@torch.no_grad()
def test_verify_and_accept_refuses_a_sampled_rule_without_its_uniforms_before_writing_the_cache():
    cache = KVCache((model := tiny_model(5)).config, batch_size=1, max_len=64)
    args = (model, cache, torch.zeros(1, TREE.num_nodes, dtype=torch.long))
    kw = dict(tree=TREE.tensors("cpu"), stop_at=torch.tensor([64]))
    for rule in ("typical", "rejection"):
        pytest.raises(ValueError, lambda: verify_and_accept(*args, **kw, sampling=RULES[rule], u=None)).match("uniform")
    assert int(cache.lengths[0]) == 0
    accepted, hidden, *_ = verify_and_accept(*args, **kw, sampling=RULES["typical"], u=torch.tensor([0.5]))
    assert hidden.shape == (1, model.config.n_embd) and int(cache.lengths[0]) == TREE.depths[int(accepted.last[0])] + 1


@pytest.mark.parametrize("rule", ["greedy", "typical", "rejection-topk", "rejection"])
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_a_compiled_step_drafts_the_next_tree_in_its_graph_and_makes_the_eager_tokens(kind, rule, monkeypatch):
    """Compiled (graphs replayed as CUDA graphs would), every step verifies, accepts and drafts the next tree
    in `verify_and_accept`'s one graph, with the uniforms drawn before in the eager order: the eager
    proposer fills no tree but, for top-k candidates, the first (drawn ones: `draft_tree`'s graph draws
    it), and the tokens are the eager ones, for a ragged batch; the warm-up recorded every graph; none sorts."""
    model, heads, steps, caches, backend = warmed_up(5, kind=kind, rows=2, rules=(RULES[rule],))
    graphs, proposer_type, proposed, calls = len(backend.graphs), type(heads.proposer(model, TREE)), [], []
    propose, verify = proposer_type.propose, steps.medusa.verify_and_accept
    monkeypatch.setattr(proposer_type, "propose", lambda *a, **kw: proposed.append(1) or propose(*a, **kw))
    steps.medusa.verify_and_accept = lambda *a, **kw: calls.append(1) or verify(*a, **kw)
    eager, compiled = run_both(model, heads, RULES[rule], steps, cache=caches)
    assert compiled == eager and len(proposed) - (rule != "rejection") == len(calls) > 1
    assert len(backend.graphs) == graphs and sum(map(len, compiled)) == 60
    targets = {getattr(node.target, "__name__", node.target) for gm in backend.graphs for node in gm.graph.nodes}
    assert not targets & {"sort", "argsort", "msort"}


def test_an_aligned_head_writes_the_models_logits_at_a_stride_of_64_and_leaves_the_model_as_it_was():
    """On CUDA the compiled steps run a twin whose lm_head pads the vocabulary (`warmed_up`'s on a CPU)."""
    model, ids = tiny_model(3, vocab_size=50), torch.tensor([[1, 2, 3]])
    twin = with_aligned_head(model, devices=("cpu",))
    assert with_aligned_head(model) is model and twin.transformer is model.transformer  # CUDA only
    assert isinstance(with_aligned_head(tiny_model(3), devices=("cpu",)).lm_head, torch.nn.Linear)  # V = 64: no twin
    assert isinstance(model.lm_head, torch.nn.Linear) and twin(ids)[0].stride(-2) == 64
    torch.testing.assert_close((twin(ids)[0], twin.lm_head.weight), (model(ids)[0], model.lm_head.weight))


@pytest.mark.parametrize("flags", ["--method rejection --temperature 0.8 --batch-size 2",
                                   "--method plain --batch-size 2", "--compare --batch-size 1,4"])
def test_decode_prints_the_eager_tokens_with_its_steps_replayed_as_cuda_graphs(ckpt, capsys, monkeypatch, flags,
                                                                               one_run_each):
    """Prompts of three lengths, one meeting the context; two at a time, the last batch has one row. --compare runs
    every row, each batch size warmed up just before its timing: no run records a graph. Compiled, the run's model is
    the aligned twin, as on CUDA: its logits may differ in a last bit, which no choice here is near enough to feel."""
    torch.compiler.reset()
    backend = GraphReplay()

    def replayed(engine, *args, real=runs_mod.decode, **kw):  # compiled: `with_aligned_head`'s twin, replaying
        graphs, result = len(backend.graphs), real(engine, *args, **kw)
        assert len(backend.graphs) == graphs and not (graphs and isinstance(engine.ck.model.lm_head, torch.nn.Linear))
        return result

    monkeypatch.setattr(decode, "with_aligned_head", partial(with_aligned_head, devices=("cpu",)))  # as on CUDA
    monkeypatch.setattr(decode, "compile_steps", partial(compile_steps, backend=backend))
    monkeypatch.setattr(decode, "decode", replayed)  # the runs of one batch at a time, and --compare's
    monkeypatch.setattr(runs_mod, "decode", replayed)
    argv = ["--ckpt", ckpt, "--max-new-tokens", "12", *["--tree", "cpu"] * ("plain" not in flags), "--json", "--prompt",
            "a big dog ran", "--prompt", " ".join(["the cat sat on the mat"] * 6), "--prompt", "then", *flags.split()]
    runs = []
    for compiling in (False, True):
        assert decode.main(argv + ["--compile"] * compiling) == 0
        out, err = capsys.readouterr()
        runs.append([r["tokens"] for r in json.loads(out)["rows"]] if "--compare" in flags else
                    [[json.loads(line)["tokens"] for line in out.splitlines()]])  # rows of per-prompt tokens
        steps = ["the plain step"] * ("rejection" not in flags) + ["Medusa's steps"] * ("plain" not in flags)
        assert (f"compiled {' and '.join(steps)} in" in err) == compiling  # the steps it warmed up
    rows = 3 + ("--compare" in flags)  # batch 4 cycles the 3 prompts: warmed up on 4 rows, not 3
    assert runs[0] == runs[1] and all(len(row) == rows and len(row[1]) == 64 - 55 for row in runs[0]) and backend.graphs


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler on a CPU")
def test_inductor_writes_and_compacts_the_kv_cache_in_place_never_copying_it_whole(tmp_path, monkeypatch):
    """A compiled step writes each new key into the cache where it lies and keeps the path as the eager one
    does, bit for bit: a write through one layer's view, or a scatter_, inductor applies to a copy of that
    layer or of the whole cache, then copies back, every step. The generated code must allocate no buffer of
    a layer's keys' or values' shape, [..., max_len, hs]."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # generate the code, not a cached copy
    torch._dynamo.reset()
    model = tiny_model(block_size=80, n_layer=1).eval()  # one layer's view shows a copy as two would
    eager, compiled = (KVCache(model.config, batch_size=2, max_len=80) for _ in range(2))
    eager.lengths = compiled.lengths = torch.tensor([5, 9])

    def compiled_in_place(fn, *args, **kwargs) -> bool:  # fn compiled: no buffer of [..., max_len, hs]
        code = run_and_get_code(torch.compile(fn, fullgraph=True), *args, **kwargs)[1]
        return bool(code) and not any("empty_strided" in s and ", 80, 16)" in s for c in code for s in c.splitlines())

    tokens = torch.tensor([[3, 1, 4], [1, 5, 9]])
    # Row b's accepted slots from start[b], and where they go: [start[b], start[b] + 3), overlapping them.
    keep, to, length = (torch.tensor(t) for t in ([[5, 7, 8], [9, 10, 12]], [[5, 6, 7], [9, 10, 11]], [7, 12]))
    with torch.no_grad(), torch._inductor.config.patch({"cpp.simdlen": 1}):  # scalar kernels: built sooner
        plain_step(model, eager, tokens)
        assert compiled_in_place(plain_step, model, compiled, tokens)
        eager.kv.copy_(torch.randn(eager.kv.shape, generator=torch.Generator().manual_seed(0)))
        compiled.kv.copy_(eager.kv)  # the same values: compaction only moves them
        compact_kv_cache(eager, keep, to=to, length=length)
        assert compiled_in_place(compact_kv_cache, compiled, keep, to=to, length=length)
    assert torch.equal(eager.kv, compiled.kv) and torch.equal(eager.length_buffer, compiled.length_buffer)
    torch._dynamo.reset()
