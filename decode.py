"""Generate text from a checkpoint with plain or Medusa decoding; show the steps, explain one, or compare.

    python decode.py                      # Medusa, greedy, on the checkpoint's held-out prompts
    python decode.py --show --show-tree   # each forward pass's tokens in their own colour
    python decode.py --explain            # one Medusa step, stage by stage
    python decode.py --compare            # plain vs Medusa: steps, tokens/step, ms/token, speedup

Tokens/step counts the bonus token (the verify pass's own next token); plain decoding is 1.0.
Bad input (missing checkpoint, bad tree, empty prompt, ...) gives a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from medusa_mini.cli.common import (
    BONUS_NOTE,
    OneLineParser,
    StepPrinter,
    as_flags,
    encode_prompt,
    pick_device,
    stat_line,
    use_color,
)
from medusa_mini.cli.explain import explain_step
from medusa_mini.decoding import GenerationStats, generate, medusa_generate
from medusa_mini.io.loading import (
    PROMPTS_FILE,
    Checkpoint,
    load_for_decoding,
    load_prompts,
)
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree
from medusa_mini.tune.acceptance_tables import (
    SAMPLING_TEMPERATURE,  # the sampling rules' default temperature
)
from medusa_mini.tune.clock import timed_generation
from medusa_mini.tune.trees import (
    RuleTrees,
    default_tree_name,
    resolve_trees,
    tree_nodes_text,
)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/tiny", metavar="DIR",
                   help="checkpoint directory (default: %(default)s)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="prompt text; repeat for several (default: the checkpoint's prompts.json)")
    p.add_argument("--first-prompt", type=int, default=0, metavar="I",
                   help="index of the first stored prompt to use (default: 0)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N",
                   help="how many stored prompts to use (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--method", choices=("plain", "medusa"), default="medusa",
                   help="plain: one forward pass per token; medusa: heads + tree (default: %(default)s)")
    p.add_argument("--acceptance", choices=("greedy", "typical", "rejection"),
                   help="Medusa acceptance rule; rejection sampling is lossless (default: greedy at temperature"
                        " 0, rejection when sampling)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help=f"0 = greedy (default: 0 for greedy, {SAMPLING_TEMPERATURE} for typical/rejection)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--epsilon", type=float, default=0.09, help="typical acceptance ε (default: %(default)s)")
    p.add_argument("--delta", type=float, default=0.3, help="typical acceptance δ (default: %(default)s)")
    p.add_argument("--draft", choices=("sampled", "topk"), default="sampled",
                   help="how rejection sampling fills the tree: tokens drawn from the heads (accepted with "
                        "min(1, p/q)) or the heads' top-k (accepted with p); both lossless (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling generator (default: %(default)s)")
    p.add_argument("--tree", metavar="NAME|N|FILE.json",
                   help="stored (the trees training sized for this device type, in trees.json), auto (sized"
                        " now from heads_accuracy.json and step costs measured on this device: varies with"
                        " load), N (N nodes built from heads_accuracy.json), cpu, gpu, chainN, or a JSON list"
                        " of choices (default: stored; else 8 nodes on a CPU and 64 on CUDA from"
                        " heads_accuracy.json; else the cpu or gpu preset)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--show", action="store_true", help="mark the tokens of each forward pass")
    mode.add_argument("--explain", action="store_true", help="walk through one Medusa step on the first prompt")
    mode.add_argument("--compare", action="store_true", help="table: plain vs Medusa, greedy and sampling")
    p.add_argument("--repeat", type=int, default=3, metavar="R",
                   help="--compare runs every generation R times, in turns, and keeps the fastest time: "
                        "noise on a shared machine only ever adds time (default: %(default)s)")
    p.add_argument("--show-tree", action="store_true", help="print the tree and its attention mask once")
    p.add_argument("--json", action="store_true", help="JSON lines per prompt (with --compare: one object)")
    p.add_argument("--no-color", action="store_true", help="brackets instead of colours for --show")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject impossible settings before any loading; fill in the temperature default."""
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, not {a.max_new_tokens}")
    if a.first_prompt < 0:
        p.error(f"--first-prompt must be >= 0, not {a.first_prompt}")
    if a.num_prompts < 1:
        p.error(f"--num-prompts must be at least 1, not {a.num_prompts}")
    if a.repeat < 1:
        p.error(f"--repeat must be at least 1, not {a.repeat}")
    if a.threads is not None and a.threads < 1:
        p.error(f"--threads must be at least 1, not {a.threads}")
    if a.json and (a.show or a.explain or a.show_tree):
        p.error("--json cannot be combined with --show, --show-tree or --explain")
    if a.temperature is None:
        a.temperature = 0.0 if a.acceptance in (None, "greedy") else SAMPLING_TEMPERATURE
    try:  # every sampling setting is checked here, once; plain decoding reads only T and top-p
        a.sampling = Sampling(acceptance=a.acceptance if a.method == "medusa" or a.explain else None,
                              temperature=a.temperature, top_p=a.top_p, epsilon=a.epsilon, delta=a.delta,
                              draft=a.draft)
    except ValueError as e:
        if a.compare and a.acceptance == "greedy":  # --compare builds its own rows from T
            a.sampling = Sampling(temperature=a.temperature, top_p=a.top_p, epsilon=a.epsilon, delta=a.delta,
                                  draft=a.draft)
        else:
            p.error(as_flags(str(e)))


