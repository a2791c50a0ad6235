"""What a `train_tiny.py` run is: its settings, its hyper-parameters (every one a flag) and the presets.

A run's identity (hyper-parameters, data, seed) is what `--resume` compares, so a resumed run never
silently continues with other settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..heads import HEAD_KINDS


class TrainError(Exception):
    """A problem the user can fix (bad data, a clashing --resume, ...): one line, exit code 2."""


def hp(default, help: str):
    """A hyper-parameter: a flag of its own (`help`), left out it keeps the preset's value."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainArgs:
    # the run's settings, each its own flag
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
    # hyper-parameters; the defaults are the cpu preset
    max_bytes: int = hp(3_000_000, "cap on the default corpus")
    vocab_size: int = hp(2048, "BPE vocabulary incl. end-of-text")
    n_layer: int = hp(4, "transformer blocks")
    n_head: int = hp(4, "attention heads")
    n_embd: int = hp(256, "width")
    block_size: int = hp(256, "context length")
    num_heads: int = hp(4, "Medusa heads K")
    heads: str = hp("medusa", "medusa: head k reads h_t only; hydra: h_t and the k tokens before its target")
    medusa: int = hp(2, "1: heads on the frozen backbone; 2: heads trained jointly with the backbone, then alone")
    batch_size: int = hp(16, "backbone batch")
    backbone_steps: int = hp(420, "backbone optimizer steps")
    lr: float = hp(1e-3, "backbone learning rate")
    weight_decay: float = hp(0.1, "AdamW weight decay")
    heads_lr_mult: float = hp(4.0, "heads' learning-rate multiple in joint training")
    lambda0: float = hp(0.2, "Medusa-2 heads-loss weight (ramped up)")
    heads_stride: int = hp(4, "joint training computes head losses at every n-th position only (speed)")
    head_decay: float = hp(0.8, "head k's loss weight decay^k (joint)")
    distill_prompts: int = hp(512, "self-distillation prompts")
    distill_prompt_len: int = hp(32, "tokens per prompt")
    distill_tokens: int = hp(96, "tokens the backbone writes per prompt")
    distill_temperatures: str = hp("0,0.8", "comma-separated sampling temperatures, cycled (0 = greedy)")
    heads_steps: int = hp(250, "heads-only optimizer steps on the self-distilled text")
    heads_batch_size: int = hp(32, "heads batch")
    heads_lr: float = hp(1e-3, "heads learning rate")
    draft_vocab: int = hp(0, "M: heads guess among the M tokens most frequent in the self-distilled text (0: all)")
    eval_prompts: int = hp(16, "held-out prompts saved for decode.py")
    eval_every: int = hp(0, "backbone steps between validation losses (0: only the summary's)")
    heads_chunk: int = hp(0, "positions per chunk of the heads' loss (0: as many as fit 2^26 logits)")

    # how a run is computed or reported, not what it trains: free to change on --resume
    _NOT_IDENTITY = ("eval_every", "heads_chunk")

    def __post_init__(self) -> None:
        for name in self.hyper_parameters():
            if isinstance(getattr(self, name), (int, float)) and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "num_heads", "threads", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.heads not in HEAD_KINDS:
            raise ValueError(f"--heads must be one of {', '.join(HEAD_KINDS)}, not {self.heads!r}")
        if self.vocab_size < 257:
            raise ValueError("--vocab-size must be at least 257 (256 bytes + the end-of-text token)")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd {self.n_embd} must be divisible by --n-head {self.n_head}")
        if self.distill_prompt_len >= self.block_size:
            raise ValueError("--distill-prompt-len must be shorter than --block-size")
        try:
            temps = self.temperatures()
        except ValueError:
            temps = []
        if not temps or min(temps) < 0:
            raise ValueError(f"--distill-temperatures must be numbers >= 0 like 0,0.8: {self.distill_temperatures!r}")
        if self.init:  # a pretrained backbone stays frozen: heads only (Medusa-1)
            self.backbone_steps, self.medusa = 0, 1

    @classmethod
    def hyper_parameters(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls) if "help" in f.metadata}

    def temperatures(self) -> list[float]:
        return [float(t) for t in self.distill_temperatures.split(",") if t.strip()]

    def identity(self) -> dict:
        """What must match for --resume: the hyper-parameters, the data and the seed."""
        d = {k: getattr(self, k) for k in self.hyper_parameters() if k not in self._NOT_IDENTITY}
        return {**d, "data": self.data, "init": self.init, "tokenizer": self.tokenizer, "seed": self.seed,
                "dtype": self.dtype}


PRESETS: dict[str, dict] = {
    # under a minute on two CPU cores: proves the pipeline end to end, not a useful model
    "smoke": dict(max_bytes=300_000, vocab_size=512, n_layer=2, n_head=2, n_embd=64, block_size=128,
                  batch_size=8, backbone_steps=120, distill_prompts=64, distill_prompt_len=16,
                  distill_tokens=48, heads_steps=80, heads_batch_size=16, eval_prompts=4),
    # two CPU cores, about a quarter of an hour
    "cpu": dict(),
    # one GPU, a few minutes; the whole standard library (~11 MB, ~3M tokens at this vocabulary) rather than
    # 3 MB, so 4000 steps x 16K tokens are ~20 passes over the text instead of ~85
    "gpu": dict(max_bytes=16_000_000, eval_every=250, vocab_size=4096, n_layer=8, n_head=8, n_embd=512,
                batch_size=64, backbone_steps=4000, lr=6e-4, distill_prompts=4096, distill_tokens=128,
                heads_steps=1500, heads_batch_size=128, eval_prompts=32),
    # --init gpt2...: heads only on a frozen GPT-2, sized for one GPU (gpt2 124M: well under an hour) or a CPU
    "gpt2": dict(medusa=1, backbone_steps=0, distill_prompts=4096, distill_tokens=128, heads_steps=2000,
                 eval_prompts=32),
    "gpt2-cpu": dict(medusa=1, backbone_steps=0, distill_prompts=32, distill_prompt_len=16, distill_tokens=32,
                     heads_steps=30, heads_batch_size=4, eval_prompts=4),
}
