"""Sweep the node budget: tokens per step and tokens per second per drafter, rule and draft vocabulary.

    python benchmarks/sweep.py --ckpt out/tiny --rules greedy,lookup-greedy --draft-vocab 512,1024 --plot sweep.png

Budget N (root excluded) decodes with `build_tree(acc, N)`, as `decode.py --tree N` does, acc the rule's table
(`rejection-drawn`: the drawn candidates' own, where heads_accuracy.json has it); `lookup-greedy` verifies prompt
lookup's chain of N nodes, and needs no heads. Each row against plain decoding of its rule; greedy and drawn rows also
against the product rule's estimate, greedy rows against plain greedy's tokens."""

import copy
import json
import os
import sys
from argparse import Namespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from anywhere, uninstalled

import torch

from medusa_mini.cli import common
from medusa_mini.cli.common import BONUS_NOTE, OneLineParser, at_least, check_plot_path, draw, names_of, numbers, seed
from medusa_mini.cli.runs import Engine, Method, compare
from medusa_mini.io.loading import Checkpoint, load_for_decoding, prompt_ids
from medusa_mini.proposal import PromptLookup
from medusa_mini.sampling import SAMPLING_TEMPERATURE, Sampling
from medusa_mini.train.accuracy import load_accuracy
from medusa_mini.train.device import DTYPES, pick_device, pick_dtype
from medusa_mini.tree import MAX_NODES, build_tree, chain, expected_tokens_per_step

RULES = {"greedy": None, "rejection-topk": dict(acceptance="rejection", candidates="topk"),
         "rejection-drawn": dict(acceptance="rejection", candidates="drawn"), "typical": dict(acceptance="typical"),
         "lookup-greedy": None}  # rule: how it samples at --temperature (none: greedy, at T = 0)


def sweep(ck: Checkpoint, tables: dict, prompts: list[list[int]], ns: Namespace) -> dict:
    """A row per rule, drafter and budget; `tables`: rule -> (its accuracy table, whether it predicts tokens/step)."""
    samplings = {r: Sampling(**RULES[r], temperature=ns.temperature) if RULES[r] else Sampling() for r in tables}
    plain = {s.temperature: s for s in samplings.values()}  # plain decoding reads only T
    specs = [(Method("plain", plain[T]), {}) for T in sorted(plain)]  # greedy's first: the tokens greedy rows must make
    heads = {}
    for M in ns.draft_vocab:  # a copy per size, guessing among the M most frequent tokens of its training text
        h = copy.deepcopy(ck.heads)
        h.use_draft_vocabulary(h.vocab_order, M)
        heads[h.draft_ids.numel()] = h  # M = 0: the whole vocabulary
    for rule, (table, predicts) in tables.items():
        for M, drafter in ({None: PromptLookup()} if rule.startswith("lookup") else heads).items():
            for n in ns.budgets:
                tree = chain(n) if M is None else build_tree(table[: ck.heads.num_heads], n)[0]  # may hold more heads
                name = f"{'prompt lookup' if M is None else f'{drafter.name} M{M}'} {rule} {n}"  # unique: the runs' key
                try:  # a rank-r node needs a head's top r + 1: a draft vocabulary of at least r + 1 tokens
                    verified = drafter.proposer(ck.model, tree).tree.num_nodes - 1
                except ValueError as e:
                    raise ValueError(f"--draft-vocab {M}: {e}") from None
                specs.append((Method(name, samplings[rule], drafter, tree), {
                    "rule": rule, "nodes": n, "draft_vocab": M, "verified_nodes": verified,
                    "expected_tokens_per_step": expected_tokens_per_step(table, tree) if predicts else None}))
    result = compare(Engine(ck), prompts, [m for m, _ in specs], max_new_tokens=ns.max_new_tokens, seed=ns.seed,
                     repeat=ns.repeat, stop_at_eot=False)
    rows = [{**row, **info} for row, (_, info) in zip(result["rows"], specs)]
    return {"plain": {r["method"]: r for r in rows if r["plain"]}, "rows": [r for r in rows if not r["plain"]],
            "rules": list(tables), "checkpoint": ns.ckpt, "device": str(ck.model.device), "dtype": ns.dtype,
            "num_heads": ck.heads.num_heads if ck.heads else 0, "threads": torch.get_num_threads(),
            "temperature": ns.temperature, "num_prompts": len(prompts), "max_new_tokens": ns.max_new_tokens,
            "repeat": ns.repeat}


