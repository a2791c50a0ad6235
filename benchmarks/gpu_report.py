"""Every figure a GPU run of the project should report, measured and written as one markdown report.

    python benchmarks/gpu_report.py --out gpu.md                       # all four parts, one after another
    python benchmarks/gpu_report.py --out gpu.md --part step --append  # or part by part
    python benchmarks/gpu_report.py --device cpu --quick --out cpu.md  # the same code, small, on a CPU

Each part runs the project's own commands and writes their tables: step: `bench_step.py` per GPT-2 shape
and dtype, eager and (on CUDA) compiled; train: `train_tiny.py --preset gpu` into --ckpt; decode: `decode.py
--compare` on it in bfloat16 (compiled on CUDA); batch: the same with --batch-size 1,2,4,8,16. A part runs
within --budget-s and adds its section when it ends, so a stopped run keeps what it finished: --out is
replaced whole each time (an older report stays as it was until the first part ends). Exit status: 0, 1 if
a part failed (its section says why, in one line), 2 for bad flags, the forwarded ones included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import bench_step  # noqa: E402
from benchmarks.bench_step import CONFIGS, names_of  # noqa: E402
from medusa_mini.cli.common import OneLineParser, timed  # noqa: E402
from medusa_mini.io.files import atomic_write_text, check_writable  # noqa: E402
from medusa_mini.train.device import DTYPES, pick_device  # noqa: E402

PARTS = ("step", "train", "decode", "batch")
GPT2_SHAPES = "gpt2,gpt2-medium,gpt2-large,gpt2-xl"
QUICK_STEP = ["--nodes", "1,4,16", "--repeat", "3", "--warmup", "1"]
QUICK_DECODE = ["--num-prompts", "2", "--max-new-tokens", "32"]
BUDGET_S, QUICK_BUDGET_S = 510.0, 170.0  # a part stays under 9 minutes on an H100; --quick under 3


def run_script(argv: list[str], *, timeout_s: float, label: str) -> tuple[int | None, str, float]:
    """`python ARGV` in the repository root, stopped after timeout_s: its exit status (None: stopped), its
    output (stdout and stderr as they came, echoed to stderr line by line, prefixed with `label`), seconds."""
    t0 = time.perf_counter()
    # A session of its own: stopping it stops what it started too (compile workers holding its pipe).
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            print(f"  [{label}] {line}", end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        returncode = None
    finally:  # also on Ctrl-C or SIGTERM (`main`): nothing it started outlives the report
        with contextlib.suppress(ProcessLookupError):  # what is left of its session, if anything
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join()
    return returncode, "".join(lines), time.perf_counter() - t0


def section(argv: list[str], *, timeout_s: float, label: str, keep=str.splitlines) -> tuple[list[str], bool]:
    """A command's lines for the report: the command, then the lines `keep` picks from its output in a code
    block, or one line saying why there are none (stopped at its budget, failed, or printed none)."""
    returncode, output, seconds = run_script(argv, timeout_s=timeout_s, label=label)
    head = [f"Command: `{shlex.join(['python', *argv])}`, {seconds:.0f} s.", ""]
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no message")
    why = (f"stopped at its budget after {seconds:.0f} s" if returncode is None
           else f"exit status {returncode} after {seconds:.0f} s: {last}" if returncode else None)
    lines = [] if why else keep(output)
    if not lines:
        return [*head, f"Failed: {why or 'it printed nothing to report'}"], False
    return [*head, "```", *lines, "```"], True


def step_table(output: str) -> list[str]:
    """bench_step.py's table from its column names on ([] if it printed none)."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("layers / heads")), None)
    return [] if first is None else lines[first - 1 :]


