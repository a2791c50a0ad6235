"""A `train_tiny.py` run: its settings, its hyper-parameters (each a flag) and the presets. `--resume` refuses
another identity (`TrainArgs.identity`) or other text; the device may change."""

import math
import os
import re
from dataclasses import Field, dataclass, field, fields

from ..heads import HEAD_KINDS
from ..io.gpt2 import GPT2_CONFIGS
from ..sampling import FLOAT32_MAX


class TrainError(Exception):
    """A problem the user can fix (bad data, a clashing --resume, ...): one line, exit code 2."""


def hp(default, help: str, least: int = 0):
    """A hyper-parameter: a flag of its own (`help`), left out it keeps the preset's value; `least`: its minimum."""
    return field(default=default, metadata={"help": help, "least": least})


@dataclass
class TrainArgs:
    # the run's settings, each its own flag
    preset: str = "cpu"
    data: str | None = None
    out: str = "out/tiny"
    init: str | None = None
    resume: bool = False
    overwrite: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    save_every: int | None = field(default=None, metadata={"least": 1})
    log_every: float = field(default=10.0, metadata={"least": 0})
    # hyper-parameters; the defaults are the cpu preset's but for num_heads (PRESETS)
    max_bytes: int = hp(3_000_000, "cap on the default corpus", 1)
    vocab_size: int = hp(2048, "BPE vocabulary incl. end-of-text", 257)  # the least: 256 bytes and end-of-text
    n_layer: int = hp(4, "transformer blocks", 1)
    n_head: int = hp(4, "attention heads", 1)
    n_embd: int = hp(256, "width", 1)
    block_size: int = hp(256, "context length", 1)
    num_heads: int = hp(4, "Medusa heads K", 1)
    heads: str = hp("medusa", "medusa: head k reads h_t only; hydra: h_t and the k tokens before its target")
    medusa: int = hp(2, "1: heads on the frozen backbone; 2: heads trained jointly with the backbone, then alone", 1)
    batch_size: int = hp(16, "backbone sequences per step", 1)
    backbone_steps: int = hp(420, "optimizer steps")
    lr: float = hp(1e-3, "backbone learning rate")
    weight_decay: float = hp(0.1, "AdamW's, on weight matrices only")
    heads_lr_mult: float = hp(4.0, "heads' learning rate over the backbone's in joint training")
    lambda0: float = hp(0.2, "Medusa-2 heads-loss weight (ramped up)")
    heads_stride: int = hp(4, "joint training: head losses at every n-th position only (speed)", 1)
    head_decay: float = hp(0.8, "head k's loss weight decay^k (joint)")
    distill_prompts: int = hp(1024, "self-distillation prompts", 1)
    distill_prompt_len: int = hp(32, "tokens per prompt", 1)
    distill_tokens: int = hp(96, "tokens the backbone writes per prompt", 1)
    distill_temperatures: str = hp("0,0.8", "sampling temperatures, cycled (0: greedy)")
    heads_steps: int = hp(500, "heads-only optimizer steps on the self-distilled text")
    heads_batch_size: int = hp(32, "sequences per heads step", 1)
    heads_lr: float = hp(1e-3, "heads-only learning rate")
    draft_vocab: int = hp(512, "M: heads guess among the M tokens most frequent in the self-distilled text (0: all)")
    eval_prompts: int = hp(16, "held-out prompts saved for decode.py", 1)
    eval_every: int = hp(0, "backbone steps between validation losses (0: only the summary's)")

    def __post_init__(self) -> None:
        for f in fields(self):  # the hyper-parameters, --save-every and --log-every: each has its least
            value, least = getattr(self, f.name), f.metadata.get("least")
            if least is not None and isinstance(value, (int, float)) and not (math.isfinite(value) and value >= least):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a number >= {least}, got {value}")  # nan too
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite replaces it: give one of them")
        if self.medusa not in (1, 2):
            raise ValueError(f"--medusa must be 1 (heads on the frozen backbone) or 2 (jointly), not {self.medusa}")
        if not self.out or os.path.isfile(self.out):
            raise ValueError(f"--out must name a folder for the checkpoint, not {self.out!r}")
        if empty := [f"--{name}" for name in ("data", "init") if getattr(self, name) == ""]:  # '': the working folder
            raise ValueError(f"{empty[0]} needs a file or folder, not ''")
        if self.eval_prompts > 1000:  # each is looked for up to 150 times: that many would take minutes
            raise ValueError(f"--eval-prompts must be at most 1000 (prompts for decode.py), not {self.eval_prompts}")
        if self.heads not in HEAD_KINDS:
            raise ValueError(f"--heads must be one of {', '.join(HEAD_KINDS)}, not {self.heads!r}")
        if self.head_decay > 1:  # later heads weigh less (decay^k); beyond 1 their weights soon overflow
            raise ValueError(f"--head-decay must be from 0 to 1 (the paper's 0.8), not {self.head_decay}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd {self.n_embd} must be divisible by --n-head {self.n_head}")
        named = GPT2_CONFIGS.get(self.init)  # --init replaces the context: a named GPT-2's is known, a folder's not yet
        context, flag = (named.block_size, f"--init {self.init}") if named else (self.block_size, "--block-size")
        if (named or not self.init) and (why := self.context_error(context)):  # a folder's: run.py, once loaded
            raise ValueError(f"{why} ({flag})")
        temps = self.distill_temperatures.replace(" ", "")
        if not re.fullmatch(r"\d+(\.\d*)?(,\d+(\.\d*)?)*", temps) or max(map(float, temps.split(","))) > FLOAT32_MAX:
            raise ValueError(f"--distill-temperatures must be numbers in [0, {FLOAT32_MAX:.3g}], like 0,0.8: {temps!r}")
        if self.preset.startswith("gpt2") and not self.init:  # else heads on a random backbone, and no word of it
            raise ValueError(f"--preset {self.preset} trains heads on GPT-2: add --init gpt2 (a larger one, a folder)")
        if self.init:  # a pretrained backbone stays frozen: heads only (Medusa-1)
            self.backbone_steps, self.medusa = 0, 1

    @classmethod
    def hyper_parameters(cls) -> dict[str, Field]:
        return {f.name: f for f in fields(cls) if "help" in f.metadata}

    def context_error(self, block_size: int) -> str:
        """Why the distilled prompts, the heads' stride (past the context a step trains no head, which DDP cannot
        reduce) or the heads do not fit block_size tokens, --block-size's or --init's model's; '' if they fit."""
        if self.distill_prompt_len >= block_size:
            return f"--distill-prompt-len must be shorter than the context, {block_size} tokens"
        if self.num_heads > (room := min(block_size, self.distill_prompt_len + self.distill_tokens) - 2):  # else
            return (f"--num-heads must be at most {room}: head k guesses k + 1 tokens ahead in the context and the "
                    "self-distilled text (--distill-prompt-len + --distill-tokens)")  # zeros for the heads past them
        return f"--heads-stride must be at most the context, {block_size} tokens" * (self.heads_stride > block_size)

    def identity(self) -> dict:
        """What --resume compares: the hyper-parameters but --eval-every (it only reports), init, seed; the text under
        --data is compared by its digest, and --init's folder or file by its real path, however either is spelled."""
        trained = {k: getattr(self, k) for k in self.hyper_parameters() if k != "eval_every"}
        init = os.path.realpath(self.init) if self.init and os.path.exists(self.init) else self.init  # else a name
        return {**trained, "init": init, "seed": self.seed, "dtype": self.dtype}


