"""Every figure a GPU run of the project should report, measured and written as one markdown report.

    python benchmarks/gpu_report.py --out gpu.md                       # all four parts, one after another
    python benchmarks/gpu_report.py --out gpu.md --part step --append  # or part by part
    python benchmarks/gpu_report.py --device cpu --quick --out cpu.md  # the same code, small, on a CPU

Parts: step: `bench_step.py` per GPT-2 shape and dtype, eager and (on CUDA) compiled; train: `train_tiny.py --preset
gpu` into --ckpt; decode: `decode.py --compare` on it in bfloat16 (compiled on CUDA); batch: the same with --batch-size
1,2,4,8,16. A part runs within --budget-s; when it ends, the report so far is written, so a stopped run keeps what it
finished: to --out, or, while --out holds an older report (no --append), to --out.partial, which replaces it when the
run ends (unless every part failed). Exit status: 0, 1 if a part failed (its section says why), 2 for bad flags, the
forwarded ones as their script's parser reads them (what needs the trained checkpoint, as --tree, fails its part)."""

import argparse
import contextlib
import importlib
import io
import os
import pathlib
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere, without installing the package

import torch

from benchmarks.bench_step import CONFIGS
from medusa_mini.cli.common import OneLineParser, check_file_path, exit_with, names_of, timed
from medusa_mini.io.files import atomic_write, check_writable, remove_file, text_writer
from medusa_mini.train.device import DTYPES, pick_device
from medusa_mini.train.run import STATE_FILE

GPT2_SHAPES = "gpt2,gpt2-medium,gpt2-large,gpt2-xl"
QUICK_STEP = ["--nodes", "1,4,16", "--repeat", "3", "--warmup", "1"]
QUICK_DECODE = ["--num-prompts", "2", "--max-new-tokens", "32"]
BUDGET_S, QUICK_BUDGET_S = 510.0, 170.0  # a part stays under 9 minutes on an H100; --quick under 3
# Per script: the flag whose flags go to it, and the flags its part sets itself (forwarded, the last would win).
FORWARDED = {"benchmarks/bench_step.py": ("--step-flags", ("--configs", "--dtypes", "--device", "--compile", "--json")),
             "train_tiny.py": ("--train-flags", ("--preset", "--out", "--device")), "decode.py": (
                 "--decode-flags", ("--ckpt", "--compare", "--batch-size", "--dtype", "--device", "--compile"))}


def run_script(argv: list[str], *, timeout_s: float, label: str) -> tuple[int | None, str, float]:
    """`python ARGV` in the repository root, stopped after timeout_s: its exit status (None: stopped), its
    output (stdout and stderr as they came, echoed to stderr line by line, prefixed with `label`), seconds."""
    t0, lines = time.perf_counter(), []
    # A session of its own: stopping it stops what it started too (compile workers holding its pipe).
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def pump() -> None:
        with proc.stdout:  # closed at its end (the process's, and its session's: `finally` below)
            for line in proc.stdout:
                lines.append(line)
                print(f"  [{label}] {line}", end="", file=sys.stderr, flush=True)
    (reader := threading.Thread(target=pump, daemon=True)).start()
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


def step_table(output: str) -> list[str]:
    """bench_step.py's table from its column names on ([] if it printed none)."""
    lines = output.splitlines()
    return next((lines[i - 1 :] for i, line in enumerate(lines) if line.startswith("layers / heads")), [])


def training_summary(log: str) -> list[str]:
    """train_tiny.py's summary and its seconds and peak memory per stage, from its log."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("summary ")), len(lines))
    return [line for line in lines[first:] if line.startswith((" ", "summary ", "stages "))]


PARTS = {  # part: its section's title, the lines kept of each command's output, an introduction
    "step": ("What one step costs", step_table, "Random weights (speed depends on shapes, not values). Targets: "
             "the heads at most 10% of a plain step, a whole step at most 1.15x its verify alone."),
    "train": ("Training", training_summary, ""), "decode": ("decode.py --compare", str.splitlines, ""),
    "batch": ("Batch sizes", str.splitlines, "")}


def commands(s: argparse.Namespace, part: str) -> list[tuple[str | None, list[str]]]:
    """A part's commands, each (its heading or None, argv)."""
    if part == "step":
        return [(shape, ["benchmarks/bench_step.py", "--configs", shape, "--dtypes", ",".join(s.dtypes), "--device",
                         s.device, *s.compile, *(QUICK_STEP if s.quick else []), *s.step_flags]) for shape in s.configs]
    if part == "train":
        return [(None, ["train_tiny.py", "--preset", "smoke" if s.quick else "gpu", "--out", s.ckpt,
                        "--overwrite", "--device", s.device, *s.train_flags])]
    batch = ["--batch-size", "1,2,4" if s.quick else "1,2,4,8,16"] if part == "batch" else []
    return [(None, ["decode.py", "--ckpt", s.ckpt, "--compare", *batch, "--dtype", "bfloat16", "--device", s.device,
                    *s.compile, *(QUICK_DECODE if s.quick else []), *s.decode_flags])]


