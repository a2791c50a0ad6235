"""Wall clocks for decoding, kept out of the decoding loops: time around a call, in the caller.

CUDA runs kernels asynchronously: a clock read before synchronizing measures only their launch, so
every clock read here waits for the device first.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

import torch

R = TypeVar("R")
G = TypeVar("G")  # a GenerationStats
Key = TypeVar("Key")


def sync_device(device: torch.device | str) -> None:
    """Wait for `device` to finish its queued work; a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[[], R]) -> tuple[R, float]:
    """(fn(), seconds it took on `device`), the device synchronized before both clock reads."""
    sync_device(device)
    t0 = time.perf_counter()
    result = fn()
    sync_device(device)
    return result, time.perf_counter() - t0


def timed_generation(device: torch.device | str, fn: Callable[[], tuple[list[int], G]]) -> tuple[list[int], G]:
    """Run a generation `fn() -> (tokens, stats)` and store its wall time, prefill included, in
    stats.seconds: the decoding loops keep no clock of their own."""
    (tokens, stats), seconds = timed(device, fn)
    stats.seconds = seconds
    return tokens, stats


def time_in_turns(
    steps: dict[Key, Callable[[], object]],
    *,
    reset: Callable[[], None],
    device: torch.device,
    repeat: int,
    warmup: int,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> tuple[dict[Key, float], float]:
    """Each step's time in ms over its repetitions (their median, or `statistic` of them), and the
    seconds the first round took (compilation, if any).

    The steps take turns, one call each per round, so a change in machine load during the run touches
    every number alike instead of skewing whichever step happened to run then; `reset` runs untimed
    before every call. On CUDA, events recorded around the call on `device`'s current stream time the
    device's own work; elsewhere a wall clock does. The first `warmup` rounds are not counted: they pay
    for allocator growth, kernel selection and, under torch.compile, compilation.
    """
    cuda = torch.device(device).type == "cuda"
    times: dict[Key, list[float]] = {name: [] for name in steps}
    first_round = 0.0
    for round_ in range(warmup + repeat):
        round_start = time.perf_counter()
        for name, step in steps.items():
            reset()
            sync_device(device)
            if cuda:
                # An event is recorded on the current device's stream: make that `device`, or the events
                # time an idle GPU (about 0 ms) while the model's kernels run on another.
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
