"""Measure how often a checkpoint's heads are accepted, and store the trees sized for this device.

    python -m medusa_mini.cli.measure --ckpt out/tiny [--prompts 32] [--max-new-tokens 64]
    python -m medusa_mini.cli.measure --ckpt out/gpt2 --device cuda --dtype bfloat16 --compile

Writes heads_accuracy.json (the greedy and the sampled acceptance tables, tune/acceptance_tables.py)
and trees.json's entry for this device type, --dtype and --compile (the `auto` trees that decode.py
then uses by default when it runs the same way). `train_tiny.py` sizes float32, eager trees at the
end of training; run this after moving a checkpoint to another device type, to size trees for
`decode.py --dtype ... --compile`, or to re-measure. The tables are measured in float32 either way.
"""

from __future__ import annotations

import os
import sys

import torch

from ..io.loading import PROMPTS_FILE, load_for_decoding, load_prompts
from ..tree import build_tree
from ..tune.acceptance_tables import (
    ACCURACY_FILE,
    SAMPLING_TEMPERATURE,
    continuations,
    format_accuracy,
    measure_head_accuracy,
    save_accuracy,
)
from ..tune.calibration import (
    CALIBRATION_FILE,
    format_calibration,
    load_calibration,
    measure_calibration,
    save_calibration,
)
from ..tune.replay import greedy_ranks, replay_ceiling, replay_greedy
from ..tune.sizing import REPORT_BUDGETS
from ..tune.trees import TREES_FILE, measure_and_store_trees, trees_key
from .common import DTYPES, OneLineParser, pick_device, pick_dtype
from .compiled import compile_steps


def encode_prompts(enc, texts: list[str], *, block_size: int, max_new_tokens: int) -> list[list[int]]:
    """Token ids of each non-empty prompt, cut so the continuation still fits in the context."""
    room = block_size - max_new_tokens
    if room < 1:
        raise ValueError(f"max-new-tokens {max_new_tokens} leaves no room for a prompt in {block_size} positions")
    return [ids[:room] for ids in (enc.encode_ordinary(t) for t in texts) if ids]


def recompute_accuracy(
    directory: str, *, num_prompts: int = 32, max_new_tokens: int = 64, top_k: int = 10,
    temperature: float = SAMPLING_TEMPERATURE, device: torch.device | str = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Measure both tables (greedy; sampled at `temperature`) and the greedy rank strings on a
    checkpoint's prompts.json, save heads_accuracy.json, return (acc, sampled, ranks)."""
    ckpt = load_for_decoding(directory, device=torch.device(device))  # model, heads, tokenizer
    if ckpt.heads is None:
        raise ValueError(f"checkpoint {directory} has no Medusa heads; train heads first")
    prompts = encode_prompts(ckpt.enc, load_prompts(directory)[:num_prompts],
                             block_size=ckpt.block_size, max_new_tokens=max_new_tokens)
    if not prompts:
        raise ValueError(f"every prompt in {os.path.join(directory, PROMPTS_FILE)} encodes to no tokens")
    top_k = min(top_k, ckpt.model.config.vocab_size)
    lens = [len(p) for p in prompts]
    greedy = continuations(ckpt.model, prompts, max_new_tokens=max_new_tokens)
    acc = measure_head_accuracy(ckpt.model, ckpt.heads, greedy, prompt_lens=lens, top_k=top_k)
    ranks = greedy_ranks(ckpt.model, ckpt.heads, greedy, prompt_lens=lens, top_k=top_k)
    seqs = continuations(ckpt.model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    sampled = measure_head_accuracy(ckpt.model, ckpt.heads, seqs, prompt_lens=lens, top_k=top_k,
                                    temperature=temperature, seed=seed)
    meta = {"measured_on": f"continuations ({max_new_tokens} new tokens, greedy and sampled) of the first "
            f"{len(prompts)} prompts of {PROMPTS_FILE}", "num_prompts": len(prompts), "max_new_tokens": max_new_tokens}
    save_accuracy(directory, acc, sampled=sampled, temperature=temperature, ranks=ranks, meta=meta)
    save_calibration(directory, measure_calibration(ckpt.model, ckpt.heads, greedy, prompt_lens=lens),
                     sampled=measure_calibration(ckpt.model, ckpt.heads, seqs, prompt_lens=lens),
                     temperature=temperature)
    return acc, sampled, ranks


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.cli.measure", description="Measure how often a "
                                "checkpoint's Medusa heads are accepted, on greedy and on sampled "
                                "continuations of its prompts.json; save heads_accuracy.json, then size "
                                "the trees on this device's step cost and store them in trees.json.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (with prompts.json and a tokenizer)")
    p.add_argument("--prompts", type=int, default=32, help="how many prompts of prompts.json to use (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="continuation length per prompt (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=10, help="ranks measured per head (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE,
                   help="temperature of the sampled table, the one rejection sampling uses (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled continuations and draws (default: %(default)s)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="size the trees for decode.py --dtype (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="size the trees for decode.py --compile (the "
                   "compilation itself is not timed)")
    p.add_argument("--no-trees", action="store_true", help="measure the tables only; leave trees.json as it is")
    ns = p.parse_args(argv)
    try:
        if ns.prompts < 1 or ns.max_new_tokens < 3 or ns.top_k < 1:
            raise ValueError("--prompts and --top-k must be >= 1 and --max-new-tokens >= 3")
        if not ns.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {ns.temperature}")
        device = pick_device(ns.device)
        tables = recompute_accuracy(ns.ckpt, num_prompts=ns.prompts, max_new_tokens=ns.max_new_tokens,
                                    top_k=ns.top_k, temperature=ns.temperature, device=device, seed=ns.seed)
        report = None
        if not ns.no_trees:
            ckpt = load_for_decoding(ns.ckpt, device=device, dtype=pick_dtype(ns.dtype, device))
            if ns.compile:
                compile_steps(ckpt.model)
            report = measure_and_store_trees(ns.ckpt, model=ckpt.model, heads=ckpt.heads, device=device)
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"saved {os.path.join(ns.ckpt, ACCURACY_FILE)}")
    acc, sampled, ranks = tables
    print(f"-- greedy acceptance\n{format_accuracy(acc)}")
    print("tokens/step of build_tree replayed on these greedy continuations (bonus token counted) by node budget:")
    print("  ".join(f"{n} nodes: {replay_greedy(ranks, build_tree(acc, n)[0]):.2f}" for n in REPORT_BUDGETS))
    below = min(acc.shape[1], 10)
    print(f"no tree of the heads' top-{below} guesses, fixed or dynamic, makes more than "
          f"{replay_ceiling(ranks, below=below):.2f} tokens/step on these continuations")
    print(f"-- rejection sampling at T={ns.temperature:g}: candidates drawn from the heads\n{format_accuracy(sampled)}")
    print("expected tokens/step of build_tree (product rule, bonus token counted) by node budget:")
    print("  ".join(f"{n} nodes: {build_tree(sampled, n)[1]:.2f}" for n in REPORT_BUDGETS))
    print(f"-- saved {os.path.join(ns.ckpt, CALIBRATION_FILE)}, read by dynamic trees\n"
          f"{format_calibration(load_calibration(ns.ckpt))}")
    if report is not None:
        key = trees_key(device, dtype=pick_dtype(ns.dtype, device), compiled=ns.compile)
        print(f"-- saved {os.path.join(ns.ckpt, TREES_FILE)}, the default trees for {key}\n{report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
