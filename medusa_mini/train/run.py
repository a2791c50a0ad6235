"""A `train_tiny.py` run's stages (train_tiny.py lists them), each resumable: `state.Run` saves what an exact
--resume needs, also on Ctrl-C. Under torchrun (DDP) each rank trains on its own batches, rank 0 writes."""

import hashlib
import math
import os
import shlex
import signal
import time
from typing import Callable

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..heads import HeadsConfig, frequency_order, make_heads
from ..io.checkpoint import CHECKPOINT_FILES, CONFIG_FILE
from ..io.files import check_writable, json_writer
from ..io.gpt2 import GPT2_CONFIGS, download_gpt2, load_gpt2
from ..io.loading import PROMPTS_FILE
from ..io.tokenizer import RANKS_FILE, TOKENIZER_FILES, load_tokenizer, make_encoding, tokenizer_digest, train_bpe
from ..model import GPT, GPTConfig
from ..sampling import SAMPLING_TEMPERATURE
from ..training import MedusaLM, cosine_lr, lambda_schedule, lm_loss, self_distill
from ..tree import build_tree, expected_tokens_per_step, preset
from . import accuracy
from .config import TrainArgs, TrainError
from .data import corpus_digest, encode_documents, get_batch, held_out_prompts, load_corpus, split_documents
from .device import DTYPES, to_device
from .state import LOWER_LR, STATE_FILE, Run, seeded

OUTPUTS = (STATE_FILE, PROMPTS_FILE, accuracy.ACCURACY_FILE, *CHECKPOINT_FILES, *TOKENIZER_FILES)  # a run's, in --out
OFFICIAL_TOP1 = (0.56, 0.32, 0.20, 0.15)  # official Medusa-1 heads on Vicuna-7B, heads 1-4 (paper, repository)


def tokenizer_folder(init: str) -> str | None:
    """Where --init's own tokenizer is: the checkpoint folder, or a weights file's folder, if it holds one
    of ours (a Hugging Face folder's tokenizer_config.json is not); else None, and the tokenizer is tiktoken's gpt2."""
    folder = init if os.path.isdir(init) else os.path.dirname(os.path.abspath(init))
    return folder if os.path.exists(init) and os.path.isfile(os.path.join(folder, RANKS_FILE)) else None


