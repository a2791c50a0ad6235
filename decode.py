"""Generate text from a checkpoint with plain or Medusa decoding; show the steps, explain one, or compare.

    python decode.py                      # Medusa, greedy, on the checkpoint's held-out prompts
    python decode.py --show --show-tree   # each forward pass's tokens in their own colour
    python decode.py --explain            # one Medusa step, stage by stage (--demo: no checkpoint needed)
    python decode.py --compare            # plain vs Medusa: steps, tokens/step, ms/token, speedup
    python decode.py --compare --batch-sizes 1,2,4,8,16   # where batching ends Medusa's speedup
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
from medusa_mini.cli.common import (
    DTYPES,
    OneLineParser,
    as_flags,
    encode_prompt,
    pick_device,
    pick_dtype,
)
from medusa_mini.cli.compare import compare, format_compare
from medusa_mini.cli.compiled import compile_steps, warm_up
from medusa_mini.cli.explain import explain_step
from medusa_mini.cli.demo import DEMO_NOTE, demo_checkpoint
from medusa_mini.cli.generation import generate_each, json_each
from medusa_mini.cli.plots import plot_batch, require_matplotlib
from medusa_mini.dynamic import DynamicTree
from medusa_mini.io.loading import (
    PROMPTS_FILE,
    Checkpoint,
    load_for_decoding,
    load_prompts,
)
from medusa_mini.sampling import Sampling
from medusa_mini.tune.acceptance_tables import (
    SAMPLING_TEMPERATURE,  # the sampling rules' default temperature
)
from medusa_mini.tune.trees import (
    RuleTrees,
    default_tree_name,
    resolve_trees,
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
                   help="stored (trees.json's for this device type, --dtype, --compile, or the closest), auto (sized"
                        " now from heads_accuracy.json and step costs measured on this device: varies with"
                        " load), N (N nodes built from heads_accuracy.json), dynamic (each step its own most"
                        " confident nodes, as many as the default tree has) or dynamic:N, cpu, gpu, chainN, or a"
                        " JSON list of choices (default: stored; else 8 nodes on a CPU and 64 on CUDA from"
                        " heads_accuracy.json; else the cpu or gpu preset)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="decode the prompts B at a time, each row with its own path and length (default: 1)")
    p.add_argument("--reference", action="store_true",
                   help="decode with reference.py, the readable one-file decoder (same tokens, slower); with "
                        "--compare, add its rows")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weights, heads and KV cache in this precision; acceptance in float32. In half "
                        "precision a tree pass and a plain pass may round a near-tie differently: "
                        "--compare reports where (default: %(default)s)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the plain step and the tree verify (CUDA graphs on CUDA); their "
                        "compilation runs first and is reported apart from the timings")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--show", action="store_true", help="mark the tokens of each forward pass")
    mode.add_argument("--explain", action="store_true", help="walk through one Medusa step on the first prompt")
    mode.add_argument("--compare", action="store_true", help="table: plain vs Medusa, greedy and sampling")
    p.add_argument("--demo", action="store_true",
                   help="with --explain: a tiny model and heads trained on the spot (a few seconds), no checkpoint")
    p.add_argument("--batch-sizes", metavar="B1,B2,...",
                   help="with --compare: tokens/s of plain and Medusa decoding at each batch size, and where "
                        "Medusa stops paying")
    p.add_argument("--plot", metavar="FILE.png", help="with --batch-sizes: draw the table (needs matplotlib)")
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
    if a.batch_size < 1:
        p.error(f"--batch-size must be at least 1, not {a.batch_size}")
    if a.batch_size > 1 and (a.show or a.reference or a.explain or a.compare):
        p.error("--batch-size decodes several prompts at once; --show, --reference, --explain and --compare take "
                "one at a time (use --compare --batch-sizes for a batch table)")
    if a.demo and not a.explain:
        p.error("--demo goes with --explain: python decode.py --explain --demo")
    if a.batch_sizes is not None:
        sizes = a.batch_sizes.split(",")
        if not a.compare or not all(x.isdigit() and int(x) >= 1 for x in sizes):
            p.error("--batch-sizes goes with --compare and takes sizes >= 1, e.g. --compare --batch-sizes 1,2,4,8")
        a.batch_sizes = sorted({int(x) for x in sizes})
    if a.plot is not None:
        if a.batch_sizes is None:
            p.error("--plot draws the batch table: use it with --compare --batch-sizes")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.plot))):
            p.error(f"--plot {a.plot}: its folder does not exist")
        try:
            require_matplotlib()
        except ValueError as e:
            p.error(str(e))
    if a.reference:
        if a.method == "plain" and not a.compare:
            p.error("--reference decodes with Medusa; leave out --method plain")
        a.method = "reference" if not a.compare else a.method
    if a.temperature is None:
        a.temperature = 0.0 if a.acceptance in (None, "greedy") else SAMPLING_TEMPERATURE
    try:  # every sampling setting is checked here, once; plain decoding reads only T and top-p
        a.sampling = Sampling(acceptance=a.acceptance if a.method != "plain" or a.explain else None,
                              temperature=a.temperature, top_p=a.top_p, epsilon=a.epsilon, delta=a.delta,
                              draft=a.draft)
    except ValueError as e:
        if a.compare and a.acceptance == "greedy":  # --compare builds its own rows from T
            a.sampling = Sampling(temperature=a.temperature, top_p=a.top_p, epsilon=a.epsilon, delta=a.delta,
                                  draft=a.draft)
        else:
            p.error(as_flags(str(e)))


def prepare(a: argparse.Namespace) -> tuple[Checkpoint, RuleTrees | None, str | None, list[tuple[str, list[int]]]]:
    """Load the checkpoint, choose the tree and encode the prompts; ValueError for anything unusable."""
    device = pick_device(a.device)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if a.demo:
        print("training the demo model and its heads (a few seconds)...", file=sys.stderr)
        ck, texts = demo_checkpoint()
        ck.model.to(device=device, dtype=pick_dtype(a.dtype, device))
        ck.heads.to(device=device, dtype=pick_dtype(a.dtype, device))
        trees = resolve_trees(a.tree or "cpu", num_heads=ck.heads.num_heads, ckpt_dir="", device=device)
        ids = encode_prompt(ck.enc, a.prompt[0] if a.prompt else texts[0], block_size=ck.block_size)
        return ck, trees, a.tree or "cpu", [(a.prompt[0] if a.prompt else texts[0], ids)]
    ck = load_for_decoding(a.ckpt, device=device, dtype=pick_dtype(a.dtype, device))
    needs_heads = a.method != "plain" or a.compare or a.explain
    if needs_heads and ck.heads is None:
        wanted = "--compare" if a.compare else "--explain" if a.explain else "--method medusa"
        raise ValueError(f"{a.ckpt} has no Medusa heads, which {wanted} needs; use --method plain or train heads")
    trees = tree_name = None
    if needs_heads or a.show_tree:
        num_heads = ck.heads.num_heads if ck.heads is not None else None
        trees = resolve_trees(a.tree, num_heads=num_heads, ckpt_dir=a.ckpt, device=device,
                              dtype=pick_dtype(a.dtype, device), compiled=a.compile,
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
    warmup_s = None
    if a.compile:
        compile_steps(ck.model)
        # Every batch size that runs: prompts B at a time end with a smaller batch when B does not divide them.
        sizes = a.batch_sizes or sorted({a.batch_size, len(prompts) % a.batch_size} - {0})
        warmup_s = sum(warm_up(ck.model, [] if trees is None else [trees.greedy, trees.sampled], batch_size=b)
                       for b in sizes)
        print(f"compiled the plain step and the verify steps in {warmup_s:.1f} s (not in any timing)",
              file=sys.stderr)
    try:
        if a.show_tree:
            shown = tree.fixed if isinstance(tree, DynamicTree) else tree
            what = "the fixed tree of sampled drafts; other rules choose each step's own" \
                if isinstance(tree, DynamicTree) else f"{tree_name}"
            print(f"tree {what}: {shown.num_nodes - 1} nodes + root, depth {shown.depth}\n{shown.draw()}\n")
            print(f"attention mask (row attends to column):\n{shown.draw_mask()}\n")
        if a.compare and a.batch_sizes:
            result = compare_batches(ck, [ids for _, ids in prompts], trees=trees, batch_sizes=a.batch_sizes,
                                     sampling=a.sampling, seed=a.seed, max_new_tokens=a.max_new_tokens,
                                     sample_temperature=a.temperature if a.temperature > 0 else SAMPLING_TEMPERATURE,
                                     repeat=a.repeat)
            result["compile_warmup_s"] = warmup_s
            if a.plot:
                plot_batch(result["rows"], a.plot, title=f"medusa_mini, {ck.directory}, {result['device']}")
            print(json.dumps(result) if a.json else format_batches(result))
        elif a.compare:
            result = compare(ck, prompts, sampling=a.sampling, trees=trees, tree_name=tree_name, seed=a.seed,
                             sample_temperature=a.temperature if a.temperature > 0 else SAMPLING_TEMPERATURE,
                             max_new_tokens=a.max_new_tokens, repeat=a.repeat, with_reference=a.reference)
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
