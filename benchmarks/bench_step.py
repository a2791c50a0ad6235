"""What one decoding step costs, stage by stage: a plain step against Medusa's verify, heads and whole step.

    python benchmarks/bench_step.py                          # tiny and gpt2-shaped models, this device
    python benchmarks/bench_step.py --configs tiny --threads 2 --json
    python benchmarks/bench_step.py --configs gpt2,gpt2-xl --dtypes float32,bfloat16 --compile   # a GPU

Medusa wins only if a step that verifies N candidates costs little more than a plain step. On random
weights (speed depends on shapes, not values) this prints, in ms: a plain step; verify N, one
tree-masked forward over N nodes; and per Medusa tree ('cpu', 'gpu') each stage of a greedy
`medusa_step` and the whole step, over a plain step and over its verify alone (target: 1.15x).
Each time is the median of --repeat runs after --warmup rounds, the steps taking turns, the KV cache
reset to the same prefix before each. --compile measures each config again with compiled steps.
"""

from __future__ import annotations

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

from benchmarks.clock import at_least_one, names_of, time_in_turns  # noqa: E402
from medusa_mini.acceptance import Accepted, accept_paths  # noqa: E402
from medusa_mini.cli.common import DTYPES, OneLineParser, pick_device, pick_dtype  # noqa: E402
from medusa_mini.cli.compiled import compile_steps, step_cache  # noqa: E402
from medusa_mini.decoding import prefill  # noqa: E402
from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.io.gpt2 import GPT2_CONFIGS  # noqa: E402
from medusa_mini.model import GPT, GPTConfig, KVCache  # noqa: E402
from medusa_mini.proposal import MedusaProposer, Proposal  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.step import keep_path, medusa_step, usable_nodes, verify  # noqa: E402
from medusa_mini.tree import Tree, build_tree, preset  # noqa: E402

CONFIGS: dict[str, GPTConfig] = {"tiny": GPTConfig(), **GPT2_CONFIGS}
NODES = (1, 2, 4, 8, 16, 32, 64)
CUDA_NODES = (*NODES, 96, 128)  # a GPU at batch 1 may verify this many for about the price of one
MAX_VERIFY_NODES = 256
MEDUSA_TREES = ("cpu", "gpu")
STAGES = ("heads", "verify", "accept", "keep_path", "host read", "step")


def verify_tree(nodes: int) -> Tree:
    """The root and the first N - 1 choices of the 'gpu' preset (a choice's prefixes come before it),
    or past its size the best N - 1 nodes for heads right 60%, 36%, ... of the time at rank 0."""
    if not 1 <= nodes <= MAX_VERIFY_NODES:
        raise ValueError(f"a verify tree has 1 to {MAX_VERIFY_NODES} nodes, not {nodes}")
    choices = preset("gpu").choices
    if nodes <= len(choices) + 1:
        return Tree.from_choices(choices[: nodes - 1])
    acc = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(10)] for k in range(4)])  # [K heads, R ranks]
    return build_tree(acc, nodes - 1)[0]


def host_read(proposal: Proposal, accepted: Accepted) -> list[list[int]]:
    """The step's one host sync, as `medusa_step` makes it: path, tokens, bonus and count per row."""
    return torch.cat([accepted.nodes, proposal.tokens.gather(1, accepted.nodes), accepted.bonus[:, None],
                      accepted.count[:, None]], dim=1).tolist()  # [B][2 (D + 1) + 2]


def check_prefix(config: GPTConfig, prefix_len: int) -> None:
    """The cached prefix must leave room in the context for the deepest Medusa tree."""
    depth = max(preset(name).depth for name in MEDUSA_TREES)
    if not 1 <= prefix_len < config.block_size - depth:
        raise ValueError(f"prefix length {prefix_len} must be between 1 and {config.block_size - depth - 1}, so "
                         f"that a depth-{depth} tree fits after it in the context of {config.block_size}")