def series(result: dict) -> list[tuple[str, dict, list[dict]]]:
    """(label, its plain decoder's row, rows) per rule and draft vocabulary, in the rows' order."""
    out: dict[tuple, tuple[str, dict, list[dict]]] = {}
    for r in result["rows"]:
        T, M = r["temperature"], r["draft_vocab"]
        label = r["rule"] + (f" (T={T:g})" if T else "") + ("" if M is None else f", draft vocabulary {M}")
        plain = next(p for p in result["plain"].values() if p["temperature"] == T)
        out.setdefault((r["rule"], M), (label, plain, []))[2].append(r)
    return list(out.values())


def format_sweep(result: dict) -> str:
    """A block per rule and draft vocabulary: its plain decoder's speed, then one line per budget."""
    n = result["num_prompts"]
    lines = ["checkpoint {checkpoint} on {device}, {dtype}, {threads} threads; {num_heads} heads".format(**result),
             f"{n} prompts x {result['max_new_tokens']} new tokens, fastest of {result['repeat']} runs in turns; "
             f"nodes exclude the root; times include the prefill", f"Note: {BONUS_NOTE}."]
    for label, plain, rows in series(result):
        greedy = plain["temperature"] == 0
        lines += ["", f"{label}: {plain['method']} {plain['tokens_per_s']:.1f} tokens/s",
                  f"{'nodes':>5}{'expected':>9}{'tok/step':>9}{'ms/step':>9}{'tokens/s':>9}{'speedup':>9}"
                  + ("  same as plain greedy" if greedy else "")]
        for r in rows:
            expected = "" if r["expected_tokens_per_step"] is None else f"{r['expected_tokens_per_step']:.2f}"
            lines.append(f"{r['nodes']:>5}{expected:>9}{r['tokens_per_step']:>9.2f}{r['ms_per_step']:>9.2f}"
                         f"{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x"
                         + (f"  {n - len(r['differences'])}/{n}" if greedy else ""))
        lines += [f"  budget {r['nodes']} verifies {r['verified_nodes']} nodes (all the table holds for these heads)"
                  for r in rows if r["verified_nodes"] < r["nodes"]]
    if any(r["expected_tokens_per_step"] is not None for r in result["rows"]):
        lines.append("\nexpected: the product rule on heads_accuracy.json (tree.expected_tokens_per_step; drawn "
                     "candidates: their own table, at the temperature it names), measured over the checkpoint's own "
                     "draft vocabulary: the same estimate under every --draft-vocab")
    return "\n".join(lines)


def expected_tokens_per_s(row: dict, expected: float) -> float:
    """A row's tokens/s had each of its steps made `expected` tokens in the same time (its prefills' tokens kept)."""
    return (row["new_tokens"] + row["steps"] * (expected - row["tokens_per_step"])) / row["seconds"]


