"""Sweep the tree size: what the accuracies promise against what decoding delivers, budget by budget.

For node budgets 1, 2, 4, ..., 64 (candidate nodes, the root excluded) this builds the tree from the
checkpoint's heads_accuracy.json (or measures the accuracies first), decodes the same prompts with
greedy Medusa, and prints per budget: expected and measured tokens per step (the bonus token counted),
ms per step, ms per token, the speedup over plain greedy decoding of the same prompts in the same run,
and how many outputs equal plain greedy's (all of them, or something is broken).

With --temperature T > 0 it sweeps rejection sampling instead: trees from the table measured under
sampling, Medusa against plain sampling at T (each prompt with its own seeded generator), expected
tokens/step by the product rule (sampling cannot be replayed).

    python benchmarks/sweep.py --ckpt out/tiny [--num-prompts 8] [--max-new-tokens 64] [--temperature T] [--json]
    python benchmarks/sweep.py --ckpt out/tiny --plot sweep.png   # also draw the rows (needs matplotlib)

Decoding ignores the end-of-text token, so every prompt yields the same number of tokens in every row.
Times include the prefill, the same for plain and Medusa decoding.
"""

from __future__ import annotations

import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from medusa_mini.cli.common import DTYPES, OneLineParser, pick_device, pick_dtype  # noqa: E402
from medusa_mini.cli.measure import encode_prompts  # noqa: E402
from medusa_mini.cli.plots import plot_node_sweep, require_matplotlib  # noqa: E402
from medusa_mini.decoding import generate, medusa_generate  # noqa: E402
from medusa_mini.io.loading import load_for_decoding, load_prompts  # noqa: E402
from medusa_mini.model import GPT  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.tree import build_tree  # noqa: E402
from medusa_mini.tune.acceptance_tables import (  # noqa: E402
    ACCURACY_FILE,
    HeadsFn,
    accuracy_on_prompts,
    load_accuracy,
    load_greedy_ranks,
    replay_greedy,
)
from medusa_mini.tune.clock import timed_generation  # noqa: E402
from medusa_mini.tune.sizing import auto_tree  # noqa: E402

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def run_sweep(
    model: GPT, heads: HeadsFn, prompts: list[list[int]], *, acc: torch.Tensor, max_new_tokens: int,
    budgets: tuple[int, ...] = BUDGETS, ranks: list[str] | None = None, temperature: float = 0.0, seed: int = 0,
) -> dict:
    """Decode every prompt plainly once, then with the build_tree tree of each budget; gather numbers.

    temperature 0: greedy decoding, greedy acceptance; T > 0: sampling, rejection sampling."""
    if not prompts:
        raise ValueError("the sweep needs at least one prompt")
    sampling = Sampling(temperature=temperature)  # greedy at 0, else rejection sampling at T
    device = model.device

    def gen(i: int) -> torch.Generator:  # prompt i's generator, seeded afresh for every row
        return torch.Generator(device=device).manual_seed(seed + i)

    generate(model, prompts[0], max_new_tokens=min(4, max_new_tokens))  # warm-up, not timed
    plain = [timed_generation(device, lambda: generate(model, p, max_new_tokens=max_new_tokens, sampling=sampling,
                                                       generator=gen(i)))
             for i, p in enumerate(prompts)]
    plain_tokens = sum(len(out) for out, _ in plain)
    plain_ms_per_token = 1000 * sum(st.seconds for _, st in plain) / max(plain_tokens, 1)
    rows = []
    for n in budgets:
        tree, expected = build_tree(acc, n)
        if ranks is not None:  # replayed on the measured continuations, not the product rule
            expected = replay_greedy(ranks, tree)
        runs = [timed_generation(device, lambda: medusa_generate(
                    model, heads, p, tree=tree, max_new_tokens=max_new_tokens, sampling=sampling, generator=gen(i)))
                for i, p in enumerate(prompts)]
        steps = max(sum(st.steps for _, st in runs), 1)
        seconds = sum(st.seconds for _, st in runs)
        ms_per_token = 1000 * seconds / max(sum(len(out) for out, _ in runs), 1)
        rows.append({
            "nodes": n,
            "expected_tokens_per_step": expected,
            "tokens_per_step": sum(sum(st.step_tokens) for _, st in runs) / steps,
            "ms_per_step": 1000 * seconds / steps,
            "ms_per_token": ms_per_token,
            "speedup": plain_ms_per_token / ms_per_token if ms_per_token > 0 else 0.0,
            "equal_to_greedy": None if not sampling.greedy else sum(out == ref for (out, _), (ref, _) in zip(runs, plain)),
        })
    _, why = auto_tree(acc, {row["nodes"]: row["ms_per_step"] for row in rows}, ranks=ranks)
    return {
        "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature,
        "plain_ms_per_token": plain_ms_per_token, "rows": rows,
        "auto_tree_on_measured_step_ms": why.splitlines()[-1],
    }


