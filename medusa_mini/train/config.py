"""What a `train_tiny.py` run is: its hyper-parameters (every one a flag) and the presets.

A run's identity (hyper-parameters, data, seed) is what `--resume` compares, so a resumed run can
never silently continue with different settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..heads import HEAD_KINDS
from .backbone import GPT2_PRESETS

DTYPES = ("float32", "bfloat16", "float16")  # --dtype: the autocast type of the training forward


class TrainError(Exception):
    """A problem the user can fix (bad data, a clashing --resume, ...): one line, exit code 2."""


@dataclass
class TrainArgs:
    # run-level settings (not part of a run's identity, except where --resume compares them)
    preset: str = "cpu"
    data: str | None = None
    out: str = "out/tiny"
    init: str | None = None
    tokenizer: str | None = None
    resume: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    save_every: int | None = None
    log_every: float = 10.0
    interrupt_at: str | None = None
    # hyper-parameters: every one is a command-line flag
    max_bytes: int = 3_000_000
    vocab_size: int = 2048
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    num_heads: int = 4
    heads: str = "medusa"
    own_lm_head: bool = False
    medusa: int = 2
    batch_size: int = 16
    backbone_steps: int = 420
    lr: float = 1e-3
    weight_decay: float = 0.1
    heads_lr_mult: float = 4.0
    lambda0: float = 0.2
    heads_stride: int = 4
    head_decay: float = 0.8
    distill_prompts: int = 512
    distill_prompt_len: int = 32
    distill_tokens: int = 96
    distill_temperatures: str = "0,0.8"
    heads_steps: int = 250
    heads_batch_size: int = 32
    heads_lr: float = 1e-3
    eval_prompts: int = 16
    eval_every: int = 0
    heads_chunk: int = 0

    _RUN_FIELDS = ("preset", "data", "out", "init", "tokenizer", "resume", "seed", "device", "dtype", "threads",
                   "save_every", "log_every", "interrupt_at")
    # flags that change how a run is computed or reported, not what it trains: free to change on --resume
    _NOT_IDENTITY = ("eval_every", "heads_chunk")

    def __post_init__(self) -> None:
        for name, value in self.overridable().items():
            v = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "num_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.heads not in HEAD_KINDS:
            raise ValueError(f"--heads must be one of {', '.join(HEAD_KINDS)}, not {self.heads!r}")
        if self.heads == "hydra" and self.own_lm_head:
            raise ValueError("--heads hydra shares the backbone's lm_head: drop --own-lm-head")
        if self.vocab_size < 257:
            raise ValueError("--vocab-size must be at least 257 (256 bytes + the end-of-text token)")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd {self.n_embd} must be divisible by --n-head {self.n_head}")
        if self.distill_prompt_len >= self.block_size:
            raise ValueError("--distill-prompt-len must be shorter than --block-size")
        try:
            temps = self.temperatures()
        except ValueError:
            raise ValueError(f"--distill-temperatures must be numbers like 0,0.8: {self.distill_temperatures!r}")
        if not temps or any(t < 0 for t in temps):
            raise ValueError("--distill-temperatures must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.init:  # a pretrained backbone stays frozen: heads only (Medusa-1)
            self.backbone_steps, self.medusa = 0, 1

    @classmethod
    def overridable(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in cls._RUN_FIELDS}

    def temperatures(self) -> list[float]:
        return [float(t) for t in self.distill_temperatures.split(",") if t.strip()]

    def identity(self) -> dict:
        """What must match for --resume: the hyper-parameters, the data and the seed."""
        d = {k: getattr(self, k) for k in self.overridable() if k not in self._NOT_IDENTITY}
        d.update(data=self.data, init=self.init, tokenizer=self.tokenizer, seed=self.seed, dtype=self.dtype)
        return d


FLAG_HELP = {
    "max_bytes": "cap on the default corpus", "vocab_size": "BPE vocabulary incl. end-of-text",
    "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "width",
    "block_size": "context length", "num_heads": "Medusa heads K",
    "heads": "medusa: head k reads h_t only; hydra: h_t and the k tokens before its target (hydra.py)",
    "own_lm_head": "each head its own lm_head",
    "medusa": "1: heads on the frozen backbone; 2: heads trained jointly with the backbone, then alone",
    "batch_size": "backbone batch", "backbone_steps": "backbone optimizer steps", "lr": "backbone learning rate",
    "weight_decay": "AdamW weight decay", "heads_lr_mult": "heads' learning-rate multiple in joint training",
    "lambda0": "Medusa-2 heads-loss weight (ramped up)",
    "heads_stride": "joint training computes head losses at every n-th position only (speed)", "head_decay": "head k's loss weight decay^k (joint)",
    "distill_prompts": "self-distillation prompts", "distill_prompt_len": "tokens per prompt",
    "distill_tokens": "tokens the backbone writes per prompt",
    "distill_temperatures": "comma-separated sampling temperatures, cycled (0 = greedy)",
    "heads_steps": "heads-only optimizer steps on the self-distilled text", "heads_batch_size": "heads batch",
    "heads_lr": "heads learning rate", "eval_prompts": "held-out prompts saved for decode.py",
    "eval_every": "backbone steps between validation losses (0: only the summary's)",
    "heads_chunk": "positions per chunk of the heads' loss (0: as many as fit 2^26 logits)",
}

PRESETS: dict[str, dict] = {
    # under a minute on two CPU cores: proves the pipeline end to end, not a useful model
    "smoke": dict(max_bytes=300_000, vocab_size=512, n_layer=2, n_head=2, n_embd=64, block_size=128,
                  batch_size=8, backbone_steps=120, distill_prompts=64, distill_prompt_len=16,
                  distill_tokens=48, heads_steps=80, heads_batch_size=16, eval_prompts=4),
    # two CPU cores, about a quarter of an hour
    "cpu": dict(),
    # one GPU, a few minutes; the whole standard library (~11 MB, ~3M tokens at this vocabulary)
    # rather than 3 MB, so 4000 steps x 16K tokens are ~20 passes over the text instead of ~85
    "gpu": dict(max_bytes=16_000_000, eval_every=250, vocab_size=4096, n_layer=8, n_head=8, n_embd=512, block_size=256, batch_size=64,
                backbone_steps=4000, lr=6e-4, distill_prompts=4096, distill_tokens=128,
                heads_steps=1500, heads_batch_size=128, eval_prompts=32),
    **GPT2_PRESETS,  # --init gpt2...: heads on a frozen GPT-2
}