def run(
    ck: Checkpoint, ids: list[int], a: argparse.Namespace, *, method: str, sampling: Sampling,
    tree: Tree | None, max_new_tokens: int | None = None, on_step=None,
) -> tuple[list[int], GenerationStats]:
    """One generation with its own seeded generator, so each prompt's result is reproducible alone.

    The wall time of the whole call, prefill included, goes to stats.seconds."""
    gen = torch.Generator(device=ck.model.device).manual_seed(a.seed)
    common = dict(max_new_tokens=max_new_tokens or a.max_new_tokens, sampling=sampling, eos_id=ck.eot_id,
                  generator=gen, on_step=on_step)
    if method == "plain":
        return timed_generation(ck.model.device, lambda: generate(ck.model, ids, **common))
    return timed_generation(ck.model.device, lambda: medusa_generate(ck.model, ck.heads, ids, tree=tree, **common))


def text_of(ck: Checkpoint, tokens: list[int]) -> str:
    return ck.enc.decode([t for t in tokens if t != ck.eot_id])


def label_of(method: str, sampling: Sampling) -> str:
    t = sampling.temperature
    if method == "plain":
        return "plain greedy" if sampling.greedy else f"plain sampling (T={t:g})"
    return "Medusa greedy" if sampling.greedy else f"Medusa {sampling.rule} (T={t:g})"


def generate_each(
    ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, tree: Tree | None,
    tree_name: str | None,
) -> None:
    """Default and --show modes: stream each continuation, then one line of statistics."""
    color = use_color(sys.stdout, no_color=a.no_color)
    label = label_of(a.method, a.sampling)
    if tree is not None and a.method == "medusa":
        label += f", tree {tree_name}"
    for n, (text, ids) in enumerate(prompts, start=1):
        print(f"=== prompt {n}/{len(prompts)} ({len(ids)} tokens) ===\n{text}")
        how = ""
        if a.show:
            marks = "colour" if color else "[chunk]"
            how = f"; one {marks} per forward pass, the first from the prefill"
        print(f"=== {label}{how} ===")
        printer = StepPrinter(ck.enc, sys.stdout, eot_id=ck.eot_id, show_steps=a.show, color=color)
        tokens, stats = run(ck, ids, a, method=a.method, sampling=a.sampling, tree=tree, on_step=printer)
        printer.close()
        print(f"stats: {stat_line(stats, new_tokens=len(tokens), block_size=ck.block_size)}\n")


def json_each(
    ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, tree: Tree | None
) -> None:
    """--json: one object per prompt per line; `tokens` are the new ids (an end token included)."""
    for text, ids in prompts:
        tokens, stats = run(ck, ids, a, method=a.method, sampling=a.sampling, tree=tree)
        print(json.dumps({
            "prompt": text, "prompt_tokens": len(ids), "tokens": tokens, "text": text_of(ck, tokens),
            "steps": stats.steps, "tokens_per_step": stats.tokens_per_step, "seconds": stats.seconds,
            "stop_reason": stats.stop_reason, "method": a.method,
            "acceptance": a.sampling.acceptance if a.method == "medusa" else None, "temperature": a.temperature,
        }, ensure_ascii=False))


