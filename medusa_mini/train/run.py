"""The stages of `train_tiny.py`: corpus and tokenizer, backbone, self-distillation, heads, summary.

Every stage is resumable: the state goes to `train_state.pt` periodically and on Ctrl-C (honoured
between optimizer steps; a second one stops at once). Under torchrun (DDP) every rank trains on its
own batches, gradients are averaged, only rank 0 prints and writes the shared files.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..heads import HeadsConfig
from ..hydra import make_heads
from ..io.checkpoint import save_checkpoint
from ..io.tokenizer import load_tokenizer, make_encoding, save_tokenizer, train_bpe
from ..model import GPT, GPTConfig
from ..training import MedusaLM, cosine_lr, lambda_schedule, sample_continuations
from .backbone import fetch_backbone, init_backbone, save_tokenizer_for
from .config import TrainArgs, TrainError
from .data import encode_documents, get_batch, load_corpus, split_documents
from .device import StageClock, autocast, check_dtype, enable_tf32, grad_scaler, to_device
from .report import held_out_prompts, periodic_validation, progress_line, summarize
from .state import STATE_FILE, DeferredInterrupt, Run, report_replicas


def _data_and_tokenizer(r: Run, *, resume: bool):
    """Corpus -> train/val documents; the tokenizer trained on train text (or reused); token arrays."""
    a = r.args
    try:
        train_docs, val_docs = split_documents(load_corpus(a.data, max_bytes=a.max_bytes), val_fraction=0.05, seed=a.seed)
    except ValueError as e:
        raise TrainError(str(e)) from None
    model = None
    if a.init:  # GPT-2 weights and their tokenizer
        try:
            r.main_first(lambda: fetch_backbone(a.init))  # under torchrun: one download, then every rank reads it
            model, enc = init_backbone(a.init, device=r.device)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if r.main:
            save_tokenizer_for(enc, a.out)
    elif resume:
        enc = load_tokenizer(a.out)
    elif a.tokenizer:  # another checkpoint's tokenizer: a draft model must speak the same tokens
        try:
            enc = load_tokenizer(a.tokenizer)
        except ValueError as e:
            raise TrainError(f"--tokenizer: {e}") from None
        if r.main:
            save_tokenizer(enc, a.out)
        r.log(f"tokenizer  {enc.n_vocab} tokens, from {a.tokenizer}")
    else:
        t0 = time.time()
        enc = make_encoding(train_bpe("".join(text for _, text in train_docs), vocab_size=a.vocab_size))
        if r.main:
            save_tokenizer(enc, a.out)
        r.log(f"tokenizer  {enc.n_vocab} tokens, trained in {time.time() - t0:.1f}s")
    train_tokens = encode_documents(enc, train_docs, eot_id=enc.eot_token)
    val_tokens = encode_documents(enc, val_docs, eot_id=enc.eot_token)
    return enc, model, val_docs, train_tokens, val_tokens


def _train(r: Run, module: MedusaLM, optimizer, *, stage: str, steps: int, start: int, gen, batch_fn,
           lrs: list[float], loss_kwargs, distill=None, state=None, evaluate=None) -> None:
    """The optimizer loop of both training stages: cosine lr, clipping, progress, saves, Ctrl-C; `state`:
    the saved one to resume from (optimizer, generator, loss scaler).

    It never waits for the device: metrics stay tensors until a progress line reads them, the ranks
    agree on stopping and printing through host memory, batches arrive through pinned memory.
    """
    # No find_unused_parameters: every trainable parameter gets a gradient each step (a frozen backbone
    # has requires_grad off; with λ0 = 0 the joint stage leaves the heads out).
    ddp = DDP(module) if r.world > 1 else module
    trained = [p for p in module.parameters() if p.requires_grad]
    scaler = grad_scaler(r.device, r.args.dtype)
    if state and state["optim"] is not None:
        optimizer.load_state_dict(state["optim"])
        gen.set_state(state["gen"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
    save_every = r.args.save_every or max(50, steps // 5)
    t_start, t_log, tokens_seen = time.time(), 0.0, 0
    for step in range(start, steps):
        if r.should_stop(stage, step):
            r.save(stage=stage, step=step, optimizer=optimizer, gen=gen, distill=distill, scaler=scaler)
            raise KeyboardInterrupt
        for group, base in zip(optimizer.param_groups, lrs):
            group["lr"] = cosine_lr(step, steps, lr=base)
        x, y, valid = batch_fn(gen)
        with autocast(r.device, r.args.dtype):
            loss, metrics = ddp(x, y, valid=valid, heads_chunk=r.args.heads_chunk or None, **loss_kwargs(step))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        scaler.step(optimizer)
        scaler.update()
        tokens_seen += x.numel() * r.world
        # Every rank must take part in the metrics' all-reduce: print when any rank's clock says so.
        if r.any_rank(time.time() - t_log >= r.args.log_every) or step in (start, steps - 1):
            values = r.mean_metrics(metrics)  # the one place the loop reads the device: it waits for it
            now = time.time()  # after the wait, so tok/s and the ETA count the device's time, not the queuing
            t_log = now
            elapsed = max(now - t_start, 1e-9)
            eta = (steps - step - 1) * elapsed / (step + 1 - start)
            r.log(progress_line(stage, step, steps, values, tokens_per_s=tokens_seen / elapsed, eta=eta))
        if evaluate is not None and ((step + 1) % r.args.eval_every == 0 or step + 1 == steps):
            evaluate(step + 1)
        if (step + 1) % save_every == 0 and step + 1 < steps:
            r.save(stage=stage, step=step + 1, optimizer=optimizer, gen=gen, distill=distill, scaler=scaler)


def _optimizer(params_and_lrs: list[tuple[list[torch.nn.Parameter], float]], args: TrainArgs
               ) -> tuple[torch.optim.Optimizer, list[float]]:
    """AdamW decaying matrices only (GPT-2 practice: LayerNorm gains and biases must not shrink to 0);
    returns it and each param group's base lr."""
    groups, lrs = [], []
    for params, lr in params_and_lrs:
        for decay in (True, False):
            chosen = [p for p in params if (p.dim() >= 2) == decay]
            if chosen:
                groups.append({"params": chosen, "weight_decay": args.weight_decay if decay else 0.0})
                lrs.append(lr)
    fused = all(p.is_cuda for g in groups for p in g["params"])  # one kernel for all tensors, CUDA only
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=fused or None), lrs


