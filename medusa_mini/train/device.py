"""How a training run uses its device: the forward's number format, TF32, non-blocking copies, and
each stage's time and peak memory.

--dtype float32 is exact (the CPU default). bfloat16 and float16 run the forward under torch.autocast
(matmuls in 16 bits; reductions, weights and optimizer in float32). float16's narrow range needs a
GradScaler so small gradients do not flush to zero; bfloat16 has float32's range. On CUDA the default
is bfloat16 from compute capability 8.0 (Ampere) on, else float16.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from .config import TrainError


def rank_device(device: str) -> str:
    """The device this process trains on: under torchrun, "cuda" means this rank's GPU, cuda:LOCAL_RANK."""
    if device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', os.environ.get('RANK', '0')))}"
    return device


def has_native_bfloat16(device: str | torch.device) -> bool:
    """True for a CUDA device of compute capability 8.0+ (Ampere and later), whose tensor cores compute
    in bfloat16. Not torch.cuda.is_bf16_supported(): it counts emulation (several times slower on a T4
    or V100) and asks the current device (GPU 0 on every rank before set_device), not `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(index)) >= (8, 0)


def default_dtype(device: str) -> str:
    """float32 on a CPU; on CUDA bfloat16 if this rank's GPU computes in it, else float16."""
    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if has_native_bfloat16(rank_device(device)) else "float16"


def check_dtype(dtype: str, device: str) -> None:
    """A one-line TrainError for a number format this device cannot train in (emulated bfloat16 included)."""
    if dtype == "float16" and not device.startswith("cuda"):
        raise TrainError("--dtype float16 needs CUDA (its GradScaler); on a CPU use bfloat16 or float32")
    if dtype == "bfloat16" and device.startswith("cuda") and not has_native_bfloat16(rank_device(device)):
        raise TrainError("--dtype bfloat16 is not native on this GPU (compute capability below 8.0); "
                         "use float16 or float32")


def enable_tf32(device: str) -> None:
    """float32 matmuls on CUDA's tensor cores (TF32): several times faster, at an error training never notices."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")


def autocast(device: str, dtype: str):
    """The forward's number format: torch.autocast for bfloat16/float16, nothing at all for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


def grad_scaler(device: str, dtype: str) -> torch.amp.GradScaler:
    """Loss scaling for float16 only; disabled, it passes the loss and the optimizer step through unchanged."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "float16")


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device` without waiting: from pinned memory a copy is queued like a kernel
    (from pageable memory it would synchronise), so the next batch travels while a step runs."""
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


class StageClock:
    """Wall time of each stage and, on CUDA, its peak allocated memory (reset at every stage's start)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:  # the queue must drain before the clock stops, or the time is the host's only
                torch.cuda.synchronize(self.device)
                self.peak_bytes[name] = torch.cuda.max_memory_allocated(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def line(self) -> str:
        """"stages     backbone 123.40 s (peak 3.21 GiB), ...": two decimals, so no stage reads as 0 s."""
        parts = []
        for name, sec in self.seconds.items():
            peak = f" (peak {self.peak_bytes[name] / 2**30:.2f} GiB)" if name in self.peak_bytes else ""
            parts.append(f"{name} {sec:.2f} s{peak}")
        return "stages     " + ", ".join(parts)