def format_sweep(result: dict) -> str:
    n, T = result["num_prompts"], result.get("temperature", 0.0)
    plain = f"plain sampling (T={T:g})" if T > 0 else "plain greedy"
    lines = [
        f"{n} prompts x {result['max_new_tokens']} new tokens; {plain} "
        f"{result['plain_ms_per_token']:.2f} ms/token (1.00 tokens/step)"
        + (f"; Medusa with rejection sampling at T={T:g}" if T > 0 else ""),
        "nodes exclude the root; tokens/step counts the bonus token; times include the prefill",
        "nodes  expected tok/step  measured tok/step  ms/step  ms/token  speedup  same as greedy",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['nodes']:>5}  {r['expected_tokens_per_step']:>17.2f}  {r['tokens_per_step']:>17.2f}  "
            f"{r['ms_per_step']:>7.2f}  {r['ms_per_token']:>8.2f}  {r['speedup']:>6.2f}x  "
            + (f"{r['equal_to_greedy']:>6}/{n}" if r["equal_to_greedy"] is not None else f"{'-':>8}")
        )
    best = max(result["rows"], key=lambda r: r["speedup"])
    lines.append(f"fastest measured: {best['nodes']} nodes, {best['speedup']:.2f}x over {plain}")
    lines.append("auto_tree on these step times: " + result["auto_tree_on_measured_step_ms"])
    return "\n".join(lines)


def draw(result: dict, path: str) -> str:
    """The sweep's rows as one named series (the static build_tree trees), plain decoding's speed marked."""
    T = result.get("temperature", 0.0)
    name = f"static tree, rejection T={T:g}" if T > 0 else "static tree, greedy"
    dtype = "" if result.get("dtype", "float32") == "float32" else f", {result['dtype']}"
    title = f"{result.get('checkpoint', '')} on {result.get('device', '')}{dtype}: node budgets"
    plain_ms = result["plain_ms_per_token"]
    return plot_node_sweep([(name, result["rows"])], path, title=title,
                           plain_tokens_per_s=1000.0 / plain_ms if plain_ms else None)


def _accuracies(directory: str, ckpt, texts: list[str], *, temperature: float):
    """(acc, greedy ranks or None, where they came from) for a sweep at `temperature`."""
    if temperature > 0:  # only the table measured under sampling describes rejection sampling
        return load_accuracy(directory, sampled=True), None, f"{ACCURACY_FILE}, sampled table (product rule)"
    try:
        ranks = load_greedy_ranks(directory)
        how = " (expected = replayed on its greedy continuations)" if ranks else " (product rule)"
        return load_accuracy(directory), ranks, ACCURACY_FILE + how
    except ValueError:  # missing or unreadable: measure now, as python -m medusa_mini.cli.measure would
        block = ckpt.block_size
        measure_on = encode_prompts(ckpt.enc, texts[:32], block_size=block, max_new_tokens=min(64, block - 1))
        acc = accuracy_on_prompts(ckpt.model, ckpt.heads, measure_on, max_new_tokens=min(64, block - 1))
        return acc, None, f"measured now on {len(measure_on)} prompts ({ACCURACY_FILE} missing or unreadable)"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python benchmarks/sweep.py",
        description="Expected vs measured Medusa tokens/step and speed for tree budgets 1 ... 64.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint directory (with heads, tokenizer, prompts.json)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts drawn from prompts.json (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which prompts are drawn, and the sampling seeds (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy Medusa vs plain greedy; T > 0: rejection sampling vs plain sampling at T, "
                        "trees from the sampled table (default: %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (fewer can be faster on a busy CPU)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weights, heads and KV cache in this precision (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw tokens/step and tokens/s against the budget, "
                   "expected and measured, into this PNG (needs matplotlib: pip install -e '.[plot]')")
    ns = p.parse_args(argv)
    try:
        if ns.plot:  # before the sweep, not after it: a missing library or folder fails in a second
            require_matplotlib()
            if not os.path.isdir(os.path.dirname(os.path.abspath(ns.plot))):
                raise ValueError(f"--plot {ns.plot}: its folder does not exist")
        if ns.num_prompts < 1 or ns.max_new_tokens < 1 or (ns.threads is not None and ns.threads < 1):
            raise ValueError("--num-prompts, --max-new-tokens and --threads must be at least 1")
        if ns.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, not {ns.temperature}")
        if ns.threads:
            torch.set_num_threads(ns.threads)
        device = pick_device(ns.device)
        ckpt = load_for_decoding(ns.ckpt, device=device, dtype=pick_dtype(ns.dtype, device))
        if ckpt.heads is None:
            raise ValueError(f"checkpoint {ns.ckpt} has no Medusa heads; train heads first")
        texts = load_prompts(ns.ckpt)
        block = ckpt.block_size
        acc, ranks, source = _accuracies(ns.ckpt, ckpt, texts, temperature=ns.temperature)
        if acc.shape[0] > ckpt.heads.num_heads:
            raise ValueError(f"{ACCURACY_FILE} describes {acc.shape[0]} heads but the checkpoint has "
                             f"{ckpt.heads.num_heads}; recompute it with python -m medusa_mini.cli.measure")
        chosen = random.Random(ns.seed).sample(texts, min(ns.num_prompts, len(texts)))
        prompts = encode_prompts(ckpt.enc, chosen, block_size=block, max_new_tokens=ns.max_new_tokens)
        result = run_sweep(ckpt.model, ckpt.heads, prompts, acc=acc, max_new_tokens=ns.max_new_tokens, ranks=ranks,
                           temperature=ns.temperature, seed=ns.seed)
        result.update(checkpoint=ns.ckpt, device=str(device), dtype=ns.dtype, accuracy_source=source, seed=ns.seed)
        if ns.plot:
            draw(result, ns.plot)
            print(f"plot: {ns.plot}", file=sys.stderr)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        dtype = "" if ns.dtype == "float32" else f", {ns.dtype}"
        print(f"checkpoint {ns.ckpt} on {device}{dtype}; accuracies: {source}")
        print(format_sweep(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
