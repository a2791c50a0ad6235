"""A training run's state, shared by every stage (`run.py`): its ranks under torchrun (DDP), saving what an exact
--resume needs (also on Ctrl-C) and reading it back, the checks across ranks, and the stages' clock."""

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from ..io.checkpoint import CONFIG_FILE, save_checkpoint
from ..io.files import Writer, atomic_write, remove_file
from ..io.loading import PROMPTS_FILE
from ..io.tokenizer import save_tokenizer, tokenizer_digest
from . import accuracy
from .config import UNBEGUN, TrainArgs, TrainError

STATE_FILE = "train_state.pt"
LOWER_LR = "start again with a lower learning rate (--lr; the heads stage's: --heads-lr), and --overwrite if it saved"


def seeded(seed: int, *, device: str = "cpu") -> torch.Generator:
    """A generator of its own for each use of --seed, which goes up to 2**63 - 1: seed * 7919 + ... wraps at 2**64."""
    return torch.Generator(device).manual_seed(seed % 2**64)


class Run:
    """What every stage needs: args, ranks, device, model and heads; saving and resuming them; the stage clock."""

    def __init__(self, args: TrainArgs, data_digest: str) -> None:
        self.args, self.data_digest, self.device, self.rank, self.world = args, data_digest, args.device, 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            cuda = args.device.startswith("cuda")
            if cuda:  # before init_process_group: NCCL binds each process to the current device when it starts
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend="nccl" if cuda else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            # Per-step flags (stop? print?) go through host memory: NCCL would make every step wait for the GPU.
            self.host_group = dist.new_group(backend="gloo")
        self.main, self.state_path = self.rank == 0, os.path.join(args.out, STATE_FILE)
        self.rank_path = f"{self.state_path}.rank{self.rank}"
        self.stop_requested = self.model_written = False
        self.distill = None  # [S, P + n] the self-distilled text, once written
        self.stages: list[str] = []  # each timed stage, as the `stages` line shows it

    def log(self, msg: str) -> None:
        try:
            if self.main:
                print(msg, flush=True)
        except OSError as e:  # its reader gone (`| head`) or a full disk: saved at the next step, as on Ctrl-C
            with contextlib.suppress(OSError):  # later lines go nowhere: a stdout that is no file has nothing to swap
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print(f"\ntrain_tiny.py: the output failed ({e.strerror or e}): saving after this step", file=sys.stderr)
            self.stop_requested = True

    def save(self, *, stage: str, step: int, optimizer=None, gen=None, scaler=None) -> None:
        """State for --resume (each rank's generator and text in a file of its own) and a usable checkpoint."""
        # A weight not finite stops every rank alike (their replicas are equal): a diverged run saves nothing over the
        # last good checkpoint (a check of the loss may come too late).
        trained = [p for p in (*self.model.parameters(), *self.heads.parameters()) if p.requires_grad]
        if not torch.stack([p.isfinite().all() for p in trained]).all():
            raise TrainError(f"{stage} step {step}: the weights are not finite; {LOWER_LR}")
        mine = {"gen": gen and gen.get_state(), "distill": None if self.distill is None else self.distill.cpu()}
        if self.world > 1:
            atomic_write(self.rank_path, lambda f: torch.save(mine, f))
            dist.barrier()
        if self.main:
            state = {"identity": self.args.identity(), "data": self.data_digest, "world": self.world, "stage": stage,
                     "step": step, "model": None if self.args.init else self.model.state_dict(),
                     "heads": self.heads.state_dict(), "optim": optimizer and optimizer.state_dict(),
                     "scaler": scaler and scaler.state_dict(), "tokenizer": tokenizer_digest(self.enc), **mine}
            self.write(self.state_path, lambda f: torch.save(state, f))

    def write(self, path: str, writer: Writer) -> None:
        """`writer`'s file at `path` (the resume state, the held-out prompts), then the checkpoint. The first save
        writes the state, then removes --overwrite's old checkpoint and writes the tokenizer (a run that stops or fails,
        a full disk, before then leaves the old checkpoint whole; --resume refuses a tokenizer not the state's)."""
        atomic_write(path, writer)
        if not self.model_written:  # the first save: later, this run's files are there already
            for name in (CONFIG_FILE, accuracy.ACCURACY_FILE, PROMPTS_FILE) if self.args.overwrite else ():
                try:
                    remove_file(os.path.join(self.args.out, name))
                except OSError as e:
                    raise TrainError(f"--overwrite: cannot remove {e.filename} ({e.strerror})") from None
            save_tokenizer(self.enc, self.args.out)
        # A pretrained backbone never changes: written once, not copied again (gigabytes) at every save.
        save_checkpoint(self.args.out, self.model, heads=self.heads, extra=self.extra,
                        eos_token_id=self.extra["eot_id"], write_model=not (self.args.init and self.model_written))
        self.model_written = True

    def load_state(self) -> dict:
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
            if self.world > 1:
                state.update(torch.load(self.rank_path, map_location="cpu", weights_only=True))
        except Exception as e:  # missing or unreadable (the run may resume once it is back), or torn or foreign
            how = f": {e.strerror or e}; restore it, or" if isinstance(e, OSError) else f" ({type(e).__name__});"
            raise TrainError(f"--resume: cannot read the saved state in {self.args.out}{how} start anew with "
                             "--overwrite") from None
        mine, theirs = self.args.identity(), dict(state.get("identity") or {})
        if theirs.get("heads_target") == "token":  # saved when heads could be taught p too; tokens are what is left
            del theirs["heads_target"]
        theirs.pop("data", None)  # saved when the path of --data was compared too, not only its text
        free = UNBEGUN.get(state.get("stage"), ()) if state.get("step") == 0 else ()  # a stage not begun: its own
        diff = sorted(k for k in mine | theirs if mine.get(k) != theirs.get(k) and k not in free)  # left out: None
        if diff or state.get("world", 1) != self.world:  # each setting as saved, then as given now
            was = [f"{k} {theirs.get(k)}, not {mine.get(k)}" for k in diff] or [f"{state.get('world', 1)} processes"]
            raise TrainError(f"--resume: the run began with {'; '.join(was)}: give the flags it began with")
        if state.get("data") != self.data_digest:  # no digest: saved by a train_tiny.py that kept none
            raise TrainError("--resume: the text under --data is not the text this run began with (or its digest "
                             "was not saved); restore it, or start anew with --overwrite")
        return state

    def on_ctrl_c(self, signum, frame) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        with contextlib.suppress(OSError):  # to the terminal: `| tee`, stopped by the same Ctrl-C, reads stdout
            print("\nCtrl-C: saving after this step (press again to stop at once)", file=sys.stderr, flush=True)

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
        return {k: [next(numbers) for _ in range(v.numel())] if v.dim() else next(numbers) for k, v in metrics.items()}

    def stage(self, name: str, fn):
        """fn(), a stage, timed for the `stages` line, with its peak allocated memory on CUDA."""
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        result = fn()
        if cuda:  # the queue must drain before the clock stops, or the time is the host's only
            torch.cuda.synchronize(self.device)
        peak = f" (peak {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB)" if cuda else ""
        self.stages.append(f"{name} {time.perf_counter() - t0:.2f} s{peak}")  # two decimals: no stage reads 0 s
        return result

    def finish(self) -> None:
        """Remove the resume state (each rank its own file) once every rank is done, then leave the group."""
        if self.world > 1:
            dist.barrier()  # a rank tearing the group down while a peer still talks to it aborts the peer
        for path in [self.rank_path] + ([self.state_path] if self.main else []):
            remove_file(path)
        if self.world > 1:
            dist.destroy_process_group()