def plot_sweep(result: dict, path: str, *, title: str) -> str:
    """Tokens/step (left) and tokens/s (right) against the node budget, a colour per `series`, the estimate dashed."""
    steps = [(None, 1.0, dict(color="gray", ls=":", label="plain decoding (1.00)"))]
    speed = [(None, r["tokens_per_s"], dict(color=("gray", "silver", "dimgray")[i % 3], ls=":", label=name))
             for i, (name, r) in enumerate(result["plain"].items())]
    for i, (label, _, rows) in enumerate(series(result)):
        nodes, style = [r["nodes"] for r in rows], dict(marker="o", color=f"C{i}", label=f"{label}, measured")
        steps.append((nodes, [r["tokens_per_step"] for r in rows], style))
        speed.append((nodes, [r["tokens_per_s"] for r in rows], style))
        if known := [r for r in rows if r["expected_tokens_per_step"] is not None]:
            at, expected = [r["nodes"] for r in known], [r["expected_tokens_per_step"] for r in known]
            dashed = dict(ls="--", marker="x", color=f"C{i}")
            steps.append((at, expected, {**dashed, "label": f"{label}, expected"}))
            speed.append((at, [expected_tokens_per_s(r, e) for e, r in zip(expected, known)],
                          {**dashed, "label": f"{label}, expected at measured ms/step"}))
    return draw(path, {"tokens per step (bonus counted)": steps, "tokens per second": speed},
                xlabel="node budget (root excluded)", ticks=sorted({r["nodes"] for r in result["rows"]}), title=title)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python benchmarks/sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=os.path.expanduser, required=True,
                   help="checkpoint directory with heads_accuracy.json and prompts.json")
    p.add_argument("--budgets", type=numbers(1, MAX_NODES), default="1,2,4,8,16,32", metavar="N,N,...",
                   help="node budgets, root excluded (default: %(default)s)")
    p.add_argument("--rules", type=names_of(RULES), default="greedy,rejection-topk,rejection-drawn",
                   metavar="RULE,...", help=f"from {', '.join(RULES)} (default: %(default)s)")
    p.add_argument("--draft-vocab", type=numbers(0), metavar="M,...", help="sizes, 0: all (default: the checkpoint's)")
    p.add_argument("--temperature", type=common.temperature, default=SAMPLING_TEMPERATURE, metavar="T",
                   help="temperature of every rule but greedy (default: %(default)s)")
    p.add_argument("--num-prompts", type=at_least(1), default=8, help="the first prompts of prompts.json (default: 8)")
    p.add_argument("--max-new-tokens", type=at_least(2), default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--repeat", type=at_least(1), default=3, help="runs of each; the fastest counts (default: 3)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampled rules (default: 0)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default: float32)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--plot", type=os.path.expanduser, metavar="FILE.png", help="also draw the table (needs matplotlib)")
    ns = p.parse_args(argv)
    with p.refusing(ValueError, OSError):  # the flags checked, then the checkpoint, each rule's table and the prompts
        if ns.plot is not None:  # "" too: no file to draw into
            check_plot_path(ns.plot)
        ck = load_for_decoding(ns.ckpt, device=(device := pick_device(ns.device)), dtype=pick_dtype(ns.dtype, device))
        tables = {r: (None, False) for r in RULES if r in ns.rules}  # in RULES' order; prompt lookup reads none
        if any(not r.startswith("lookup") for r in tables):  # heads' rules: their heads and tables
            if ck.heads is None:
                raise ValueError(f"checkpoint {ns.ckpt} has no Medusa heads; train heads first, or sweep lookup-greedy")
            ns.draft_vocab = ns.draft_vocab or (ck.heads.draft_ids.numel(),)
            if max(ns.draft_vocab) > (V := ck.model.config.vocab_size):
                raise ValueError(f"--draft-vocab {max(ns.draft_vocab)}: the vocabulary has {V} tokens")
            acc = load_accuracy(ns.ckpt)  # its error says how to measure it
            if build_tree(acc, 1)[0].num_nodes == 1:  # no node is ever accepted: every tree is the root alone
                raise ValueError("heads_accuracy.json: no head's top guess was ever right, so every tree is the root "
                                 "alone; train the heads, then measure again")
            drawn = load_accuracy(ns.ckpt, drawn=True)  # None where the file predates the drawn candidates' table
            tables.update({r: (drawn, True) if r == "rejection-drawn" and drawn is not None else (acc, r == "greedy")
                           for r in tables if not r.startswith("lookup")})
        else:  # prompt lookup alone: no heads, no draft vocabulary
            ns.draft_vocab = ()
        prompts = prompt_ids(ck, count=ns.num_prompts, max_new_tokens=ns.max_new_tokens)
        result = sweep(ck, tables, prompts, ns)
        if ns.plot is not None:
            plot_sweep(result, ns.plot, title=f"{ns.ckpt} on {result['device']}, {ns.dtype}")
            print(f"plot: {ns.plot}", file=sys.stderr)
    print(json.dumps(result, indent=2) if ns.json else format_sweep(result))
    return 0


if __name__ == "__main__":
    common.exit_with(main)
