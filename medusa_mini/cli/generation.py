"""`decode.py`'s own output: each prompt's continuation streamed, or one JSON line per prompt.

Prompts run one at a time, each with its own seeded generator, or `--batch-size B` at a time through
the batched engine, one generator per batch.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..decoding import GenerationStats
from ..io.loading import Checkpoint
from .batches import run_batch
from .common import StepPrinter, stat_line, use_color
from .compare import generate_once, label_of


def decode_all(ck: Checkpoint, ids: list[list[int]], a: argparse.Namespace, tree) -> list[tuple[list[int], GenerationStats]]:
    """Every prompt's (tokens, stats), B at a time; a batch's wall time goes to each of its rows."""
    if a.batch_size == 1:
        return [generate_once(ck, x, method=a.method, sampling=a.sampling, tree=tree, seed=a.seed,
                              max_new_tokens=a.max_new_tokens) for x in ids]
    out = []
    for i in range(0, len(ids), a.batch_size):
        results, seconds = run_batch(ck, ids[i : i + a.batch_size], method=a.method, sampling=a.sampling, tree=tree,
                                     seed=a.seed, max_new_tokens=a.max_new_tokens)
        for _, stats in results:
            stats.seconds = seconds
        out += results
    return out


def generate_each(ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, tree,
                  tree_name: str | None) -> None:
    """Default and --show modes: stream each continuation (batches: print each when all are done), then
    one line of statistics."""
    color = use_color(sys.stdout)
    label = label_of(a.method, a.sampling)
    if tree is not None and a.method != "plain":
        label += f", tree {tree_name}"
    if a.batch_size > 1:
        label += f", {a.batch_size} prompts per batch"
    batched = decode_all(ck, [ids for _, ids in prompts], a, tree) if a.batch_size > 1 else None
    for n, (text, ids) in enumerate(prompts, start=1):
        print(f"=== prompt {n}/{len(prompts)} ({len(ids)} tokens) ===\n{text}")
        how = f"; one {'colour' if color else '[chunk]'} per forward pass, the first from the prefill" if a.show else ""
        print(f"=== {label}{how} ===")
        printer = StepPrinter(ck.enc, sys.stdout, eot_id=ck.eot_id, show_steps=a.show, color=color)
        if batched is not None:
            tokens, stats = batched[n - 1]
            printer(tokens)
        else:
            tokens, stats = generate_once(ck, ids, method=a.method, sampling=a.sampling, tree=tree, seed=a.seed,
                                          max_new_tokens=a.max_new_tokens, on_step=printer)
        printer.close()
        print(f"stats: {stat_line(stats, new_tokens=len(tokens), block_size=ck.block_size)}\n")


def json_each(ck: Checkpoint, prompts: list[tuple[str, list[int]]], a: argparse.Namespace, tree) -> None:
    """--json: one object per prompt per line; `tokens` are the new ids (an end token included)."""
    results = decode_all(ck, [ids for _, ids in prompts], a, tree)
    for (text, ids), (tokens, stats) in zip(prompts, results):
        print(json.dumps({
            "prompt": text, "prompt_tokens": len(ids), "tokens": tokens,
            "text": ck.enc.decode([t for t in tokens if t != ck.eot_id]),
            "steps": stats.steps, "tokens_per_step": stats.tokens_per_step, "seconds": stats.seconds,
            "stop_reason": stats.stop_reason, "method": a.method, "batch_size": a.batch_size,
            "acceptance": a.sampling.acceptance if a.method != "plain" else None, "temperature": a.temperature,
        }, ensure_ascii=False))
