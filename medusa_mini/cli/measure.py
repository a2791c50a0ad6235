"""`python -m medusa_mini.cli.measure --ckpt DIR`: how often a checkpoint's heads are accepted, measured
again (train_tiny.py measures it after training) in float32: heads_accuracy.json, which `--tree N` reads.
"""

from __future__ import annotations

import os
import sys

import torch

from ..io.loading import PROMPTS_FILE, load_for_decoding, load_prompts
from ..train.device import pick_device
from ..train.report import ACCURACY_FILE, format_accuracy, greedy_continuations, measure_head_accuracy, save_accuracy
from ..tree import build_tree
from .common import OneLineParser

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def recompute_accuracy(directory: str, *, num_prompts: int = 32, max_new_tokens: int = 64, top_k: int = 10,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """acc [K, top_k] on the greedy continuations of the checkpoint's prompts.json, saved with it."""
    ckpt = load_for_decoding(directory, device=torch.device(device))
    if ckpt.heads is None:
        raise ValueError(f"checkpoint {directory} has no Medusa heads; train heads first")
    room = ckpt.block_size - max_new_tokens  # each prompt cut so that its continuation fits in the context
    if room < 1:
        raise ValueError(f"max-new-tokens {max_new_tokens} leaves no room for a prompt in {ckpt.block_size} positions")
    prompts = [ids[:room] for ids in map(ckpt.enc.encode_ordinary, load_prompts(directory)[:num_prompts]) if ids]
    if not prompts:
        raise ValueError(f"every prompt in {os.path.join(directory, PROMPTS_FILE)} encodes to no tokens")
    greedy = greedy_continuations(ckpt.model, prompts, max_new_tokens=max_new_tokens)
    acc = measure_head_accuracy(ckpt.model, ckpt.heads, greedy, prompt_lens=[len(p) for p in prompts],
                                top_k=min(top_k, ckpt.model.config.vocab_size))
    meta = {"measured_on": f"greedy continuations ({max_new_tokens} new tokens) of the first {len(prompts)} "
            f"prompts of {PROMPTS_FILE}", "num_prompts": len(prompts), "max_new_tokens": max_new_tokens}
    save_accuracy(directory, acc, meta=meta)
    return acc


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.cli.measure", description="Measure how often a checkpoint's "
                      "Medusa heads are accepted on greedy continuations of its prompts.json; save "
                      "heads_accuracy.json, from which decode.py --tree N builds trees.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (with prompts.json and a tokenizer)")
    p.add_argument("--prompts", type=int, default=32, help="prompts of prompts.json used (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="continuation length per prompt (default: 64)")
    p.add_argument("--top-k", type=int, default=10, help="ranks measured per head (default: 10)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    ns = p.parse_args(argv)
    try:
        if ns.prompts < 1 or ns.max_new_tokens < 3 or ns.top_k < 1:
            raise ValueError("--prompts and --top-k must be >= 1 and --max-new-tokens >= 3")
        acc = recompute_accuracy(ns.ckpt, num_prompts=ns.prompts, max_new_tokens=ns.max_new_tokens,
                                 top_k=ns.top_k, device=pick_device(ns.device))
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"saved {os.path.join(ns.ckpt, ACCURACY_FILE)}\n{format_accuracy(acc)}")
    print("expected tokens/step of build_tree (product rule, bonus token counted) by node budget:")
    print("  ".join(f"{n} nodes: {build_tree(acc, n)[1]:.2f}" for n in BUDGETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
