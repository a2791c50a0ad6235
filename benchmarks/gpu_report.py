"""Every figure BENCHMARKS.md's "On a GPU" section asks for, measured and written as one markdown report.

    python benchmarks/gpu_report.py --out gpu.md                     # all four parts, one after another
    python benchmarks/gpu_report.py --out gpu.md --part step         # or part by part, each within its
    python benchmarks/gpu_report.py --out gpu.md --part train --append   # budget (default 510 s)
    python benchmarks/gpu_report.py --out gpu.md --part decode --part batch --append
    python benchmarks/gpu_report.py --device cpu --quick --out cpu.md   # the same code, small, on a CPU

Parts, each running the project's own commands (this interpreter, the repository as working folder):

- step: what one step costs, `bench_step.py --json` once per GPT-2 shape and dtype (random weights, no
  download), bfloat16 and float32, eager and compiled (on CUDA), verify over 1 ... 128 nodes;
- train: `train_tiny.py --preset gpu` into --ckpt: seconds and peak memory per stage;
- decode: `decode.py --compare --json --dtype bfloat16 --compile` on that checkpoint;
- batch: `decode.py --compare --batch-sizes 1,2,4,8,16 --json`: tokens/s and speedup per batch size,
  skipped with a note while decode.py has no --batch-sizes.

The report starts with the device, torch and CUDA; each part adds its section when it ends, so a
stopped run keeps what it finished. Without --append the file is written anew. Each part stops its
command at --budget-s and says so in the report. Compiling every step shape of four GPT-2 sizes may
take the step part past its budget: the report then names each shape and dtype left, with the command
that measures it (`--part step --configs gpt2-xl --dtypes float32 --append`). Progress and each
part's time against its budget go to stderr. --quick
(for a CPU) takes the smoke training preset, the tiny shape, few nodes and few prompts; --compile is
used on CUDA only (on a CPU it costs minutes and gains nothing). Exit status: 0, 1 if a part failed
(the report says which and why), 2 for bad flags (one line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import report_tables as tables  # noqa: E402
from benchmarks.bench_step import CONFIGS  # noqa: E402
from medusa_mini.cli.common import DTYPES, OneLineParser, pick_device  # noqa: E402

PARTS = ("step", "train", "decode", "batch")
GPT2_SHAPES = "gpt2,gpt2-medium,gpt2-large,gpt2-xl"
BATCH_SIZES, QUICK_BATCH_SIZES = "1,2,4,8,16", "1,2,4"
QUICK_STEP = ["--nodes", "1,4,16", "--repeat", "3", "--warmup", "1"]
QUICK_DECODE = ["--num-prompts", "2", "--max-new-tokens", "32", "--repeat", "1"]
BUDGET_S, QUICK_BUDGET_S = 510.0, 170.0  # a part stays under 9 minutes on an H100; --quick under 3


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
    """`python ARGV` in the repository root, stopped after timeout_s. Its stderr (and with echo_stdout
    its stdout) goes on to ours line by line, prefixed with `label`, while both are kept."""
    t0 = time.perf_counter()
    # A session of its own: stopping it stops what it started too (compile workers), which would
    # otherwise keep its output pipes open.
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    stopped: list[bool] = []

    def stop() -> None:
        stopped.append(True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass

    timer = threading.Timer(max(timeout_s, 0.0), stop)
    timer.start()
    err: list[str] = []

    def pump(stream, keep: list[str], echo: bool) -> None:
        for line in stream:
            keep.append(line)
            if echo:
                print(f"  [{label}] {line}", end="", file=sys.stderr, flush=True)

    err_thread = threading.Thread(target=pump, args=(proc.stderr, err, True), daemon=True)
    err_thread.start()
    out: list[str] = []
    pump(proc.stdout, out, echo_stdout)
    proc.wait()
    err_thread.join()
    timer.cancel()
    return ScriptRun(argv, None if stopped else proc.returncode, "".join(out), "".join(err),
                     time.perf_counter() - t0)


@dataclass
class Settings:
    out: str
    parts: list[str]
    device: str
    quick: bool
    ckpt: str
    configs: list[str]
    dtypes: list[str]
    budget_s: float
    train_flags: list[str]
    decode_flags: list[str]
    append: bool

    @property
    def compile(self) -> list[str]:
        return ["--compile"] if self.device.startswith("cuda") else []


def command_text(argv: list[str]) -> str:
    return "`" + shlex.join(["python", *argv]) + "`"


def step_part(s: Settings) -> tuple[str, bool]:
    """bench_step.py once per shape and dtype (eager, then compiled on CUDA); what the budget did not
    reach is named with the command that measures it."""
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
    parts = ["## What one step costs", "", "Random weights (speed depends on shapes, not values); ms, median of "
             "the repetitions (CUDA events on a GPU); KV cache holding 128 tokens before each step. A compiled "
             "column's first round includes compiling every step shape.", "", "Commands:", "",
             *(f"- {c}" for c in commands)]
    if by_config:
        parts += ["", tables.step_summary(by_config)]
        parts += ["", *(f"{tables.step_table(c, v)}\n" for c, v in by_config.items())]
    parts += [f"\nNot measured: {n}" for n in notes]
    return "\n".join(parts), not notes


def train_part(s: Settings) -> tuple[str, bool]:
    argv = ["train_tiny.py", "--preset", "smoke" if s.quick else "gpu", "--out", s.ckpt, "--device", s.device,
            *s.train_flags]
    run = run_script(argv, timeout_s=s.budget_s, label="train", echo_stdout=True)
    head = ["## Training the gpu preset" if not s.quick else "## Training the smoke preset", "",
            f"Command: {command_text(argv)}.", ""]
    if not run.ok:
        return "\n".join([*head, f"Failed: {run.failure()}"]), False
    parsed = tables.parse_training_log(run.stdout)
    text = [*head, tables.train_table(parsed, wall_s=run.seconds), "",
            "Peak memory is torch's peak allocation in the stage (CUDA only).", ""]
    text += ["```", *parsed["summary"], "```"] if parsed["summary"] else []
    return "\n".join(text), bool(parsed["stages"])


def decode_part(s: Settings) -> tuple[str, bool]:
    argv = ["decode.py", "--ckpt", s.ckpt, "--compare", "--json", "--dtype", "bfloat16", "--device", s.device,
            *s.compile, *(QUICK_DECODE if s.quick else []), *s.decode_flags]
    run = run_script(argv, timeout_s=s.budget_s, label="decode")
    head = ["## decode.py --compare", "", f"Command: {command_text(argv)}.", ""]
    if not run.ok:
        return "\n".join([*head, f"Failed: {run.failure()}"]), False
    return "\n".join([*head, tables.decode_table(json.loads(run.stdout))]), True


def batch_part(s: Settings) -> tuple[str, bool]:
    head = ["## Batch sizes", ""]
    usage = run_script(["decode.py", "--help"], timeout_s=min(s.budget_s, 120), label="batch")
    if "--batch-sizes" not in usage.stdout:
        return "\n".join([*head, "Skipped: this decode.py does not accept --batch-sizes yet."]), True
    sizes = QUICK_BATCH_SIZES if s.quick else BATCH_SIZES
    argv = ["decode.py", "--ckpt", s.ckpt, "--compare", "--batch-sizes", sizes, "--json", "--dtype", "bfloat16",
            "--device", s.device, *s.compile, *(QUICK_DECODE[2:] if s.quick else []), *s.decode_flags]
    run = run_script(argv, timeout_s=s.budget_s - usage.seconds, label="batch")
    head += [f"Command: {command_text(argv)}.", ""]
    if not run.ok:
        return "\n".join([*head, f"Failed: {run.failure()}"]), False
    try:
        rows = tables.batch_rows_of(json.loads(run.stdout))
    except ValueError as e:  # JSONDecodeError is one too
        return "\n".join([*head, f"Failed: {' '.join(str(e).split())}"]), False
    return "\n".join([*head, tables.batch_table(rows)]), True


RUN_PART = {"step": step_part, "train": train_part, "decode": decode_part, "batch": batch_part}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def header(s: Settings, argv: list[str]) -> str:
    device = torch.device(s.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        name = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    rows = [["device", f"{s.device}: {name}"], ["torch", torch.__version__],
            ["CUDA", torch.version.cuda or "none (a CPU build of torch)"],
            ["Python", platform.python_version()], ["code", git_commit()],
            ["date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")],
            ["command", command_text(["benchmarks/gpu_report.py", *argv])]]
    return f"# medusa_mini on {name.split(',')[0]}\n\n{tables.md_table(['', ''], rows)}\n"


def parse_args(argv: list[str]) -> Settings:
    p = OneLineParser(prog="python benchmarks/gpu_report.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="FILE.md", help="the markdown report")
    p.add_argument("--part", action="append", choices=PARTS,
                   help="run only this part; repeat for several (default: all four, in this order)")
    p.add_argument("--append", action="store_true", help="add the sections to --out instead of writing it anew")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="smoke training, the tiny shape, few nodes and prompts")
    p.add_argument("--ckpt", default="out/gpu_report", metavar="DIR",
                   help="where train writes its checkpoint, which decode and batch read (default: %(default)s)")
    p.add_argument("--configs", help=f"step: shapes for bench_step.py (default: {GPT2_SHAPES}; --quick: tiny)")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="step: comma-separated, one bench_step.py run each (default: %(default)s)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help=f"seconds each part may take (default: {BUDGET_S:.0f}; --quick: {QUICK_BUDGET_S:.0f})")
    p.add_argument("--train-flags", default="", metavar="'FLAGS'", help="more train_tiny.py flags, quoted")
    p.add_argument("--decode-flags", default="", metavar="'FLAGS'", help="more decode.py flags, quoted")
    a = p.parse_args(argv)
    try:
        device = str(pick_device(a.device))
        flags = [shlex.split(a.train_flags), shlex.split(a.decode_flags)]
    except ValueError as e:  # shlex: an unclosed quote
        p.error(str(e))
    budget = a.budget_s if a.budget_s is not None else (QUICK_BUDGET_S if a.quick else BUDGET_S)
    if budget <= 0:
        p.error(f"--budget-s must be positive, not {a.budget_s:g}")
    parts = [part for part in PARTS if part in (a.part or PARTS)]
    if not {"decode", "batch"}.isdisjoint(parts) and "train" not in parts and not os.path.isfile(
            os.path.join(a.ckpt, "config.json")):
        p.error(f"no checkpoint in {a.ckpt} for the decode and batch parts: run --part train first, or name one "
                "with --ckpt")
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        p.error(f"--out {a.out}: its folder does not exist")
    configs = [c.strip() for c in (a.configs or ("tiny" if a.quick else GPT2_SHAPES)).split(",") if c.strip()]
    if not configs or not set(configs) <= set(CONFIGS):
        p.error(f"--configs {a.configs}: name shapes from {', '.join(CONFIGS)}")
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= set(DTYPES):
        p.error(f"--dtypes {a.dtypes}: name dtypes from {', '.join(DTYPES)}")
    return Settings(out=a.out, parts=parts, device=device, quick=a.quick, ckpt=a.ckpt, configs=configs, dtypes=dtypes,
                    budget_s=budget, train_flags=flags[0], decode_flags=flags[1], append=a.append)


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
