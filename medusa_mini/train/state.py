"""A training run's state: ranks and device, saving and resuming exactly (weights, optimizer, generators,
loss scale, stage and step, the self-distilled text), Ctrl-C, replica checksums."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal

import torch
import torch.distributed as dist

from ..io.checkpoint import save_checkpoint
from ..io.files import atomic_write, remove_file
from .config import TrainArgs, TrainError

STATE_FILE = "train_state.pt"


class Run:
    """What every stage needs: args, ranks, device, model and heads; saving and resuming them."""

    def __init__(self, args: TrainArgs) -> None:
        self.args, self.device = args, args.device
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            cuda = args.device.startswith("cuda")
            if cuda:  # before init_process_group: NCCL binds each process to the current device when it starts
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if cuda else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            # Per-step flags (stop? print?) go through host memory: NCCL would make every step wait for the GPU.
            self.host_group = dist.new_group(backend="gloo")
        self.main = self.rank == 0
        self.state_path = os.path.join(args.out, STATE_FILE)
        self.rank_path = f"{self.state_path}.rank{self.rank}"
        self.stop_requested = self.model_written = False
        self.distill = None  # [S, P + n] the self-distilled text, once written
        self.data_digest = ""  # `data.corpus_digest` of the text the run trains on

    def log(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    def save(self, *, stage: str, step: int, optimizer=None, gen=None, scaler=None) -> None:
        """State for --resume (each rank's generator and text in a file of its own) and a usable checkpoint."""
        mine = {"gen": gen and gen.get_state(), "distill": None if self.distill is None else self.distill.cpu()}
        if self.world > 1:
            atomic_write(self.rank_path, lambda f: torch.save(mine, f))
            dist.barrier()
        if not self.main:
            return
        state = {"identity": self.args.identity(), "data": self.data_digest, "world": self.world, "stage": stage,
                 "step": step, "model": None if self.args.init else self.model.state_dict(),
                 "heads": self.heads.state_dict(), "optim": optimizer and optimizer.state_dict(),
                 "scaler": scaler and scaler.state_dict(), **mine}
        atomic_write(self.state_path, lambda f: torch.save(state, f))
        self.write_checkpoint()

    def write_checkpoint(self) -> None:
        # A pretrained backbone never changes: written once, not copied again (gigabytes) at every save.
        save_checkpoint(self.args.out, self.model, heads=self.heads, extra=self.extra, eos_token_id=self.eot_id,
                        write_model=not (self.args.init and self.model_written))
        self.model_written = True

    def load_state(self) -> dict:
        if not os.path.isfile(self.state_path):
            raise TrainError(f"--resume: no {STATE_FILE} in {self.args.out}; start without --resume")
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
            if self.world > 1:
                state.update(torch.load(self.rank_path, map_location="cpu", weights_only=True))
        except Exception as e:  # a torn or foreign file
            raise TrainError(f"--resume: cannot read the saved state in {self.args.out}: {e}") from None
        mine, theirs = self.args.identity(), dict(state.get("identity") or {})
        if theirs.get("heads_target") == "token":  # saved when heads could be taught p too; tokens are what is left
            del theirs["heads_target"]
        diff = sorted(k for k in mine | theirs if mine.get(k) != theirs.get(k))  # a setting left out is None
        if diff or state.get("world", 1) != self.world:
            raise TrainError(f"--resume with a different configuration ({', '.join(diff or ['number of processes'])});"
                             " use the original flags")
        if state.get("data") != self.data_digest:  # no digest: saved by a train_tiny.py that kept none
            raise TrainError("--resume: the text under --data is not the text this run began with (or its digest "
                             "was not saved); restore it, or start a new run without --resume")
        return state

    @contextlib.contextmanager
    def ctrl_c_saves(self):
        """First Ctrl-C: finish the current optimizer step, save, stop. Second Ctrl-C: stop at once."""
        def handler(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True
            print("\nCtrl-C: saving after this step (press again to stop at once)", flush=True)

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def any_rank(self, flag: bool) -> bool:
        """True if `flag` is true on any rank (all ranks must ask); host memory only, the GPU is not waited for."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)  # on the CPU, reduced over gloo
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t[0])

    def mean_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
        """The metrics as numbers averaged over the ranks: one all-reduce, one read of the device."""
        flat = torch.cat([v.detach().float().reshape(-1) for v in metrics.values()])
        if self.world > 1:
            dist.all_reduce(flat)  # a sum: gloo has no mean
            flat /= self.world
        numbers = iter(flat.tolist())
        return {key: [next(numbers) for _ in range(v.numel())] if v.dim() else next(numbers)
                for key, v in metrics.items()}

    def print_checksum(self) -> None:
        """Every rank prints a checksum of its weights: equal lines mean the replicas stayed identical."""
        h = hashlib.sha256()
        for t in [*self.model.state_dict().values(), *self.heads.state_dict().values()]:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        # The newline in the text: print() writes it separately, and two ranks would interleave the writes.
        print(f"rank {self.rank}/{self.world} weights sha256 {h.hexdigest()[:16]}\n", end="", flush=True)

    def finish(self) -> None:
        """Remove the resume state (each rank its own file) once every rank is done, then leave the group."""
        if self.world > 1:
            dist.barrier()  # a rank tearing the group down while a peer still talks to it aborts the peer
        for path in [self.rank_path] + ([self.state_path] if self.main else []):
            remove_file(path)
        if self.world > 1:
            dist.destroy_process_group()
