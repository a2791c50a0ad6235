"""The rows of `decode.py --compare` and the sweep: each way of decoding (`Method`) timed in turns, B prompts at
a time, against the plain decoder of its temperature: speedup ≈ tokens/step ÷ step cost. Greedy rows must make plain
greedy's tokens; in half precision a near-tie may round either way, so a parting is located. The tables, the figure."""

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from .. import reference
from ..decoding import CacheSource, GenerationStats, generate_batch, length_stop_reason, medusa_generate_batch
from ..io.loading import Checkpoint
from ..sampling import Sampling
from ..step import Steps
from ..tree import Tree
from .common import BONUS_NOTE, draw, in_turns, out_of_memory

REPEAT = 3  # every generation runs this many times, methods in turns; the fastest counts
Results = list[tuple[list[int], GenerationStats]]  # per row of a batch: its new tokens and statistics
Runs = list[tuple[Results, float]]  # per batch of prompts: its results and the seconds it took


@dataclass(frozen=True)
class Method:
    """Plain decoding (no drafter), a drafter (heads, `PromptLookup`) on `tree`, or reference.py's decoder."""

    name: str  # "plain", "Medusa", "prompt lookup", "reference"
    sampling: Sampling
    drafter: object = None
    tree: Tree | None = None
    reference: bool = False

    @property
    def rule(self) -> str:
        return "greedy" if self.sampling.greedy else "sampling" if self.drafter is None else self.sampling.acceptance

    @property
    def label(self) -> str:  # heads shown by their kind: "Hydra greedy" is Medusa decoding with Hydra heads
        name = getattr(self.drafter, "name", self.name) if self.name == "Medusa" else self.name
        return f"{name} {self.rule}" + ("" if self.sampling.greedy else f" (T={self.sampling.temperature:g})")

    @property
    def key(self) -> str:  # one per row, whatever the heads' kind: "medusa_greedy", "plain_sampling", ...
        return f"{self.name} {self.rule}".lower().replace(" ", "_")


@dataclass
class Engine:
    """How this run decodes: eager steps, or compiled ones and the static caches they replay on."""

    ck: Checkpoint
    steps: Steps = Steps()
    caches: CacheSource | None = None


def decode(engine: Engine, method: Method, prompts: list[list[int]], *, seed: int, max_new_tokens: int,
           stop_at_eot: bool = True, on_step=None) -> Results:
    """The prompts decoded together (the reference: one by one, unstreamed), one generator seeded `seed`; untimed."""
    ck = engine.ck
    kw = dict(max_new_tokens=max_new_tokens, sampling=method.sampling, eos_id=ck.eot_id if stop_at_eot else None,
              generator=torch.Generator(device=ck.model.device).manual_seed(seed))
    if not method.reference:
        kw.update(on_step=on_step, steps=engine.steps, cache=engine.caches)  # the loop asks for its size
        if method.drafter is None:
            return generate_batch(ck.model, prompts, **kw)
        return medusa_generate_batch(ck.model, method.drafter, prompts, tree=method.tree, **kw)
    out = []
    for ids in prompts:  # the engine's statistics from the reference's tokens and passes
        tokens, steps = reference.medusa_generate(ck.model, ck.heads, ids, tree=method.tree, **kw)
        why = "eos" if tokens[-1:] == [kw["eos_id"]] else length_stop_reason(len(ids), max_new_tokens, ck.block_size)
        out.append((tokens, GenerationStats(len(ids), steps, [len(tokens) - 1] if steps else [], stop_reason=why)))
    return out


def run_in_turns(engine: Engine, methods: list[Method], batches: list[list[list[int]]], *, max_new_tokens: int,
                 seed: int, repeat: int = REPEAT, stop_at_eot: bool = True) -> tuple[dict[str, Runs], set[str]]:
    """Per method key, each batch's fastest of `repeat` runs in turns, after a short untimed run each; and the
    keys whose repeats made other tokens (non-deterministic kernels)."""
    device, kw = engine.ck.model.device, dict(seed=seed, stop_at_eot=stop_at_eot)
    in_turns({m.key: partial(decode, engine, m, batches[0], max_new_tokens=min(max_new_tokens, 8), **kw)
              for m in methods}, rounds=1, device=device)
    runs = in_turns({(m.key, i): partial(decode, engine, m, b, max_new_tokens=max_new_tokens, **kw)
                     for i, b in enumerate(batches) for m in methods}, rounds=repeat, device=device)
    tokens = {k: [[t for t, _ in results] for results, _ in tries] for k, tries in runs.items()}
    unsteady = {key for (key, _), seen in tokens.items() if any(t != seen[0] for t in seen)}
    return {m.key: [min(runs[m.key, i], key=lambda r: r[1]) for i in range(len(batches))] for m in methods}, unsteady


