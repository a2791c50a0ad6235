"""The stages of `train_tiny.py`: tokenizer, backbone, self-distillation, heads, draft vocabulary, summary,
each resumable. Under torchrun (DDP) every rank trains on its own batches, gradients are averaged, rank 0
prints and writes. `--init` brings a pretrained, frozen tokenizer and backbone (gpt2, ..., or a checkpoint)."""

from __future__ import annotations

import os
import time

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..heads import HeadsConfig, frequency_order, make_heads
from ..io.gpt2 import GPT2_CONFIGS, download_gpt2, load_gpt2
from ..io.tokenizer import load_tokenizer, make_encoding, save_tokenizer, save_tokenizer_reference, train_bpe
from ..model import GPT, GPTConfig
from ..training import MedusaLM, cosine_lr, lambda_schedule, self_distill
from .config import TrainArgs, TrainError
from .data import corpus_digest, encode_documents, get_batch, load_corpus, split_documents
from .device import DTYPES, StageClock, to_device
from .report import held_out_prompts, progress_line, summarize, validation_batches, validation_loss
from .state import STATE_FILE, Run


def tokenizer_folder(init: str) -> str | None:
    """Where --init's own tokenizer is: the checkpoint folder, or a weights file's folder, if it holds
    one; None for a name (gpt2, ...), whose tokenizer is tiktoken's, whatever the working folder holds."""
    path = os.path.expanduser(init)
    if not os.path.exists(path):
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return folder if os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else None


def _pretrained(r: Run) -> tuple[GPT, tiktoken.Encoding]:
    """--init: GPT-2 weights, frozen, and their tokenizer (the directory's own, else tiktoken's "gpt2").
    Under torchrun rank 0 downloads alone: ranks writing one `.part` file at once would corrupt it."""
    init = r.args.init
    try:
        if r.main and not os.path.exists(os.path.expanduser(init)) and init in GPT2_CONFIGS:
            download_gpt2(init)
            tiktoken.get_encoding("gpt2")  # fetches its files once, like the weights
        if r.world > 1:
            dist.barrier(group=r.host_group)
        model = load_gpt2(init, device=r.device)
        folder = tokenizer_folder(init)
        enc = load_tokenizer(folder) if folder else tiktoken.get_encoding("gpt2")
    except (ValueError, OSError) as e:
        raise TrainError(f"--init {init}: {e}") from None
    if enc.n_vocab > model.config.vocab_size:
        raise TrainError(f"--init {init}: tokenizer has {enc.n_vocab} tokens, the model {model.config.vocab_size}")
    return model.requires_grad_(False), enc


def _prepare(r: Run, state: dict | None, train_docs: list, val_docs: list) -> tuple:
    """Tokenizer, backbone (pretrained with --init) and heads, restored on --resume; the token arrays."""
    a = r.args
    torch.manual_seed(a.seed)  # the backbone's and the heads' first weights
    if a.init:
        model, enc = _pretrained(r)
    else:
        if state:
            enc = load_tokenizer(a.out)
        else:  # BPE on the training text
            t0 = time.time()
            enc = make_encoding(train_bpe("".join(text for _, text in train_docs), vocab_size=a.vocab_size))
            r.log(f"tokenizer  {enc.n_vocab} tokens, trained in {time.time() - t0:.1f}s")
        model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=a.block_size, n_layer=a.n_layer,
                              n_head=a.n_head, n_embd=a.n_embd)).to(r.device)
    cfg = model.config
    train_tokens, val_tokens = (encode_documents(enc, docs) for docs in (train_docs, val_docs))
    if min(len(train_tokens), len(val_tokens)) <= cfg.block_size:
        raise TrainError(f"the data is too small for --block-size {cfg.block_size}: give more text")
    r.heads = make_heads(HeadsConfig(num_heads=a.num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                                     kind=a.heads)).to(r.device)
    if state:
        r.heads.load_state_dict(state["heads"])
        if not a.init:
            model.load_state_dict(state["model"])
    if r.main and enc.name == "gpt2":  # saved as a reference: tiktoken fetches it
        save_tokenizer_reference(a.out, "gpt2")
    elif r.main:
        save_tokenizer(enc, a.out)
    r.model, r.eot_id = model, enc.eot_token
    r.extra = {"eot_id": enc.eot_token, "preset": a.preset, "medusa": a.medusa, "init": a.init, "heads": a.heads}
    r.log(f"data       {len(train_tokens):,} train / {len(val_tokens):,} val tokens  "
          f"model {model.num_params() / 1e6:.2f}M params  device {r.device}  ranks {r.world}")
    return enc, train_tokens, val_tokens


def _optimizer(params_and_lrs: list[tuple[list[torch.nn.Parameter], float]], args: TrainArgs) -> torch.optim.Optimizer:
    """AdamW decaying matrices only (LayerNorm gains and biases must not shrink to 0), "base_lr" per group."""
    groups = []
    for params, lr in params_and_lrs:
        for decay in (True, False):
            if chosen := [p for p in params if (p.dim() >= 2) == decay]:
                groups.append({"params": chosen, "weight_decay": args.weight_decay if decay else 0.0, "base_lr": lr})
    fused = all(p.is_cuda for g in groups for p in g["params"])  # one kernel for all tensors, CUDA only
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=fused or None)


