"""Every figure a GPU run of the project should report, measured and written as one markdown report.

    python benchmarks/gpu_report.py --out gpu.md                       # all four parts, one after another
    python benchmarks/gpu_report.py --out gpu.md --part step           # or part by part, each within its
    python benchmarks/gpu_report.py --out gpu.md --part train --append # budget (default 510 s)
    python benchmarks/gpu_report.py --device cpu --quick --out cpu.md  # the same code, small, on a CPU

Parts, each running the project's own commands: step: `bench_step.py --json` per GPT-2 shape and dtype,
eager and compiled on CUDA; train: `train_tiny.py --preset gpu` into --ckpt, seconds and peak memory per
stage; decode: `decode.py --compare --json --dtype bfloat16 --compile` on it; batch: the same with
--batch-size 1,2,4,8,16.

Each part appends its section when it ends, so a stopped run keeps what it finished; a command stops at
--budget-s and the report says so. Exit status: 0, 1 if a part failed (the report says why), 2 for bad
flags (one line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.bench_step import CONFIGS, table_rows  # noqa: E402
from benchmarks.clock import names_of  # noqa: E402
from medusa_mini.cli.common import DTYPES, OneLineParser, pick_device  # noqa: E402

PARTS = ("step", "train", "decode", "batch")
GPT2_SHAPES = "gpt2,gpt2-medium,gpt2-large,gpt2-xl"
BATCH_SIZES, QUICK_BATCH_SIZES = "1,2,4,8,16", "1,2,4"
QUICK_STEP = ["--nodes", "1,4,16", "--repeat", "3", "--warmup", "1"]
QUICK_DECODE = ["--num-prompts", "2", "--max-new-tokens", "32"]
BUDGET_S, QUICK_BUDGET_S = 510.0, 170.0  # a part stays under 9 minutes on an H100; --quick under 3
BATCH_FIELDS = ("method", "batch_size", "tokens_per_s", "speedup", "tokens_per_step")


@dataclass
class ScriptRun:
    """One finished (or stopped) command: its exit status (None: stopped at its budget), output, seconds."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> str:
        """One line saying why a command gave nothing to tabulate."""
        if self.returncode is None:
            return f"stopped at its budget after {self.seconds:.0f} s"
        last = next((ln for ln in reversed(self.stderr.splitlines()) if ln.strip()), "no message")
        return f"exit status {self.returncode} after {self.seconds:.0f} s: {last.strip()}"


def run_script(argv: list[str], *, timeout_s: float, label: str, echo_stdout: bool = False) -> ScriptRun:
    """`python ARGV` in the repository root, stopped after timeout_s; its stderr (and with echo_stdout
    its stdout) is echoed line by line, prefixed with `label`, and kept."""
    t0 = time.perf_counter()
    # A session of its own: stopping it stops what it started too (compile workers holding its pipes).
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    out: list[str] = []
    err: list[str] = []

    def pump(stream, keep: list[str], echo: bool) -> None:
        for line in stream:
            keep.append(line)
            if echo:
                print(f"  [{label}] {line}", end="", file=sys.stderr, flush=True)

    pumps = [threading.Thread(target=pump, args=args, daemon=True)
             for args in ((proc.stdout, out, echo_stdout), (proc.stderr, err, True))]
    for t in pumps:
        t.start()
    try:
        returncode: int | None = proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        returncode = None
    try:  # what is left of its session, if anything
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for t in pumps:
        t.join()
    return ScriptRun(argv, returncode, "".join(out), "".join(err), time.perf_counter() - t0)


# ---- markdown tables from the commands' output ---------------------------------------------------


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
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def variant_name(result: dict) -> str:
    return result["dtype"] + (" compiled" if result["compiled"] else "")