def summarise(runs: Runs) -> dict:
    """One row's numbers, tokens and stop reasons. A batch runs until its slowest row stops: `passes` are its
    forward passes (ms/step is per pass); `row_passes` count each once per row it carried, against the rows' steps."""
    rows = [row for results, _ in runs for row in results]
    steps, passes = sum(st.steps for _, st in rows), sum(max(st.steps for _, st in results) for results, _ in runs)
    row_passes = sum(max(st.steps for _, st in results) * len(results) for results, _ in runs)
    new, seconds = sum(len(tokens) for tokens, _ in rows), sum(s for _, s in runs)
    return {"steps": steps, "passes": passes, "row_passes": row_passes, "new_tokens": new, "seconds": seconds,
            "tokens_per_step": sum(sum(st.step_tokens) for _, st in rows) / max(steps, 1),
            "ms_per_token": 1000 * seconds / max(new, 1), "ms_per_step": 1000 * seconds / max(passes, 1),
            "tokens_per_s": new / seconds if seconds else 0.0, "tokens": [tokens for tokens, _ in rows],
            "stop_reasons": [st.stop_reason for _, st in rows]}


@torch.no_grad()
def first_difference(ck: Checkpoint, prompt: list[int], want: list[int], got: list[int]) -> dict | None:
    """Where `got` first leaves `want`, and the backbone's top-1 minus top-2 logit there; None if equal."""
    if got == want:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    seq = torch.tensor(prompt + want[:pos], device=ck.model.device)[-ck.block_size:]  # [T]
    top2 = ck.model(seq[None])[0][0, -1].float().topk(2).values  # [2]
    return {"position": pos, "margin": float(top2[0] - top2[1])}


def compare(engine: Engine, prompts: list[list[int]], methods: list[Method], *, max_new_tokens: int, seed: int,
            batch_sizes: list[int] = (1,), repeat: int = REPEAT, stop_at_eot: bool = True,
            warm: Callable[[int], float] | None = None) -> dict:
    """A row per method and batch size, the prompts (cycled up to the largest batch) taken B at a time; the
    first row's tokens are those greedy rows must make. warm(B), for compiled steps, warms B's shapes up first. The
    first size the device cannot hold ends the table there (`stopped` says why), the sizes measured before it kept."""
    work = [prompts[i % len(prompts)] for i in range(max(max(batch_sizes), len(prompts)))]
    rows, stopped, warmed_s = [], None, 0.0
    for B in batch_sizes:
        try:
            warmed_s += warm(B) if warm else 0.0
            runs, unsteady = run_in_turns(engine, methods, [work[i : i + B] for i in range(0, len(work), B)], seed=seed,
                                          max_new_tokens=max_new_tokens, repeat=repeat, stop_at_eot=stop_at_eot)
        except RuntimeError as e:  # out of memory (CUDA's or a CPU's) at the first size: exit_with's one line
            if not rows or (words := out_of_memory(e)) is None:
                raise
            held = "; compiled, every smaller size's static caches are still held" if warm else ""
            stopped = f"batch {B} does not fit ({words}{held}): the table ends at batch {rows[-1]['batch_size']}"
            break
        rows += [{"method": m.label, "key": m.key, "batch_size": B, "temperature": m.sampling.temperature,
                  "plain": m.drafter is None, **summarise(runs[m.key]), "repeats_differ": m.key in unsteady}
                 for m in methods]
    plains = {(r["temperature"], r["batch_size"]): r for r in rows if r["plain"]}
    for row in rows:
        plain = plains[row["temperature"], row["batch_size"]]
        row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
        row["step_cost"] = row["ms_per_step"] / plain["ms_per_step"] if plain["ms_per_step"] else 0.0
        row["same_as_plain_greedy"] = None
        if row["temperature"] == 0:
            row["differences"] = [{"prompt": i, **d} for i, (ids, want, got) in enumerate(
                zip(work, rows[0]["tokens"], row["tokens"])) if (d := first_difference(engine.ck, ids, want, got))]
            row["same_as_plain_greedy"] = not row["differences"]
        if row["key"].startswith("reference"):
            engine_row = next(r for r in rows if r["key"] == row["key"].replace("reference", "medusa"))
            row["same_as_engine"] = sum(a == b for a, b in zip(row["tokens"], engine_row["tokens"]))
    one = list(batch_sizes) == [1] and "prompt_lookup_greedy" in runs
    return {"rows": rows, "batch_sizes": list(batch_sizes), "stopped": stopped, "prompts": len(work),
            "distinct_prompts": len(prompts), "compile_warmup_s": warmed_s if warm else None,
            "max_new_tokens": max_new_tokens, "repeat": repeat, "per_prompt": per_prompt(work, runs) if one else None}