def _prepare(r: Run, state: dict | None, train_docs: list, val_docs: list) -> tuple:
    """Tokenizer, backbone (pretrained with --init) and heads, restored on --resume; the token arrays."""
    a = r.args
    torch.manual_seed(a.seed)  # the backbone's and the heads' first weights
    if a.init:  # GPT-2 weights, frozen, and their tokenizer (the folder's own, else tiktoken's "gpt2")
        try:  # under torchrun rank 0 downloads alone: ranks writing one `.part` file at once would corrupt it
            if r.main and not os.path.exists(a.init) and a.init in GPT2_CONFIGS:
                download_gpt2(a.init)
                tiktoken.get_encoding("gpt2")  # fetches its files once, like the weights
            if r.world > 1:
                dist.barrier(group=r.host_group)
            model, folder = load_gpt2(a.init, device=r.device).requires_grad_(False), tokenizer_folder(a.init)
            enc = load_tokenizer(folder) if folder else tiktoken.get_encoding("gpt2")
        except (ValueError, OSError) as e:
            raise TrainError(f"--init {a.init}: {e}") from None
    else:  # a resumed run's tokenizer, or BPE on the training text
        t0 = time.time()
        try:
            enc = load_tokenizer(a.out) if state else make_encoding(
                train_bpe("".join(text for _, text in train_docs), vocab_size=a.vocab_size))
        except ValueError as e:  # the resumed run's tokenizer missing or torn (a trained one was checked before)
            raise TrainError(f"--resume: {str(e).split('; ')[0]}; restore it, or start anew with --overwrite") from None
        if state and state.get("tokenizer") not in (None, tokenizer_digest(enc)):  # None: saved before digests
            raise TrainError(f"--resume: the tokenizer in {a.out} is not the one this run began with; restore it, or "
                             "start anew with --overwrite")
        r.log(f"tokenizer  {enc.n_vocab} tokens, {'loaded' if state else 'trained'} in {time.time() - t0:.1f}s")
        model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=a.block_size, n_layer=a.n_layer,
                              n_head=a.n_head, n_embd=a.n_embd)).to(r.device)
    cfg = model.config
    if a.init and enc.n_vocab > cfg.vocab_size:
        raise TrainError(f"--init {a.init}: tokenizer has {enc.n_vocab} tokens, the model {cfg.vocab_size}")
    if a.init and (why := a.context_error(cfg.block_size)):  # TrainArgs checked a named GPT-2's, not a folder's
        raise TrainError(f"--init {a.init} holds {cfg.block_size} tokens of context: {why}")
    train_tokens, val_tokens = (encode_documents(enc, docs) for docs in (train_docs, val_docs))
    sizes = {"training": len(train_tokens), "held-out": len(val_tokens)}  # held out: `split_documents`'
    if sizes[part := min(sizes, key=sizes.get)] <= cfg.block_size:
        raise TrainError(f"the {part} text ({sizes[part]:,} tokens) is too small for --block-size {cfg.block_size}: "
                         "give more text (--data; --max-bytes for the built-in corpus) or a smaller --block-size")
    r.heads = make_heads(HeadsConfig(num_heads=a.num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                                     kind=a.heads)).to(r.device)
    try:
        if state:
            r.heads.load_state_dict(state["heads"])
        if state and not a.init:
            model.load_state_dict(state["model"])
    except RuntimeError:  # their shapes are another vocabulary's: the tokenizer beside them is another run's
        raise TrainError(f"--resume: the saved weights do not fit the tokenizer in {a.out}; restore the run's own, "
                         "or start anew with --overwrite") from None
    r.model, r.enc = model, enc
    r.extra = {"eot_id": enc.eot_token, "preset": a.preset, "medusa": a.medusa, "init": a.init, "heads": a.heads}
    r.log(f"data       {len(train_tokens):,} train / {len(val_tokens):,} val tokens  "
          f"model {model.num_params() / 1e6:.2f}M params  device {r.device}  ranks {r.world}")
    return enc, train_tokens, val_tokens


def progress_line(stage: str, step: int, steps: int, metrics: dict, *, tokens_per_s: float, eta: float) -> str:
    parts = [f"{stage:9s} step {step + 1:5d}/{steps}"] + ([f"lm {metrics['lm']:.3f}"] if "lm" in metrics else [])
    if "heads" in metrics:
        parts.append("heads " + " ".join(f"{v:.2f}" for v in metrics["heads"]))
        parts.append("top1 " + " ".join(f"{v:.2f}" for v in metrics["acc"]))
    return "  ".join(parts + [f"{tokens_per_s:,.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s"])