def step_table(config: str, variants: list[dict]) -> str:
    """One GPT shape from bench_step.py --json: a row per measurement, a column per dtype and eager/compiled."""
    shape = "{n_layer} layers, {n_head} heads, width {n_embd}, vocabulary {vocab_size}".format(**variants[0]["config"])
    return md_table([f"{config} ({shape})", *(variant_name(v) for v in variants)],
                    [[label, *values] for label, values in table_rows(variants)])


def step_summary(by_config: dict[str, list[dict]]) -> str:
    """The targets side by side: verify over 64 nodes against a plain step, a whole step against its verify."""
    rows = []
    for config, variants in by_config.items():
        for v in variants:
            v64 = v["verify_ms"].get("64")
            rows.append([f"{config} {variant_name(v)}", v["plain_ms"], v64, None if v64 is None else v64 / v["plain_ms"],
                         v["medusa"]["cpu"]["step_vs_verify"], v["medusa"]["gpu"]["ratio"]])
    return md_table(["shape and variant", "plain step, ms", "verify 64, ms", "verify 64 / plain (x)",
                     "cpu tree: step / verify (x)", "gpu tree: step / plain (x)"], rows)


def parse_training_log(log: str) -> dict:
    """From train_tiny.py's output: {stage: (seconds, peak GiB or None)}, in order, and the summary lines."""
    stages: dict[str, tuple[float, float | None]] = {}
    summary: list[str] = []
    for line in log.splitlines():
        if m := re.match(r"tokenizer\s+\d+ tokens, trained in ([\d.]+)s", line):  # trained before the clock
            stages["tokenizer"] = (float(m.group(1)), None)
        elif line.startswith("stages "):
            for name, sec, peak in re.findall(r"(\w+) ([\d.]+) s(?: \(peak ([\d.]+) GiB\))?", line):
                stages[name] = (float(sec), float(peak) if peak else None)
        if line.startswith("summary ") or (summary and line.startswith(" ")):
            summary.append(line)
    return {"stages": stages, "summary": summary}


def train_table(parsed: dict, *, wall_s: float) -> str:
    rows = [[name, sec, peak] for name, (sec, peak) in parsed["stages"].items()]
    rows.append(["whole command (start-up, data and saving too)", wall_s, None])
    return md_table(["stage", "seconds", "peak memory, GiB"], rows)


def decode_table(result: dict) -> str:
    """decode.py --compare --json: its rows, with tokens/s beside ms/token."""
    rows = [[r["method"], r["new_tokens"], r["steps"], r["tokens_per_step"], r["ms_per_token"],
             1000.0 / r["ms_per_token"], r["speedup"],
             {None: "-", True: "yes", False: "no"}[r.get("same_as_plain_greedy")]] for r in result["rows"]]
    table = md_table(["method", "tokens", "steps", "tokens/step", "ms/token", "tokens/s", "speedup (x)",
                      "same as plain greedy"], rows)
    compiled = result.get("compile_warmup_s")
    how = (f"device {result['device']}, {result['dtype']}, "
           + (f"compiled steps (compilation {compiled:.1f} s, not timed)" if compiled is not None else "eager")
           + f"; tree {result['tree']} ({result['tree_nodes']} nodes incl. root); {result['prompts']} prompts x "
           f"{result['max_new_tokens']} new tokens; fastest of 3 runs in turns.")
    return f"{table}\n\n{how} Tokens/step counts the bonus token; ms/token includes the prefill."


def batch_table(result: dict) -> str:
    """decode.py --compare --batch-size ... --json; a row without a needed field is a KeyError."""
    if not result.get("rows"):
        raise ValueError("decode.py --compare --batch-size --json gave no rows")
    return md_table(["method", "batch size", "tokens/s", "speedup (x)", "tokens/step"],
                    [[r[f] for f in BATCH_FIELDS] for r in result["rows"]])


# ---- the parts --------------------------------------------------------------------------------------


def command_text(argv: list[str]) -> str:
    return "`" + shlex.join(["python", *argv]) + "`"


