"""What one decoding step costs: plain decoding vs Medusa's tree verify, heads and whole step.

    python benchmarks/bench_step.py                     # tiny and gpt2-shaped models
    python benchmarks/bench_step.py --configs tiny --repeat 50 --threads 2 --json
    python benchmarks/bench_step.py --configs tiny,gpt2,gpt2-medium,gpt2-large,gpt2-xl \
        --dtypes float32,bfloat16 --compile           # on a GPU: every shape, dtype, eager and compiled

Medusa wins only if a step that verifies N candidates costs little more than a plain step, and that
depends on the device: a GPU at batch 1 is bound by reading the weights, two CPU cores are not. For
each config, with random weights (speed depends on shapes, not values), this prints in milliseconds:

- plain step: one cached 1-token forward plus the argmax, as `generate` does per token;
- verify N: one tree-masked forward over N nodes (`step.verify`) for N = 1 ... 64 (128 on CUDA), the
  tree being the first N - 1 choices of the 'gpu' preset (sorted by depth, so every prefix comes
  first), or beyond its 68 nodes a tree grown by `build_tree` from a made-up acceptance table;
- heads: four Medusa heads at one hidden state, through the shared lm_head or through their own;
- Medusa step: one iteration of `medusa_generate`'s loop (`step.medusa_step` with greedy
  acceptance: candidates, verify, acceptance, KV compaction; then the heads) on the 'cpu' and 'gpu'
  trees, and its ratio to the plain step;
- hydra: dependent heads (hydra.py) filling the 'cpu' and 'gpu' trees depth by depth (their whole
  head work per step), and a step with them (the fill, verify, acceptance, compaction).

Each time is the median of R repetitions after a warm-up, read from CUDA events on a GPU and from a
wall clock on a CPU. Every config runs once per --dtypes entry, and with --compile once more with the
plain step and the verify compiled (`cli/compiled.py`; CUDA graphs on CUDA); the first round's
seconds, which include any compilation, are printed on their own row and never enter a median. The KV cache is reset to the same prefix
length before every repetition, so every repetition measures the same step; the steps take turns, so a
change in machine load mid-run does not favour one of them. On a shared machine, mind the load
average printed in the header. Bad input (an unknown config or device, a prefix that leaves no room
for a tree, ...) ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from functools import partial
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from medusa_mini.cli.common import DTYPES, OneLineParser, pick_device, pick_dtype  # noqa: E402
from medusa_mini.cli.compiled import compile_steps, step_cache  # noqa: E402
from medusa_mini.decoding import prefill  # noqa: E402
from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.hydra import HydraProposer, make_heads  # noqa: E402
from medusa_mini.io.gpt2 import GPT2_CONFIGS  # noqa: E402
from medusa_mini.model import GPT, GPTConfig, KVCache  # noqa: E402
from medusa_mini.proposal import MedusaProposer, StepTree  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.step import medusa_step, verify  # noqa: E402
from medusa_mini.tree import Tree, build_tree, preset  # noqa: E402
from medusa_mini.tune.clock import time_in_turns  # noqa: E402

CONFIGS: dict[str, GPTConfig] = {"tiny": GPTConfig(), **GPT2_CONFIGS}
NODES = (1, 2, 4, 8, 16, 32, 64)
CUDA_NODES = (*NODES, 96, 128)  # a GPU at batch 1 may verify this many for about the price of one
MEDUSA_TREES = ("cpu", "gpu")
# Small models need more repetitions for a stable median; large ones are slow enough with fewer.
DEFAULT_REPEAT = {"tiny": 30}
FALLBACK_REPEAT = 10


def verify_tree(nodes: int) -> Tree:
    """A representative N-node tree: the root plus the first N - 1 choices of the 'gpu' preset, or
    past its size, the best N - 1 nodes for heads right 60%, 36%, ... of the time at rank 0 (build_tree)."""
    choices = preset("gpu").choices
    if not 1 <= nodes <= MAX_VERIFY_NODES:
        raise ValueError(f"a verify tree has 1 to {MAX_VERIFY_NODES} nodes, not {nodes}")
    if nodes <= len(choices) + 1:
        return Tree.from_choices(choices[: nodes - 1])
    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(10)] for k in range(4)])  # [K heads, ranks]
    tree, _ = build_tree(acc, nodes - 1)
    return tree


MAX_VERIFY_NODES = 256


def medusa_iteration(model: GPT, cache: KVCache, proposer, root: torch.Tensor, hidden: torch.Tensor) -> int:
    """One iteration of `medusa_generate`'s loop with greedy acceptance (the heads run inside the
    proposal, at the last accepted node); returns the accepted nodes."""
    step = medusa_step(model, cache, proposer, root, hidden)  # its emitted tokens read on the host, once
    return len(step.paths[0]) - 1


def check_prefix(config: GPTConfig, prefix_len: int) -> None:
    """The cached prefix must leave room in the context for the deepest benchmarked tree."""
    depth = max(preset(name).depth for name in MEDUSA_TREES)
    if not 1 <= prefix_len < config.block_size - depth:
        raise ValueError(
            f"prefix length {prefix_len} must be between 1 and {config.block_size - depth - 1}, so that a "
            f"depth-{depth} tree fits after it in the context of {config.block_size}"
        )


def build(
    config: GPTConfig, *, device: torch.device, dtype: torch.dtype = torch.float32, num_heads: int = 4,
    seed: int = 0,
) -> tuple[GPT, MedusaHeads, MedusaHeads]:
    """A random backbone and two sets of heads on it, all in `dtype`: shared lm_head and own lm_heads."""
    torch.manual_seed(seed)
    with device:  # initialise in place: copying a large model across devices costs more than its init
        model = GPT(config).eval().to(dtype)
        heads = {}
        for own in (False, True):
            cfg = HeadsConfig(num_heads=num_heads, n_embd=config.n_embd, vocab_size=config.vocab_size, own_lm_head=own)
            heads[own] = MedusaHeads(cfg, lm_head_weight=model.lm_head.weight).eval().to(dtype)
    return model, heads[False], heads[True]


@torch.no_grad()
def bench_config(
    config: GPTConfig,
    *,
    device: torch.device,
    repeat: int,
    warmup: int = 3,
    prefix_len: int = 128,
    nodes: tuple[int, ...] = NODES,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    compiled: bool = False,
    compile_backend: str = "inductor",
) -> dict:
    """Every timing for one config in one dtype, eager or compiled, as a dict of plain numbers (ms)."""
    check_prefix(config, prefix_len)
    trees = {name: preset(name) for name in MEDUSA_TREES}
    model, shared, own = build(config, device=device, dtype=dtype, seed=seed)
    if compiled:
        # Graphs are cached per code object (GPT.forward), across models: start each variant afresh,
        # which also frees the previous variant's CUDA-graph memory.
        torch.compiler.reset()
        compile_steps(model, backend=compile_backend)
        if device.type == "cuda":  # under CUDA graphs: an eager call, a recording, then replays
            warmup = max(warmup, 3)
    max_nodes = max(max(nodes), *(t.num_nodes for t in trees.values()))
    # As large as medusa_generate's (attention spans every slot, so the size is part of the cost);
    # compiled, the one cache of that size the compiled steps replay on.
    max_len = config.block_size + max_nodes
    cache = step_cache(model, max_len) or KVCache(config, max_len=max_len, device=device,
                                                    dtype=model.lm_head.weight.dtype)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, config.vocab_size, (1, prefix_len), generator=gen).to(device)
    logits, hidden = prefill(model, prefix, cache)  # [1, V], [1, C]
    # [1] on the device, as decoding keeps its root: a Python int would make every timed step pay a
    # blocking host-to-device copy that real decoding never pays.
    root = logits.argmax(dim=-1)
    root_ids = root.reshape(1, 1)  # [1, 1]

    def reset() -> None:
        cache.lengths = prefix_len  # later slots are stale and get overwritten, as in decoding

    def plain() -> int:
        out, _ = model(root_ids, cache=cache)
        return int(out[0, -1].argmax())

    h = hidden  # [1, C]: heads run at the one hidden state that proposes the next tree
    steps: dict[str, Callable[[], object]] = {"plain": plain}
    for n in nodes:
        tokens = torch.randint(0, config.vocab_size, (1, n), generator=gen).to(device)
        steps[f"verify {n}"] = partial(verify, model, cache, StepTree.of(verify_tree(n), 1, device), tokens)
    steps["heads shared"] = partial(shared, h, model.lm_head)
    steps["heads own"] = partial(own, h, model.lm_head)
    for name, tree in trees.items():
        steps[f"medusa {name}"] = partial(medusa_iteration, model, cache, MedusaProposer(model, shared, tree), root, h)
    # Dependent heads: the heads' work is the tree filling itself, one head call per depth.
    with device:
        hydra = make_heads(HeadsConfig(num_heads=4, n_embd=config.n_embd, vocab_size=config.vocab_size,
                                       kind="hydra")).eval().to(dtype)
    for name, tree in trees.items():
        proposer = HydraProposer(model, hydra, tree)
        steps[f"hydra fill {name}"] = partial(proposer.propose, root, h, max_depth=tree.depth, sampling=Sampling(),
                                              generator=None)
        steps[f"hydra {name}"] = partial(medusa_step, model, cache, proposer, root, h)
    ms, first_round = time_in_turns(steps, reset=reset, device=device, repeat=repeat, warmup=warmup)

    result: dict = {
        "config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")},
        "prefix_len": prefix_len,
        "repeat": repeat,
        "warmup": warmup,
        "dtype": str(dtype).split(".")[-1],
        "compiled": compiled,
        "first_round_s": first_round,
        "plain_ms": ms["plain"],
        "verify_ms": {n: ms[f"verify {n}"] for n in nodes},
        "heads_ms": {"shared": ms["heads shared"], "own": ms["heads own"]},
        "medusa": {},
        "hydra": {},
    }
    for name, tree in trees.items():
        reset()
        result["medusa"][name] = {
            "nodes": tree.num_nodes,
            "ms": ms[f"medusa {name}"],
            "ratio": ms[f"medusa {name}"] / ms["plain"],
            "accepted": steps[f"medusa {name}"](),  # same inputs every call, so the same path
        }
        result["hydra"][name] = {
            "fill_ms": ms[f"hydra fill {name}"],
            "fill_vs_plain": ms[f"hydra fill {name}"] / ms["plain"],
            "ms": ms[f"hydra {name}"],
            "ratio": ms[f"hydra {name}"] / ms["plain"],
        }
    return result


def format_table(results: dict[str, dict], *, header: list[str], warmup: int) -> str:
    """Configs as columns, one timing per row."""
    names = list(results)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, values: list[float], unit: str = "") -> None:
        rows.append((label, [f"{v:.2f}{unit}" for v in values]))

    first = results[names[0]]
    rows.append(("layers / heads / width", [
        "{n_layer} / {n_head} / {n_embd}".format(**results[n]["config"]) for n in names]))
    rows.append(("vocabulary", [str(results[n]["config"]["vocab_size"]) for n in names]))
    rows.append(("dtype", [results[n]["dtype"] for n in names]))
    rows.append(("compiled steps", ["yes" if results[n]["compiled"] else "no" for n in names]))
    rows.append(("repetitions", [str(results[n]["repeat"]) for n in names]))
    rows.append(("first round, s (compilation, if any)", [f"{results[n]['first_round_s']:.1f}" for n in names]))
    row("plain step (1 token + argmax)", [results[n]["plain_ms"] for n in names])
    for n_nodes in first["verify_ms"]:
        row(f"verify, N = {n_nodes}", [results[n]["verify_ms"][n_nodes] for n in names])
    row("heads (4), shared lm_head", [results[n]["heads_ms"]["shared"] for n in names])
    row("heads (4), own lm_heads", [results[n]["heads_ms"]["own"] for n in names])
    for tree, info in first["medusa"].items():
        row(f"Medusa step, {tree} tree ({info['nodes']} nodes incl. root)", [results[n]["medusa"][tree]["ms"] for n in names])
        row("  / plain step", [results[n]["medusa"][tree]["ratio"] for n in names], "x")
        rows.append(("  accepted nodes (random weights)", [str(results[n]["medusa"][tree]["accepted"]) for n in names]))
    for tree in first["hydra"]:
        row(f"hydra heads fill the {tree} tree", [results[n]["hydra"][tree]["fill_ms"] for n in names])
        row("  / plain step", [results[n]["hydra"][tree]["fill_vs_plain"] for n in names], "x")
        row(f"step with hydra heads, {tree} tree (no heads after)", [results[n]["hydra"][tree]["ms"] for n in names])
        row("  / plain step", [results[n]["hydra"][tree]["ratio"] for n in names], "x")

    width = max(len(label) for label, _ in rows) + 2
    col = max(12, *(len(v) + 2 for _, vals in rows for v in vals), *(len(n) + 2 for n in names))
    lines = [*header, "", " " * width + "".join(f"{n:>{col}}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in vals) for label, vals in rows]
    lines.append("")
    lines.append(
        f"ms, median of the repetitions after {warmup} warm-up rounds; steps run in turns; "
        f"KV cache holding {first['prefix_len']} tokens before each step"
    )
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="python benchmarks/bench_step.py",
        description="Time plain decoding steps, tree-verify steps, Medusa heads and whole Medusa steps "
        "on random weights.",
    )
    p.add_argument("--configs", default="tiny,gpt2", help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--repeat", type=int, default=None,
                   help=f"timed repetitions per measurement (default: {DEFAULT_REPEAT['tiny']} for tiny, "
                   f"{FALLBACK_REPEAT} otherwise)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before the timed ones, at least 1 "
                   "(default: 3)")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma-separated, from: {', '.join(DTYPES)}; weights, heads and cache (default: float32)")
    p.add_argument("--compile", action="store_true",
                   help="measure every config a second time with the plain step and the verify compiled")
    p.add_argument("--nodes", default=None, help="comma-separated verify sizes (default: "
                   f"{','.join(map(str, NODES))}; on CUDA {','.join(map(str, CUDA_NODES))})")
    p.add_argument("--prefix", type=int, default=128, help="tokens in the KV cache before each step (default: 128)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights and tokens (default: 0)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed and checked arguments; `device` becomes a torch.device. Bad input exits with status 2."""
    p = build_parser()
    args = p.parse_args(argv)
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_names if c not in CONFIGS]
    if unknown or not args.config_names:
        p.error(f"unknown config {', '.join(unknown) or '(none)'}: use {', '.join(CONFIGS)}")
    if (args.repeat is not None and args.repeat < 1) or args.warmup < 1:
        p.error("--repeat and --warmup must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, not {args.threads}")
    for name in args.config_names:  # every config before the first is measured, not after
        try:
            check_prefix(CONFIGS[name], args.prefix)
        except ValueError as e:
            p.error(f"--prefix, config {name}: {e}")
    try:
        args.device = pick_device(args.device)
        args.dtype_list = [pick_dtype(d.strip(), args.device) for d in args.dtypes.split(",") if d.strip()]
    except ValueError as e:
        p.error(str(e))
    if not args.dtype_list:
        p.error(f"--dtypes: name at least one of {', '.join(DTYPES)}")
    try:
        args.node_list = (CUDA_NODES if args.device.type == "cuda" else NODES) if args.nodes is None else tuple(
            int(n) for n in args.nodes.split(","))
    except ValueError:
        p.error(f"--nodes must be comma-separated integers, not {args.nodes!r}")
    if not all(1 <= n <= MAX_VERIFY_NODES for n in args.node_list):
        p.error(f"--nodes: every size must be between 1 and {MAX_VERIFY_NODES}")
    return args


