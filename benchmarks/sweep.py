"""Sweep the node budget: tokens per step and tokens per second of Medusa, rule by rule.

    python benchmarks/sweep.py --ckpt out/tiny [--budgets 1,2,4,8,16,32] [--rules greedy,typical]
        [--num-prompts 8] [--max-new-tokens 64] [--repeat 3] [--json] [--plot sweep.png]

Per node budget N (root excluded) the tree is `build_tree(acc, N)`, as `decode.py --tree N` builds it.
Per rule and budget: tokens/step, ms/step, tokens/s and the speedup over plain decoding of the same
rule; for greedy also the product rule's estimate and agreement with plain greedy. Fastest of --repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.clock import at_least_one, names_of  # noqa: E402
from medusa_mini.cli.common import BONUS_NOTE, DTYPES, OneLineParser, pick_device, pick_dtype  # noqa: E402
from medusa_mini.cli.compare import Runs, fastest_in_turns, generate_once  # noqa: E402
from medusa_mini.cli.plots import plot_node_sweep, require_matplotlib  # noqa: E402
from medusa_mini.io.loading import Checkpoint, load_for_decoding, load_prompts  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.tree import Tree, build_tree, expected_tokens_per_step  # noqa: E402
from medusa_mini.tune.acceptance_tables import SAMPLING_TEMPERATURE, load_accuracy  # noqa: E402

BUDGETS = (1, 2, 4, 8, 16, 32)
RULES = ("greedy", "rejection-topk", "rejection-sampled", "typical")
DEFAULT_RULES = RULES[:3]


def rule_sampling(rule: str, *, temperature: float) -> Sampling:
    """The Sampling a rule decodes with; the plain decoder of a rule reads only its temperature."""
    if rule in ("greedy", "typical"):
        return Sampling(acceptance=rule, temperature=0.0 if rule == "greedy" else temperature)
    return Sampling(acceptance="rejection", temperature=temperature, draft=rule.split("-")[1])


def plain_key(rule: str, temperature: float) -> str:
    return "plain greedy" if rule == "greedy" else f"plain sampling (T={temperature:g})"


@dataclass(frozen=True)
class Method:
    """One way to decode the prompts: plain decoding when `tree` is None."""

    key: str
    rule: str
    sampling: Sampling
    tree: Tree | None = None
    budget: int = 0


def sweep_methods(acc: torch.Tensor, *, budgets: tuple[int, ...], rules: tuple[str, ...], temperature: float,
                  num_heads: int) -> list[Method]:
    """The plain decoders the rules need, then one Medusa method per rule and budget."""
    methods: dict[str, Method] = {}
    for rule in rules:
        key = plain_key(rule, temperature)
        methods.setdefault(key, Method(key, rule, rule_sampling(rule, temperature=temperature)))
    for rule in rules:
        for n in budgets:
            tree = build_tree(acc, n)[0].truncated(num_heads)  # acc may describe more heads than are loaded
            methods[f"{rule} {n}"] = Method(f"{rule} {n}", rule, rule_sampling(rule, temperature=temperature), tree, n)
    return list(methods.values())


def measure(ck: Checkpoint, methods: list[Method], prompts: list[list[int]], *, max_new_tokens: int, repeat: int,
            seed: int) -> dict[str, Runs]:
    """Every method on every prompt, `repeat` times in turns, the end-of-text token stopping nothing; per
    method key, the fastest run per prompt."""
    by_key = {m.key: m for m in methods}

    def run(key: str, prompt: list[int], i: int, n: int):
        m = by_key[key]
        return generate_once(ck, prompt, method="plain" if m.tree is None else "medusa", sampling=m.sampling,
                             tree=m.tree, seed=seed + i, max_new_tokens=n, stop_at_eot=False)

    return fastest_in_turns(run, list(by_key), prompts, max_new_tokens=max_new_tokens, repeat=repeat)[0]


def speed(runs: Runs) -> dict:
    """Tokens, steps and speed of a method's per-prompt runs."""
    steps = sum(st.steps for _, st in runs)
    seconds = sum(st.seconds for _, st in runs)
    new = sum(len(tokens) for tokens, _ in runs)
    return {"new_tokens": new, "steps": steps, "seconds": seconds, "tokens_per_s": new / seconds,
            "ms_per_step": 1000 * seconds / max(steps, 1),
            "tokens_per_step": sum(sum(st.step_tokens) for _, st in runs) / max(steps, 1)}