def backbone_stage(r: Run, train_tokens: np.ndarray, val_tokens: np.ndarray, *, step: int,
                   state: dict | None) -> None:
    """Next-token training; with --medusa 2 the heads train jointly (paper §2.2.2): L_LM + λ Σ 0.8^k L_k."""
    a, model, heads = r.args, r.model, r.heads
    joint = a.medusa == 2 and a.lambda0 > 0  # with λ0 = 0 the heads would get no gradient: leave them out
    params_and_lrs = [(list(model.parameters()), a.lr)]
    if joint:  # heads learn faster than the backbone they sit on
        params_and_lrs.append((list(heads.parameters()), a.lr * a.heads_lr_mult))
    opt, lrs = _optimizer(params_and_lrs, a)
    gen = torch.Generator().manual_seed(a.seed * 1009 + r.rank)
    B, T = a.batch_size, model.config.block_size

    def batch(g):
        x, y = get_batch(train_tokens, batch_size=B, block_size=T, generator=g, device=r.device)
        return x, y, None

    evaluate = None
    if a.eval_every and r.main:
        evaluate = periodic_validation(r, val_tokens, batch_size=B, block_size=T)

    def loss_kwargs(s: int) -> dict:
        w = lambda_schedule(s, a.backbone_steps, lambda0=a.lambda0) if joint else 0.0
        return dict(lm_weight=1.0, heads_weight=w, decay=a.head_decay, heads_stride=a.heads_stride, heads_offset=s)

    _train(r, MedusaLM(model, heads if joint else None), opt, stage="backbone", steps=a.backbone_steps,
           start=step, gen=gen, batch_fn=batch, lrs=lrs, loss_kwargs=loss_kwargs, evaluate=evaluate, state=state)