def step_part(s: argparse.Namespace) -> tuple[str, bool]:
    """bench_step.py once per shape and dtype; what the budget did not reach is named with its command."""
    deadline = time.monotonic() + s.budget_s
    by_config: dict[str, list[dict]] = {}
    notes, commands = [], []
    for config in s.configs:
        for dtype in s.dtypes:
            left = deadline - time.monotonic()
            if left <= 1:
                notes.append(f"{config} {dtype}: the part's {s.budget_s:.0f} s were spent; measure it with "
                             f"`--part step --configs {config} --dtypes {dtype} --append`")
                continue
            argv = ["benchmarks/bench_step.py", "--configs", config, "--dtypes", dtype, "--device", s.device,
                    "--json", *s.compile, *(QUICK_STEP if s.quick else [])]
            commands.append(command_text(argv))
            run = run_script(argv, timeout_s=left, label=f"step {config} {dtype}")
            if run.ok:
                by_config.setdefault(config, []).extend(json.loads(run.stdout)["configs"].values())
            else:
                notes.append(f"{config} {dtype}: {run.failure()}")
    text = ["## What one step costs", "", "Random weights (speed depends on shapes, not values); ms, median of the "
            "repetitions (CUDA events on a GPU); KV cache holding 128 tokens before each step; a compiled column's "
            "first round includes compiling every step shape.", "", "Commands:", "", *(f"- {c}" for c in commands)]
    if by_config:
        text += ["", step_summary(by_config), "", *(f"{step_table(c, v)}\n" for c, v in by_config.items())]
    text += [f"\nNot measured: {n}" for n in notes]
    return "\n".join(text), not notes


def train_part(s: argparse.Namespace) -> tuple[str, bool]:
    argv = ["train_tiny.py", "--preset", "smoke" if s.quick else "gpu", "--out", s.ckpt, "--device", s.device,
            *s.train_flags]
    run = run_script(argv, timeout_s=s.budget_s, label="train", echo_stdout=True)
    head = [f"## Training the {argv[2]} preset", "", f"Command: {command_text(argv)}.", ""]
    if not run.ok:
        return "\n".join([*head, f"Failed: {run.failure()}"]), False
    parsed = parse_training_log(run.stdout)
    text = [*head, train_table(parsed, wall_s=run.seconds), "",
            "Peak memory is torch's peak allocation in the stage (CUDA only).", ""]
    text += ["```", *parsed["summary"], "```"] if parsed["summary"] else []
    return "\n".join(text), bool(parsed["stages"])


def decode_argv(s: argparse.Namespace, *extra: str) -> list[str]:
    return ["decode.py", "--ckpt", s.ckpt, "--compare", *extra, "--json", "--dtype", "bfloat16", "--device", s.device,
            *s.compile, *(QUICK_DECODE if s.quick else []), *s.decode_flags]


def decode_part(s: argparse.Namespace) -> tuple[str, bool]:
    return table_part(s, decode_argv(s), title="## decode.py --compare", label="decode", tabulate=decode_table)


def batch_part(s: argparse.Namespace) -> tuple[str, bool]:
    argv = decode_argv(s, "--batch-size", QUICK_BATCH_SIZES if s.quick else BATCH_SIZES)
    return table_part(s, argv, title="## Batch sizes", label="batch", tabulate=batch_table)


def table_part(s: argparse.Namespace, argv: list[str], *, title: str, label: str, tabulate) -> tuple[str, bool]:
    """Run a command that prints one JSON object and tabulate it; a failure is one line of the section."""
    run = run_script(argv, timeout_s=s.budget_s, label=label)
    head = [title, "", f"Command: {command_text(argv)}.", ""]
    try:
        if not run.ok:
            raise ValueError(run.failure())
        return "\n".join([*head, tabulate(json.loads(run.stdout))]), True
    except (ValueError, KeyError) as e:  # JSONDecodeError is a ValueError; KeyError: a field missing
        why = f"a row lacks {e.args[0]}" if isinstance(e, KeyError) else " ".join(str(e).split())
        return "\n".join([*head, f"Failed: {why}"]), False


