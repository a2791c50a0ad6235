"""What the command-line scripts share: the clock (`timed`, `in_turns`); one-line errors: a script passes
bad input, a ValueError, to `OneLineParser.error` (`<prog>: error: ...`, exit status 2); and figures, in two
panels (matplotlib, an optional extra, imported only when drawing, on the Agg canvas: no display, no pyplot)."""

import argparse
import contextlib
import io
import os
import sys
import time
from typing import Callable, Collection, Iterator, NoReturn, TypeVar

import torch

from ..io.files import atomic_write, check_writable
from ..sampling import FLOAT32_MAX

R, K = TypeVar("R"), TypeVar("K")
BONUS_NOTE = "tokens/step counts the bonus token (the verify pass's own next token)"
# What matplotlib's Agg canvas writes (3.5 on) with no other tool, so that a path is checked without
# importing matplotlib; savefig takes the file's extension as its format.
PLOT_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff")


def timed(device: torch.device | str, fn: Callable[[], R]) -> tuple[R, float]:
    """(fn(), its seconds on `device`): on CUDA, events after the device is idle (a host clock would time
    the kernels' launch, not their run); elsewhere a wall clock."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):  # events record on the current device's stream: make it `device`'s
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1e3


def in_turns(calls: dict[K, Callable[[], R]], *, rounds: int, device: torch.device | str,
             before_each: Callable[[], None] = lambda: None) -> dict[K, list[tuple[R, float]]]:
    """Every call `rounds` times in turns (a, b, c, a, b, c, ...), each `timed`, so that a change in the
    machine's load touches every call alike; `before_each` runs untimed before each call."""
    out: dict[K, list[tuple[R, float]]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            before_each()
            out[key].append(timed(device, call))
    return out


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low` (and at most `high`)."""
    def integer(text: str) -> int:
        if (value := int(text)) < low or (high is not None and value > high):
            most = "" if high is None else f" and at most {high}"
            raise argparse.ArgumentTypeError(f"must be at least {low}{most}, not {text}")
        return value
    return integer


def names_of(allowed: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated set of names from `allowed` (read at every call: no generator), in order."""
    def names(text: str) -> list[str]:
        chosen = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        if not chosen or not set(chosen) <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: unknown name; use {', '.join(allowed)}")
        return chosen
    return names


def numbers(low: int, high: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: distinct whole numbers from `low` to `high` (None: no limit), comma-separated."""
    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isascii() and p.isdigit() and low <= int(p) <= (high or int(p)) for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: give numbers from {low}{f' to {high}' if high else ''}, "
                                             "e.g. 2,4,8")
        return tuple(sorted({int(p) for p in parts}))
    return parse


seed = at_least(0, 2**63 - 1)  # the argparse type of every --seed: an integer every generator takes


def temperature(text: str) -> float:
    """The argparse type of a sampling --temperature: above 0 (greedy has none) and no larger than float32 holds."""
    if not 0 < (value := float(text)) <= FLOAT32_MAX:  # nan too; not a number: argparse's own one-line error
        raise argparse.ArgumentTypeError(f"must be a number above 0, at most {FLOAT32_MAX:.3g}, not {text}")
    return value


def check_file_path(flag: str, path: str, example: str) -> None:
    """A ValueError now, not after a long run, unless `path` names a file in a folder that exists and takes one."""
    if not path:
        raise ValueError(f"{flag} needs a file name, such as {example}")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {path} is a folder; name a file in it, such as {os.path.join(path, example)}")
    if not os.path.isdir(folder := os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{flag} {path}: its folder does not exist")
    check_writable(folder, f"{flag} {path}")  # its temporary file goes there too


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors, its own and the script's, are one line: `<prog>: error: <message>`; parsing
    also lets a console that cannot print Σ, ≈ or a tree's lines (cp1252) show escapes, not fail after the work."""

    def parse_known_args(self, *args, **kwargs):
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(errors="backslashreplace")
        return super().parse_known_args(*args, **kwargs)

    def print_help(self, file=None) -> None:  # argparse's drops a failed write: --help to a full disk would exit 0
        (file or sys.stdout).write(self.format_help())

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")

    @contextlib.contextmanager
    def refusing(self, *errors: type[Exception]) -> Iterator[None]:
        """The block's bad input, a ValueError (or one of `errors`), as this parser's one-line error."""
        try:
            yield
        except BrokenPipeError:  # an OSError, but no bad input: `exit_with` ends quietly
            raise
        except errors or ValueError as e:
            self.error(str(e))


def out_of_memory(e: BaseException) -> str | None:
    """The allocator's own words (what, how much) if e is a device out of memory, CUDA's or a CPU's; else None."""
    if cpu := str(e).partition("DefaultCPUAllocator: ")[2]:
        return cpu.split(". ")[0]
    return ". ".join(str(e).split(". ")[:2]) if isinstance(e, torch.OutOfMemoryError) else None


def exit_with(main: Callable[[], int], *, memory_advice: str = "") -> NoReturn:
    """sys.exit(main()) as a command line ends, never with a traceback: Ctrl-C, status 130; its reader gone (`| head`),
    1; a device out of memory (its size, not a fault), one line and status 2: the allocator's words, `memory_advice`;
    any other OSError (a full disk), the system's words, status 2."""
    try:
        try:
            status = main()
        finally:  # what a pipe still buffers is written here, where a reader gone is caught (--help's too)
            sys.stdout.flush()
    except KeyboardInterrupt:
        status = 130
    except OSError as e:  # the recipe in Python's signal docs: the flush at exit must not fail again
        with contextlib.suppress(OSError):  # a stdout that is no file (io.UnsupportedOperation) has nothing to flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(e, BrokenPipeError):  # a reader gone is no error to report
            print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        status = 1 if isinstance(e, BrokenPipeError) else 2
    except RuntimeError as e:
        if (words := out_of_memory(e)) is None:
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {words}{memory_advice}", file=sys.stderr)
        status = 2
    sys.exit(status)


def check_plot_path(path: str) -> None:
    """A ValueError now, not after a long run, if matplotlib is missing or `path` is no file it writes as
    named (savefig would write a folder or an unknown extension as PATH.png)."""
    check_file_path("--plot", path, "plot.png")
    if os.path.splitext(path)[1][1:].lower() not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: end the name in .png or another format matplotlib writes: "
                         + ", ".join(f".{f}" for f in PLOT_FORMATS))
    _figure()


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError('drawing a plot needs matplotlib: pip install matplotlib (or pip install -e ".[plot]")'
                         ) from None
    return FigureCanvasAgg(Figure(figsize=(11, 4.2), layout="constrained")).figure


def draw(path: str, panels: dict[str, list[tuple]], *, xlabel: str, ticks: list[int], title: str) -> str:
    """Two panels side by side, {y label: [(xs, ys, plot keywords), ...]} (xs None: a horizontal line at
    ys), over a log2 x axis at the measured points `ticks`; titled and saved in the format `path` names."""
    fig = _figure()
    for ax, (ylabel, lines) in zip(fig.subplots(1, 2, squeeze=False)[0], panels.items()):
        for xs, ys, style in lines:
            if xs is None:
                ax.axhline(ys, **style)
            else:
                ax.plot(xs, ys, **style)
        ax.set_xscale("log", base=2)
        ax.set(xticks=ticks, xticklabels=[str(t) for t in ticks], xlabel=xlabel, ylabel=ylabel, ylim=(0, None))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    # Into a temporary file first: a figure that fails to render leaves an older one at `path` as it was.
    atomic_write(path, lambda f: fig.savefig(f, format=os.path.splitext(path)[1][1:].lower(), dpi=120))
    return path