# The settings --resume may change at a stage's step 0 (as after running out of memory as it began): no saved step
# holds what they shape, theirs or a later stage's, so the run goes on as one begun with them would.
UNBEGUN = {"heads": ("heads_steps", "heads_batch_size", "heads_lr", "draft_vocab")}
UNBEGUN["distill"] = (*UNBEGUN["heads"], *(f"distill_{s}" for s in ("prompts", "prompt_len", "tokens", "temperatures")))

PRESETS: dict[str, dict] = {
    # the pipeline end to end in small, not a useful model: 16 s on two CPU cores
    "smoke": dict(max_bytes=300_000, vocab_size=512, n_layer=2, n_head=2, n_embd=64, block_size=128,
                  batch_size=8, backbone_steps=60, distill_prompts=64, distill_prompt_len=16,
                  distill_tokens=48, heads_steps=40, heads_batch_size=16, eval_prompts=4, draft_vocab=128),
    # two CPU cores; a draft vocabulary of a quarter of the tokens measured fastest; twice the heads' text and
    # steps took greedy tokens/step from 3.60 to 3.91; five heads, not four: 4.79 on the auto tree against 3.81
    "cpu": dict(num_heads=5),  # (BENCHMARKS.md, "The heads' training")
    # one GPU; the whole standard library (~11 MB) ~6 times. 4000 steps (~20 passes) overfit it on an H100:
    # greedy tokens/step 1.87 against 3.14 after 1200 (BENCHMARKS.md)
    "gpu": dict(max_bytes=16_000_000, eval_every=250, vocab_size=4096, n_layer=8, n_head=8, n_embd=512,
                batch_size=64, backbone_steps=1200, lr=6e-4, distill_prompts=4096, distill_tokens=128,
                heads_steps=1500, heads_batch_size=128, eval_prompts=32, draft_vocab=1024),
    # --init gpt2...: heads only on a frozen GPT-2, for one GPU or a CPU; a draft vocabulary of 4,096 of its
    # 50,257 tokens makes the heads cost under a tenth of a plain step (bench_step.py)
    "gpt2": dict(distill_prompts=4096, distill_tokens=128, heads_steps=2000, eval_prompts=32, draft_vocab=4096),
    "gpt2-cpu": dict(distill_prompts=32, distill_prompt_len=16, distill_tokens=32, heads_steps=30, heads_batch_size=4,
                     eval_prompts=4, draft_vocab=4096)}