def build(config: GPTConfig, *, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[GPT, MedusaHeads]:
    """A random backbone and four Medusa heads on its lm_head, in `dtype`."""
    torch.manual_seed(seed)
    with device:  # initialise in place: copying a large model across devices costs more than its init
        model = GPT(config).eval().to(dtype)
        cfg = HeadsConfig(num_heads=4, n_embd=config.n_embd, vocab_size=config.vocab_size)
        heads = MedusaHeads(cfg, lm_head_weight=model.lm_head.weight).eval().to(dtype)
    return model, heads


def tree_stages(model: GPT, cache: KVCache, heads: MedusaHeads, tree: Tree, root: torch.Tensor,
                hidden: torch.Tensor, *, prefix_len: int) -> dict[str, Callable[[], object]]:
    """One callable per stage of a greedy `medusa_step` on `tree`, its inputs made once before timing by
    the stages before it (same inputs every run, so the same path)."""
    proposer, greedy = MedusaProposer(model, heads, tree), Sampling()
    span = prefix_len + tree.num_nodes  # the slots decoding reads in this step (the host knows them)
    propose = partial(proposer.propose, root, hidden, max_depth=tree.depth, sampling=greedy, generator=None)
    proposal = propose()
    start = cache.lengths.clone()  # [1]
    logits, _ = verify(model, cache, tree, proposal.tokens, span=span)  # [1, N, V]
    usable = usable_nodes(tree, start, torch.full_like(start, model.config.block_size))  # [1, N]
    accept = partial(accept_paths, proposal, logits, sampling=greedy, generator=None, usable=usable)
    accepted = accept()
    return {"heads": propose, "verify": partial(verify, model, cache, tree, proposal.tokens, span=span),
            "accept": accept, "keep_path": partial(keep_path, cache, accepted, start=start, active=usable[:, 0]),
            "host read": partial(host_read, proposal, accepted),
            "step": partial(medusa_step, model, cache, proposer, root, hidden, span=span)}


@torch.no_grad()
def bench_config(config: GPTConfig, *, device: torch.device, repeat: int, warmup: int = 3, prefix_len: int = 128,
                 nodes: tuple[int, ...] = NODES, seed: int = 0, dtype: torch.dtype = torch.float32,
                 compiled: bool = False, compile_backend: str = "inductor") -> dict:
    """Every timing of one config in one dtype, eager or compiled, as plain numbers (ms)."""
    check_prefix(config, prefix_len)
    model, heads = build(config, device=device, dtype=dtype, seed=seed)
    if compiled:
        torch.compiler.reset()  # graphs are cached per code object, across models: start afresh
        model = compile_steps(model, backend=compile_backend)
        warmup = max(warmup, 3) if device.type == "cuda" else warmup  # CUDA graphs: eager, record, replay
    max_len = config.block_size + max(max(nodes), preset("gpu").num_nodes)
    cache = step_cache(model, max_len) or KVCache(config, max_len=max_len, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, config.vocab_size, (1, prefix_len), generator=gen).to(device)  # [1, P]
    logits, hidden = prefill(model, prefix, cache)  # [1, V], [1, C]
    # The root stays on the device, as decoding keeps it: an int would add a host-to-device copy per step.
    root = logits.argmax(dim=-1)  # [1]

    def reset() -> None:
        cache.lengths = prefix_len  # later slots are stale and get overwritten, as in decoding

    def plain() -> int:
        out, _ = model(root[:, None], cache=cache, span=prefix_len + 1)  # [1, 1, V]
        return int(out[0, -1].argmax())

    steps: dict[str, Callable[[], object]] = {"plain": plain}
    for n in nodes:
        tokens = torch.randint(0, config.vocab_size, (1, n), generator=gen).to(device)  # [1, n]
        steps[f"verify {n}"] = partial(verify, model, cache, verify_tree(n), tokens, span=prefix_len + n)
    for name in MEDUSA_TREES:
        reset()
        stages = tree_stages(model, cache, heads, preset(name), root, hidden, prefix_len=prefix_len)
        steps.update({f"{name} {stage}": fn for stage, fn in stages.items()})
    ms, first_round = time_in_turns(steps, reset=reset, device=device, repeat=repeat, warmup=warmup)
    reset()
    medusa = {}
    for name in MEDUSA_TREES:
        stage_ms = {stage: ms[f"{name} {stage}"] for stage in STAGES}
        medusa[name] = {"nodes": preset(name).num_nodes, "ms": stage_ms["step"], "stages_ms": stage_ms,
                        "ratio": stage_ms["step"] / ms["plain"], "step_vs_verify": stage_ms["step"] / stage_ms["verify"],
                        "accepted": len(steps[f"{name} step"]().paths[0]) - 1}  # random weights: few
    return {"config": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")},
            "prefix_len": prefix_len, "repeat": repeat, "warmup": warmup, "dtype": str(dtype).split(".")[-1],
            "compiled": compiled, "first_round_s": first_round, "plain_ms": ms["plain"],
            "verify_ms": {n: ms[f"verify {n}"] for n in nodes}, "medusa": medusa}


def table_rows(results: list[dict]) -> list[tuple[str, list[float]]]:
    """One row per timing, (label, a number per result): ms, or x for a label ending in '(x)'."""
    first = results[0]
    rows = [("first round, s (compilation, if any)", [r["first_round_s"] for r in results]),
            ("plain step (1 token + argmax)", [r["plain_ms"] for r in results])]
    rows += [(f"verify, N = {n}", [r["verify_ms"][n] for r in results]) for n in first["verify_ms"]]
    for tree, info in first["medusa"].items():
        m = [r["medusa"][tree] for r in results]
        rows += [(f"{tree} tree ({info['nodes']} nodes incl. root): {stage}", [x["stages_ms"][stage] for x in m])
                 for stage in STAGES[:-1]]
        rows += [(f"{tree} tree: whole medusa_step", [x["ms"] for x in m]),
                 (f"{tree} tree: whole step / plain step (x)", [x["ratio"] for x in m]),
                 (f"{tree} tree: whole step / verify alone (x)", [x["step_vs_verify"] for x in m])]
    return rows


def format_table(results: dict[str, dict], *, header: list[str]) -> str:
    """Configs as columns, one timing per row."""
    names, first = list(results), next(iter(results.values()))
    rows = [("layers / heads / width / vocabulary",
             ["{n_layer} / {n_head} / {n_embd} / {vocab_size}".format(**r["config"]) for r in results.values()])]
    rows += [(label, [f"{v:.2f}" for v in values]) for label, values in table_rows(list(results.values()))]
    width, col = max(len(label) for label, _ in rows) + 2, max(12, *(len(n) + 2 for n in names))
    lines = [*header, "", " " * width + "".join(f"{n:>{col}}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in vals) for label, vals in rows]
    lines.append(f"\nms, median of the repetitions after {first['warmup']} warm-up rounds, steps in turns; KV cache "
                 f"holding {first['prefix_len']} tokens before each step; random weights, greedy acceptance")
    return "\n".join(lines)


def parse_args(argv: list[str]):
    p = OneLineParser(prog="python benchmarks/bench_step.py", description="Time plain steps, tree verifies and "
                      "the stages of a Medusa step on random weights.")
    p.add_argument("--configs", default="tiny,gpt2", help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--repeat", type=int, default=10, help="timed repetitions per measurement (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first, at least 1 (default: 3)")
    p.add_argument("--dtypes", default="float32", help=f"comma-separated, from: {', '.join(DTYPES)}")
    p.add_argument("--compile", action="store_true", help="measure every config again with compiled steps")
    p.add_argument("--nodes", help=f"verify sizes (default: {','.join(map(str, NODES))}; CUDA: up to 128)")
    p.add_argument("--prefix", type=int, default=128, help="tokens in the KV cache before each step (default: 128)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default: 0)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    a = p.parse_args(argv)
    try:
        a.config_names = names_of("--configs", a.configs, CONFIGS)
        at_least_one(a, "repeat", "warmup", "threads")
        for name in a.config_names:  # every config checked before the first is measured
            try:
                check_prefix(CONFIGS[name], a.prefix)
            except ValueError as e:
                raise ValueError(f"--prefix, config {name}: {e}") from None
        a.device = pick_device(a.device)
        a.dtype_list = [pick_dtype(d, a.device) for d in names_of("--dtypes", a.dtypes, DTYPES)]
        sizes = [n.strip() for n in a.nodes.split(",")] if a.nodes else None
        if sizes is not None and not all(s.isdigit() and 1 <= int(s) <= MAX_VERIFY_NODES for s in sizes):
            raise ValueError(f"--nodes {a.nodes!r}: give sizes from 1 to {MAX_VERIFY_NODES}, comma-separated")
        a.node_list = tuple(map(int, sizes)) if sizes else CUDA_NODES if a.device.type == "cuda" else NODES
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before: other work competing for cores
    results = {" ".join([name] + ([str(dtype).split(".")[-1]] if dtype != torch.float32 else [])
                        + (["compiled"] if compiled else [])):
               bench_config(CONFIGS[name], device=a.device, repeat=a.repeat, warmup=a.warmup, prefix_len=a.prefix,
                            seed=a.seed, nodes=a.node_list, dtype=dtype, compiled=compiled)
               for name in a.config_names for dtype in a.dtype_list for compiled in (False, True)[: 1 + a.compile]}
    device_name = (torch.cuda.get_device_name(a.device) if a.device.type == "cuda"
                   else platform.processor() or platform.machine())
    meta = {"torch": torch.__version__, "device": str(a.device), "device_name": device_name,
            "threads": torch.get_num_threads(), "load_avg_1min": load,
            "command": shlex.join(["python", "benchmarks/bench_step.py", *argv])}
    if a.json:
        print(json.dumps({**meta, "configs": results}, indent=2))
    else:
        print(format_table(results, header=[
            f"torch {meta['torch']}, {meta['device']} ({device_name}), {meta['threads']} threads, load average "
            f"{'unknown' if load is None else f'{load:.2f}'} before the run", f"command: {meta['command']}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