@torch.no_grad()
def distill_stage(r: Run, train_tokens: np.ndarray) -> torch.Tensor:
    """Self-distillation (paper §2.3.2): the backbone continues corpus prompts -> [S, P + n] tokens, the
    temperatures cycled per chunk (greedy text teaches what greedy decoding meets, sampled text sampling)."""
    a = r.args
    t0 = time.time()
    g = torch.Generator().manual_seed(a.seed * 7919 + 17 + r.rank)
    sample_gen = torch.Generator(device=r.device).manual_seed(a.seed * 7919 + 29 + r.rank)
    temps, chunk, parts = a.temperatures(), 64, []
    for i in range(0, a.distill_prompts, chunk):
        n = min(chunk, a.distill_prompts - i)
        x, _ = get_batch(train_tokens, batch_size=n, block_size=a.distill_prompt_len, generator=g, device=r.device)
        temp = temps[(i // chunk) % len(temps)]
        parts.append(sample_continuations(r.model, x, max_new_tokens=a.distill_tokens, temperature=temp,
                                          generator=sample_gen))
    data = torch.cat(parts)  # [S, P + n]
    r.log(f"distill    {data.shape[0]} continuations x {data.shape[1] - a.distill_prompt_len} tokens "
          f"at T={a.distill_temperatures} in {time.time() - t0:.1f}s")
    return data


def heads_stage(r: Run, distill: torch.Tensor, *, step: int, state: dict | None) -> None:
    """Medusa-1 (paper §2.2.1): backbone frozen, heads trained on the backbone's own text."""
    a, heads = r.args, r.heads
    opt, lrs = _optimizer([(list(heads.parameters()), a.heads_lr)], a)
    gen = torch.Generator().manual_seed(a.seed * 1009 + r.rank + 1)
    P, HB = a.distill_prompt_len, a.heads_batch_size
    # target j is token j+1: train only on tokens the backbone wrote itself
    valid_row = (torch.arange(distill.shape[1] - 1, device=r.device) + 1) >= P

    def batch(g):
        seq = distill[to_device(torch.randint(distill.shape[0], (HB,), generator=g), r.device)]  # [HB, P + n]
        return seq[:, :-1], seq[:, 1:], valid_row.expand(HB, -1)

    _train(r, MedusaLM(r.model, heads), opt, stage="heads", steps=a.heads_steps, start=step, gen=gen,
           batch_fn=batch, lrs=lrs, distill=distill, state=state,
           loss_kwargs=lambda s: dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True))


def run(args: TrainArgs) -> None:
    """Run (or resume) every stage and write the checkpoint to args.out."""
    if args.threads:
        torch.set_num_threads(args.threads)
    check_dtype(args.dtype, args.device)
    enable_tf32(args.device)
    if not args.resume and os.path.exists(os.path.join(args.out, STATE_FILE)):
        raise TrainError(f"{args.out} holds an unfinished run: add --resume, or choose another --out")
    r = Run(args)
    clock = StageClock(r.device)
    state = r.load_state() if args.resume else None
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    enc, model, val_docs, train_tokens, val_tokens = _data_and_tokenizer(r, resume=state is not None)
    if model is None:
        model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=args.block_size, n_layer=args.n_layer,
                              n_head=args.n_head, n_embd=args.n_embd)).to(r.device)
    cfg = model.config
    heads = make_heads(HeadsConfig(num_heads=args.num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                                   own_lm_head=args.own_lm_head, kind=args.heads),
                       lm_head_weight=model.lm_head.weight).to(r.device)
    r.model, r.heads, r.eot_id = model, heads, enc.eot_token
    r.extra = {"eot_id": r.eot_id, "preset": args.preset, "medusa": args.medusa, "init": args.init,
               "heads": args.heads}
    if min(len(train_tokens), len(val_tokens)) <= cfg.block_size:
        raise TrainError(f"the data is too small for --block-size {cfg.block_size}: give more text")
    r.log(f"data       {len(train_tokens):,} train / {len(val_tokens):,} val tokens  "
          f"model {model.num_params() / 1e6:.2f}M params  device {r.device}  ranks {r.world}")
    stage, step = (state["stage"], state["step"]) if state else ("backbone", 0)
    if state:
        if state["model"] is not None:
            model.load_state_dict(state["model"])
        heads.load_state_dict(state["heads"])
        r.log(f"resuming   at {stage} step {step}")
    with DeferredInterrupt(r):
        if stage == "backbone":
            if args.backbone_steps > 0:
                with clock.stage("backbone"):
                    backbone_stage(r, train_tokens, val_tokens, step=step, state=state)
            stage, step, state = "distill", 0, None
            r.save(stage=stage, step=0)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None  # stale backbone gradients must not enter the heads' gradient clipping
        if stage == "distill":
            with clock.stage("distill"):
                distill = distill_stage(r, train_tokens)
            stage, step = "heads", 0
            r.save(stage=stage, step=0, distill=distill)
        else:
            distill = state["distill"].to(r.device)
        if args.heads_steps > 0:
            with clock.stage("heads"):
                heads_stage(r, distill, step=step, state=state)
    heads.eval()
    if r.world > 1:
        report_replicas(r)
    if r.main:
        with clock.stage("summary"):
            r.extra.update(summarize(r, model, heads, enc, val_docs, val_tokens))
        r.log(clock.line())
        held_out_prompts(args.out, val_docs, enc, count=args.eval_prompts, seed=args.seed, block_size=cfg.block_size)
        save_checkpoint(args.out, model, heads=heads, extra=r.extra, eos_token_id=r.eot_id,
                        write_model=not (args.init and r.model_written))
        r.log(f"saved      {args.out}  (python decode.py --ckpt {args.out} --compare)")
    if r.world > 1:
        dist.barrier()
    for path in [r._rank_path()] + ([r.state_path] if r.main else []):  # a finished run needs no resume state
        if os.path.exists(path):  # each rank removes only its own files
            os.remove(path)
    if r.world > 1:
        dist.destroy_process_group()
