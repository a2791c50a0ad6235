"""Generate text from a checkpoint with plain or Medusa decoding; show the steps, explain one, or compare.

    python decode.py                      # Medusa, greedy, on the checkpoint's held-out prompts
    python decode.py --show               # the tree, then each forward pass's tokens in their own colour
    python decode.py --explain            # one Medusa step, stage by stage (--demo: no checkpoint needed)
    python decode.py --compare            # plain vs Medusa: steps, tokens/step, ms/token, speedup
    python decode.py --compare --batch-size 1,2,4,8,16   # where batching ends Medusa's speedup
    python decode.py --reference          # the same tokens from reference.py, the readable decoder

Tokens/step counts the bonus token (the verify pass's own next token); plain decoding is 1.0.
Bad input (missing checkpoint, bad tree, empty prompt, ...) gives a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from medusa_mini.cli.batches import compare_batches, format_batches
from medusa_mini.cli.common import DTYPES, OneLineParser, as_flags, encode_prompt, pick_device, pick_dtype
from medusa_mini.cli.compare import compare, format_compare
from medusa_mini.cli.compiled import compile_steps, warm_up
from medusa_mini.cli.demo import DEMO_NOTE, demo_checkpoint
from medusa_mini.cli.explain import explain_step
from medusa_mini.cli.generation import generate_each, json_each
from medusa_mini.cli.plots import plot_batch, require_matplotlib
from medusa_mini.io.loading import PROMPTS_FILE, Checkpoint, load_for_decoding, load_prompts
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree
from medusa_mini.tune.acceptance_tables import SAMPLING_TEMPERATURE  # the sampling rules' default temperature
from medusa_mini.tune.trees import resolve_tree

METHODS = ("plain", "greedy", "typical", "rejection")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/tiny", metavar="DIR", help="checkpoint directory (default: %(default)s)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text; repeat for several "
                   "(default: the checkpoint's prompts.json)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="stored prompts used (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="new tokens per prompt (default: 128)")
    p.add_argument("--method", choices=METHODS, help="plain: one forward pass per token; else Medusa with that "
                   "acceptance rule (default: greedy at temperature 0, rejection, which is lossless, when sampling)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help=f"0 = greedy (default: 0, or {SAMPLING_TEMPERATURE} for typical and rejection)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling generator (default: %(default)s)")
    p.add_argument("--tree", metavar="N|NAME|FILE.json", help="N nodes built from heads_accuracy.json; a preset "
                   "(cpu, gpu, chainN); or a JSON list of choices (default: 8 on a CPU, 64 on CUDA, else a preset)")
    p.add_argument("--batch-size", metavar="B", help="decode the prompts B at a time; with --compare, a list "
                   "(1,2,4,8) gives tokens/s per batch size (default: 1)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weights and KV cache in this "
                   "precision; in half precision greedy Medusa may differ from plain greedy at near-ties, which "
                   "--compare reports (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the plain step and the tree verify "
                   "(CUDA graphs on CUDA), compiled before any timing")
    p.add_argument("--reference", action="store_true", help="decode with reference.py, the readable decoder "
                   "(same tokens, slower); with --compare, add its rows")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--show", action="store_true", help="print the tree and its mask, then each pass's tokens")
    mode.add_argument("--explain", action="store_true", help="walk through one Medusa step on the first prompt")
    mode.add_argument("--compare", action="store_true", help="table: plain vs Medusa, greedy and sampling")
    p.add_argument("--demo", action="store_true", help="with --explain: a tiny model trained on the spot, no checkpoint")
    p.add_argument("--plot", metavar="FILE.png", help="with --compare --batch-size B1,B2,...: draw the table "
                   "(needs matplotlib)")
    p.add_argument("--json", action="store_true", help="JSON lines per prompt (with --compare: one object)")
    return p


def batch_sizes(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[int]:
    """--batch-size as a sorted list of sizes >= 1; several only with --compare."""
    text = a.batch_size or "1"
    sizes = text.split(",")
    if not all(x.strip().isdigit() and int(x) >= 1 for x in sizes):
        p.error(f"--batch-size takes a size >= 1 (with --compare, a list such as 1,2,4,8), not {text!r}")
    if len(sizes) > 1 and not a.compare:
        p.error("--batch-size takes one size; a list of sizes goes with --compare")
    return sorted({int(x) for x in sizes})


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject impossible settings before any loading; fill in the method and temperature defaults."""
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, not {a.max_new_tokens}")
    if a.num_prompts < 1:
        p.error(f"--num-prompts must be at least 1, not {a.num_prompts}")
    if a.json and (a.show or a.explain):
        p.error("--json cannot be combined with --show or --explain")
    a.batch_sizes = batch_sizes(p, a)
    a.batch_size = a.batch_sizes[0]
    a.batch_table = a.compare and a.batch_sizes != [1]
    if a.batch_size > 1 and (a.show or a.reference or a.explain):
        p.error("--batch-size decodes several prompts at once; --show, --reference and --explain take one at a time")
    if a.demo and not a.explain:
        p.error("--demo goes with --explain: python decode.py --explain --demo")
    if a.plot is not None:
        if not a.batch_table:
            p.error("--plot draws the batch table: use it with --compare --batch-size 1,2,4,8")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.plot))):
            p.error(f"--plot {a.plot}: its folder does not exist")
        try:
            require_matplotlib()
        except ValueError as e:
            p.error(str(e))
    if a.reference and a.method == "plain":
        p.error("--reference decodes with Medusa; choose --method greedy, typical or rejection")
    if a.temperature is None:
        a.temperature = SAMPLING_TEMPERATURE if a.method in ("typical", "rejection") else 0.0
    rule = None if a.method in (None, "plain") else a.method  # None: greedy at T = 0, else rejection
    a.method = "plain" if a.method == "plain" else "reference" if a.reference and not a.compare else "medusa"
    try:  # every sampling setting is checked here, once; plain decoding reads only T and top-p
        a.sampling = Sampling(acceptance=rule, temperature=a.temperature, top_p=a.top_p)
    except ValueError as e:
        if a.compare and rule == "greedy":  # --compare builds its own rows from T
            a.sampling = Sampling(temperature=a.temperature, top_p=a.top_p)
        else:
            p.error(as_flags(str(e)).replace("greedy acceptance", "--method greedy"))