def per_prompt(prompts: list[list[int]], runs: dict[str, Runs]) -> list[dict]:
    """Per prompt: greedy tokens/step of prompt lookup and of Medusa, and the share of plain greedy's new tokens
    that repeat the one before (what lookup finds)."""
    seqs = [ids[-1:] + runs["plain_greedy"][i][0][0][0] for i, ids in enumerate(prompts)]
    return [{"prompt": i, **{key: runs[key][i][0][0][1].tokens_per_step for key in ("prompt_lookup_greedy",
             "medusa_greedy")}, "repeats": sum(a == b for a, b in zip(seq, seq[1:])) / max(len(seq) - 1, 1)}
            for i, seq in enumerate(seqs)]


COLUMNS = {  # row key: (header, width, format)
    "batch_size": ("batch", 6, "d"), "new_tokens": ("tokens", 7, "d"), "tokens_per_s": ("tokens/s", 10, ".1f"),
    "steps": ("steps", 7, "d"), "tokens_per_step": ("tokens/step", 13, ".2f"), "step_cost": ("step cost", 11, ".2f"),
    "ms_per_token": ("ms/token", 10, ".2f"), "ms_per_step": ("ms/step", 9, ".2f"), "speedup": ("speedup", 9, ".2f")}


def why_line(rows: list[dict]) -> str:
    """Where a drafter (its rows, in batch sizes' order) stops paying, the smallest batch size from which its speedup
    stays below 1x, and why: its step's cost, and the passes a batch makes against those its rows needed."""
    stops = next((i for i in range(len(rows)) if all(r["speedup"] < 1 for r in rows[i:])), None)
    r, first = rows[-1 if stops is None else stops], rows[0]
    B, cost = r["batch_size"], f"a step costs {first['step_cost']:.2f}x a plain step at batch {first['batch_size']}"
    waiting = r["row_passes"] / max(r["steps"], 1)  # 1.0: every row needed every pass
    where = ("does not pay at any batch size here" if stops == 0 else f"stops paying at batch {B}" if stops
             else f"pays at batch {B}" + ", the largest measured" * (len(rows) > 1))
    cost += "" if r is first else f" and {r['step_cost']:.2f}x at batch {B}"  # one batch size: said once
    return (f"{r['method']} {where}: {cost}, and a batch of {B} makes "
            f"{waiting:.2f}x the passes its rows need ({r['tokens_per_step']:.2f} tokens per row per step).")


