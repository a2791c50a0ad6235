"""Markdown tables from what the benchmark commands print, for `benchmarks/gpu_report.py`.

Each function reads one command's output (bench_step.py --json, train_tiny.py's log, decode.py --compare
--json, and its --batch-sizes rows) and returns markdown: a table, numbers only in its cells, and the
lines that say how to read it. No measuring here.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

BATCH_FIELDS = ("method", "batch_size", "tokens_per_s", "speedup", "tokens_per_step")


def cell(value) -> str:
    """A table cell: floats with 2 decimals (3 significant digits below 1), None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value).replace("|", "\\|")


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table; columns of numbers (None allowed) right-aligned, the others left-aligned."""
    rows = [list(row) for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def variant_name(result: dict) -> str:
    return result["dtype"] + (" compiled" if result["compiled"] else "")


def step_table(config: str, variants: list[dict]) -> str:
    """One GPT shape: a row per measurement (ms unless marked), a column per dtype and eager/compiled."""
    first = variants[0]
    shape = "{n_layer} layers, {n_head} heads, width {n_embd}, vocabulary {vocab_size}".format(**first["config"])
    rows: list[list] = [["first round, s (compilation, if any)", *(v["first_round_s"] for v in variants)],
                        ["plain step (1 token + argmax)", *(v["plain_ms"] for v in variants)]]
    for n in first["verify_ms"]:
        rows.append([f"verify, N = {n}", *(v["verify_ms"][n] for v in variants)])
    for n in [n for n in first["verify_ms"] if int(n) in (64, max(map(int, first["verify_ms"])))]:
        rows.append([f"verify N = {n} / plain step (x)", *(v["verify_ms"][n] / v["plain_ms"] for v in variants)])
    rows.append(["heads (4), shared lm_head", *(v["heads_ms"]["shared"] for v in variants)])
    rows.append(["heads (4), own lm_heads", *(v["heads_ms"]["own"] for v in variants)])
    for tree, info in first["medusa"].items():
        rows.append([f"Medusa step, {tree} tree ({info['nodes']} nodes incl. root)",
                     *(v["medusa"][tree]["ms"] for v in variants)])
        rows.append(["  / plain step (x)", *(v["medusa"][tree]["ratio"] for v in variants)])
    for tree in first["hydra"]:
        rows.append([f"hydra heads fill the {tree} tree", *(v["hydra"][tree]["fill_ms"] for v in variants)])
        rows.append([f"step with hydra heads, {tree} tree", *(v["hydra"][tree]["ms"] for v in variants)])
    header = [f"{config} ({shape})", *(variant_name(v) for v in variants)]
    return md_table(header, rows)


def step_summary(by_config: dict[str, list[dict]]) -> str:
    """The targets' figures side by side: verify over 64 nodes and a whole Medusa step against a plain step."""
    rows = []
    for config, variants in by_config.items():
        for v in variants:
            v64 = v["verify_ms"].get("64")
            gpu = v["medusa"].get("gpu", {})
            rows.append([f"{config} {variant_name(v)}", v["plain_ms"], v64,
                         None if v64 is None else v64 / v["plain_ms"], gpu.get("ratio")])
    return md_table(["shape and variant", "plain step, ms", "verify 64, ms", "verify 64 / plain (x)",
                     "Medusa step, gpu tree / plain (x)"], rows)


STAGE = re.compile(r"(\w+) ([\d.]+) s(?: \(peak ([\d.]+) GiB\))?")


def parse_training_log(log: str) -> dict:
    """From train_tiny.py's output: {stage: (seconds, peak GiB or None)}, in order, and the summary lines.

    The stages line is StageClock.line(); the tokenizer, trained before the clock starts, has its own line."""
    stages: dict[str, tuple[float, float | None]] = {}
    summary: list[str] = []
    for line in log.splitlines():
        if m := re.match(r"tokenizer\s+\d+ tokens, trained in ([\d.]+)s", line):
            stages["tokenizer"] = (float(m.group(1)), None)
        elif line.startswith("stages "):
            for name, sec, peak in STAGE.findall(line):
                stages[name] = (float(sec), float(peak) if peak else None)
        if line.startswith("summary ") or (summary and line.startswith(" ")):
            summary.append(line)
    return {"stages": stages, "summary": summary}


def train_table(parsed: dict, *, wall_s: float) -> str:
    rows = [[name, sec, peak] for name, (sec, peak) in parsed["stages"].items()]
    rows.append(["whole command (start-up, data and saving too)", wall_s, None])
    return md_table(["stage", "seconds", "peak memory, GiB"], rows)


def decode_table(result: dict) -> str:
    """decode.py --compare --json: its five rows, with tokens/s beside ms/token."""
    rows = []
    for r in result["rows"]:
        same = "-" if r["same_as_plain_greedy"] is None else ("yes" if r["same_as_plain_greedy"] else
                                                               f"{len(r['tokens']) - len(r['differences'])}"
                                                               f" of {len(r['tokens'])} prompts")
        tps = 1000.0 / r["ms_per_token"] if r["ms_per_token"] else None
        rows.append([r["method"], r["new_tokens"], r["steps"], r["tokens_per_step"], r["ms_per_token"], tps,
                     r["speedup"], same])
    table = md_table(["method", "tokens", "steps", "tokens/step", "ms/token", "tokens/s", "speedup (x)",
                      "same as plain greedy"], rows)
    compiled = result.get("compile_warmup_s")
    how = (f"device {result['device']}, {result['dtype']}, "
           + (f"compiled steps (compilation {compiled:.1f} s, not timed)" if compiled is not None else "eager")
           + f"; tree {result['tree']} ({result['tree_nodes']} nodes incl. root; rejection "
           f"{result['rejection_tree_nodes']}); {result['prompts']} prompts x {result['max_new_tokens']} new "
           f"tokens; fastest of {result['repeat']} runs in turns.")
    return f"{table}\n\n{how} Tokens/step counts the bonus token; ms/token includes the prefill."


def batch_rows_of(result) -> list[dict]:
    """The rows of decode.py --compare --batch-sizes --json: a list, or an object's 'rows'; ValueError
    (one line) if a row lacks a field the table needs."""
    rows = result.get("rows") if isinstance(result, dict) else result
    if not isinstance(rows, list) or not rows:
        raise ValueError("decode.py --batch-sizes --json gave no rows (expected a list, or an object with 'rows')")
    for row in rows:
        missing = [f for f in BATCH_FIELDS if f not in row]
        if missing:
            raise ValueError(f"a batch row lacks {', '.join(missing)}: it has {', '.join(sorted(row))}")
    return rows


def batch_table(rows: list[dict]) -> str:
    return md_table(["method", "batch size", "tokens/s", "speedup (x)", "tokens/step"],
                    [[r["method"], r["batch_size"], r["tokens_per_s"], r["speedup"], r["tokens_per_step"]]
                     for r in rows])
