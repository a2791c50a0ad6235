"""Steps timed in turns (CUDA events on a GPU, a synchronized wall clock elsewhere), and the flag checks
the benchmark scripts share."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace
from typing import Callable, Iterable, TypeVar

import torch

from medusa_mini.cli.common import sync_device

Key = TypeVar("Key")


def time_in_turns(
    steps: dict[Key, Callable[[], object]],
    *,
    reset: Callable[[], None],
    device: torch.device,
    repeat: int,
    warmup: int,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> tuple[dict[Key, float], float]:
    """Each step's time in ms (`statistic` of its repetitions), and the seconds the first round took.
    The steps take turns, so a change in machine load touches every number alike; `reset` runs untimed
    before every call; the first `warmup` rounds (allocation, kernel selection, compilation) count not."""
    cuda = torch.device(device).type == "cuda"
    times: dict[Key, list[float]] = {name: [] for name in steps}
    first_round = 0.0
    for round_ in range(warmup + repeat):
        round_start = time.perf_counter()
        for name, step in steps.items():
            reset()
            sync_device(device)
            if cuda:
                # Events are recorded on the current device's stream: make that `device`, or they time an
                # idle GPU (about 0 ms) while the model's kernels run on another.
                with torch.cuda.device(device):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                ms = (time.perf_counter() - t0) * 1e3
            if round_ >= warmup:
                times[name].append(ms)
        if round_ == 0:
            sync_device(device)
            first_round = time.perf_counter() - round_start
    return {name: statistic(t) for name, t in times.items()}, first_round


def at_least_one(ns: Namespace, *flags: str) -> None:
    """A one-line ValueError for the first of these flags (attribute names) set below 1; None passes."""
    for flag in flags:
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")


def names_of(flag: str, text: str, allowed: Iterable[str]) -> list[str]:
    """A comma-separated list of names from `allowed`; a one-line ValueError naming `flag` otherwise."""
    names, allowed = [n.strip() for n in text.split(",") if n.strip()], list(allowed)
    if not names or not set(names) <= set(allowed):
        raise ValueError(f"{flag} {text!r}: unknown name; use {', '.join(allowed)}")
    return names