def format_table(result: dict) -> str:
    """`compare`'s rows, then the settings, what the numbers count and where rows stopped early or left plain
    greedy; then at batch 1 greedy tokens/step per prompt, or with batch sizes where each drafter stops paying."""
    batches = result["batch_sizes"] != [1]
    columns = (("batch_size", "tokens_per_s") if batches else ("new_tokens", "steps")) + (
        "tokens_per_step", "step_cost", "ms_per_step" if batches else "ms_per_token", "speedup")
    head = f"{'method':<32}" + "".join(f"{COLUMNS[c][0]:>{COLUMNS[c][1]}}" for c in columns) + "  same as plain greedy"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        n, agreed = len(r["tokens"]), r["same_as_plain_greedy"]
        same = "-" if agreed is None else "yes" if agreed else f"{n - len(r['differences'])}/{n} prompts"
        lines.append(f"{r['method']:<32}" + "".join(f"{format(r[c], COLUMNS[c][2]):>{COLUMNS[c][1]}}"
                                                    for c in columns) + f"  {same}")
    identity = ("tokens/step is per row, step cost per pass of a whole batch, which runs until its slowest row "
                "stops: speedup ≈ tokens/step ÷ step cost ÷ the extra passes its rows wait for (below) over plain's."
                if batches else "speedup ≈ tokens/step ÷ step cost.")
    compiled, drawn = result.get("compile_warmup_s"), result.get("drawn_tree_nodes")  # None: the others' tree
    lines += ["\ndevice {device}, {dtype}, {threads} thread{ts}; {prompts} prompt{ps}; tree {tree} ({tree_nodes} nodes "
              "incl. root{drawn}{lookup}); max-new-tokens {max_new_tokens}; top-p {top_p:g}{compiled}; {heads} "
              "heads; {heads} rejection candidates: drawn from q".format(
                  **result, ts="s" * (result["threads"] != 1), ps="s" * (result["prompts"] != 1),
                  drawn="" if drawn is None else f"; {result['heads']} rejection's, from its own table: {drawn}",
                  lookup="" if batches else f"; prompt lookup: a chain of up to {result['lookup_nodes']}",
                  compiled="" if compiled is None else f"; steps compiled in {compiled:.1f} s (not timed)"),
              f"Note: {BONUS_NOTE}; plain decoding is exactly 1.00.\nTokens count the prefill's too, which no step "
              f"makes. Step cost: ms per step over the plain decoder's: {identity} Times include the prefill; "
              f"fastest of {result['repeat']} runs."]
    for reason, what in (("context", "at the context limit"), ("eos", "at the end-of-text token")):
        if stopped := sum(row["stop_reasons"].count(reason) for row in result["rows"]):
            lines.append(f"{stopped} of the generations stopped {what} (the tokens column counts what each row made).")
    for r in result["rows"]:
        lines += [f"{r['method']} differs from plain greedy on prompt {d['prompt'] + 1} at new token "
                  f"{d['position'] + 1}: plain's top-2 logit margin there is {d['margin']:.3g}"
                  + " (a near-tie that rounding can flip)" * (d["margin"] < 0.1) for d in r.get("differences", [])]
        if "same_as_engine" in r:
            n, same = len(r["tokens"]), r["same_as_engine"]
            lines.append(f"{r['method']}: the engine's tokens on {same}/{n} prompts" + " (a draw that lands within "
                         "rounding of a probability can go either way)" * (same < n and r["temperature"] > 0))
        if r["repeats_differ"]:
            lines.append(f"{r['method']}: repeated runs made different tokens (non-deterministic kernels); "
                         "the fastest run's are reported")
    if batches:
        lines += [result["stopped"]] if result["stopped"] else []
        n, distinct = result["prompts"], result["distinct_prompts"]
        lines.append(f"{n} prompts" + (f" ({distinct} distinct, cycled)" if distinct < n else "")
                     + " taken B at a time; tokens/s counts every row's new tokens over the whole run.")
        drafters = dict.fromkeys(r["key"] for r in result["rows"] if not r["plain"])
        return "\n".join(lines + [why_line([r for r in result["rows"] if r["key"] == key]) for key in drafters])
    lines.append(f"\n{'prompt':<8}{'prompt lookup':>15}{result['heads']:>8}{'repeats':>9}   (greedy tokens/step; "
                 "repeats: new tokens equal to the one before)")
    return "\n".join(lines + [f"{p['prompt'] + 1:<8}{p['prompt_lookup_greedy']:>15.2f}{p['medusa_greedy']:>8.2f}"
                              f"{p['repeats']:>9.0%}" for p in result["per_prompt"]])


def plot_batch(rows: list[dict], path: str, *, title: str) -> str:
    """The batch table drawn: tokens/s (left) and every drafter's speedup (right) against batch size."""
    speed, gain = [], [(None, 1.0, dict(color="black", ls="--", lw=1, label="1x: as fast as plain"))]
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = [r for r in rows if r["method"] == method]  # in batch sizes' order, as `compare` makes them
        sizes, style = [r["batch_size"] for r in mine], dict(marker="o", color=f"C{i}", label=method)
        speed.append((sizes, [r["tokens_per_s"] for r in mine], style))
        if not method.startswith("plain"):
            gain.append((sizes, [r["speedup"] for r in mine], style))
    return draw(path, {"tokens per second": speed, "speedup over plain": gain}, xlabel="batch size",
                ticks=sorted({r["batch_size"] for r in rows}), title=title)
