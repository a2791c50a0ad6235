"""Sweep the node budget: static against dynamic trees, greedy and rejection sampling, side by side.

For node budgets 2, 4, ..., 64 (candidate nodes, the root excluded) this decodes the checkpoint's
held-out prompts (prompts.json) with Medusa under each acceptance rule, once with the static tree of
that budget (build_tree from heads_accuracy.json, as `decode.py --tree N` uses) and once with the
dynamic tree (`decode.py --tree dynamic:N`: each step keeps its N most confident candidates). It
prints per budget: measured tokens per step (the bonus token counted), ms per step, tokens per
second, the speedup over the plain decoder of the same rule, whether greedy rows write plain greedy's
tokens (they must), and for static trees the tokens per step the accuracy table expects; for greedy
also the ceiling no tree of the heads' top guesses can pass on these prompts (the heads' ranks along
plain greedy's text, replayed by tune/replay.py's replay_ceiling). Last, per rule, which tree kind at
which budget gave the most tokens per second.

Rules: greedy, and rejection sampling at T with the heads' top-k as drafts (lossless too). With
`--draft sampled`, the drafts `decode.py` draws by default, the rejection rows are static trees only
(a dynamic tree keeps a fixed tree for drawn drafts) and their expectation is exactly theirs: this is
how to check the rejection tree that training stores. Works for Medusa and
dependent (hydra) heads alike. Methods take turns prompt by prompt; the fastest of --repeat runs
counts (benchmarks/sweep_methods.py).

    python benchmarks/sweep.py --ckpt out/tiny [--budgets 2,4,8,16,32,64] [--rules greedy,rejection]
        [--trees static,dynamic] [--draft topk|sampled] [--num-prompts 8] [--max-new-tokens 64] [--repeat 3] [--json] [--plot sweep.png]

Decoding ignores the end-of-text token, so every prompt yields the same number of tokens in every row.
Times include the prefill, the same for plain and Medusa decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.sweep_methods import RULES, TREE_KINDS, load_tables, run_sweep, sweep_methods  # noqa: E402
from medusa_mini.cli.common import BONUS_NOTE, DTYPES, OneLineParser, pick_device, pick_dtype  # noqa: E402
from medusa_mini.cli.measure import encode_prompts  # noqa: E402
from medusa_mini.cli.plots import plot_node_sweep, require_matplotlib  # noqa: E402
from medusa_mini.io.loading import load_for_decoding, load_prompts  # noqa: E402
from medusa_mini.tune.acceptance_tables import SAMPLING_TEMPERATURE  # noqa: E402

BUDGETS = (2, 4, 8, 16, 32, 64)


def budget_list(text: str) -> tuple[int, ...]:
    """--budgets "2,4,8": distinct node budgets from 1 to 256, in increasing order."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and 1 <= int(p) <= 256 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give node budgets from 1 to 256, comma-separated, e.g. 2,4,8")
    return tuple(sorted({int(p) for p in parts}))


def names_of(allowed: tuple[str, ...]):
    """An argparse type for a comma-separated subset of `allowed`, kept in `allowed`'s order."""
    def parse(text: str) -> tuple[str, ...]:
        names = {p.strip() for p in text.split(",")}
        if not names <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}, comma-separated")
        return tuple(a for a in allowed if a in names)
    return parse


DRAFT_WORDS = {"topk": "top-k drafts", "sampled": "drafts drawn from q"}


def rule_label(rule: str, temperature: float, draft: str = "topk") -> str:
    return "greedy" if rule == "greedy" else f"rejection sampling (T={temperature:g}, {DRAFT_WORDS[draft]})"


def plain_label(rule: str, temperature: float) -> str:
    return "plain greedy" if rule == "greedy" else f"plain sampling (T={temperature:g})"


def _columns(kind: str, *, greedy: bool, num_prompts: int) -> list[tuple[str, Callable[[dict], str]]]:
    """(header, cell) per column of one tree kind: static trees add the expectation, greedy rows the
    prompts that wrote plain greedy's tokens."""
    cols = [("expected", lambda r: "-" if r["expected_tokens_per_step"] is None
             else f"{r['expected_tokens_per_step']:.2f}")] if kind == "static" else []
    cols += [("tok/step", lambda r: f"{r['tokens_per_step']:.2f}"), ("ms/step", lambda r: f"{r['ms_per_step']:.2f}"),
             ("tokens/s", lambda r: f"{r['tokens_per_s']:.1f}"), ("speedup", lambda r: f"{r['speedup']:.2f}x")]
    if greedy:
        cols.append(("same", lambda r: f"{r['prompts_same_as_plain_greedy']}/{num_prompts}"))
    return cols


