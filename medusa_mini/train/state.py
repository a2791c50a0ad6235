"""A training run's state: ranks and device, saving and resuming, Ctrl-C, replica checksums.

`--resume` continues exactly, so the state file holds everything a step depends on: weights,
optimizer, generator, stage and step, the self-distilled data; written atomically. Under torchrun
each rank keeps its generator and data in a file of its own and rank 0 writes the shared files.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from typing import Callable

import torch
import torch.distributed as dist

from ..io.checkpoint import save_checkpoint
from ..io.safetensors import atomic_write
from .config import TrainArgs, TrainError
from .device import rank_device

STATE_FILE = "train_state.pt"


class Run:
    """What every stage needs: args, ranks, device, model and heads; saving and resuming them."""

    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        self.rank, self.world, self.device = 0, 1, args.device
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            if args.device.startswith("cuda"):
                # Before init_process_group: NCCL binds each process to the current device when it
                # starts, and every rank would otherwise open a context on GPU 0.
                self.device = rank_device(args.device)
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if args.device.startswith("cuda") else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            # Per-step flags (stop? print?) go through host memory: NCCL would make every step wait for the GPU.
            self.host_group = dist.new_group(backend="gloo")
        self.main = self.rank == 0
        self.state_path = os.path.join(args.out, STATE_FILE)
        self.stop_requested = False
        self.model_written = False  # a frozen backbone is written once per run, then left alone

    def log(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    def _rank_path(self) -> str:
        return f"{self.state_path}.rank{self.rank}"

    def save(self, *, stage: str, step: int, optimizer=None, gen=None, distill=None, scaler=None) -> None:
        """State for --resume plus a usable checkpoint. Each rank keeps its own generator and data."""
        mine = {"gen": gen.get_state() if gen is not None else None,
                "distill": distill.cpu() if distill is not None else None}
        if self.world > 1:
            atomic_write(self._rank_path(), lambda f: torch.save(mine, f))
            dist.barrier()
        if not self.main:
            return
        frozen = bool(self.args.init)  # a pretrained backbone never changes: do not copy gigabytes again
        state = {"identity": self.args.identity(), "world": self.world, "stage": stage, "step": step,
                 "model": None if frozen else self.model.state_dict(), "heads": self.heads.state_dict(),
                 "optim": optimizer.state_dict() if optimizer is not None else None,
                 "scaler": scaler.state_dict() if scaler is not None else None, **mine}
        atomic_write(self.state_path, lambda f: torch.save(state, f))
        save_checkpoint(self.args.out, self.model, heads=self.heads, extra=self.extra, eos_token_id=self.eot_id,
                        write_model=not (frozen and self.model_written))
        self.model_written = True

    def load_state(self) -> dict:
        if not os.path.isfile(self.state_path):
            raise TrainError(f"--resume: no {STATE_FILE} in {self.args.out}; start without --resume")
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
            if self.world > 1:
                state.update(torch.load(self._rank_path(), map_location="cpu", weights_only=True))
        except Exception as e:  # a torn or foreign file
            raise TrainError(f"--resume: cannot read the saved state in {self.args.out}: {e}") from None
        mine, theirs = self.args.identity(), state.get("identity") or {}
        if mine != theirs or state.get("world", 1) != self.world:
            diff = sorted(k for k in mine if mine.get(k) != theirs.get(k)) or ["number of processes"]
            raise TrainError(f"--resume with a different configuration ({', '.join(diff)}); use the original flags")
        return state

    def should_stop(self, stage: str, step: int) -> bool:
        """True when Ctrl-C was pressed (on any rank: all ranks must stop at the same step)."""
        return self.any_rank(self.stop_requested or self.args.interrupt_at == f"{stage}:{step}")

    def main_first(self, fn: Callable[[], None]) -> None:
        """Run `fn` on rank 0 alone while the others wait (a download they then read); its ValueError or
        OSError is raised on every rank as a ValueError."""
        error = None
        if self.main:
            try:
                fn()
            except (ValueError, OSError) as e:
                error = str(e)
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.host_group)  # also the barrier
            error = box[0]
        if error is not None:
            raise ValueError(error)

    def any_rank(self, flag: bool) -> bool:
        """True if `flag` is true on any rank (all ranks must ask); host memory only, the GPU is not waited for."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)  # on the CPU, reduced over gloo
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t[0])

    def mean_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
        """The metrics as numbers averaged over the ranks: one all-reduce, one read of the device (per progress line)."""
        flat = torch.cat([v.detach().float().reshape(-1) for v in metrics.values()])
        if self.world > 1:
            dist.all_reduce(flat)  # a sum: gloo has no mean
            flat /= self.world
        numbers, out = flat.tolist(), {}
        for key, v in metrics.items():
            part, numbers = numbers[: v.numel()], numbers[v.numel():]
            out[key] = part if v.dim() else part[0]
        return out


class DeferredInterrupt:
    """First Ctrl-C: finish the current optimizer step, save, stop. Second Ctrl-C: stop at once."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self):
        self.previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if self.run.stop_requested:
                raise KeyboardInterrupt
            self.run.stop_requested = True
            print("\nCtrl-C: saving after this step (press again to stop at once)", flush=True)

        signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)


def report_replicas(r: Run) -> None:
    """Every rank prints a checksum of its weights: equal lines mean the replicas stayed identical."""
    h = hashlib.sha256()
    for t in list(r.model.state_dict().values()) + list(r.heads.state_dict().values()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    # One write per line: print() writes text and newline separately, and two ranks would interleave them.
    sys.stdout.write(f"rank {r.rank}/{r.world} weights sha256 {h.hexdigest()[:16]}\n")
    sys.stdout.flush()
