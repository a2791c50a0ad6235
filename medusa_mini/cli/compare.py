"""`decode.py --compare`: five ways to decode the same prompts, timed in one run, in one table.

Rows: plain greedy, Medusa greedy, Medusa typical, plain sampling, Medusa rejection sampling; with
`--reference`, the reference decoder (reference.py) under each Medusa rule, which must print the
engine's tokens. Greedy Medusa makes plain greedy's tokens in float32; in half precision a tree forward
and a one-token forward may round a near-tie differently, so the table never aborts on a difference:
it says where, and how close plain decoding's top two logits were there.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import reference
from ..decoding import GenerationStats, generate, medusa_generate
from ..io.loading import Checkpoint
from ..sampling import Sampling
from ..tree import Tree
from .common import BONUS_NOTE, timed
from .compiled import step_cache

REPEAT = 3  # every generation runs this many times, methods in turns; the fastest counts


def generate_once(
    ck: Checkpoint, ids: list[int], *, method: str, sampling: Sampling, tree: Tree | None, seed: int,
    max_new_tokens: int, on_step: Callable | None = None, stop_at_eot: bool = True,
) -> tuple[list[int], GenerationStats]:
    """One generation with its own seeded generator, so each prompt's result is reproducible alone.
    The wall time of the whole call, prefill included, goes to stats.seconds."""
    gen = torch.Generator(device=ck.model.device).manual_seed(seed)
    eos_id = ck.eot_id if stop_at_eot else None
    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, generator=gen, on_step=on_step)
    block = ck.model.config.block_size
    if method == "plain":
        cache = step_cache(ck.model, block)  # compiled steps replay on one cache; else None: a new one
        run = lambda: generate(ck.model, ids, cache=cache, **common)  # noqa: E731
    elif method == "reference":
        run = lambda: reference_generate(ck, ids, tree=tree, **common)  # noqa: E731
    else:
        cache = step_cache(ck.model, block + tree.num_nodes)
        run = lambda: medusa_generate(ck.model, ck.heads, ids, tree=tree, cache=cache, **common)  # noqa: E731
    (tokens, stats), seconds = timed(ck.model.device, run)
    stats.seconds = seconds
    return tokens, stats


def reference_generate(ck: Checkpoint, ids: list[int], *, tree, max_new_tokens: int, sampling: Sampling,
                       eos_id: int | None, generator: torch.Generator, on_step: Callable | None = None
                       ) -> tuple[list[int], GenerationStats]:
    """The reference decoder (reference.py) with the engine's statistics: it counts passes, not steps' tokens."""
    if ck.heads.config.kind == "hydra":
        raise ValueError("the reference decoder reads Medusa heads; dependent (hydra) heads decode in the engine")
    tokens, steps = reference.medusa_generate(ck.model, ck.heads, ids, tree=tree, max_new_tokens=max_new_tokens,
                                              sampling=sampling, eos_id=eos_id, generator=generator)
    if on_step is not None and tokens:
        on_step(tokens)
    stats = GenerationStats(prompt_tokens=len(ids), steps=steps, step_tokens=[len(tokens) - 1] if steps else [])
    return tokens, stats


def label_of(method: str, sampling: Sampling) -> str:
    t = sampling.temperature
    if method == "plain":
        return "plain greedy" if sampling.greedy else f"plain sampling (T={t:g})"
    who = "reference" if method == "reference" else "Medusa"
    return f"{who} greedy" if sampling.greedy else f"{who} {sampling.rule} (T={t:g})"


@torch.no_grad()
def first_difference(ck: Checkpoint, prompt: list[int], reference: list[int], other: list[int]) -> dict | None:
    """Where `other` first leaves `reference` (plain greedy's tokens), with the backbone's top-1 minus
    top-2 logit there (near 0: a near-tie that rounding may flip); None if equal."""
    pos = next((i for i, (r, o) in enumerate(zip(reference, other)) if r != o), None)
    if pos is None:
        if len(reference) == len(other):
            return None
        pos = min(len(reference), len(other))  # one stopped earlier (an end token) and the other did not
    seq = torch.tensor(prompt + reference[:pos], device=ck.model.device)[-ck.block_size:]  # [T]
    logits, _ = ck.model(seq[None])  # [1, T, V]
    top2 = logits[0, -1].float().topk(2).values  # [2]
    return {"position": pos, "margin": float(top2[0] - top2[1])}


Runs = list[tuple[list[int], GenerationStats]]  # per prompt: the new tokens and the fastest run's statistics


def fastest_in_turns(run: Callable[[str, list[int], int, int], tuple[list[int], GenerationStats]], keys: list[str],
                     prompts: list[list[int]], *, max_new_tokens: int, repeat: int) -> tuple[dict[str, Runs], set[str]]:
    """Per key, each prompt's fastest of `repeat` runs of run(key, ids, prompt index, max_new_tokens); and the
    keys whose repeats made different tokens (the first run's are kept)."""
    for key in keys:  # untimed: the first calls pay for allocation, kernel setup and tree tensors
        run(key, prompts[0], 0, min(max_new_tokens, 8))
    # Prompt-major order, every generation `repeat` times in turns: a load spike on a shared machine
    # then slows every method alike, and the fastest of the repeats is the one it did not touch.
    results: dict[str, Runs] = {key: [] for key in keys}
    unsteady: set[str] = set()
    for i, ids in enumerate(prompts):
        best: dict[str, tuple[list[int], GenerationStats]] = {}
        for _ in range(repeat):
            for key in keys:
                tokens, stats = run(key, ids, i, max_new_tokens)
                if key in best and best[key][0] != tokens:  # seeded: repeats make the same tokens, or we say so
                    unsteady.add(key)
                    tokens = best[key][0]
                if key not in best or stats.seconds < best[key][1].seconds:
                    best[key] = (tokens, stats)
        for key in keys:
            results[key].append(best[key])
    return results, unsteady


def rule_specs(sampling: Sampling, temperature: float) -> list[tuple[str, str, Sampling]]:
    """(key, decoder, sampling) of the five rows; the sampled ones at `temperature`, top-p and draft kept."""
    greedy = dataclasses.replace(sampling, acceptance="greedy", temperature=0.0)
    sampled = {rule: dataclasses.replace(greedy, acceptance=rule, temperature=temperature)
               for rule in ("typical", "rejection")}
    return [("plain_greedy", "plain", greedy), ("medusa_greedy", "medusa", greedy),
            ("medusa_typical", "medusa", sampled["typical"]), ("plain_sampling", "plain", sampled["rejection"]),
            ("medusa_rejection", "medusa", sampled["rejection"])]


def compare(
    ck: Checkpoint, prompts: list[tuple[str, list[int]]], *, sampling: Sampling, tree: Tree, tree_name: str,
    sample_temperature: float, seed: int, max_new_tokens: int, repeat: int = REPEAT, with_reference: bool = False,
) -> dict:
    """The five rows (eight `with_reference`) on `tree`, timed in the same run, the sampled ones at
    `sample_temperature`; one dict of rows, settings and per-prompt differences."""
    specs = rule_specs(sampling, sample_temperature)
    if with_reference:
        specs += [(key.replace("medusa", "reference"), "reference", s) for key, method, s in specs if method == "medusa"]
    spec = {key: (method, s) for key, method, s in specs}
    results, unsteady = fastest_in_turns(
        lambda key, ids, _, n: generate_once(ck, ids, method=spec[key][0], sampling=spec[key][1], tree=tree, seed=seed,
                                             max_new_tokens=n), list(spec), [ids for _, ids in prompts],
        max_new_tokens=max_new_tokens, repeat=repeat)
    rows = [summarise(key, method, s, results[key]) for key, method, s in specs]
    base = rows[0]
    for row in rows:
        row["speedup"] = base["ms_per_token"] / row["ms_per_token"] if row["ms_per_token"] else 0.0
        row["same_as_plain_greedy"] = None
        if row["temperature"] == 0:
            row["differences"] = [
                {"prompt": i, **d} for i, ((_, ids), ref, out) in enumerate(zip(prompts, base["tokens"], row["tokens"]))
                if (d := first_difference(ck, ids, ref, out)) is not None]
            row["same_as_plain_greedy"] = not row["differences"]
        row["repeats_differ"] = row["key"] in unsteady
        if row["decoder"] == "reference":  # the engine row of the same rule
            engine = next(r for r in rows if r["key"] == row["key"].replace("reference", "medusa"))
            row["same_as_engine"] = sum(a == b for a, b in zip(row["tokens"], engine["tokens"]))
    return {"rows": rows, "device": str(ck.model.device), "dtype": str(ck.model.lm_head.weight.dtype).split(".")[-1],
            "threads": torch.get_num_threads(), "tree": tree_name, "tree_nodes": tree.num_nodes,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "top_p": sampling.top_p, "repeat": repeat, "draft": sampling.draft,
            "note": BONUS_NOTE, "heads": ck.heads.config.kind if ck.heads is not None else None}


def summarise(key: str, method: str, sampling: Sampling, outs: list[tuple[list[int], GenerationStats]]) -> dict:
    """One table row from a method's per-prompt results."""
    steps = sum(s.steps for _, s in outs)
    new = sum(len(tok) for tok, _ in outs)
    seconds = sum(s.seconds for _, s in outs)
    return {
        "method": label_of(method, sampling), "key": key, "decoder": method,
        "acceptance": sampling.rule if method == "medusa" else None, "temperature": sampling.temperature,
        "steps": steps, "new_tokens": new, "seconds": seconds,
        "tokens_per_step": sum(sum(s.step_tokens) for _, s in outs) / steps if steps else 0.0,
        "ms_per_token": 1000 * seconds / max(new, 1),
        "tokens": [tok for tok, _ in outs], "stop_reasons": [s.stop_reason for _, s in outs],
    }


def format_compare(result: dict) -> str:
    head = (f"{'method':<28}{'tokens':>7}{'steps':>7}{'tokens/step':>13}{'ms/token':>10}{'speedup':>9}"
            "  same as plain greedy")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        same = "-"
        if r["same_as_plain_greedy"] is not None:
            n = len(r["tokens"])
            same = "yes" if r["same_as_plain_greedy"] else f"{n - len(r['differences'])}/{n} prompts"
        lines.append(f"{r['method']:<28}{r['new_tokens']:>7}{r['steps']:>7}{r['tokens_per_step']:>13.2f}"
                     f"{r['ms_per_token']:>10.2f}{r['speedup']:>8.2f}x  {same}")
    top_p = f", top-p {result['top_p']:g}" if result["top_p"] < 1 else ""
    top_p += "; rejection candidates: " + ("the heads' top-k" if result.get("draft") == "topk" else "drawn from q")
    threads = f"{result['threads']} thread" + ("s" if result["threads"] != 1 else "")
    nodes = f"{result['tree_nodes']} nodes incl. root"
    if result.get("heads") == "hydra":
        top_p += "; hydra heads (each node's children from its own path's q)"
    dtype = f", {result['dtype']}" if result.get("dtype", "float32") != "float32" else ""
    if result.get("compile_warmup_s") is not None:
        dtype += f", compiled steps (compilation {result['compile_warmup_s']:.1f} s, not timed)"
    lines.append(f"\ndevice {result['device']}{dtype}, {threads}; tree {result['tree']} ({nodes}); "
                 f"{result['prompts']} prompts; max-new-tokens {result['max_new_tokens']}{top_p}")
    best = f", fastest of {result['repeat']} runs in turns" if result["repeat"] > 1 else ""
    lines.append(f"Note: {result['note']};\nplain decoding is exactly 1.00. ms/token includes the prefill{best}.")
    for reason, what in (("context", "at the context limit"), ("eos", "at the end-of-text token")):
        stopped = sum(row["stop_reasons"].count(reason) for row in result["rows"])
        if stopped:
            noun = "generation" if stopped == 1 else "generations"
            lines.append(f"{stopped} {noun} stopped {what} (the tokens column counts what each row made).")
    for r in result["rows"]:
        for d in r.get("differences", []):
            lines.append(f"{r['method']} differs from plain greedy on prompt {d['prompt'] + 1} at new token "
                         f"{d['position'] + 1}: plain's top-2 logit margin there is {d['margin']:.3g}"
                         + (" (a near-tie that rounding can flip)" if d["margin"] < 0.1 else ""))
        if "same_as_engine" in r:
            n = len(r["tokens"])
            lines.append(f"{r['method']}: the engine's tokens on {r['same_as_engine']}/{n} prompts"
                         + ("" if r["same_as_engine"] == n or r["temperature"] == 0 else
                            " (a draw that lands within rounding of a probability can go either way)"))
        if r.get("repeats_differ"):
            lines.append(f"{r['method']}: repeated runs made different tokens (non-deterministic kernels); "
                         "the first run's tokens are reported")
    return "\n".join(lines)