def prepare(a: argparse.Namespace) -> tuple[Checkpoint, Tree | None, str | None, list[tuple[str, list[int]]]]:
    """Load the checkpoint, choose the tree and encode the prompts; ValueError for anything unusable."""
    device = pick_device(a.device)
    dtype = pick_dtype(a.dtype, device)
    if a.demo:
        print("training the demo model and its heads (a few seconds)...", file=sys.stderr)
        ck, texts = demo_checkpoint()
        ck.model.to(device=device, dtype=dtype)
        ck.heads.to(device=device, dtype=dtype)
        tree, name = resolve_tree(a.tree or "cpu", num_heads=ck.heads.num_heads, ckpt_dir="", device=device)
        text = a.prompt[0] if a.prompt else texts[0]
        return ck, tree, name, [(text, encode_prompt(ck.enc, text, block_size=ck.block_size))]
    ck = load_for_decoding(a.ckpt, device=device, dtype=dtype)
    needs_heads = a.method != "plain" or a.compare or a.explain or a.show
    if needs_heads and ck.heads is None:
        wanted = "--compare" if a.compare else "--explain" if a.explain else "Medusa decoding"
        raise ValueError(f"{a.ckpt} has no Medusa heads, which {wanted} needs; use --method plain or train heads")
    tree, name = (None, None) if ck.heads is None else resolve_tree(
        a.tree, num_heads=ck.heads.num_heads, ckpt_dir=a.ckpt, device=device)
    texts = a.prompt if a.prompt else load_prompts(a.ckpt)[: a.num_prompts]
    prompts = []
    for i, text in enumerate(texts, start=1):
        try:
            prompts.append((text, encode_prompt(ck.enc, text, block_size=ck.block_size)))
        except ValueError as e:
            source = "--prompt" if a.prompt else PROMPTS_FILE
            raise ValueError(f"prompt {i} ({source}): {e}") from None
    return ck, tree, name, prompts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    check_args(parser, a)
    try:
        ck, tree, tree_name, prompts = prepare(a)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    sample_t = a.temperature if a.temperature > 0 else SAMPLING_TEMPERATURE  # --compare's sampled rows
    warmup_s = None
    if a.compile:
        ck.model = compile_steps(ck.model)
        # Every batch size that runs: prompts B at a time end with a smaller batch when B does not divide them.
        sizes = a.batch_sizes if a.batch_table else sorted({a.batch_size, len(prompts) % a.batch_size} - {0})
        warmup_s = sum(warm_up(ck.model, tree, batch_size=b) for b in sizes)
        print(f"compiled the plain step and the verify steps in {warmup_s:.1f} s (not in any timing)",
              file=sys.stderr)
    try:
        if a.show:
            print(f"tree {tree_name}: {tree.num_nodes - 1} nodes + root, depth {tree.depth}\n{tree.draw()}\n")
            print(f"attention mask (row attends to column):\n{tree.draw_mask()}\n")
        if a.batch_table:
            result = compare_batches(ck, [ids for _, ids in prompts], tree=tree, batch_sizes=a.batch_sizes,
                                     sampling=a.sampling, seed=a.seed, max_new_tokens=a.max_new_tokens,
                                     sample_temperature=sample_t)
            result["compile_warmup_s"] = warmup_s
            if a.plot:
                plot_batch(result["rows"], a.plot, title=f"medusa_mini, {ck.directory}, {result['device']}")
            print(json.dumps(result) if a.json else format_batches(result))
        elif a.compare:
            result = compare(ck, prompts, sampling=a.sampling, tree=tree, tree_name=tree_name, seed=a.seed,
                             sample_temperature=sample_t, max_new_tokens=a.max_new_tokens, with_reference=a.reference)
            result["compile_warmup_s"] = warmup_s
            print(json.dumps(result) if a.json else format_compare(result))
        elif a.explain:
            if a.demo:
                print(DEMO_NOTE + "\n")
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