def rule_table(result: dict, rule: str) -> list[str]:
    """One rule's lines: its plain decoder's speed, then a line per budget, the tree kinds side by side."""
    T, n, width, draft = result["temperature"], result["num_prompts"], 9, result["draft"]
    rows = [r for r in result["rows"] if r["rule"] == rule]
    kinds = [(kind, _columns(kind, greedy=rule == "greedy", num_prompts=n)) for kind in result["trees"]
             if any(r["tree"] == kind for r in rows)]
    plain = result["plain"][rule]
    lines = [f"{rule_label(rule, T, draft)}: {plain_label(rule, T)} {plain['tokens_per_s']:.1f} tokens/s",
             f"{'':>5}" + "".join(f" | {kind + ' tree':<{width * len(cols)}}" for kind, cols in kinds),
             f"{'nodes':>5}" + "".join(" | " + "".join(f"{h:>{width}}" for h, _ in cols) for _, cols in kinds)]
    for budget in sorted({r["nodes"] for r in rows}):
        line = f"{budget:>5}"
        for kind, cols in kinds:
            row = next((r for r in rows if r["tree"] == kind and r["nodes"] == budget), None)
            line += " | " + "".join(f"{cell(row) if row else '':>{width}}" for _, cell in cols)
        lines.append(line)
    if rule == "greedy" and result.get("greedy_ceiling") is not None:
        lines.append(f"ceiling: on these prompts no tree of the heads' top-10 guesses, fixed or dynamic, "
                     f"makes more than {result['greedy_ceiling']:.2f} tokens/step")
    if rule == "rejection" and any(r["expected_tokens_per_step"] is not None for r in rows):
        lines.append("expected: the sampled table's product rule, which assumes drafts drawn from the heads' q; "
                     + ("so are these rows'" if draft == "sampled" else "these rows draft their top-k"))
    if rule == "rejection" and draft == "sampled" and "dynamic" in result["trees"]:
        lines.append("no dynamic rows: for drafts drawn from q a dynamic tree keeps its fixed tree (--draft topk ranks them)")
    for r in rows:
        if r["verified_nodes"] != r["nodes"]:
            lines.append(f"the {r['tree']} tree of budget {r['nodes']} verifies {r['verified_nodes']} nodes a step "
                         "(the table offers no more)")
        if r["repeats_differ"]:
            lines.append(f"the {r['tree']} tree of budget {r['nodes']}: repeated runs made different tokens; "
                         "the first run's are reported")
    return lines


def format_sweep(result: dict) -> str:
    T, runs = result["temperature"], result["repeat"]
    lines = [f"{result['num_prompts']} prompts x {result['max_new_tokens']} new tokens, "
             + (f"fastest of {runs} runs in turns" if runs > 1 else "one run each")
             + "; nodes exclude the root; times include the prefill", f"Note: {BONUS_NOTE}."]
    for rule in result["rules"]:
        lines += [""] + rule_table(result, rule)
    lines.append("")
    for rule in result["rules"]:
        b = result["best"][rule]
        lines.append(f"most tokens/s, {rule_label(rule, T, result['draft'])}: the {b['tree']} tree at {b['nodes']} nodes, "
                     f"{b['tokens_per_s']:.1f} tokens/s ({b['speedup']:.2f}x {plain_label(rule, T)}; measured)")
    return "\n".join(line.rstrip() for line in lines)


def draw(result: dict, path: str) -> str:
    """Series "static, greedy", "dynamic, greedy", "static, rejection", "dynamic, rejection"; each
    rule's plain decoder as a dotted line."""
    series = [(f"{kind}, {rule}", [r for r in result["rows"] if r["tree"] == kind and r["rule"] == rule])
              for rule in result["rules"] for kind in result["trees"]]
    series = [(name, rows) for name, rows in series if rows]  # drawn drafts have no dynamic rows
    T = result["temperature"]
    plain = {plain_label(rule, T): result["plain"][rule]["tokens_per_s"] for rule in result["rules"]}
    dtype = "" if result["dtype"] == "float32" else f", {result['dtype']}"
    title = f"{result['checkpoint']} ({result['heads']} heads) on {result['device']}{dtype}: static vs dynamic trees"
    return plot_node_sweep(series, path, title=title, plain_tokens_per_s=plain)