def run_part(s: argparse.Namespace, part: str, *, trained: bool = True) -> tuple[str, bool]:
    """A part's section: each command within what is left of its budget, then the lines `keep` picks, or why none."""
    title, keep, intro = PARTS[part]
    if part in ("decode", "batch") and not trained:
        return f"## {title}\n\nNot run: the train part failed, so {s.ckpt} holds no checkpoint of this run.", False
    deadline, text, ok = time.monotonic() + s.budget_s, [f"## {title}", *(["", intro] if intro else [])], True
    for heading, argv in commands(s, part):
        text += ["", f"### {heading}"] if heading else []
        if (left := deadline - time.monotonic()) <= 1:
            text += ["", f"Not run: the part's {s.budget_s:.0f} s were spent; run it alone with `--part ... --append`."]
            ok = False
            continue
        returncode, output, seconds = run_script(argv, timeout_s=left, label=heading or title)
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no message")
        why = (f"stopped at its budget after {seconds:.0f} s" if returncode is None
               else f"exit status {returncode} after {seconds:.0f} s: {last}" if returncode else None)
        lines = [] if why else keep(output)
        text += ["", f"Command: `{shlex.join(['python', *argv])}`, {seconds:.0f} s.", ""]
        text += ["```", *lines, "```"] if lines else [f"Failed: {why or 'it printed nothing to report'}"]
        ok = ok and bool(lines)
    return "\n".join(text), ok


def check_command(argv: list[str]) -> None:
    """A ValueError now, not after the parts before, if the script's own parse_args refuses its forwarded flags."""
    script, printed = argv[0], io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            importlib.import_module(script[:-3].replace("/", ".")).parse_args(argv[1:])
    except SystemExit as e:  # its parser's error (status 2), or --help (0), which would print and stop it
        message = printed.getvalue().strip().partition(": error: ")[2] if e.code else "--help prints and stops"
        raise ValueError(f"{FORWARDED[script][0]}: {os.path.basename(script)} refuses its flags: {message}") from None


