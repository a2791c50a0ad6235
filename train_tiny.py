"""Train a small GPT and its Medusa heads on a corpus that ships with Python: no download.

Stages: tokenizer -> backbone (with the heads jointly for --medusa 2) -> self-distillation (the
backbone writes continuations of corpus prompts) -> heads on that text (backbone frozen) -> summary
(validation loss, per-head accuracy, the tree the accuracies suggest) -> a Hugging Face GPT-2
checkpoint directory that decode.py reads.

    python train_tiny.py                  # picks --preset gpu or cpu by the device
    python train_tiny.py --preset smoke   # under a minute on two CPU cores
    python train_tiny.py --init gpt2 --out out/gpt2   # Medusa heads on GPT-2 (downloads it once)
    torchrun --nproc_per_node 2 train_tiny.py --preset smoke   # DDP (gloo on CPU, NCCL on GPU)
"""

from __future__ import annotations

import argparse
import os
import sys

from medusa_mini.cli.common import OneLineParser, pick_device
from medusa_mini.train.config import DTYPES, FLAG_HELP, PRESETS, TrainArgs, TrainError
from medusa_mini.train.device import check_dtype, default_dtype
from medusa_mini.train.run import STATE_FILE, run


def _bool(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return text.lower() in ("1", "true", "yes")


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = OneLineParser(prog="train_tiny.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="size of the run (default: gpu if CUDA else cpu; with --init: gpt2 on CUDA else gpt2-cpu)")
    p.add_argument("--data", help="a UTF-8 text file or folder (default: this Python's standard library)")
    p.add_argument("--out", default="out/tiny", help="checkpoint directory (default: out/tiny)")
    p.add_argument("--init", help="start from GPT-2 weights (gpt2, gpt2-medium, ..., or a path) and train heads only")
    p.add_argument("--tokenizer", metavar="DIR", help="reuse the tokenizer of another checkpoint instead of training one")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out exactly")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the batches and the sampling (default: 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="number format of the training forward (autocast; float16 adds loss scaling; "
                        "default: float32 on CPU, bfloat16 on CUDA, float16 on GPUs without bfloat16)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--save-every", type=int, default=None, help="steps between checkpoints (default: a fifth of a stage)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines (default: 10)")
    # every hyper-parameter is a flag; left out, it keeps the preset's value
    hp = p.add_argument_group("hyper-parameters (defaults: the preset's)")
    for name, default in TrainArgs.overridable().items():
        flag = "--" + name.replace("_", "-")
        kind = _bool if type(default) is bool else type(default)
        hp.add_argument(flag, type=kind, metavar=type(default).__name__.upper(),
                        help=FLAG_HELP.get(name, "") + f" (the preset's; cpu: {default})")
    p.add_argument("--interrupt-at", help=argparse.SUPPRESS)  # tests: simulate Ctrl-C at STAGE:STEP
    ns = p.parse_args(argv)
    try:
        device = str(pick_device(ns.device))
        dtype = ns.dtype or default_dtype(device)
        check_dtype(dtype, device)
    except (ValueError, TrainError) as e:
        p.error(str(e))
    for name in ("threads", "save_every"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    cuda = device.startswith("cuda")
    preset = ns.preset or (("gpt2" if cuda else "gpt2-cpu") if ns.init else ("gpu" if cuda else "cpu"))
    values = {**PRESETS[preset], **{n: getattr(ns, n) for n in TrainArgs.overridable() if getattr(ns, n) is not None}}
    try:
        return TrainArgs(
            preset=preset, data=ns.data, out=ns.out, init=ns.init, tokenizer=ns.tokenizer, resume=ns.resume, seed=ns.seed,
            device=device, dtype=dtype, threads=ns.threads, save_every=ns.save_every, log_every=ns.log_every,
            interrupt_at=ns.interrupt_at, **values,
        )
    except ValueError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except TrainError as e:
        print(f"train_tiny.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.path.exists(os.path.join(args.out, STATE_FILE)):
            print(f"\ninterrupted: progress saved in {args.out}; continue with --resume", file=sys.stderr)
        else:
            print("\ninterrupted before anything was saved; start again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
