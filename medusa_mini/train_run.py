"""The stages of `train_tiny.py`: corpus and tokenizer, backbone, self-distillation, heads, summary.

Every stage is resumable: the run's state (weights, optimizer, random generator, stage and step, the
self-distilled data) goes to `train_state.pt` atomically, periodically and on Ctrl-C, and `--resume`
continues exactly where it stopped. The same code runs under torchrun (DDP): every rank trains on
its own batches, gradients are averaged, only rank 0 prints and writes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .checkpoint import save_checkpoint
from .data import encode_documents, get_batch, load_corpus, split_documents
from .gpt2_heads import GPT2_PRESETS, init_backbone, save_tokenizer_for
from .heads import HeadsConfig, MedusaHeads
from .model import GPT, GPTConfig
from .tokenizer import load_tokenizer, make_encoding, save_tokenizer, train_bpe
from .train_report import held_out_prompts, summarize
from .training import MedusaLM, cosine_lr, lambda_schedule, sample_continuations

STATE_FILE = "train_state.pt"


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
    own_lm_head: bool = False
    medusa: int = 2
    batch_size: int = 16
    backbone_steps: int = 2000
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
    heads_steps: int = 600
    heads_batch_size: int = 32
    heads_lr: float = 1e-3
    eval_prompts: int = 16

    _RUN_FIELDS = ("preset", "data", "out", "init", "tokenizer", "resume", "seed", "device", "threads",
                   "save_every", "log_every", "interrupt_at")

    def __post_init__(self) -> None:
        for name, value in self.overridable().items():
            v = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "num_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
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

    @classmethod
    def overridable(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in cls._RUN_FIELDS}

    def temperatures(self) -> list[float]:
        return [float(t) for t in self.distill_temperatures.split(",") if t.strip()]

    def identity(self) -> dict:
        """What must match for --resume: the hyper-parameters, the data and the seed."""
        d = {k: getattr(self, k) for k in self.overridable()}
        d.update(data=self.data, init=self.init, tokenizer=self.tokenizer, seed=self.seed)
        return d


FLAG_HELP = {
    "max_bytes": "cap on the default corpus", "vocab_size": "BPE vocabulary incl. end-of-text",
    "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "width",
    "block_size": "context length", "num_heads": "Medusa heads K", "own_lm_head": "each head its own lm_head",
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
}

PRESETS: dict[str, dict] = {
    # about a minute on two CPU cores: proves the pipeline end to end, not a useful model
    "smoke": dict(max_bytes=300_000, vocab_size=512, n_layer=2, n_head=2, n_embd=64, block_size=128,
                  batch_size=8, backbone_steps=120, distill_prompts=64, distill_prompt_len=16,
                  distill_tokens=48, heads_steps=80, heads_batch_size=16, eval_prompts=4),
    # two CPU cores, about a quarter of an hour
    "cpu": dict(),
    # one GPU, a few minutes
    "gpu": dict(vocab_size=4096, n_layer=8, n_head=8, n_embd=512, block_size=256, batch_size=64,
                backbone_steps=4000, lr=6e-4, distill_prompts=4096, distill_tokens=128,
                heads_steps=1500, heads_batch_size=128, eval_prompts=32),
    **GPT2_PRESETS,  # --init gpt2...: heads on a frozen GPT-2
}


# ---- plumbing ---------------------------------------------------------------------------------


def _setup_distributed(device: str) -> tuple[int, int, str]:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
    return rank, world, device


def _save_atomic(obj: dict, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Run:
    """Holds the pieces every stage needs, and saves them."""

    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        self.rank, self.world, self.device = _setup_distributed(args.device)
        self.main = self.rank == 0
        self.state_path = os.path.join(args.out, STATE_FILE)

    def log(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    def save(self, *, stage: str, step: int, optimizer=None, gen=None, distill=None) -> None:
        if not self.main:
            return
        state = {
            "identity": self.args.identity(), "stage": stage, "step": step,
            "model": self.model.state_dict(), "heads": self.heads.state_dict(),
            "optim": optimizer.state_dict() if optimizer is not None else None,
            "gen": gen.get_state() if gen is not None else None,
            "distill": distill.cpu() if distill is not None else None,
        }
        _save_atomic(state, self.state_path)
        save_checkpoint(self.args.out, self.model, heads=self.heads, extra=self.extra, eos_token_id=self.eot_id)

    def load_state(self) -> dict:
        if not os.path.isfile(self.state_path):
            raise TrainError(f"--resume: no {STATE_FILE} in {self.args.out}; start without --resume")
        try:
            state = torch.load(self.state_path, map_location="cpu", weights_only=True)
        except Exception as e:  # a torn or foreign file
            raise TrainError(f"--resume: cannot read {self.state_path}: {e}") from None
        if state.get("identity") != self.args.identity():
            mine, theirs = self.args.identity(), state.get("identity") or {}
            diff = sorted(k for k in mine if mine.get(k) != theirs.get(k))
            raise TrainError(f"--resume with a different configuration ({', '.join(diff)}); use the original flags")
        return state

    def check_interrupt(self, stage: str, step: int) -> None:
        if self.args.interrupt_at == f"{stage}:{step}":
            raise KeyboardInterrupt


def _corpus(run: Run):
    a = run.args
    try:
        docs = load_corpus(a.data, max_bytes=a.max_bytes)
        train_docs, val_docs = split_documents(docs, val_fraction=0.05, seed=a.seed)
    except ValueError as e:
        raise TrainError(str(e)) from None
    return train_docs, val_docs


def _tokenizer(run: Run, train_docs, *, resume: bool):
    a = run.args
    if resume:
        return load_tokenizer(a.out)
    if a.tokenizer:  # share another checkpoint's tokenizer (a draft model must speak the same tokens)
        try:
            enc = load_tokenizer(a.tokenizer)
        except ValueError as e:
            raise TrainError(f"--tokenizer: {e}") from None
        if run.main:
            save_tokenizer(enc, a.out)
        run.log(f"tokenizer  {enc.n_vocab} tokens, from {a.tokenizer}")
        return enc
    t0 = time.time()
    ranks = train_bpe("".join(text for _, text in train_docs), vocab_size=a.vocab_size)
    enc = make_encoding(ranks)
    if run.main:
        save_tokenizer(enc, a.out)
    run.log(f"tokenizer  {enc.n_vocab} tokens, trained in {time.time() - t0:.1f}s")
    return enc


# ---- the training loop shared by both stages --------------------------------------------------


def _train(run: Run, module: MedusaLM, optimizer, *, stage: str, steps: int, start: int, gen, batch_fn,
           lrs: list[float], loss_kwargs, distill=None) -> None:
    ddp = DDP(module) if run.world > 1 else module
    trained = [p for p in module.parameters() if p.requires_grad]
    save_every = run.args.save_every or max(50, steps // 5)
    t_start, t_log, tokens_seen = time.time(), time.time(), 0
    step = start
    try:
        for step in range(start, steps):
            run.check_interrupt(stage, step)
            for group, base in zip(optimizer.param_groups, lrs):
                group["lr"] = cosine_lr(step, steps, lr=base)
            x, y, valid = batch_fn(gen)
            loss, metrics = ddp(x, y, valid=valid, **loss_kwargs(step))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            tokens_seen += x.numel() * run.world
            now = time.time()
            if now - t_log >= run.args.log_every or step == steps - 1 or step == start:
                t_log = now
                rate = tokens_seen / max(now - t_start, 1e-9)
                eta = (steps - step - 1) * (now - t_start) / (step + 1 - start)
                parts = [f"{stage:9s} step {step + 1:5d}/{steps}"]
                if "lm" in metrics:
                    parts.append(f"lm {metrics['lm']:.3f}")
                if "heads" in metrics:
                    parts.append("heads " + " ".join(f"{v:.2f}" for v in metrics["heads"]))
                    parts.append("top1 " + " ".join(f"{v:.2f}" for v in metrics["acc"]))
                parts.append(f"{rate:,.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s")
                run.log("  ".join(parts))
            if (step + 1) % save_every == 0 and step + 1 < steps:
                run.save(stage=stage, step=step + 1, optimizer=optimizer, gen=gen, distill=distill)
    except KeyboardInterrupt:
        run.save(stage=stage, step=step, optimizer=optimizer, gen=gen, distill=distill)
        raise


def _optimizer(params_groups, args: TrainArgs):
    return torch.optim.AdamW(params_groups, betas=(0.9, 0.95), weight_decay=args.weight_decay)


def _stage_order(stage: str) -> int:
    return ["backbone", "distill", "heads", "done"].index(stage)


def run(args: TrainArgs) -> None:
    """Run (or resume) every stage and write the checkpoint to args.out."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.resume and os.path.exists(os.path.join(args.out, STATE_FILE)):
        raise TrainError(f"{args.out} holds an unfinished run: add --resume, or choose another --out")
    os.makedirs(args.out, exist_ok=True)
    r = Run(args)
    state = r.load_state() if args.resume else None
    torch.manual_seed(args.seed)
    train_docs, val_docs = _corpus(r)
    if args.init:  # GPT-2 weights: heads only, on self-distilled text
        try:
            model, enc = init_backbone(args.init, device=r.device)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if r.main:
            save_tokenizer_for(enc, args.out)
        args.backbone_steps = 0
    else:
        enc = _tokenizer(r, train_docs, resume=state is not None)
        cfg = GPTConfig(vocab_size=enc.n_vocab, block_size=args.block_size, n_layer=args.n_layer,
                        n_head=args.n_head, n_embd=args.n_embd)
        model = GPT(cfg).to(r.device)
    r.eot_id = enc.eot_token
    r.model = model
    cfg = model.config
    heads = MedusaHeads(HeadsConfig(num_heads=args.num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                                    own_lm_head=args.own_lm_head), lm_head_weight=model.lm_head.weight).to(r.device)
    r.heads = heads
    r.extra = {"eot_id": r.eot_id, "preset": args.preset, "medusa": args.medusa, "init": args.init}
    train_tokens = encode_documents(enc, train_docs, eot_id=enc.eot_token)
    val_tokens = encode_documents(enc, val_docs, eot_id=enc.eot_token)
    if len(train_tokens) <= cfg.block_size or len(val_tokens) <= cfg.block_size:
        raise TrainError(f"the data is too small for --block-size {cfg.block_size}: give more text")
    r.log(f"data       {len(train_tokens):,} train / {len(val_tokens):,} val tokens  "
          f"model {model.num_params() / 1e6:.2f}M params  device {r.device}  ranks {r.world}")
    stage, step = (state["stage"], state["step"]) if state else ("backbone", 0)
    if state:
        model.load_state_dict(state["model"])
        heads.load_state_dict(state["heads"])
        r.log(f"resuming   at {stage} step {step}")
    gen = torch.Generator().manual_seed(args.seed * 1009 + r.rank)

    # ---- backbone (with heads jointly for Medusa-2) ----
    if _stage_order(stage) == 0 and args.backbone_steps > 0:
        joint = args.medusa == 2
        module = MedusaLM(model, heads if joint else None)
        groups = [{"params": list(model.parameters())}]
        lrs = [args.lr]
        if joint:
            groups.append({"params": list(heads.parameters())})
            lrs.append(args.lr * args.heads_lr_mult)
        opt = _optimizer(groups, args)
        if state and state["optim"] is not None:
            opt.load_state_dict(state["optim"])
            gen.set_state(state["gen"])
        B, T = args.batch_size, cfg.block_size

        def batch(g):
            x, y = get_batch(train_tokens, batch_size=B, block_size=T, generator=g, device=r.device)
            return x, y, None

        def loss_kwargs(s):
            w = lambda_schedule(s, args.backbone_steps, lambda0=args.lambda0) if joint else 0.0
            return dict(lm_weight=1.0, heads_weight=w, decay=args.head_decay, heads_stride=args.heads_stride,
                        heads_offset=s)

        _train(r, module, opt, stage="backbone", steps=args.backbone_steps, start=step, gen=gen,
               batch_fn=batch, lrs=lrs, loss_kwargs=loss_kwargs)
        stage, step, state = "distill", 0, None
        r.save(stage=stage, step=0)
    elif _stage_order(stage) == 0:
        stage, step = "distill", 0

    # ---- self-distillation: the backbone writes the heads' training text ----
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None  # stale backbone gradients must not enter the heads' gradient clipping
    if stage == "distill":
        distill = _self_distill(r, model, train_tokens)
        r.save(stage="heads", step=0, distill=distill)
        stage, step = "heads", 0
    else:
        distill = state["distill"].to(r.device) if state and state["distill"] is not None else None

    # ---- heads on the backbone's own text (backbone frozen: Medusa-1) ----
    if stage == "heads" and args.heads_steps > 0:
        opt = _optimizer([{"params": list(heads.parameters())}], args)
        gen.manual_seed(args.seed * 1009 + r.rank + 1)  # the stage starts from its own seed
        if state and state["optim"] is not None and step > 0:
            opt.load_state_dict(state["optim"])
            gen.set_state(state["gen"])
        P, HB = args.distill_prompt_len, args.heads_batch_size
        # target j is token j+1: train only on tokens the backbone wrote itself
        valid_row = (torch.arange(distill.shape[1] - 1, device=r.device) + 1) >= P

        def batch(g):
            rows = torch.randint(distill.shape[0], (HB,), generator=g).to(r.device)
            seq = distill[rows]
            return seq[:, :-1], seq[:, 1:], valid_row.expand(HB, -1)

        _train(r, MedusaLM(model, heads), opt, stage="heads", steps=args.heads_steps, start=step, gen=gen,
               batch_fn=batch, lrs=[args.heads_lr], distill=distill,
               loss_kwargs=lambda s: dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True))
    heads.eval()
    if r.world > 1:
        _report_replicas(r)
    if r.main:
        r.extra.update(summarize(r, model, heads, enc, val_docs, val_tokens))
        held_out_prompts(args.out, val_docs, enc, count=args.eval_prompts, seed=args.seed, block_size=cfg.block_size)
        save_checkpoint(args.out, model, heads=heads, extra=r.extra, eos_token_id=r.eot_id)
        os.remove(r.state_path) if os.path.exists(r.state_path) else None
        r.log(f"saved      {args.out}  (python decode.py --ckpt {args.out} --compare)")
    if r.world > 1:
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def _self_distill(r: Run, model: GPT, train_tokens: np.ndarray) -> torch.Tensor:
    """Continue random corpus prompts with the backbone, alternating the configured temperatures."""
    a = r.args
    t0 = time.time()
    g = torch.Generator().manual_seed(a.seed * 7919 + 17 + r.rank)
    sample_gen = torch.Generator(device=r.device).manual_seed(a.seed * 7919 + 29 + r.rank)
    temps = a.temperatures()
    chunk = 64
    parts = []
    for i in range(0, a.distill_prompts, chunk):
        n = min(chunk, a.distill_prompts - i)
        x, _ = get_batch(train_tokens, batch_size=n, block_size=a.distill_prompt_len, generator=g, device=r.device)
        temp = temps[(i // chunk) % len(temps)]
        parts.append(sample_continuations(model, x, max_new_tokens=a.distill_tokens, temperature=temp,
                                          generator=sample_gen))
    data = torch.cat(parts)  # [S, P + n]
    r.log(f"distill    {data.shape[0]} continuations x {data.shape[1] - a.distill_prompt_len} tokens "
          f"at T={a.distill_temperatures} in {time.time() - t0:.1f}s")
    return data


def _report_replicas(r: Run) -> None:
    """Every rank prints a checksum of its weights: equal lines mean the replicas stayed identical."""
    import hashlib

    h = hashlib.sha256()
    for t in list(r.model.state_dict().values()) + list(r.heads.state_dict().values()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    print(f"rank {r.rank}/{r.world} weights sha256 {h.hexdigest()[:16]}", flush=True)