def _train(r: Run, module: MedusaLM, lrs: list[tuple[torch.nn.Module, float]], *, stage: str, steps: int, gen,
           batch_fn, loss_kwargs, state: dict | None, val_batches: list | None = None) -> None:
    """The optimizer loop of both training stages, from `state` on: AdamW at each module's lr (`lrs`), cosine schedule,
    clipping, progress, saves, Ctrl-C; the validation loss every --eval-every steps where val_batches are given."""
    # No find_unused_parameters: every trainable parameter gets a gradient each step (a frozen backbone
    # has requires_grad off; with λ0 = 0 the joint stage leaves the heads out).
    ddp = DDP(module) if r.world > 1 else module
    a, device_type, trained = r.args, torch.device(r.device).type, [p for p in module.parameters() if p.requires_grad]
    # Weight decay on matrices only: LayerNorm gains and biases must not shrink to 0.
    groups = [{"params": chosen, "weight_decay": a.weight_decay if decay else 0.0, "base_lr": lr} for part, lr in lrs
              for decay in (True, False) if (chosen := [p for p in part.parameters() if (p.dim() >= 2) == decay])]
    fused = all(p.is_cuda for g in groups for p in g["params"])  # one kernel for all tensors, CUDA only
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=fused or None)
    scaler = torch.amp.GradScaler(device_type, enabled=a.dtype == "float16")  # float16's loss scaling
    if state and state["step"] and state["optim"] is not None:  # at step 0 unused: made anew with --resume's flags
        optimizer.load_state_dict(state["optim"])
        gen.set_state(state["gen"])
        scaler.load_state_dict(state["scaler"])  # a disabled scaler ignores it
    saved, start = dict(optimizer=optimizer, gen=gen, scaler=scaler), state["step"] if state else 0
    t_start, t_log, strikes = time.time(), 0.0, 0
    for step in range(start, steps):
        if r.any_rank(r.stop_requested):  # Ctrl-C on any rank: all stop at this step
            r.save(stage=stage, step=step, **saved)
            raise KeyboardInterrupt
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr=group["base_lr"])
        x, y = batch_fn(gen)
        with torch.autocast(device_type, dtype=DTYPES[a.dtype], enabled=a.dtype != "float32"):
            loss, metrics = ddp(x, y, **loss_kwargs(step))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        scaler.step(optimizer)
        scaler.update()
        # Every rank must take part in the metrics' all-reduce: print when any rank's clock says so.
        if r.any_rank(time.time() - t_log >= a.log_every) or step in (start, steps - 1):
            values = r.mean_metrics(metrics)  # the one place the loop reads the device: it waits for it
            t_log = time.time()  # after the wait, so tok/s and the ETA count the device's time
            per_step = max(t_log - t_start, 1e-9) / (step + 1 - start)  # seconds, over this session's steps
            r.log(progress_line(stage, step, steps, values, tokens_per_s=x.numel() * r.world / per_step,
                                eta=(steps - step - 1) * per_step))
            # A loss not finite: the run diverged, unless float16's scaler skipped just this step (keeping the
            # weights), so under it a second such line in a row, or one at a stage's end, stops the run.
            strikes = 0 if math.isfinite(values.get("lm", 0.0) + sum(values.get("heads", []))) else strikes + 1
            if strikes > scaler.is_enabled() or (strikes and step == steps - 1):
                raise TrainError(f"{stage} step {step + 1}: the loss is not finite; {LOWER_LR}")
        if val_batches and a.eval_every and r.main and ((step + 1) % a.eval_every == 0 or step + 1 == steps):
            loss = validation_loss(r.model, val_batches)
            r.log(f"{'eval':9s} step {step + 1:5d}/{steps}  validation loss {loss:.3f}")  # aligned as progress_line
        if (step + 1) % (a.save_every or max(50, steps // 5)) == 0 and step + 1 < steps:
            r.save(stage=stage, step=step + 1, **saved)


@torch.no_grad()
def validation_loss(model: GPT, batches: list) -> float:
    """The backbone's mean next-token loss on `batches`, in float32 whatever --dtype, one read."""
    return (sum(lm_loss(model(x)[0], y) for x, y in batches) / len(batches)).item()


def backbone_stage(r: Run, train_tokens: np.ndarray, val_batches: list, *, state: dict | None) -> None:
    """Next-token training; with --medusa 2 the heads train jointly (paper §2.2.2): L_LM + λ Σ 0.8^k L_k,
    heads at a higher learning rate, λ ramped up."""
    a, model, heads = r.args, r.model, r.heads
    joint = a.medusa == 2 and a.lambda0 > 0  # with λ0 = 0 the heads would get no gradient: leave them out
    lrs = [(model, a.lr)] + ([(heads, a.lr * a.heads_lr_mult)] if joint else [])

    def loss_kwargs(s: int) -> dict:
        w = lambda_schedule(s, a.backbone_steps, lambda0=a.lambda0) if joint else 0.0
        return dict(lm_weight=1.0, heads_weight=w, decay=a.head_decay, heads_stride=a.heads_stride, heads_offset=s)
    _train(r, MedusaLM(model, heads if joint else None), lrs, stage="backbone", steps=a.backbone_steps, state=state,
           gen=seeded(a.seed * 1009 + r.rank), loss_kwargs=loss_kwargs, val_batches=val_batches,
           batch_fn=lambda g: get_batch(train_tokens, batch_size=a.batch_size, block_size=model.config.block_size,
                                        generator=g, device=r.device))


@torch.no_grad()
def distill_stage(r: Run, train_tokens: np.ndarray) -> torch.Tensor:
    """Self-distillation (paper §2.3.2): the backbone continues corpus prompts -> [S, P + n] tokens, the
    temperatures cycled per chunk: greedy text teaches what greedy decoding meets, sampled text sampling."""
    a, t0 = r.args, time.time()
    g, sample_gen = seeded(a.seed * 7919 + 17 + r.rank), seeded(a.seed * 7919 + 29 + r.rank, device=r.device)
    temps, chunk, parts = [float(t) for t in a.distill_temperatures.split(",")], 64, []
    for i in range(0, a.distill_prompts, chunk):
        if r.any_rank(r.stop_requested):  # Ctrl-C: the state saved before this stage redoes it on --resume
            raise KeyboardInterrupt
        x, _ = get_batch(train_tokens, batch_size=min(chunk, a.distill_prompts - i), block_size=a.distill_prompt_len,
                         generator=g, device=r.device)
        parts.append(self_distill(r.model, x, max_new_tokens=a.distill_tokens,
                                  temperature=temps[i // chunk % len(temps)], generator=sample_gen))
    data = torch.cat(parts)  # [S, P + n]
    r.log(f"distill    {data.shape[0]} continuations x {data.shape[1] - a.distill_prompt_len} tokens "
          f"at T={a.distill_temperatures} in {time.time() - t0:.1f}s")
    return data


def heads_stage(r: Run, *, state: dict | None) -> None:
    """Medusa-1 (paper §2.2.1): backbone frozen, heads trained on the backbone's own text (`r.distill`)."""
    a, distill = r.args, r.distill
    # Targets only where the backbone wrote the token, not in the prompt.
    valid = (torch.arange(1, distill.shape[1], device=r.device) >= a.distill_prompt_len).expand(a.heads_batch_size, -1)

    def batch(g):
        seq = distill[to_device(torch.randint(distill.shape[0], (a.heads_batch_size,), generator=g), r.device)]
        return seq[:, :-1], seq[:, 1:]
    _train(r, MedusaLM(r.model, r.heads), [(r.heads, a.heads_lr)], stage="heads", steps=a.heads_steps,
           gen=seeded(a.seed * 1009 + r.rank + 1), state=state, batch_fn=batch,
           loss_kwargs=lambda s: dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True, valid=valid))


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


def _train_stages(r: Run, state: dict | None, train_tokens: np.ndarray, val_batches: list) -> None:
    """Backbone (with the heads for --medusa 2), self-distillation, heads, from where `state` stopped."""
    stage = state["stage"] if state else "backbone"
    if state:
        r.log(f"resuming   at {stage} step {state['step']}")
    if stage == "backbone":
        if r.args.backbone_steps > 0:
            r.stage("backbone", lambda: backbone_stage(r, train_tokens, val_batches, state=state))
        stage, state = "distill", None
        r.save(stage=stage, step=0)
    r.model.eval().requires_grad_(False).zero_grad(set_to_none=True)  # the backbone's gradients are not needed again
    if stage == "distill":
        r.distill = r.stage("distill", lambda: distill_stage(r, train_tokens))
        stage, state = "heads", None
        r.save(stage=stage, step=0)
    else:
        r.distill = state["distill"].to(r.device)
    if r.args.heads_steps > 0:
        r.stage("heads", lambda: heads_stage(r, state=state))
        r.save(stage="heads", step=r.args.heads_steps)  # a Ctrl-C in the summary then keeps every step


def summarize(r: Run, val_batches: list, val_tokens: np.ndarray) -> tuple[dict, Callable[[], None]]:
    """Measure and print the trained model's figures; return them, and what writes their heads_accuracy.json."""
    model, heads, args, T = r.model, r.heads, r.args, SAMPLING_TEMPERATURE
    K, V, M = heads.num_heads, heads.config.vocab_size, heads.config.draft_vocab_size
    val_loss, top_k = validation_loss(model, val_batches), min(10, heads.draft_ids.numel())
    windows = [row for x, _ in val_batches for row in x.tolist()]
    text = accuracy.measure_head_accuracy(model, heads, windows, prompt_lens=1, top_k=top_k)
    # Against what the model itself says: held-out prompts (a draw of their own) continued greedily, and sampled.
    P = max(1, min(32, model.config.block_size // 4))  # at least 1: the least context, 3, gives 3 // 4 = 0
    n = min(96, model.config.block_size - P)
    prompts, _ = get_batch(val_tokens, batch_size=min(64, 8 * args.eval_prompts), block_size=P,
                           generator=seeded(args.seed + 5))
    seqs = accuracy.continuations(model, prompts.tolist(), max_new_tokens=n)
    acc = accuracy.measure_head_accuracy(model, heads, seqs, prompt_lens=P, top_k=top_k)
    sampled = accuracy.continuations(model, prompts.tolist(), max_new_tokens=n, temperature=T, seed=args.seed + 6)
    accept = accuracy.measure_sampled_acceptance(model, heads, sampled, prompt_lens=P, temperature=T)
    drawn = accuracy.measure_try_acceptance(model, heads, sampled, prompt_lens=P, temperature=T, ranks=top_k,
                                            seed=args.seed + 7)
    meta = {"measured_on": f"{len(seqs)} held-out prompts x {n} greedy tokens",
            "drawn_on": f"the same prompts x {n} tokens sampled at T={T:g}"}
    # The share of the greedy tokens inside the draft vocabulary of each size m: a token's place in vocab_order < m.
    ranks = heads.vocab_order.cpu().argsort()[torch.tensor([s[P:] for s in seqs])]
    sizes = sorted({m for m in (256, 512, 1024, 2048, 4096, 8192) if m < V} | ({M} if M else set()))
    coverage = {m: (ranks < m).double().mean().item() for m in sizes}
    figures = {"top-1 on held-out text": text[:, 0], "top-5 on held-out text": text[:, :5].sum(1),
               "top-1 vs own greedy continuation": acc[:, 0], "top-5 vs own greedy continuation": acc[:, :5].sum(1),
               f"Σ min(p, q) on own text at T={T:g}": accept,
               "official Medusa-1, Vicuna-7B top-1": torch.tensor(OFFICIAL_TOP1[:K])}
    lines = [f"summary    validation loss {val_loss:.3f} nats/token (perplexity {math.exp(val_loss):.1f})",
             f"           {'head':<36}" + "".join(f"{k:>7d}" for k in range(1, K + 1))]
    lines += [f"           {name:<36}" + "".join(f"{v:7.2f}" for v in xs.tolist()) for name, xs in figures.items()]
    cpu = preset("cpu").truncated(K)  # its ranks 0-2: a table of fewer (a draft vocabulary of 1 or 2) leaves it out
    nodes = lambda table: ", ".join(f"{b} nodes {build_tree(table, b)[1]:.2f}" for b in (4, 8, 16, 32, 64))
    lines.append(f"           {'expected tokens/step, greedy (bonus counted):':<48}" + nodes(acc)
                 + (f"; cpu preset {expected_tokens_per_step(acc, cpu):.2f}" if cpu.max_rank < acc.shape[1] else ""))
    lines.append(f"           {f'expected tokens/step, rejection (T={T:g}):':<48}" + nodes(drawn))
    lines.append("           draft vocabulary coverage of greedy text: "  # never empty: V > 256 (bytes, end-of-text)
                 + ", ".join(f"{m} {c:.2f}" for m, c in coverage.items()))
    r.log("\n".join(lines))
    saved = {"head_top1_text": text[:, 0], "head_top1_own": acc[:, 0], "head_accept_sampled": accept}
    stored = {"val_loss": round(val_loss, 4), **{k: [round(v, 4) for v in xs.tolist()] for k, xs in saved.items()},
              "draft_vocab_coverage": {str(m): round(c, 4) for m, c in coverage.items()}}
    return stored, lambda: accuracy.save_accuracy(args.out, acc, drawn=drawn, meta=meta)


def run(args: TrainArgs) -> None:
    """Run (or resume) every stage and write the checkpoint to args.out."""
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32: several times faster, at an error training never sees
    unfinished, trained = (os.path.isfile(os.path.join(args.out, name)) for name in (STATE_FILE, CONFIG_FILE))
    if (unfinished or trained) and not (args.resume or args.overwrite):  # a failed run would leave a mix of both
        what = "an unfinished run: add --resume to continue it," if unfinished else "a trained checkpoint: add"
        raise TrainError(f"{args.out} holds {what} --overwrite to replace it, or choose another --out")
    if args.resume and not unfinished:
        raise TrainError(f"--resume: no {STATE_FILE} in {args.out}; " + (
            "its run has finished: train it again with --overwrite instead" if trained else "start without --resume"))
    try:  # --out now, not after the corpus and the tokenizer
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise TrainError(f"--out {args.out}: cannot make the folder ({e.strerror})") from None
    try:  # the corpus never holds the files of --out: a run writes there, and a resume would then read them
        check_writable(args.out, f"--out {args.out}", files=OUTPUTS)
        docs = load_corpus(args.data, max_bytes=args.max_bytes, skip=args.out)
        train_docs, val_docs = split_documents(docs, seed=args.seed)
    except ValueError as e:
        raise TrainError(str(e)) from None
    r = Run(args, corpus_digest(docs))
    state = r.load_state() if args.resume else None
    enc, train_tokens, val_tokens = _prepare(r, state, train_docs, val_docs)
    block_size = r.model.config.block_size
    # Eight fixed batches of 8 held-out windows, drawn by a generator of their own: measuring changes no training.
    g, T = seeded(args.seed * 7919 + 101), min(block_size, 256)
    val_batches = [get_batch(val_tokens, batch_size=8, block_size=T, generator=g, device=r.device) for _ in range(8)]
    previous = signal.signal(signal.SIGINT, r.on_ctrl_c)
    try:
        _train_stages(r, state, train_tokens, val_batches)
        if r.any_rank(r.stop_requested):  # pressed in a stage's last step: all saved, the summary left to --resume
            raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous)
    choose_draft_vocabulary(r)  # before the summary: it measures the heads as they will decode
    r.heads.eval()
    if r.world > 1:  # every rank's weights' checksum: equal lines mean the replicas stayed identical
        h = hashlib.sha256()
        for t in [*r.model.state_dict().values(), *r.heads.state_dict().values()]:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        # The newline in the text: print() writes it separately, and two ranks would interleave the writes.
        print(f"rank {r.rank}/{r.world} weights sha256 {h.hexdigest()[:16]}\n", end="", flush=True)
    if r.main:
        figures, save_accuracy = r.stage("summary", lambda: summarize(r, val_batches, val_tokens))
        r.extra.update(figures)
        r.log("stages     " + ", ".join(r.stages) + "  (this session's, since --resume)" * bool(state))
        prompts = held_out_prompts(val_docs, enc, count=args.eval_prompts, seed=args.seed, block_size=block_size)
        r.write(os.path.join(args.out, PROMPTS_FILE), json_writer({"prompts": prompts}))
        save_accuracy()  # after the heads it measures: a run stopped in between leaves no table of other heads
        r.log(f"saved      {args.out}  (python decode.py --ckpt {shlex.quote(args.out)} "
              + ("--compare)" if prompts else "--prompt TEXT: no held-out snippet fits a third of the context)"))
    r.finish()