def compare(
    ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, trees: RuleTrees, tree_name: str
) -> dict:
    """Five ways to decode the same prompts, timed in the same run; one dict of rows and settings."""
    t = a.temperature if a.temperature > 0 else SAMPLING_TEMPERATURE
    greedy = dataclasses.replace(a.sampling, acceptance="greedy", temperature=0.0)
    specs = [("plain_greedy", "plain", greedy), ("medusa_greedy", "medusa", greedy),
             ("medusa_typical", "medusa", dataclasses.replace(greedy, acceptance="typical", temperature=t)),
             ("plain_sampling", "plain", dataclasses.replace(greedy, acceptance="rejection", temperature=t)),
             ("medusa_rejection", "medusa", dataclasses.replace(greedy, acceptance="rejection", temperature=t))]
    first = prompts[0][1]
    for method in ("plain", "medusa"):  # untimed: the first calls pay for allocation and kernel setup
        run(ck, first, a, method=method, sampling=greedy, tree=trees.greedy, max_new_tokens=min(a.max_new_tokens, 8))
    # Prompt-major order, every generation `repeat` times in turns: a load spike on a shared machine
    # then slows every method alike, and the fastest of the repeats is the one it did not touch.
    results: dict[str, list[tuple[list[int], GenerationStats]]] = {key: [] for key, *_ in specs}
    for _, ids in prompts:
        best: dict[str, tuple[list[int], GenerationStats]] = {}
        for _ in range(a.repeat):
            for key, method, sampling in specs:
                tokens, stats = run(ck, ids, a, method=method, sampling=sampling, tree=trees.for_rule(sampling))
                if key in best and best[key][0] != tokens:  # seeded: every repeat must make the same tokens
                    raise RuntimeError(f"{key}: repeated generations differ; decoding is not deterministic")
                if key not in best or stats.seconds < best[key][1].seconds:
                    best[key] = (tokens, stats)
        for key in best:
            results[key].append(best[key])
    rows = []
    for key, method, sampling in specs:
        outs = results[key]
        steps = sum(s.steps for _, s in outs)
        new = sum(len(tok) for tok, _ in outs)
        seconds = sum(s.seconds for _, s in outs)
        rows.append({
            "method": label_of(method, sampling), "key": key, "decoder": method,
            "acceptance": sampling.rule if method == "medusa" else None, "temperature": sampling.temperature,
            "steps": steps, "new_tokens": new, "seconds": seconds,
            "tokens_per_step": sum(sum(s.step_tokens) for _, s in outs) / steps if steps else 0.0,
            "ms_per_token": 1000 * seconds / max(new, 1),
            "tokens": [tok for tok, _ in outs], "stop_reasons": [s.stop_reason for _, s in outs],
        })
    base = rows[0]
    for row in rows:
        row["speedup"] = base["ms_per_token"] / row["ms_per_token"] if row["ms_per_token"] else 0.0
        row["same_as_plain_greedy"] = row["tokens"] == base["tokens"] if row["temperature"] == 0 else None
    return {"rows": rows, "device": str(ck.model.device), "threads": torch.get_num_threads(), "tree": tree_name,
            "tree_nodes": trees.greedy.num_nodes,
            "rejection_tree_nodes": trees.rejection_nodes(),
            "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "top_p": a.top_p, "repeat": a.repeat,
            "draft": a.draft, "note": BONUS_NOTE, "heads": ck.heads.config.kind if ck.heads is not None else None}