def _train(r: Run, module: MedusaLM, optimizer, *, stage: str, steps: int, start: int, gen, batch_fn, loss_kwargs,
           state=None, evaluate=None) -> None:
    """The optimizer loop of both training stages, from `state` (saved) on: cosine lr, clipping, progress,
    saves, Ctrl-C. It waits for the device only to print; the ranks agree through host memory."""
    # No find_unused_parameters: every trainable parameter gets a gradient each step (a frozen backbone
    # has requires_grad off; with λ0 = 0 the joint stage leaves the heads out).
    ddp = DDP(module) if r.world > 1 else module
    trained = [p for p in module.parameters() if p.requires_grad]
    a, device_type = r.args, torch.device(r.device).type
    scaler = torch.amp.GradScaler(device_type, enabled=a.dtype == "float16")  # float16's loss scaling
    if state and state["optim"] is not None:
        optimizer.load_state_dict(state["optim"])
        gen.set_state(state["gen"])
        scaler.load_state_dict(state["scaler"])  # a disabled scaler ignores it
    saved = dict(optimizer=optimizer, gen=gen, scaler=scaler)
    t_start, t_log, tokens_seen = time.time(), 0.0, 0
    for step in range(start, steps):
        if r.any_rank(r.stop_requested):  # Ctrl-C on any rank: all stop at this step
            r.save(stage=stage, step=step, **saved)
            raise KeyboardInterrupt
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr=group["base_lr"])
        x, y, valid = batch_fn(gen)
        with torch.autocast(device_type, dtype=DTYPES[a.dtype], enabled=a.dtype != "float32"):
            loss, metrics = ddp(x, y, valid=valid, **loss_kwargs(step))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        scaler.step(optimizer)
        scaler.update()
        tokens_seen += x.numel() * r.world
        # Every rank must take part in the metrics' all-reduce: print when any rank's clock says so.
        if r.any_rank(time.time() - t_log >= a.log_every) or step in (start, steps - 1):
            values = r.mean_metrics(metrics)  # the one place the loop reads the device: it waits for it
            t_log = time.time()  # after the wait, so tok/s and the ETA count the device's time
            elapsed = max(t_log - t_start, 1e-9)
            eta = (steps - step - 1) * elapsed / (step + 1 - start)
            r.log(progress_line(stage, step, steps, values, tokens_per_s=tokens_seen / elapsed, eta=eta))
        if evaluate is not None and ((step + 1) % a.eval_every == 0 or step + 1 == steps):
            evaluate(step + 1)
        if (step + 1) % (a.save_every or max(50, steps // 5)) == 0 and step + 1 < steps:
            r.save(stage=stage, step=step + 1, **saved)


def backbone_stage(r: Run, train_tokens: np.ndarray, val_batches: list, *, step: int, state: dict | None) -> None:
    """Next-token training; with --medusa 2 the heads train jointly (paper §2.2.2): L_LM + λ Σ 0.8^k L_k,
    heads at a higher learning rate, λ ramped up."""
    a, model, heads = r.args, r.model, r.heads
    joint = a.medusa == 2 and a.lambda0 > 0  # with λ0 = 0 the heads would get no gradient: leave them out
    opt = _optimizer([(list(model.parameters()), a.lr)]
                     + ([(list(heads.parameters()), a.lr * a.heads_lr_mult)] if joint else []), a)

    def batch(g):
        return *get_batch(train_tokens, batch_size=a.batch_size, block_size=model.config.block_size,
                          generator=g, device=r.device), None

    def loss_kwargs(s: int) -> dict:
        w = lambda_schedule(s, a.backbone_steps, lambda0=a.lambda0) if joint else 0.0
        return dict(lm_weight=1.0, heads_weight=w, decay=a.head_decay, heads_stride=a.heads_stride, heads_offset=s)

    def evaluate(s: int) -> None:
        r.log(f"{'eval':9s} step {s:5d}/{a.backbone_steps}  validation loss {validation_loss(model, val_batches):.3f}")

    _train(r, MedusaLM(model, heads if joint else None), opt, stage="backbone", steps=a.backbone_steps, start=step,
           gen=torch.Generator().manual_seed(a.seed * 1009 + r.rank), batch_fn=batch, loss_kwargs=loss_kwargs,
           state=state, evaluate=evaluate if a.eval_every and r.main else None)


@torch.no_grad()
def distill_stage(r: Run, train_tokens: np.ndarray) -> torch.Tensor:
    """Self-distillation (paper §2.3.2): the backbone continues corpus prompts -> [S, P + n] tokens, the
    temperatures cycled per chunk: greedy text teaches what greedy decoding meets, sampled text sampling."""
    a, t0 = r.args, time.time()
    g = torch.Generator().manual_seed(a.seed * 7919 + 17 + r.rank)
    sample_gen = torch.Generator(device=r.device).manual_seed(a.seed * 7919 + 29 + r.rank)
    temps, chunk, parts = [float(t) for t in a.distill_temperatures.split(",")], 64, []
    for i in range(0, a.distill_prompts, chunk):
        x, _ = get_batch(train_tokens, batch_size=min(chunk, a.distill_prompts - i), block_size=a.distill_prompt_len,
                         generator=g, device=r.device)
        parts.append(self_distill(r.model, x, max_new_tokens=a.distill_tokens,
                                  temperature=temps[i // chunk % len(temps)], generator=sample_gen))
    data = torch.cat(parts)  # [S, P + n]
    r.log(f"distill    {data.shape[0]} continuations x {data.shape[1] - a.distill_prompt_len} tokens "
          f"at T={a.distill_temperatures} in {time.time() - t0:.1f}s")
    return data


def heads_stage(r: Run, *, step: int, state: dict | None) -> None:
    """Medusa-1 (paper §2.2.1): backbone frozen, heads trained on the backbone's own text (`r.distill`)."""
    a, distill = r.args, r.distill
    valid_row = torch.arange(1, distill.shape[1], device=r.device) >= a.distill_prompt_len  # tokens it wrote

    def batch(g):
        seq = distill[to_device(torch.randint(distill.shape[0], (a.heads_batch_size,), generator=g), r.device)]
        return seq[:, :-1], seq[:, 1:], valid_row.expand(a.heads_batch_size, -1)

    _train(r, MedusaLM(r.model, r.heads), _optimizer([(list(r.heads.parameters()), a.heads_lr)], a), stage="heads",
           steps=a.heads_steps, start=step, gen=torch.Generator().manual_seed(a.seed * 1009 + r.rank + 1),
           batch_fn=batch, state=state,
           loss_kwargs=lambda s: dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True))


def choose_draft_vocabulary(r: Run) -> None:
    """FR-Spec: the heads guess among the --draft-vocab tokens most frequent in what the backbone wrote
    during self-distillation (prompts excluded; every rank's text); at or above V, the whole vocabulary."""
    written = r.distill[:, r.args.distill_prompt_len:].contiguous()
    if r.world > 1:
        parts = [torch.empty_like(written) for _ in range(r.world)]
        dist.all_gather(parts, written)
        written = torch.cat(parts)
    V = r.heads.config.vocab_size
    r.heads.use_draft_vocabulary(frequency_order(written, V), min(r.args.draft_vocab, V))


def _train_stages(r: Run, state: dict | None, clock: StageClock, train_tokens: np.ndarray, val_batches: list):
    """Backbone (with the heads for --medusa 2), self-distillation, heads, from where `state` stopped."""
    stage, step = (state["stage"], state["step"]) if state else ("backbone", 0)
    if state:
        r.log(f"resuming   at {stage} step {step}")
    if stage == "backbone":
        if r.args.backbone_steps > 0:
            with clock.stage("backbone"):
                backbone_stage(r, train_tokens, val_batches, step=step, state=state)
        stage, step, state = "distill", 0, None
        r.save(stage=stage, step=0)
    r.model.eval().requires_grad_(False)
    r.model.zero_grad(set_to_none=True)  # the backbone's gradients are not needed again
    if stage == "distill":
        with clock.stage("distill"):
            r.distill = distill_stage(r, train_tokens)
        stage, step, state = "heads", 0, None
        r.save(stage=stage, step=0)
    else:
        r.distill = state["distill"].to(r.device)
    if r.args.heads_steps > 0:
        with clock.stage("heads"):
            heads_stage(r, step=step, state=state)


def run(args: TrainArgs) -> None:
    """Run (or resume) every stage and write the checkpoint to args.out."""
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32: several times faster, at an error training never sees
    if not args.resume and os.path.exists(os.path.join(args.out, STATE_FILE)):
        raise TrainError(f"{args.out} holds an unfinished run: add --resume, or choose another --out")
    r = Run(args)
    try:  # never the files of --out: a run writes there, and a resume would then read them
        docs = load_corpus(args.data, max_bytes=args.max_bytes, skip=args.out)
        train_docs, val_docs = split_documents(docs, seed=args.seed)
    except ValueError as e:
        raise TrainError(str(e)) from None
    r.data_digest = corpus_digest(docs)
    state = r.load_state() if args.resume else None
    os.makedirs(args.out, exist_ok=True)
    enc, train_tokens, val_tokens = _prepare(r, state, train_docs, val_docs)
    block_size = r.model.config.block_size
    val_batches = validation_batches(val_tokens, block_size=block_size, seed=args.seed, device=r.device)
    clock = StageClock(r.device)
    with r.ctrl_c_saves():
        _train_stages(r, state, clock, train_tokens, val_batches)
    choose_draft_vocabulary(r)  # before the summary: it measures the heads as they will decode
    r.heads.eval()
    if r.world > 1:
        r.print_checksum()
    if r.main:
        with clock.stage("summary"):
            r.extra.update(summarize(r, val_batches, val_tokens))
        r.log(clock.line())
        held_out_prompts(args.out, val_docs, enc, count=args.eval_prompts, seed=args.seed, block_size=block_size)
        r.write_checkpoint()
        r.log(f"saved      {args.out}  (python decode.py --ckpt {args.out} --compare)")
    r.finish()
