"""What one decoding step costs, stage by stage: a plain step against Medusa's verify, heads and whole step.

    python benchmarks/bench_step.py                          # tiny and gpt2-shaped models, this device
    python benchmarks/bench_step.py --configs tiny --threads 2 --json
    python benchmarks/bench_step.py --configs gpt2 --dtypes float32,bfloat16 --compile   # a GPU

Speedup = tokens/step ÷ step cost: Medusa pays only if verifying N nodes costs little more than a plain step.
On random weights (speed depends on shapes, not values): per Medusa tree each stage of a step, its device operations."""

import json
import os
import platform
import shlex
import statistics
import sys
from argparse import Namespace
from collections import Counter
from functools import partial
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from anywhere, uninstalled

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from medusa_mini.acceptance import Accepted, acceptance_uniforms
from medusa_mini.cli.common import OneLineParser, at_least, exit_with, in_turns, names_of, numbers, seed, timed
from medusa_mini.cli.compiled import compile_options, compile_steps, static_caches, verify_and_accept, with_aligned_head
from medusa_mini.decoding import prefill
from medusa_mini.heads import DraftHeads, HeadsConfig, make_heads
from medusa_mini.io.gpt2 import GPT2_CONFIGS
from medusa_mini.model import GPT, GPTConfig, KVCache
from medusa_mini.sampling import SAMPLING_TEMPERATURE, Sampling
from medusa_mini.step import Steps, read_step, verify
from medusa_mini.train.device import DTYPES, pick_device, pick_dtype
from medusa_mini.tree import Tree, build_tree, preset

CONFIGS: dict[str, GPTConfig] = {"tiny": GPTConfig(), **GPT2_CONFIGS}
NODES = (1, 2, 4, 8, 16, 32, 64)
CUDA_NODES = (*NODES, 96, 128)  # a GPU at batch 1 may verify this many for about the price of one
MEDUSA_TREES = ("cpu", "gpu")
STAGES = ("heads", "verify", "greedy verify", "rejection verify", "host read", "whole step")
DRAFT_VOCAB = 4096  # the default draft vocabulary of a larger vocabulary (GPT-2's): its heads cost < 10% of a step


def verify_tree(nodes: int) -> Tree:
    """The best tree of N nodes (root included) for heads right 60%, 36%, ... of the time at rank 0."""
    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(10)] for k in range(4)])  # [K heads, R ranks]
    return build_tree(acc, nodes - 1)[0]


def check_config(config: GPTConfig, *, prefix_len: int, draft_vocab: int | None) -> int:
    """M, the heads' draft vocabulary (0: all; default DRAFT_VOCAB of a larger one); a ValueError if trees can't fit."""
    depth, ranks = (max(getattr(preset(name), k) for name in MEDUSA_TREES) for k in ("depth", "max_rank"))
    if not 1 <= prefix_len < config.block_size - depth:
        raise ValueError(f"--prefix {prefix_len} must be from 1 to {config.block_size - depth - 1}, so that a "
                         f"depth-{depth} tree fits after it in the context of {config.block_size}")
    size = draft_vocab if draft_vocab is not None else DRAFT_VOCAB if config.vocab_size > DRAFT_VOCAB else 0
    if size != 0 and not ranks < size <= config.vocab_size:
        raise ValueError(f"--draft-vocab {size}: give 0 (all) or {ranks + 1} to {config.vocab_size}")
    return size


def tree_stages(model: GPT, cache: KVCache, heads: DraftHeads, tree: Tree, root: torch.Tensor, hidden: torch.Tensor,
                *, history: list[list[int]], steps: Steps, compiled: bool, verify_step: Callable) -> dict:
    """One callable per stage of a Medusa step on `tree`, inputs made once (every run takes the same path)."""
    proposer, gen, device = heads.proposer(model, tree), torch.Generator(root.device).manual_seed(0), root.device
    attended = None if compiled else len(history[0]) - 1 + tree.num_nodes  # the prefix and the nodes
    t, stop_at = tree.tensors(device), torch.full_like(root, model.config.block_size)
    greedy, drawn = Sampling(), Sampling(temperature=SAMPLING_TEMPERATURE)
    propose = partial(proposer.propose, root, hidden, history=history, sampling=greedy, u=None)
    proposal, sampled = propose(), propose(sampling=drawn, u=proposer.uniforms(drawn, 1, gen, device=device))
    check = partial(steps.medusa.verify_and_accept if compiled else verify_and_accept, model, cache, tree=t,
                    stop_at=stop_at, attended=attended, heads=proposer.heads if compiled else None)
    greedy_verify = partial(check, proposal.tokens, sampling=greedy, u=None)
    accepted = Accepted(*(x.clone() for x in greedy_verify()[0]))  # out of a graph's buffers: the next call reuses them
    rejection_verify = partial(check, sampled.tokens, sampling=drawn, drawn=sampled.drawn,
                               u=acceptance_uniforms(drawn, 1, tree.num_nodes, gen, device=device),
                               u_next=proposer.uniforms(drawn, 1, gen, device=device) if compiled else None)

    def whole_step():
        if compiled:  # the tree the last step drafted in its graph (no eager heads), for these roots, proposer and rule
            steps.medusa.ahead = ((root, proposer, greedy), proposal)
        return steps.medusa(model, cache, proposer, root, hidden, history=history, stop_at=None, sampling=greedy,
                            attended=attended)
    return {"heads": propose, "greedy verify": greedy_verify, "rejection verify": rejection_verify,
            "verify": partial(verify_step, model, cache, proposal.tokens, tree=t, attended=attended, clamp=False),
            "host read": partial(read_step, proposal, accepted), "whole step": whole_step}