def sweep(ck: Checkpoint, acc: torch.Tensor, prompts: list[list[int]], *, budgets: tuple[int, ...],
          rules: tuple[str, ...], temperature: float, max_new_tokens: int, repeat: int, seed: int) -> dict:
    """Measure every method; rows per rule and budget, each against its rule's plain decoder."""
    methods = sweep_methods(acc, budgets=budgets, rules=rules, temperature=temperature, num_heads=ck.heads.num_heads)
    runs = measure(ck, methods, prompts, max_new_tokens=max_new_tokens, repeat=repeat, seed=seed)
    plain = {m.key: speed(runs[m.key]) for m in methods if m.tree is None}
    rows = []
    for m in (m for m in methods if m.tree is not None):
        row = {"rule": m.rule, "nodes": m.budget, "verified_nodes": m.tree.num_nodes - 1, **speed(runs[m.key])}
        row["speedup"] = row["tokens_per_s"] / plain[plain_key(m.rule, temperature)]["tokens_per_s"]
        row["expected_tokens_per_step"] = row["prompts_same_as_plain_greedy"] = None
        if m.rule == "greedy":
            row["expected_tokens_per_step"] = expected_tokens_per_step(acc, m.tree)
            row["prompts_same_as_plain_greedy"] = sum(
                out == ref for (out, _), (ref, _) in zip(runs[m.key], runs["plain greedy"]))
        rows.append(row)
    return {"plain": plain, "rows": rows, "rules": list(rules), "temperature": temperature,
            "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeat": repeat}


def rule_label(rule: str, temperature: float) -> str:
    words = {"rejection-topk": "rejection sampling, top-k drafts", "rejection-sampled":
             "rejection sampling, drafts drawn from q", "typical": "typical acceptance"}
    return "greedy" if rule == "greedy" else f"{words[rule]} (T={temperature:g})"


def format_sweep(result: dict) -> str:
    """A block per rule: its plain decoder's speed, then one line per budget."""
    T, n = result["temperature"], result["num_prompts"]
    lines = [f"{n} prompts x {result['max_new_tokens']} new tokens, fastest of {result['repeat']} runs in turns; "
             f"nodes exclude the root; times include the prefill", f"Note: {BONUS_NOTE}."]
    for rule in result["rules"]:
        key = plain_key(rule, T)
        greedy = rule == "greedy"
        lines += ["", f"{rule_label(rule, T)}: {key} {result['plain'][key]['tokens_per_s']:.1f} tokens/s",
                  f"{'nodes':>5}{'expected' if greedy else '':>9}{'tok/step':>9}{'ms/step':>9}{'tokens/s':>9}"
                  f"{'speedup':>9}{'  same as plain greedy' if greedy else ''}"]
        for r in (r for r in result["rows"] if r["rule"] == rule):
            expected = f"{r['expected_tokens_per_step']:>9.2f}" if greedy else " " * 9
            same = f"  {r['prompts_same_as_plain_greedy']}/{n}" if greedy else ""
            lines.append(f"{r['nodes']:>5}{expected}{r['tokens_per_step']:>9.2f}{r['ms_per_step']:>9.2f}"
                         f"{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x{same}")
        lines += [f"  budget {r['nodes']} verifies {r['verified_nodes']} nodes (the table offers no more)"
                  for r in result["rows"] if r["rule"] == rule and r["verified_nodes"] < r["nodes"]]
    if "greedy" in result["rules"]:
        lines.append("\nexpected: the product rule on heads_accuracy.json (tree.expected_tokens_per_step)")
    return "\n".join(line.rstrip() for line in lines)


def draw(result: dict, path: str, *, title: str) -> str:
    """One series per rule against the node budget; each plain decoder as a dotted line."""
    T = result["temperature"]
    series = [(rule_label(rule, T), [r for r in result["rows"] if r["rule"] == rule]) for rule in result["rules"]]
    return plot_node_sweep(series, path, title=title,
                           plain_tokens_per_s={k: v["tokens_per_s"] for k, v in result["plain"].items()})


