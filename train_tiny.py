"""Train a small GPT and its Medusa heads on a corpus that ships with Python: no download.

Stages: tokenizer -> backbone (with the heads for --medusa 2) -> self-distillation -> heads on that text ->
draft vocabulary -> summary -> a GPT-2 checkpoint for decode.py. Ctrl-C saves after the current step
(--resume continues exactly); a second Ctrl-C stops at once.

    python train_tiny.py                  # picks --preset gpu or cpu by the device
    python train_tiny.py --preset smoke   # the whole pipeline in small, into out/smoke
    python train_tiny.py --init gpt2 --out out/gpt2   # Medusa heads on GPT-2 (downloads it once)
    torchrun --nproc_per_node 2 train_tiny.py --preset smoke   # DDP (gloo on CPU, NCCL on GPU)
"""

import contextlib
import os
import sys

from medusa_mini.cli.common import OneLineParser, exit_with, out_of_memory, seed
from medusa_mini.train.config import PRESETS, TrainArgs, TrainError
from medusa_mini.train.device import DTYPES, pick_device, rank_device, training_dtype
from medusa_mini.train.run import STATE_FILE, run


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = OneLineParser(prog="train_tiny.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="size of the run (default: gpu if CUDA else cpu; with --init: gpt2 on CUDA else gpt2-cpu)")
    p.add_argument("--data", type=os.path.expanduser,  # --data=~/x: no shell expands a ~ inside a word
                   help="a UTF-8 text file or folder (default: this Python's standard library)")
    p.add_argument("--out", type=os.path.expanduser, metavar="DIR", help="checkpoint directory (default: out/tiny for "
                   "the cpu and gpu presets, else out/<preset>: a smoke run never replaces the real one)")
    p.add_argument("--init", type=os.path.expanduser, metavar="NAME|DIR", help="start from GPT-2 weights (gpt2, "
                   "gpt2-medium, ..., or a path) and train heads only, the backbone frozen (--medusa 1, no backbone "
                   "steps; its shape flags ignored)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out exactly")
    p.add_argument("--overwrite", action="store_true", help="replace the run or checkpoint in --out (default: refuse)")
    p.add_argument("--seed", type=seed, default=0, help="seeds the model, the batches and the sampling (default: 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES, help="number format of the training forward (autocast; float16 adds "
                   "loss scaling; default: float32 on CPU, on CUDA bfloat16 where native, else float16)")
    p.add_argument("--save-every", type=int, metavar="STEPS",
                   help="steps between checkpoints (default: a fifth of a stage, at least 50)")
    p.add_argument("--log-every", type=float, metavar="SECONDS", help="seconds between progress lines (default: 10)")
    hp = p.add_argument_group("hyper-parameters (defaults: the preset's)")
    for name, f in TrainArgs.hyper_parameters().items():
        hp.add_argument("--" + name.replace("_", "-"), type=type(f.default), metavar=type(f.default).__name__.upper(),
                        help=f.metadata["help"] + f" (the preset's; cpu: {PRESETS['cpu'].get(name, f.default)})")
    ns = p.parse_args(argv)
    with p.refusing():
        device = rank_device(str(pick_device(ns.device)))
        cuda = device.startswith("cuda")
        preset = ns.preset or (("gpt2" if cuda else "gpt2-cpu") if ns.init else ("gpu" if cuda else "cpu"))
        given = {name: v for name, v in vars(ns).items() if v is not None}  # left out: the preset's, else the default
        return TrainArgs(**{**PRESETS[preset], "out": f"out/{'tiny' if preset in ('cpu', 'gpu') else preset}", **given,
                            "preset": preset, "device": device, "dtype": training_dtype(ns.dtype, device)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    made, folder = [], os.path.realpath(args.out)  # as makedirs follows links
    state = os.path.join(args.out, STATE_FILE)  # an old run's (--resume, --overwrite) until this run's first save
    old = os.stat(state).st_mtime_ns if os.path.exists(state) else None
    while not os.path.isdir(folder):  # the folders the run will make, --out first
        made, folder = [*made, folder], os.path.dirname(folder)
    try:
        run(args)
        return 0
    except BaseException as e:  # a run that stops before it writes leaves no empty folder (rmdir takes only those)
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        if (words := out_of_memory(e)) is not None:  # the device's size, not a fault: the flags that set its load
            e = TrainError(f"{words}: lower --batch-size and --overwrite if it saved (the heads stage's: "
                           "--heads-batch-size, with --resume)")
        if not isinstance(e, (TrainError, KeyboardInterrupt)):  # a closed pipe (exit_with's), a fault: as raised
            raise
        if isinstance(e, TrainError):
            print(f"train_tiny.py: error: {e}", file=sys.stderr)
            return 2
        saved = os.path.exists(state) and os.stat(state).st_mtime_ns != old  # rank 0 wrote it before it stopped
        if os.environ.get("RANK", "0") == "0":  # one message, not one per DDP process
            print(f"\ninterrupted: progress saved in {args.out}; continue with --resume" if saved
                  else "\ninterrupted before anything was saved; run the same command again", file=sys.stderr)
        return 130


if __name__ == "__main__":
    exit_with(main)