def parser() -> OneLineParser:
    p = OneLineParser(
        prog="python benchmarks/sweep.py",
        description="Static against dynamic trees, node budget by node budget: tokens/step and tokens/s of "
                    "Medusa under greedy acceptance and rejection sampling (top-k drafts, or drawn ones), on the "
                    "checkpoint's held-out prompts, against plain decoding of the same rule.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint directory (heads, tokenizer, prompts.json, "
                   "heads_accuracy.json from python -m medusa_mini.cli.measure)")
    p.add_argument("--budgets", type=budget_list, default=BUDGETS, metavar="N,N,...",
                   help="node budgets, root excluded (default: %s)" % ",".join(map(str, BUDGETS)))
    p.add_argument("--rules", type=names_of(RULES), default=RULES, metavar="RULE,...",
                   help="acceptance rules: greedy, rejection (default: both)")
    p.add_argument("--trees", type=names_of(TREE_KINDS), default=TREE_KINDS, metavar="KIND,...",
                   help="tree kinds: static (build_tree), dynamic (each step's most confident nodes) (default: both)")
    p.add_argument("--draft", choices=tuple(DRAFT_WORDS), default="topk",
                   help="rejection sampling's drafts: the heads' top-k, which dynamic trees rank, or drawn from "
                   "their q as decode.py draws them (static trees only) (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE, metavar="T",
                   help="temperature of the rejection-sampling rows and of plain sampling (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts drawn from prompts.json (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs per generation, taken in turns; the fastest "
                   "counts (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which prompts are drawn, and the sampling seeds (default: %(default)s)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weights, heads and KV cache in this precision (default: %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (fewer can be faster on a busy CPU)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw tokens/step and tokens/s against the budget, one "
                   "series per tree kind and rule (needs matplotlib: pip install -e '.[plot]')")
    return p


def check(ns: argparse.Namespace) -> None:
    """Flags that argparse cannot judge alone; a one-line ValueError for the first bad one."""
    if ns.plot:  # before the sweep, not after it: a missing library or folder fails in a second
        require_matplotlib()
        if not os.path.isdir(os.path.dirname(os.path.abspath(ns.plot))):
            raise ValueError(f"--plot {ns.plot}: its folder does not exist")
    for flag in ("num_prompts", "max_new_tokens", "repeat", "threads"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if "rejection" in ns.rules and not ns.temperature > 0:
        raise ValueError(f"--temperature must be > 0 for the rejection rows, not {ns.temperature}")
    if ns.draft == "sampled" and ns.rules == ("rejection",) and ns.trees == ("dynamic",):
        raise ValueError("--draft sampled: rejection sampling with drawn drafts has static trees only; add --trees static")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    try:
        check(ns)
        if ns.threads:
            torch.set_num_threads(ns.threads)
        device = pick_device(ns.device)
        ck = load_for_decoding(ns.ckpt, device=device, dtype=pick_dtype(ns.dtype, device))
        if ck.heads is None:
            raise ValueError(f"checkpoint {ns.ckpt} has no Medusa heads; train heads first")
        tables = load_tables(ns.ckpt, num_heads=ck.heads.num_heads)
        methods = sweep_methods(ns.ckpt, tables=tables, budgets=ns.budgets, rules=ns.rules, kinds=ns.trees,
                                temperature=ns.temperature, num_heads=ck.heads.num_heads, device=device,
                                draft=ns.draft)
        texts = load_prompts(ns.ckpt)
        chosen = random.Random(ns.seed).sample(texts, min(ns.num_prompts, len(texts)))
        prompts = encode_prompts(ck.enc, chosen, block_size=ck.block_size, max_new_tokens=ns.max_new_tokens)
        result = run_sweep(ck, methods, prompts, max_new_tokens=ns.max_new_tokens, repeat=ns.repeat, seed=ns.seed)
        result.update(checkpoint=ns.ckpt, device=str(device), dtype=ns.dtype, heads=ck.heads.config.kind,
                      num_heads=ck.heads.num_heads, accuracy_source=tables.describe(draft=ns.draft), seed=ns.seed,
                      temperature=ns.temperature, draft=ns.draft, rules=list(ns.rules), trees=list(ns.trees),
                      threads=torch.get_num_threads())
        if ns.plot:
            draw(result, ns.plot)
            print(f"plot: {ns.plot}", file=sys.stderr)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        dtype = "" if ns.dtype == "float32" else f", {ns.dtype}"
        threads = f"{result['threads']} thread" + ("s" if result["threads"] != 1 else "")
        print(f"checkpoint {ns.ckpt} on {device}{dtype}, {threads}; {result['heads']} heads "
              f"({result['num_heads']}); accuracies: {result['accuracy_source']}")
        print(format_sweep(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