def training_summary(log: str) -> list[str]:
    """train_tiny.py's summary and its seconds and peak memory per stage, from its log."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("summary ")), len(lines))
    return [line for line in lines[first:] if line.startswith((" ", "summary ", "stages "))]


def run_part(s: argparse.Namespace, title: str, commands: list[tuple[str | None, list[str]]], *, intro: str = "",
             keep=str.splitlines) -> tuple[str, bool]:
    """A part's section: each command (under its heading, if it has one) within what is left of the part's
    budget, with the lines `keep` picks from its output; a command the budget did not reach is named."""
    deadline, text, ok = time.monotonic() + s.budget_s, [f"## {title}", *(["", intro] if intro else [])], True
    for heading, argv in commands:
        text += ["", f"### {heading}"] if heading else []
        left = deadline - time.monotonic()
        lines, done = section(argv, timeout_s=left, label=heading or title, keep=keep) if left > 1 else (
            [f"Not run: the part's {s.budget_s:.0f} s were spent; run it alone with `--part ... --append`."], False)
        text, ok = text + ["", *lines], ok and done
    return "\n".join(text), ok


def decode_argv(s: argparse.Namespace, *extra: str) -> list[str]:
    return ["decode.py", "--ckpt", s.ckpt, "--compare", *extra, "--dtype", "bfloat16", "--device", s.device,
            *s.compile, *(QUICK_DECODE if s.quick else []), *s.decode_flags]


COMMANDS: dict[str, Callable[[argparse.Namespace], list[tuple[str | None, list[str]]]]] = {  # (heading, argv)
    "step": lambda s: [(config, [
        "benchmarks/bench_step.py", "--configs", config, "--dtypes", ",".join(s.dtypes), "--device", s.device,
        *s.compile, *(QUICK_STEP if s.quick else []), *s.step_flags]) for config in s.configs],
    "train": lambda s: [(None, ["train_tiny.py", "--preset", "smoke" if s.quick else "gpu", "--out", s.ckpt,
                                "--device", s.device, *s.train_flags])],
    "decode": lambda s: [(None, decode_argv(s))],
    "batch": lambda s: [(None, decode_argv(s, "--batch-size", "1,2,4" if s.quick else "1,2,4,8,16"))]}

RUN_PART: dict[str, Callable[[argparse.Namespace], tuple[str, bool]]] = {
    "step": lambda s: run_part(s, "What one step costs", COMMANDS["step"](s), keep=step_table,
                               intro="Random weights (speed depends on shapes, not values). Targets: the heads at "
                                     "most 10% of a plain step, a whole step at most 1.15x its verify alone."),
    "train": lambda s: run_part(s, "Training", COMMANDS["train"](s), keep=training_summary),
    "decode": lambda s: run_part(s, "decode.py --compare", COMMANDS["decode"](s)),
    "batch": lambda s: run_part(s, "Batch sizes", COMMANDS["batch"](s))}
FORWARDED = {"benchmarks/bench_step.py": "--step-flags", "train_tiny.py": "--train-flags", "decode.py": "--decode-flags"}
# The flags each part sets itself: forwarded again, the last would win and the part would measure something else.
RESERVED = {"--step-flags": ("--configs", "--dtypes", "--device", "--compile"),
            "--train-flags": ("--preset", "--out", "--device"),
            "--decode-flags": ("--ckpt", "--compare", "--batch-size", "--dtype", "--device", "--compile")}


def flag_checks(script: str) -> Callable[[list[str]], object]:
    """`script`'s own parsing and checks of its flags, which load nothing (imported only when called)."""
    if script == "decode.py":
        import decode

        def parse(flags: list[str]) -> None:
            parser = decode.build_parser()
            decode.check_args(parser, parser.parse_args(flags))
        return parse
    if script == "train_tiny.py":
        import train_tiny
        return train_tiny.parse_args
    return bench_step.parse_args


def check_command(argv: list[str]) -> None:
    """A ValueError naming the forwarded flags if the script `argv` runs would refuse them, found by its
    own checks run here, its one-line error caught, not printed: now, not after the parts before it."""
    script, printed = argv[0], io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            flag_checks(script)(argv[1:])
    except SystemExit as e:  # its parser's error (status 2), or --help (0), which would print and stop it
        message = printed.getvalue().strip().partition(": error: ")[2] if e.code else "--help prints and stops"
        raise ValueError(f"{FORWARDED[script]}: {os.path.basename(script)} refuses its flags: {message}") from None