class OpCounter(TorchDispatchMode):
    """Counts the device operations a call dispatches, by name: every operator below Python but views (they
    launch nothing) and reads of device values on the host (the step's one read)."""

    SKIPPED = ("aten::_local_scalar_dense", "aten::lift_fresh", "aten::detach", "aten::_unsafe_view")

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func._schema.name
        to_host = name == "aten::_to_copy" and torch.device(kwargs.get("device") or args[0].device).type == "cpu"
        if not (func.is_view or name in self.SKIPPED or (to_host and args[0].device.type != "cpu")):
            self.ops[name] += 1
        return func(*args, **kwargs)


def count_ops(fn: Callable[[], object]) -> Counter[str]:
    with OpCounter() as counter:
        fn()
    return counter.ops


OP_RULES = {"greedy": Sampling(), "typical": Sampling(acceptance="typical", temperature=SAMPLING_TEMPERATURE),
            "rejection": Sampling(temperature=SAMPLING_TEMPERATURE),
            "rejection top-k": Sampling(temperature=SAMPLING_TEMPERATURE, candidates="topk")}
PLAIN_OF = {rule: "greedy" if sampling.greedy else "sampling" for rule, sampling in OP_RULES.items()}


def step_ops(model: GPT, heads: DraftHeads, caches: dict[int, KVCache], trees: dict[str, Tree], root: torch.Tensor,
             hidden: torch.Tensor, *, history: list[list[int]], reset: Callable[[], None]) -> dict[str, int]:
    """Device operations of one eager step: the plain one (its uniform drawn, the token chosen) under greedy
    and sampling, and Medusa's on each tree under each rule (proposal to host read); and of one heads call."""
    gen, device, counts, eager = torch.Generator(root.device).manual_seed(0), root.device, {}, Steps()
    for name, sampling in (("plain greedy", OP_RULES["greedy"]), ("plain sampling", OP_RULES["rejection"])):
        reset()
        counts[name] = count_ops(lambda: eager.plain(model, caches[0], root[:, None], sampling=sampling,
                                                     u=sampling.uniforms((1,), gen, device=device)))
    for tree_name, tree in trees.items():  # steps with room for the whole tree, as most are
        proposer, slots = heads.proposer(model, tree), len(history[0]) + tree.num_nodes - 1  # prefix, nodes
        counts[f"{tree_name} heads call"] = count_ops(lambda: proposer.logits_of(hidden, tree.depth))
        for rule, sampling in OP_RULES.items():
            step = partial(eager.medusa, model, caches[tree.num_nodes], proposer, root, hidden, history=history,
                           stop_at=None, sampling=sampling, generator=gen, attended=slots)
            step()  # the tree's index tensors are made at its first step, once
            reset()
            counts[f"{tree_name} {rule}"] = count_ops(step)
            reset()  # every step from the prefix: at the longest --prefix a second step's nodes would pass the context
    return {key: sum(ops.values()) for key, ops in counts.items()}