def header(s: argparse.Namespace, argv: list[str]) -> str:
    """The report's title and what produced it: device, torch, CUDA, Python, code version, date, command."""
    props = torch.cuda.get_device_properties(torch.device(s.device)) if s.device.startswith("cuda") else None
    name = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB" if props else
            f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
    commit = shutil.which("git") and subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                                    capture_output=True, text=True).stdout.strip()
    return (f"# medusa_mini on {name.split(',')[0]}\n\n- device: {s.device}: {name}\n- torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'none (a CPU build of torch)'}, Python {platform.python_version()}\n"
            f"- code: {commit or 'unknown'}; date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}\n"
            f"- command: `{shlex.join(['python', 'benchmarks/gpu_report.py', *argv])}`\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="python benchmarks/gpu_report.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=os.path.expanduser, required=True, metavar="FILE.md", help="the markdown report")
    p.add_argument("--part", action="append", choices=PARTS, help="only this part; repeat for several (default: all)")
    p.add_argument("--append", action="store_true", help="add the sections to --out instead of writing it anew")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="smoke training, the tiny shape, few nodes and prompts")
    p.add_argument("--ckpt", type=lambda path: os.path.abspath(os.path.expanduser(path)), default="out/gpu_report",
                   metavar="DIR", help="train's checkpoint (replacing one there), read by decode and batch; relative "
                   "to the current folder, not the repository's, where the parts run (default: %(default)s)")
    p.add_argument("--configs", type=names_of(CONFIGS),
                   help=f"step: shapes for bench_step.py (default: {GPT2_SHAPES}; --quick: tiny)")
    p.add_argument("--dtypes", type=names_of(DTYPES), default="bfloat16,float32",
                   help="step: the number formats of bench_step.py (default: %(default)s)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help=f"seconds each part may take (default: {BUDGET_S:.0f}; --quick: {QUICK_BUDGET_S:.0f})")
    for script, (flag, _) in FORWARDED.items():
        p.add_argument(flag, default="", metavar="'FLAGS'",
                       help=f"more {os.path.basename(script)} flags, quoted; a single one after '=': {flag}='--x'")
    a = p.parse_args(argv)
    with p.refusing():  # the flags' own names become the settings of the parts
        check_file_path("--out", a.out, "gpu.md")
        a.target = a.out if a.append or not os.path.exists(a.out) else f"{a.out}.partial"  # an older report stays whole
        check_writable(os.path.dirname(os.path.abspath(a.out)), f"--out {a.out}", files=(os.path.basename(a.target),))
        a.device = str(pick_device(a.device))
        for name, reserved in FORWARDED.values():
            attr = name[2:].replace("-", "_")
            try:
                setattr(a, attr, flags := shlex.split(getattr(a, attr)))
            except ValueError as e:  # unclosed quotes
                raise ValueError(f"{name}: {e} in {getattr(a, attr)!r}") from None
            # argparse takes an unambiguous prefix of a flag as the flag: --dev is --device (-- alone ends the flags)
            if taken := [n for f in flags if len(n := f.split("=")[0]) > 2 and any(r.startswith(n) for r in reserved)]:
                raise ValueError(f"{name}: the report sets {taken[0]} itself; leave out {', '.join(reserved)}")
        a.budget_s = a.budget_s if a.budget_s is not None else (QUICK_BUDGET_S if a.quick else BUDGET_S)
        if not 1 < a.budget_s < float("inf"):  # nan too; a part with 1 s left starts no command (`run_part`)
            raise ValueError(f"--budget-s must be a finite number of seconds > 1, not {a.budget_s:g}")
        a.parts = [part for part in PARTS if part in (a.part or PARTS)]
        saved, unfinished = (os.path.isfile(os.path.join(a.ckpt, name)) for name in ("config.json", STATE_FILE))
        if {"decode", "batch"} & set(a.parts) and "train" not in a.parts and (unfinished or not saved):
            raise ValueError(f"no finished checkpoint in {a.ckpt} for the decode and batch parts: run --part train "
                             "first, or name one with --ckpt")
        a.configs = a.configs or (["tiny"] if a.quick else GPT2_SHAPES.split(","))
        a.compile = ["--compile"] if a.device.startswith("cuda") else []  # on a CPU: minutes, no gain
        for command in [c for part in a.parts for _, c in commands(a, part)]:
            check_command(command)
        try:  # what --append keeps
            a.before = pathlib.Path(a.out).read_text(encoding="utf-8") if a.append and os.path.exists(a.out) else ""
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--append: {a.out} cannot be read as a UTF-8 report ({e})") from None
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the running part's command is stopped
    report, failed = s.before or header(s, argv), []  # with --append, --out's text, each part's section added
    if s.target != s.out:  # an earlier stopped run's is replaced: it holds this run's parts alone
        remove_file(s.target)
    try:
        for part in s.parts:
            print(f"[{part}] starting, budget {s.budget_s:.0f} s", file=sys.stderr, flush=True)
            (text, ok), seconds = timed("cpu", lambda: run_part(s, part, trained="train" not in failed))  # wall clock
            report += f"\n{text}\n\n_Part {part}: {seconds:.0f} s of its {s.budget_s:.0f} s budget._\n"
            try:
                atomic_write(s.target, text_writer(report))
            except OSError as e:  # a full disk, say: the report as of the last part stays where it was
                print(f"gpu_report.py: error: {s.target} could not be written after part {part} ({e.strerror}); "
                      "it holds the parts before it", file=sys.stderr)
                return 1
            print(f"[{part}] {'done' if ok else 'FAILED'} in {seconds:.0f} s", file=sys.stderr, flush=True)
            failed += [] if ok else [part]
    except KeyboardInterrupt:
        print(f"gpu_report.py: interrupted; {s.target} holds the parts that ended before", file=sys.stderr)
        return 130
    kept = s.target != s.out and len(failed) == len(s.parts)  # a run with nothing to show leaves the older report
    if s.target != s.out and not kept:
        os.replace(s.target, s.out)
    where = f"{s.target} ({s.out} kept: every part failed)" if kept else s.out
    print(f"report: {where}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_with(main)