def column_name(config: str, dtype: torch.dtype, compiled: bool) -> str:
    """'gpt2', 'gpt2 bfloat16', 'gpt2 bfloat16 compiled': one table column per measured variant."""
    parts = [config] + ([str(dtype).split(".")[-1]] if dtype != torch.float32 else []) + (["compiled"] if compiled else [])
    return " ".join(parts)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's as far as the platform tells."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    # Read before measuring: a high load means other processes competed for the cores.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = {
        column_name(name, dtype, compiled): bench_config(
            CONFIGS[name], device=device, repeat=args.repeat or DEFAULT_REPEAT.get(name, FALLBACK_REPEAT),
            warmup=args.warmup, prefix_len=args.prefix, seed=args.seed, nodes=args.node_list, dtype=dtype,
            compiled=compiled,
        )
        for name in args.config_names
        for dtype in args.dtype_list
        for compiled in ((False, True) if args.compile else (False,))
    }
    meta = {
        "torch": torch.__version__,
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "command": shlex.join(["python", "benchmarks/bench_step.py", *argv]),
        "warmup": args.warmup,
        "load_avg_1min": load,
    }
    if args.json:
        print(json.dumps({**meta, "configs": results}, indent=2))
    else:
        load_text = "unknown" if load is None else f"{load:.2f}"
        header = [
            f"torch {meta['torch']}, device {meta['device']} ({meta['device_name']}), threads {meta['threads']}, "
            f"{os.cpu_count()} CPUs, load average {load_text} before the run",
            f"command: {meta['command']}",
        ]
        print(format_table(results, header=header, warmup=args.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