@torch.no_grad()
def bench_config(config: GPTConfig, *, device: torch.device, repeat: int, warmup: int = 3, prefix_len: int = 128,
                 nodes: tuple[int, ...] = NODES, seed: int = 0, dtype: torch.dtype = torch.float32,
                 draft_vocab: int | None = None, compiled: bool = False, compile_backend: str = "inductor") -> dict:
    """Every timing of one config in one dtype (ms), eager or with compiled steps, and the eager steps' operations."""
    draft_vocab = check_config(config, prefix_len=prefix_len, draft_vocab=draft_vocab)
    torch.manual_seed(seed)
    with device:  # initialise in place: copying a large model across devices costs more than its init
        model = GPT(config).eval().to(dtype)
        heads = make_heads(HeadsConfig(4, config.n_embd, config.vocab_size, draft_vocab)).eval().to(dtype)  # ids < M
    trees, steps, verify_step = {name: preset(name) for name in MEDUSA_TREES}, Steps(), verify
    if compiled:
        torch.compiler.reset()  # compiled code is kept per function, across models: start afresh
        model, steps = with_aligned_head(model), compile_steps(device, backend=compile_backend)
        verify_step = torch.compile(verify, **compile_options(device, backend=compile_backend))
        torch._dynamo.config.recompile_limit += len(nodes) + len(trees) + 1  # one graph per shape
        warmup = max(warmup, 3) if device.type == "cuda" else warmup  # CUDA graphs: eager, record, replay
    gen, static = torch.Generator().manual_seed(seed), static_caches(model)
    prefix = torch.randint(0, config.vocab_size, (1, prefix_len), generator=gen).to(device)  # [1, P]
    # As decoding sizes them: a step over N nodes on block_size + N slots (a compiled step reads them all).
    caches = {n: static(1, config.block_size + n) for n in {0, *nodes, *(t.num_nodes for t in trees.values())}}
    for cache in caches.values():
        logits, hidden = prefill(model, prefix, cache)  # [1, V], [1, C]
    root = logits.argmax(dim=-1)  # [1], kept on the device as decoding keeps it
    history = [prefix[0].tolist() + root.tolist()]

    def reset() -> None:
        for cache in caches.values():
            cache.lengths = prefix_len  # later slots are stale and get overwritten, as in decoding
    ops = step_ops(model, heads, caches, trees, root, hidden, history=history, reset=reset)  # caches left at the prefix
    calls: dict[str, Callable[[], object]] = {  # the plain step's greedy token [1], chosen in the step, read
        "plain": lambda: int(steps.plain(model, caches[0], root[:, None], attended=prefix_len + 1)[0][0])}
    for n in nodes:
        t, tokens = verify_tree(n).tensors(device), torch.randint(0, config.vocab_size, (1, n), generator=gen)
        calls[f"verify {n}"] = partial(verify_step, model, caches[n], tokens.to(device), tree=t,
                                       attended=None if compiled else prefix_len + n)
    stages_of = partial(tree_stages, history=history, steps=steps, compiled=compiled, verify_step=verify_step)
    stages, setup_s = timed(device, lambda: {name: stages_of(model, caches[tree.num_nodes], heads, tree, root, hidden)
                                             for name, tree in trees.items()})
    calls.update({f"{name} {stage}": fn for name in trees for stage, fn in stages[name].items()})
    runs = in_turns(calls, rounds=warmup + repeat, device=device, before_each=reset)
    ms = {key: 1e3 * statistics.median(s for _, s in times[warmup:]) for key, times in runs.items()}
    medusa = {}
    for name, tree in trees.items():
        stage_ms, step = {stage: ms[f"{name} {stage}"] for stage in STAGES}, ms[f"{name} whole step"]
        medusa[name] = {"nodes": tree.num_nodes, "stages_ms": stage_ms, "heads_share": stage_ms["heads"] / ms["plain"],
                        "step_vs_plain": step / ms["plain"], "step_vs_verify": step / stage_ms["verify"],
                        "ops": {r: ops[f"{name} {r}"] for r in OP_RULES}, "heads_call_ops": ops[f"{name} heads call"],
                        "accepted": len(runs[f"{name} whole step"][-1][0].paths[0]) - 1}  # random weights: few
    return {"config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")},
            "draft_vocab": heads.draft_ids.numel(), "prefix_len": prefix_len, "repeat": repeat, "warmup": warmup,
            "dtype": str(dtype).split(".")[-1], "compiled": compiled, "plain_ms": ms["plain"],
            "plain_ops": {"greedy": ops["plain greedy"], "sampling": ops["plain sampling"]},
            "first_round_s": setup_s + sum(times[0][1] for times in runs.values()),
            "verify_ms": {n: ms[f"verify {n}"] for n in nodes}, "medusa": medusa}