def header(s: argparse.Namespace, argv: list[str]) -> str:
    """The report's title and what produced it: device, torch, CUDA, Python, code version, date, command."""
    if s.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(s.device))
        name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        name = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    commit = shutil.which("git") and subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                                    capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    return (f"# medusa_mini on {name.split(',')[0]}\n\n- device: {s.device}: {name}\n- torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'none (a CPU build of torch)'}, Python {platform.python_version()}\n"
            f"- code: {commit or 'unknown'}; date (UTC): {now}\n"
            f"- command: `{shlex.join(['python', 'benchmarks/gpu_report.py', *argv])}`\n")


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
    p.add_argument("--configs", type=names_of(CONFIGS),
                   help=f"step: shapes for bench_step.py (default: {GPT2_SHAPES}; --quick: tiny)")
    p.add_argument("--dtypes", type=names_of(DTYPES), default="bfloat16,float32",
                   help="step: the number formats of bench_step.py (default: %(default)s)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help=f"seconds each part may take (default: {BUDGET_S:.0f}; --quick: {QUICK_BUDGET_S:.0f})")
    p.add_argument("--step-flags", default="", metavar="'FLAGS'", help="more bench_step.py flags, quoted")
    p.add_argument("--train-flags", default="", metavar="'FLAGS'", help="more train_tiny.py flags, quoted")
    p.add_argument("--decode-flags", default="", metavar="'FLAGS'", help="more decode.py flags, quoted")
    a = p.parse_args(argv)
    try:  # the flags' own names become the settings of the parts
        check_out(a.out)
        a.device = str(pick_device(a.device))
        a.step_flags, a.train_flags, a.decode_flags = map(shlex.split, (a.step_flags, a.train_flags, a.decode_flags))  # unclosed quotes
        for name, flags in (("--step-flags", a.step_flags), ("--train-flags", a.train_flags),
                            ("--decode-flags", a.decode_flags)):
            # argparse takes an unambiguous prefix of a flag as the flag: --dev is --device
            taken = [f for f in flags if f.startswith("--") and len(f.split("=")[0]) > 2
                     and any(r.startswith(f.split("=")[0]) for r in RESERVED[name])]
            if taken:
                raise ValueError(f"{name}: the report sets {taken[0].split('=')[0]} itself; "
                                 f"leave out {', '.join(RESERVED[name])}")
        a.budget_s = a.budget_s if a.budget_s is not None else (QUICK_BUDGET_S if a.quick else BUDGET_S)
        if not 0 < a.budget_s < math.inf:  # nan too
            raise ValueError(f"--budget-s must be a finite number of seconds > 0, not {a.budget_s:g}")
        a.parts = [part for part in PARTS if part in (a.part or PARTS)]
        if {"decode", "batch"} & set(a.parts) and "train" not in a.parts and not os.path.isfile(
                os.path.join(a.ckpt, "config.json")):
            raise ValueError(f"no checkpoint in {a.ckpt} for the decode and batch parts: run --part train first, "
                             "or name one with --ckpt")
        a.configs = a.configs or (["tiny"] if a.quick else GPT2_SHAPES.split(","))
        a.compile = ["--compile"] if a.device.startswith("cuda") else []  # on a CPU: minutes, no gain
        for part in a.parts:
            for _, command in COMMANDS[part](a):
                check_command(command)
        a.before = read_report(a.out) if a.append and os.path.exists(a.out) else ""  # what --append keeps
    except ValueError as e:
        p.error(str(e))
    return a


def check_out(path: str) -> None:
    """A ValueError unless `path` names a file that can be written: not empty, not a folder, in a folder
    that exists and takes new files (the report is written beside it first, then renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path:
        raise ValueError("--out needs a file name, such as gpu.md")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise ValueError(f"--out {path} is a folder; name a file in it, such as {os.path.join(path, 'gpu.md')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path}: its folder does not exist")
    try:
        check_writable(folder)
    except OSError as e:
        raise ValueError(f"--out {path}: no file can be written in {folder} ({e.strerror})") from None


def read_report(path: str) -> str:
    """The report --append adds to; a ValueError if it cannot be read as text."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--append: {path} cannot be read as a UTF-8 report ({e})") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the running part's command is stopped
    try:
        return run_parts(s, argv)
    except KeyboardInterrupt:
        print(f"gpu_report.py: interrupted; {s.out} holds the parts that ended before", file=sys.stderr)
        return 130


def run_parts(s: argparse.Namespace, argv: list[str]) -> int:
    report = s.before or header(s, argv)  # --out keeps its old text until a part has a section to add
    failed = []
    for part in s.parts:
        print(f"[{part}] starting, budget {s.budget_s:.0f} s", file=sys.stderr, flush=True)
        (text, ok), seconds = timed("cpu", lambda: RUN_PART[part](s))  # the wall clock
        report += f"\n{text}\n\n_Part {part}: {seconds:.0f} s of its {s.budget_s:.0f} s budget._\n"
        try:
            atomic_write_text(s.out, report)
        except OSError as e:  # a full disk, say: the report as of the last part stays where it was
            print(f"gpu_report.py: error: {s.out} could not be written after part {part} ({e.strerror}); "
                  "it holds the parts before it", file=sys.stderr)
            return 1
        print(f"[{part}] {'done' if ok else 'FAILED'} in {seconds:.0f} s", file=sys.stderr, flush=True)
        failed += [] if ok else [part]
    print(f"report: {s.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