def number_list(text: str) -> tuple[int, ...]:
    """--budgets "1,2,4": distinct node budgets from 1 to 256, increasing."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and 1 <= int(p) <= 256 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give node budgets from 1 to 256, comma-separated, e.g. 2,4,8")
    return tuple(sorted({int(p) for p in parts}))


def parser() -> OneLineParser:
    p = OneLineParser(prog="python benchmarks/sweep.py", description="Tokens/step and tokens/s of Medusa per "
                      "acceptance rule and node budget, against plain decoding of the same rule.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory with heads_accuracy.json and prompts.json")
    p.add_argument("--budgets", type=number_list, default=BUDGETS, metavar="N,N,...",
                   help="node budgets, root excluded (default: %s)" % ",".join(map(str, BUDGETS)))
    p.add_argument("--rules", default=",".join(DEFAULT_RULES), metavar="RULE,...",
                   help=f"from {', '.join(RULES)} (default: {','.join(DEFAULT_RULES)})")
    p.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE, metavar="T",
                   help="temperature of every rule but greedy (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts drawn from prompts.json (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--repeat", type=int, default=3, help="runs per generation; the fastest counts (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="which prompts, and the sampling seeds (default: 0)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default: float32)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the table (needs matplotlib)")
    return p


def check(ns: argparse.Namespace) -> None:
    """What argparse cannot judge alone; a one-line ValueError for the first bad flag."""
    at_least_one(ns, "num_prompts", "max_new_tokens", "repeat")
    ns.rules = tuple(r for r in RULES if r in names_of("--rules", ns.rules, RULES))  # in RULES' order
    if ns.rules != ("greedy",) and not ns.temperature > 0:
        raise ValueError(f"--temperature must be > 0 for the sampled rules, not {ns.temperature}")
    if ns.plot:  # before the sweep, not after it: a missing library or folder fails in a second
        require_matplotlib()
        if not os.path.isdir(os.path.dirname(os.path.abspath(ns.plot))):
            raise ValueError(f"--plot {ns.plot}: its folder does not exist")


def load(ns: argparse.Namespace) -> tuple[Checkpoint, torch.Tensor, list[list[int]]]:
    """The checkpoint, its accuracy table and the chosen prompts, cut to leave room for the new tokens."""
    device = pick_device(ns.device)
    ck = load_for_decoding(ns.ckpt, device=device, dtype=pick_dtype(ns.dtype, device))
    if ck.heads is None:
        raise ValueError(f"checkpoint {ns.ckpt} has no Medusa heads; train heads first")
    acc = load_accuracy(ns.ckpt)  # its error says how to measure it
    if build_tree(acc, 1)[0].num_nodes == 1:  # no node is ever accepted: every tree is the root alone
        raise ValueError("heads_accuracy.json: no head's top guess was ever right, so every tree is the root "
                         "alone; train the heads, then measure again")
    room = ck.block_size - ns.max_new_tokens
    if room < 1:
        raise ValueError(f"--max-new-tokens {ns.max_new_tokens} leaves no room for a prompt in {ck.block_size}")
    texts = load_prompts(ns.ckpt)
    chosen = random.Random(ns.seed).sample(texts, min(ns.num_prompts, len(texts)))
    prompts = [ids[-room:] for ids in (ck.enc.encode_ordinary(t) for t in chosen) if ids]
    if not prompts:
        raise ValueError(f"prompts.json in {ns.ckpt} has no prompt with a token")
    return ck, acc, prompts


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    try:
        check(ns)
        ck, acc, prompts = load(ns)
        result = sweep(ck, acc, prompts, budgets=ns.budgets, rules=ns.rules, temperature=ns.temperature,
                       max_new_tokens=ns.max_new_tokens, repeat=ns.repeat, seed=ns.seed)
        result.update(checkpoint=ns.ckpt, device=str(ck.model.device), dtype=ns.dtype, heads=ck.heads.config.kind,
                      num_heads=ck.heads.num_heads, threads=torch.get_num_threads())
        if ns.plot:
            draw(result, ns.plot, title=f"{ns.ckpt} ({result['heads']} heads) on {result['device']}, {ns.dtype}")
            print(f"plot: {ns.plot}", file=sys.stderr)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"checkpoint {ns.ckpt} on {result['device']}, {ns.dtype}, {result['threads']} threads; "
              f"{result['heads']} heads ({result['num_heads']})")
        print(format_sweep(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