RUN_PART = {"step": step_part, "train": train_part, "decode": decode_part, "batch": batch_part}


def header(s: argparse.Namespace, argv: list[str]) -> str:
    device = torch.device(s.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        name = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git on this machine
        commit = subprocess.CompletedProcess([], 1, "", "")
    rows = [["device", f"{s.device}: {name}"], ["torch", torch.__version__],
            ["CUDA", torch.version.cuda or "none (a CPU build of torch)"], ["Python", platform.python_version()],
            ["code", commit.stdout.strip() or "unknown"],
            ["date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")],
            ["command", command_text(["benchmarks/gpu_report.py", *argv])]]
    return f"# medusa_mini on {name.split(',')[0]}\n\n{md_table(['', ''], rows)}\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="python benchmarks/gpu_report.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="FILE.md", help="the markdown report")
    p.add_argument("--part", action="append", choices=PARTS, help="only this part; repeat for several (default: all)")
    p.add_argument("--append", action="store_true", help="add the sections to --out instead of writing it anew")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="smoke training, the tiny shape, few nodes and prompts")
    p.add_argument("--ckpt", default="out/gpu_report", metavar="DIR",
                   help="where train writes its checkpoint, which decode and batch read (default: %(default)s)")
    p.add_argument("--configs", help=f"step: shapes for bench_step.py (default: {GPT2_SHAPES}; --quick: tiny)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="step: one bench_step.py run each (default: %(default)s)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help=f"seconds each part may take (default: {BUDGET_S:.0f}; --quick: {QUICK_BUDGET_S:.0f})")
    p.add_argument("--train-flags", default="", metavar="'FLAGS'", help="more train_tiny.py flags, quoted")
    p.add_argument("--decode-flags", default="", metavar="'FLAGS'", help="more decode.py flags, quoted")
    a = p.parse_args(argv)
    try:  # the flags' own names become the settings of the parts
        a.device = str(pick_device(a.device))
        a.train_flags, a.decode_flags = shlex.split(a.train_flags), shlex.split(a.decode_flags)  # unclosed quotes
        a.budget_s = a.budget_s if a.budget_s is not None else (QUICK_BUDGET_S if a.quick else BUDGET_S)
        if a.budget_s <= 0:
            raise ValueError(f"--budget-s must be positive, not {a.budget_s:g}")
        a.parts = [part for part in PARTS if part in (a.part or PARTS)]
        if {"decode", "batch"} & set(a.parts) and "train" not in a.parts and not os.path.isfile(
                os.path.join(a.ckpt, "config.json")):
            raise ValueError(f"no checkpoint in {a.ckpt} for the decode and batch parts: run --part train first, "
                             "or name one with --ckpt")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
            raise ValueError(f"--out {a.out}: its folder does not exist")
        a.configs = names_of("--configs", a.configs or ("tiny" if a.quick else GPT2_SHAPES), CONFIGS)
        a.dtypes = names_of("--dtypes", a.dtypes, DTYPES)
    except ValueError as e:
        p.error(str(e))
    a.compile = ["--compile"] if a.device.startswith("cuda") else []  # on a CPU: minutes, no gain
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = parse_args(argv)
    if not (s.append and os.path.exists(s.out)):
        with open(s.out, "w", encoding="utf-8") as f:
            f.write(header(s, argv))
    failed = []
    for part in s.parts:
        print(f"[{part}] starting, budget {s.budget_s:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        section, ok = RUN_PART[part](s)
        seconds = time.perf_counter() - t0
        with open(s.out, "a", encoding="utf-8") as f:
            f.write(f"\n{section}\n\n_Part {part}: {seconds:.0f} s of its {s.budget_s:.0f} s budget._\n")
        print(f"[{part}] {'done' if ok else 'FAILED'} in {seconds:.0f} s of its {s.budget_s:.0f} s budget",
              file=sys.stderr, flush=True)
        failed += [] if ok else [part]
    print(f"report: {s.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
