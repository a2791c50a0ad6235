"""`decode.py --compare --batch-size 1,2,4,...`: where batching ends Medusa's speedup, measured.

At batch 1 a GPU's forward pass is bound by reading the weights, so verifying N tree nodes costs little
more than one token; as the batch grows the spare compute runs out, and a batch runs until its slowest
row is done. Per batch size: plain and Medusa decoding (greedy, and rejection sampling at T = 0.8) over
the same prompts taken B at a time, tokens/s over all rows, the speedup, tokens per step, what one pass
costs, and how many passes the batches made against what their rows needed.
"""

from __future__ import annotations

import torch

from ..decoding import GenerationStats, generate_batch, medusa_generate_batch
from ..io.loading import Checkpoint
from ..sampling import Sampling
from ..tree import Tree
from .common import BONUS_NOTE, timed
from .compare import REPEAT, label_of, rule_specs
from .compiled import step_cache


def run_batch(ck: Checkpoint, prompts: list[list[int]], *, method: str, sampling: Sampling, tree, seed: int,
              max_new_tokens: int) -> tuple[list[tuple[list[int], GenerationStats]], float]:
    """One batch of prompts decoded together, with its own seeded generator; (per-row results, seconds)."""
    gen = torch.Generator(device=ck.model.device).manual_seed(seed)
    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=ck.eot_id, generator=gen)
    block, B = ck.model.config.block_size, len(prompts)
    if method == "plain":
        cache = step_cache(ck.model, block, batch_size=B)
        return timed(ck.model.device, lambda: generate_batch(ck.model, prompts, cache=cache, **common))
    cache = step_cache(ck.model, block + tree.num_nodes, batch_size=B)
    return timed(ck.model.device,
                 lambda: medusa_generate_batch(ck.model, ck.heads, prompts, tree=tree, cache=cache, **common))


def compare_batches(
    ck: Checkpoint, prompts: list[list[int]], *, tree: Tree, batch_sizes: list[int], sampling: Sampling,
    sample_temperature: float, seed: int, max_new_tokens: int, repeat: int = REPEAT,
) -> dict:
    """Rows of tokens/s per method and batch size over the same prompts (cycled to the largest batch)."""
    specs = [spec for spec in rule_specs(sampling, sample_temperature) if spec[0] != "medusa_typical"]
    work = [prompts[i % len(prompts)] for i in range(max(max(batch_sizes), len(prompts)))]
    rows, plain_tokens = [], {}
    for B in batch_sizes:
        chunks = [work[i : i + B] for i in range(0, len(work), B)]
        for _, method, s in specs:  # untimed: every shape of this batch size meets its kernels once
            run_batch(ck, chunks[0], method=method, sampling=s, tree=tree, seed=seed,
                      max_new_tokens=min(max_new_tokens, 8))
        best: dict[str, tuple[float, list, int]] = {}
        for _ in range(repeat):  # methods take turns; the fastest of the repeats counts
            for key, method, s in specs:
                seconds, outs, passes = 0.0, [], 0
                for chunk in chunks:
                    result, sec = run_batch(ck, chunk, method=method, sampling=s, tree=tree,
                                            seed=seed, max_new_tokens=max_new_tokens)
                    seconds, outs, passes = seconds + sec, outs + result, passes + max(st.steps for _, st in result)
                if key not in best or seconds < best[key][0]:
                    best[key] = (seconds, outs, passes)
        for key, method, s in specs:
            seconds, outs, passes = best[key]
            new = sum(len(tokens) for tokens, _ in outs)
            steps = sum(st.steps for _, st in outs)
            row = {"method": label_of(method, s), "key": key, "batch_size": B, "new_tokens": new,
                   "seconds": seconds, "tokens_per_s": new / seconds if seconds else 0.0,
                   "tokens_per_step": sum(sum(st.step_tokens) for _, st in outs) / steps if steps else 0.0,
                   "passes": passes, "row_steps": steps,  # passes of the batches; steps its rows needed
                   "ms_per_step": 1000 * seconds / max(passes, 1), "tokens": [t for t, _ in outs]}
            if key == "plain_greedy":
                plain_tokens.setdefault("plain_greedy", row["tokens"])  # batch 1's, the reference for all
            if s.greedy:
                row["same_as_plain_greedy"] = row["tokens"] == plain_tokens["plain_greedy"]
            rows.append(row)
        for row in rows[-len(specs):]:
            plain = next(r for r in rows[-len(specs):] if r["key"] == ("plain_greedy" if "greedy" in row["key"]
                                                                          else "plain_sampling"))
            row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    return {"rows": rows, "batch_sizes": batch_sizes, "device": str(ck.model.device),
            "dtype": str(ck.model.lm_head.weight.dtype).split(".")[-1], "threads": torch.get_num_threads(),
            "prompts": len(work), "max_new_tokens": max_new_tokens, "repeat": repeat, "note": BONUS_NOTE,
            "tree_nodes": tree.num_nodes, "heads": ck.heads.config.kind if ck.heads is not None else None,
            "crossover": {key: crossover(rows, key) for key in ("medusa_greedy", "medusa_rejection")}}


