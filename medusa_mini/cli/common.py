"""What the command-line scripts share: the clock (`timed`, `in_turns`), and one-line errors: a script
passes bad input, a ValueError, to `OneLineParser.error` (`<prog>: error: ...`, exit status 2)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, NoReturn, TypeVar

import torch

R, K = TypeVar("R"), TypeVar("K")
BONUS_NOTE = "tokens/step counts the bonus token (the verify pass's own next token)"


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
             before_each: Callable[[], None] | None = None) -> dict[K, list[tuple[R, float]]]:
    """Every call `rounds` times in turns (a, b, c, a, b, c, ...), each `timed`, so that a change in the
    machine's load touches every call alike; `before_each` runs untimed before each call."""
    out: dict[K, list[tuple[R, float]]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            if before_each is not None:
                before_each()
            out[key].append(timed(device, call))
    return out


def seed(text: str) -> int:
    """The argparse type of every --seed: an integer every generator takes, 0 to 2**63 - 1."""
    value = int(text)  # not an integer: argparse's own one-line error
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: give an integer from 0 to 2**63 - 1")
    return value


def check_file_path(flag: str, path: str, example: str) -> None:
    """A ValueError now, not after a long run, unless `path` names a file in a folder that exists."""
    if not path:
        raise ValueError(f"{flag} needs a file name, such as {example}")
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {path} is a folder; name a file in it, such as {os.path.join(path, example)}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{flag} {path}: its folder does not exist")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors, its own and the script's, are one line: `<prog>: error: <message>`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")
