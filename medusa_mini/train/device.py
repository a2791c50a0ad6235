"""Devices and number formats (--device, --dtype) for decoding and training alike, each rank's GPU, copies
that do not wait. bfloat16 and float16 train under torch.autocast (weights, reductions and the optimizer stay
float32); float16's narrow range needs a GradScaler."""

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None) -> torch.device:
    """'cuda' when available, else 'cpu'; an explicit name must exist on this machine."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported: use cpu or cuda")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} is not here ({torch.cuda.device_count()} CUDA GPUs); use --device cpu")
    return device


def rank_device(device: str) -> str:
    """The device this process trains on: under torchrun, "cuda" means this rank's GPU, cuda:LOCAL_RANK."""
    ddp = device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return f"cuda:{int(os.environ['LOCAL_RANK'])}" if ddp else device


def has_native_bfloat16(device: torch.device) -> bool:
    """A CUDA device of compute capability 8.0+ (Ampere on), whose tensor cores compute in bfloat16. Not
    torch.cuda.is_bf16_supported(): it counts emulation (several times slower) and asks the current GPU."""
    return device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= (8, 0)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """A --dtype name (a key of DTYPES) as a torch dtype; bfloat16 on CUDA only where it is native."""
    if name == "bfloat16" and device.type == "cuda" and not has_native_bfloat16(device):
        raise ValueError("this GPU has no native bfloat16 (compute capability < 8.0): use --dtype float16 or float32")
    return DTYPES[name]


def training_dtype(name: str | None, device: str) -> str:
    """The --dtype a run trains in on `device`: `name`, checked, or by default the fastest one it trains well in."""
    d = torch.device(device)
    name = name or ("bfloat16" if has_native_bfloat16(d) else "float16" if d.type == "cuda" else "float32")
    if name == "float16" and d.type != "cuda":
        raise ValueError("--dtype float16 needs CUDA (its GradScaler); on a CPU use bfloat16 or float32")
    pick_dtype(name, d)
    return name


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device` without waiting: from pinned memory it travels while a step runs."""
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