def crossover(rows: list[dict], key: str) -> int | None:
    """The smallest batch size from which `key`'s speedup stays below 1x, or None if it never falls."""
    mine = sorted((r for r in rows if r["key"] == key), key=lambda r: r["batch_size"])
    below = [r["batch_size"] for i, r in enumerate(mine) if all(x["speedup"] < 1 for x in mine[i:])]
    return below[0] if below else None


def why_line(result: dict, key: str) -> str:
    """One measured sentence on why Medusa stops paying where it does: a step's cost against a plain one,
    and the passes a batch makes against what its rows needed (the slowest row sets the pace)."""
    rows = {(r["key"], r["batch_size"]): r for r in result["rows"]}
    sizes = result["batch_sizes"]
    plain = "plain_greedy" if "greedy" in key else "plain_sampling"
    first, B = sizes[0], result["crossover"][key] or sizes[-1]
    cost = {b: rows[(key, b)]["ms_per_step"] / rows[(plain, b)]["ms_per_step"] for b in (first, B)}
    r = rows[(key, B)]
    if result["crossover"][key] == first:
        return (f"{r['method']} does not pay at any batch size here: a step costs {cost[first]:.2f}x a plain "
                f"step at batch {first} and yields {r['tokens_per_step']:.2f} tokens per step.")
    waiting = r["passes"] * B / max(r["row_steps"], 1)  # 1.0: every row needed every pass
    where = f"stops paying at batch {B}" if result["crossover"][key] else f"still pays at batch {B}"
    return (f"{r['method']} {where}: a step costs {cost[first]:.2f}x a plain step at batch {first} and "
            f"{cost[B]:.2f}x at batch {B}, and a batch of {B} makes {waiting:.2f}x the passes its rows need "
            f"on average ({r['tokens_per_step']:.2f} tokens per row per step): the slowest row sets the pace.")


def format_batches(result: dict) -> str:
    head = f"{'method':<28}{'batch':>6}{'tokens/s':>11}{'speedup':>9}{'tokens/step':>13}{'ms/step':>9}  same as plain greedy"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        same = "-" if "same_as_plain_greedy" not in r else ("yes" if r["same_as_plain_greedy"] else "no")
        lines.append(f"{r['method']:<28}{r['batch_size']:>6}{r['tokens_per_s']:>11.1f}{r['speedup']:>8.2f}x"
                     f"{r['tokens_per_step']:>13.2f}{r['ms_per_step']:>9.2f}  {same}")
    threads = f"{result['threads']} thread" + ("s" if result["threads"] != 1 else "")
    dtype = f", {result['dtype']}" if result["dtype"] != "float32" else ""
    lines.append(f"\ndevice {result['device']}{dtype}, {threads}; {result['prompts']} prompts taken B at a time; "
                 f"max-new-tokens {result['max_new_tokens']}; fastest of {result['repeat']} runs in turns")
    lines.append(f"Note: {result['note']}; tokens/s counts every row's new tokens over the whole run.")
    lines += [why_line(result, key) for key in ("medusa_greedy", "medusa_rejection")]
    return "\n".join(lines)
