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
import json
import os
import sys

import torch

from medusa_mini.cli.common import (
    DTYPES,
    OneLineParser,
    StepPrinter,
    as_flags,
    encode_prompt,
    pick_device,
    pick_dtype,
    stat_line,
    use_color,
)
from medusa_mini.cli.compare import compare, format_compare, generate_once, label_of
from medusa_mini.cli.compiled import compile_steps, warm_up
from medusa_mini.cli.explain import explain_step
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
                        " load), N (N nodes built from heads_accuracy.json), cpu, gpu, chainN, or a JSON list"
                        " of choices (default: stored; else 8 nodes on a CPU and 64 on CUDA from"
                        " heads_accuracy.json; else the cpu or gpu preset)")
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


def text_of(ck: Checkpoint, tokens: list[int]) -> str:
    return ck.enc.decode([t for t in tokens if t != ck.eot_id])


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
        tokens, stats = generate_once(ck, ids, method=a.method, sampling=a.sampling, tree=tree, seed=a.seed,
                                      max_new_tokens=a.max_new_tokens, on_step=printer)
        printer.close()
        print(f"stats: {stat_line(stats, new_tokens=len(tokens), block_size=ck.block_size)}\n")


def json_each(
    ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, tree: Tree | None
) -> None:
    """--json: one object per prompt per line; `tokens` are the new ids (an end token included)."""
    for text, ids in prompts:
        tokens, stats = generate_once(ck, ids, method=a.method, sampling=a.sampling, tree=tree, seed=a.seed,
                                      max_new_tokens=a.max_new_tokens)
        print(json.dumps({
            "prompt": text, "prompt_tokens": len(ids), "tokens": tokens, "text": text_of(ck, tokens),
            "steps": stats.steps, "tokens_per_step": stats.tokens_per_step, "seconds": stats.seconds,
            "stop_reason": stats.stop_reason, "method": a.method,
            "acceptance": a.sampling.acceptance if a.method == "medusa" else None, "temperature": a.temperature,
        }, ensure_ascii=False))


def prepare(a: argparse.Namespace) -> tuple[Checkpoint, RuleTrees | None, str | None, list[tuple[str, list[int]]]]:
    """Load the checkpoint, choose the tree and encode the prompts; ValueError for anything unusable."""
    device = pick_device(a.device)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    ck = load_for_decoding(a.ckpt, device=device, dtype=pick_dtype(a.dtype, device))
    needs_heads = a.method == "medusa" or a.compare or a.explain
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
        warmup_s = warm_up(ck.model, [] if trees is None else [trees.greedy, trees.sampled])
        print(f"compiled the plain step and the verify steps in {warmup_s:.1f} s (not in any timing)",
              file=sys.stderr)
    try:
        if a.show_tree:
            print(f"tree {tree_name}: {tree.num_nodes - 1} nodes + root, depth {tree.depth}\n{tree.draw()}\n")
            print(f"attention mask (row attends to column):\n{tree.draw_mask()}\n")
        if a.compare:
            result = compare(ck, prompts, sampling=a.sampling, trees=trees, tree_name=tree_name, seed=a.seed,
                             sample_temperature=a.temperature if a.temperature > 0 else SAMPLING_TEMPERATURE,
                             max_new_tokens=a.max_new_tokens, repeat=a.repeat)
            result["compile_warmup_s"] = warmup_s
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