def format_compare(result: dict) -> str:
    head = (f"{'method':<28}{'tokens':>7}{'steps':>7}{'tokens/step':>13}{'ms/token':>10}{'speedup':>9}"
            "  same as plain greedy")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        same = "-" if r["same_as_plain_greedy"] is None else ("yes" if r["same_as_plain_greedy"] else "no")
        lines.append(f"{r['method']:<28}{r['new_tokens']:>7}{r['steps']:>7}{r['tokens_per_step']:>13.2f}"
                     f"{r['ms_per_token']:>10.2f}"
                     f"{r['speedup']:>8.2f}x  {same}")
    top_p = f", top-p {result['top_p']:g}" if result["top_p"] < 1 else ""
    if result.get("draft", "sampled") != "sampled":
        top_p += "; rejection candidates: the heads' top-k"
    threads = f"{result['threads']} thread" + ("s" if result["threads"] != 1 else "")
    nodes = tree_nodes_text(result["tree_nodes"], result["rejection_tree_nodes"])
    if result.get("heads") == "hydra":
        top_p += "; hydra heads (each node's children from its own path's q)"
    lines.append(f"\ndevice {result['device']}, {threads}; tree {result['tree']} "
                 f"({nodes}); {result['prompts']} prompts; "
                 f"max-new-tokens {result['max_new_tokens']}{top_p}")
    best = f", fastest of {result['repeat']} runs in turns" if result["repeat"] > 1 else ""
    lines.append(f"Note: {result['note']};\nplain decoding is exactly 1.00. ms/token includes the prefill{best}.")
    for reason, what in (("context", "at the context limit"), ("eos", "at the end-of-text token")):
        stopped = sum(row["stop_reasons"].count(reason) for row in result["rows"])
        if stopped:
            noun = "generation" if stopped == 1 else "generations"
            lines.append(f"{stopped} {noun} stopped {what} (the tokens column counts what each row made).")
    return "\n".join(lines)


def prepare(a: argparse.Namespace) -> tuple[Checkpoint, RuleTrees | None, str | None, list[tuple[str, list[int]]]]:
    """Load the checkpoint, choose the tree and encode the prompts; ValueError for anything unusable."""
    device = pick_device(a.device)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    ck = load_for_decoding(a.ckpt, device=device)
    needs_heads = a.method == "medusa" or a.compare or a.explain
    if needs_heads and ck.heads is None:
        wanted = "--compare" if a.compare else "--explain" if a.explain else "--method medusa"
        raise ValueError(f"{a.ckpt} has no Medusa heads, which {wanted} needs; use --method plain or train heads")
    trees = tree_name = None
    if needs_heads or a.show_tree:
        num_heads = ck.heads.num_heads if ck.heads is not None else None
        trees = resolve_trees(a.tree, num_heads=num_heads, ckpt_dir=a.ckpt, device=device,
                              model=ck.model, heads=ck.heads, log=lambda text: print(text, file=sys.stderr))
        tree_name = os.path.basename(a.tree) if a.tree else default_tree_name(device, a.ckpt)
    stored = [] if a.prompt else load_prompts(a.ckpt)
    if not a.prompt and a.first_prompt >= len(stored):
        raise ValueError(f"--first-prompt {a.first_prompt}: {PROMPTS_FILE} holds {len(stored)} prompts")
    texts = a.prompt if a.prompt else stored[a.first_prompt : a.first_prompt + a.num_prompts]
    prompts = []
    for i, text in enumerate(texts, start=1):
        try:
            prompts.append((text, encode_prompt(ck.enc, text, block_size=ck.block_size)))
        except ValueError as e:
            source = "--prompt" if a.prompt else PROMPTS_FILE
            raise ValueError(f"prompt {i} ({source}): {e}") from None
    return ck, trees, tree_name, prompts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    check_args(parser, a)
    try:
        ck, trees, tree_name, prompts = prepare(a)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    tree = trees.for_rule(a.sampling) if trees is not None else None
    try:
        if a.show_tree:
            print(f"tree {tree_name}: {tree.num_nodes - 1} nodes + root, depth {tree.depth}\n{tree.draw()}\n")
            print(f"attention mask (row attends to column):\n{tree.draw_mask()}\n")
        if a.compare:
            result = compare(ck, prompts, a, trees, tree_name)
            print(json.dumps(result) if a.json else format_compare(result))
        elif a.explain:
            print(explain_step(ck.model, ck.heads, ck.enc, prompts[0][1], tree=tree, sampling=a.sampling,
                               generator=torch.Generator(device=ck.model.device).manual_seed(a.seed)))
        elif a.json:
            json_each(ck, prompts, a, tree)
        else:
            generate_each(ck, prompts, a, tree, tree_name)
    except ValueError as e:  # the library's own checks, e.g. a cache that cannot hold the tree
        parser.error(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # piped into `head`: stop quietly (the recipe in Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