def format_table(results: dict[str, dict], meta: dict) -> str:
    """Configs as columns, one timing per row (ms, or what a label's '(x)' or '(%)' says), under `meta`."""
    rs, load = list(results.values()), meta["load_avg_1min"]
    shapes = ["{n_layer} / {n_head} / {n_embd} / {vocab_size} / {draft_vocab}".format(**r["config"], **r) for r in rs]
    rows = [("", list(results)), ("layers / heads / width / vocabulary / draft", shapes),
            ("first round, s (compiling, if any)", [r["first_round_s"] for r in rs]),
            ("plain step (1 token + argmax)", [r["plain_ms"] for r in rs]),
            ("plain step, device operations (greedy / sampling)",
             [f"{r['plain_ops']['greedy']} / {r['plain_ops']['sampling']}" for r in rs])]
    rows += [(f"verify, N = {n}", [r["verify_ms"][n] for r in rs]) for n in rs[0]["verify_ms"]]
    for tree, info in rs[0]["medusa"].items():
        m = [r["medusa"][tree] for r in rs]
        rows += [(f"{tree} tree ({info['nodes']} nodes incl. root): {stage}", [x["stages_ms"][stage] for x in m])
                 for stage in STAGES]
        rows += [(f"{tree} tree: {rule} step, device operations (x plain)",  # against plain's of its temperature
                  [f"{x['ops'][rule]} ({x['ops'][rule] / r['plain_ops'][PLAIN_OF[rule]]:.2f})" for x, r in zip(m, rs)])
                 for rule in OP_RULES]
        rows += [(f"{tree} tree: heads / plain step (%)", [100 * x["heads_share"] for x in m]),
                 (f"{tree} tree: whole step / plain step (x)", [x["step_vs_plain"] for x in m]),
                 (f"{tree} tree: whole step / verify alone (x)", [x["step_vs_verify"] for x in m])]
    rows = [(label, [v if isinstance(v, str) else f"{v:.2f}" for v in vs]) for label, vs in rows]
    width = max(len(label) for label, _ in rows) + 2
    col = max(12, *(len(v) + 2 for _, values in rows for v in values))  # the names' too
    lines = [f"torch {meta['torch']}, {meta['device']} ({meta['device_name']}), {meta['threads']} threads, load "
             f"average {'unknown' if load is None else f'{load:.2f}'} before the run", f"command: {meta['command']}\n"]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in vals) for label, vals in rows]
    lines.append(f"\nms, median of the repetitions after {rs[0]['warmup']} warm-up rounds, steps in turns; KV cache "
                 f"holding {rs[0]['prefix_len']} tokens before each step; random weights, greedy acceptance but in the "
                 "rejection verify (candidates drawn from q at T = 0.8)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> Namespace:
    p = OneLineParser(prog="python benchmarks/bench_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=names_of(CONFIGS), default="tiny,gpt2",
                   help=f"from: {', '.join(CONFIGS)} (default: %(default)s)")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--repeat", type=at_least(1), default=10, help="timed repetitions per measurement (default: 10)")
    p.add_argument("--warmup", type=at_least(1), default=3, help="untimed rounds first (default: 3)")
    p.add_argument("--dtypes", type=names_of(DTYPES), default="float32",
                   help=f"from: {', '.join(DTYPES)} (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, metavar="M", help="tokens the heads guess among, 0: the whole "
                   f"vocabulary (default: {DRAFT_VOCAB} for the GPT-2 shapes, 0 for tiny)")
    p.add_argument("--compile", action="store_true", help="measure every config again with compiled steps")
    p.add_argument("--nodes", type=numbers(1, 256), help="verify sizes (default: 1,2,4,...,64; CUDA: up to 128)")
    p.add_argument("--prefix", type=int, default=128, help="tokens in the KV cache before each step (default: 128)")
    p.add_argument("--threads", type=at_least(1, os.cpu_count() or 1), help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights and tokens (default: 0)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    a = p.parse_args(argv)
    with p.refusing():
        for name in a.configs:  # every config checked before the first is measured
            check_config(CONFIGS[name], prefix_len=a.prefix, draft_vocab=a.draft_vocab)
        a.device = pick_device(a.device)
        a.dtypes = [pick_dtype(d, a.device) for d in a.dtypes]
        a.nodes = a.nodes or (CUDA_NODES if a.device.type == "cuda" else NODES)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before: other work competing for cores
    results = {" ".join([name] + [str(dtype).split(".")[-1]] * (dtype != torch.float32) + ["compiled"] * compiled):
               bench_config(CONFIGS[name], device=a.device, repeat=a.repeat, warmup=a.warmup, prefix_len=a.prefix,
                            seed=a.seed, nodes=a.nodes, dtype=dtype, compiled=compiled, draft_vocab=a.draft_vocab)
               for name in a.configs for dtype in a.dtypes for compiled in (False, True)[: 1 + a.compile]}
    meta = {"torch": torch.__version__, "device": str(a.device), "threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name(a.device) if a.device.type == "cuda" else platform.machine(),
            "load_avg_1min": load, "command": shlex.join(["python", "benchmarks/bench_step.py", *argv])}
    print(json.dumps({**meta, "configs": results}, indent=2) if a.json else format_table(results, meta))
    return 0


if __name__ == "__main__":
    exit_with(main)
