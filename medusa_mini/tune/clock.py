"""Wall clocks for decoding, kept out of the decoding loops: time around a call, in the caller.

CUDA runs kernels asynchronously: a clock read before synchronizing measures only their launch, so
every clock read here waits for the device first.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

R = TypeVar("R")
G = TypeVar("G")  # a GenerationStats


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
