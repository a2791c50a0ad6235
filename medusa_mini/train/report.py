"""What `train_tiny.py` reports, measured: progress lines, the validation loss, the summary, prompts.json and
the acceptance tables in heads_accuracy.json: acc[k][r] = P(head k+1's rank-r guess is the backbone's greedy
token k+2 places ahead) on greedy continuations, the chance that greedy acceptance takes the guess once it
took the node above (`tree.build_tree` multiplies these along paths), and its sampling counterpart for
drawn candidates, `measure_try_acceptance`: the chance that rejection sampling accepts head k+1's r-th draw
on sampled continuations. `measure_sampled_acceptance` is that table's first try, Σ min(p, q), exactly."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..decoding import generate_batch
from ..heads import IGNORE, DraftHeads, next_tokens
from ..io.files import atomic_write_text, read_json
from ..io.loading import PROMPTS_FILE
from ..model import GPT
from ..sampling import (
    SAMPLING_TEMPERATURE,
    Sampling,
    draft_log_probs,
    gumbel_top_k,
    sampling_probs,
    scaled,
    speculative_try,
    without_earlier_draws,
)
from ..training import head_targets, lm_loss
from ..tree import build_tree, check_acc, expected_tokens_per_step, preset
from .data import get_batch

ACCURACY_FILE = "heads_accuracy.json"
OFFICIAL_TOP1 = (0.56, 0.32, 0.20, 0.15)  # official Medusa-1 heads on Vicuna-7B, heads 1-4 (paper, repository)
COVERAGE_SIZES = (256, 512, 1024, 2048, 4096, 8192)
ROWS, POSITIONS = 16, 256  # rows per greedy batch, positions per heads call: bound the cache and [K, m, M] logits


def progress_line(stage: str, step: int, steps: int, metrics: dict, *, tokens_per_s: float, eta: float) -> str:
    """One progress line: the current step's losses and head top-1, throughput, time left."""
    parts = [f"{stage:9s} step {step + 1:5d}/{steps}"]
    if "lm" in metrics:
        parts.append(f"lm {metrics['lm']:.3f}")
    if "heads" in metrics:
        parts.append("heads " + " ".join(f"{v:.2f}" for v in metrics["heads"]))
        parts.append("top1 " + " ".join(f"{v:.2f}" for v in metrics["acc"]))
    parts.append(f"{tokens_per_s:,.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    return "  ".join(parts)


def validation_batches(val_tokens: np.ndarray, *, block_size: int, seed: int, device: str) -> list:
    """Eight fixed batches (x, y) of 8 held-out windows [8, T], T <= 256; their own generator, so measuring
    never changes what is trained."""
    g = torch.Generator().manual_seed(seed * 7919 + 101)
    T = min(block_size, 256, len(val_tokens) - 1)
    return [get_batch(val_tokens, batch_size=8, block_size=T, generator=g, device=device) for _ in range(8)]


@torch.no_grad()
def validation_loss(model: GPT, batches: list) -> float:
    """The backbone's mean next-token loss on `batches`, in float32 whatever --dtype, one read."""
    return (sum(lm_loss(model(x)[0], y) for x, y in batches) / len(batches)).item()


def summarize(r, val_batches: list, val_tokens: np.ndarray) -> dict:
    """Measure, print and save (heads_accuracy.json) the trained model's figures; return them."""
    model, heads, args = r.model, r.heads, r.args
    K, V, M = heads.num_heads, heads.config.vocab_size, heads.config.draft_vocab_size
    val_loss, top_k = validation_loss(model, val_batches), min(10, heads.draft_ids.numel())
    windows = [row for x, _ in val_batches for row in x.tolist()]
    text = measure_head_accuracy(model, heads, windows, prompt_lens=1, top_k=top_k)
    # Against what the model itself says: held-out prompts (a draw of their own) continued greedily.
    P = min(32, model.config.block_size // 4)
    n = min(96, model.config.block_size - P)
    prompts, _ = get_batch(val_tokens, batch_size=min(64, 8 * args.eval_prompts), block_size=P,
                           generator=torch.Generator().manual_seed(args.seed + 5))
    seqs = continuations(model, prompts.tolist(), max_new_tokens=n)
    acc = measure_head_accuracy(model, heads, seqs, prompt_lens=P, top_k=top_k)
    sampled = continuations(model, prompts.tolist(), max_new_tokens=n, temperature=SAMPLING_TEMPERATURE,
                            seed=args.seed + 6)
    accept = measure_sampled_acceptance(model, heads, sampled, prompt_lens=P, temperature=SAMPLING_TEMPERATURE)
    drawn = measure_try_acceptance(model, heads, sampled, prompt_lens=P, temperature=SAMPLING_TEMPERATURE,
                                   ranks=top_k, seed=args.seed + 7)
    save_accuracy(args.out, acc, drawn=drawn, meta={"measured_on": f"{len(seqs)} held-out prompts x {n} greedy tokens",
                                                    "drawn_on": f"the same prompts x {n} tokens sampled at "
                                                                f"T={SAMPLING_TEMPERATURE:g}"})
    # The share of the greedy tokens inside the draft vocabulary of each size m: rank[token] < m.
    ranks = heads.vocab_order.cpu().argsort()[torch.tensor([s[P:] for s in seqs])]
    sizes = sorted({m for m in COVERAGE_SIZES if m < V} | ({M} if M else set()))
    coverage = {m: (ranks < m).double().mean().item() for m in sizes}
    figures = {"top-1 on held-out text": text[:, 0], "top-5 on held-out text": text[:, :5].sum(1),
               "top-1 vs own greedy continuation": acc[:, 0], "top-5 vs own greedy continuation": acc[:, :5].sum(1),
               f"Σ min(p, q) on own text at T={SAMPLING_TEMPERATURE:g}": accept,
               "official Medusa-1, Vicuna-7B top-1": torch.tensor(OFFICIAL_TOP1[:K])}
    lines = [f"summary    validation loss {val_loss:.3f} nats/token (perplexity {math.exp(val_loss):.1f})",
             f"           {'head':<36}" + "".join(f"{k:>7d}" for k in range(1, K + 1))]
    lines += [f"           {name:<36}" + "".join(f"{v:7.2f}" for v in xs.tolist()) for name, xs in figures.items()]
    lines.append(f"           {'expected tokens/step, greedy (bonus counted):':<48}"
                 + ", ".join(f"{b} nodes {build_tree(acc, b)[1]:.2f}" for b in (4, 8, 16, 32, 64))
                 + f"; cpu preset {expected_tokens_per_step(acc, preset('cpu').truncated(K)):.2f}")
    lines.append(f"           {f'expected tokens/step, rejection (T={SAMPLING_TEMPERATURE:g}):':<48}"
                 + ", ".join(f"{b} nodes {build_tree(drawn, b)[1]:.2f}" for b in (4, 8, 16, 32, 64)))
    if coverage:
        lines.append("           draft vocabulary coverage of greedy text: "
                     + ", ".join(f"{m} {c:.2f}" for m, c in coverage.items()))
    r.log("\n".join(lines))
    return {"val_loss": round(val_loss, 4), "head_top1_text": [round(v, 4) for v in text[:, 0].tolist()],
            "head_top1_own": [round(v, 4) for v in acc[:, 0].tolist()],
            "head_accept_sampled": [round(v, 4) for v in accept.tolist()],
            "draft_vocab_coverage": {str(m): round(c, 4) for m, c in coverage.items()}}


def held_out_prompts(out: str, val_docs, enc, *, count: int, seed: int, block_size: int) -> None:
    """`count` snippets of held-out text (at most 240 characters, line to line, under a third of the
    context), saved as prompts.json: decode.py's default prompts, text the model never trained on."""
    rng, prompts = random.Random(seed), []
    texts = [t for _, t in val_docs if t.strip()]
    for _ in range(count * 50 if texts else 0):
        if len(prompts) == count:
            break
        lines = texts[rng.randrange(len(texts))].splitlines(keepends=True)
        snippet = ""
        for line in lines[rng.randrange(len(lines)):]:
            if snippet and len(snippet) + len(line) > 240:
                break
            snippet += line
        snippet = snippet[:240]
        if snippet.strip() and 0 < len(enc.encode_ordinary(snippet)) < block_size // 3:
            prompts.append(snippet)
    atomic_write_text(os.path.join(out, PROMPTS_FILE), json.dumps({"prompts": prompts}, indent=1, ensure_ascii=False))


def continuations(model: GPT, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0) -> list[list[int]]:
    """Each prompt + the backbone's continuation: greedy at temperature 0 (token for token what `generate`
    writes), else sampled by `generate_batch`, ROWS prompts at a time from one seeded generator."""
    out, sampling = [], Sampling(temperature=temperature)
    g = torch.Generator(device=model.device).manual_seed(seed)
    for b in range(0, len(prompts), ROWS):
        part = prompts[b : b + ROWS]
        rows = generate_batch(model, part, max_new_tokens=max_new_tokens, sampling=sampling, generator=g)
        out += [p + new for p, (new, _) in zip(part, rows)]
    return out


def with_head_targets(sequences: list[list[int]], prompt_lens: int | Sequence[int]) -> Iterator[tuple[list[int], int]]:
    """(sequence, first) for each sequence where head 1 has a target: `first` is the position of its
    prompt's last token (one count for all or one each), the first hidden state decoding drafts from."""
    for seq, P in zip(sequences, [prompt_lens] * len(sequences) if isinstance(prompt_lens, int) else prompt_lens):
        first = max(P - 1, 0)
        if len(seq) >= first + 3:  # head 1 at `first` guesses token first + 2
            yield seq, first


@torch.no_grad()
def measure_head_accuracy(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                          prompt_lens: int | Sequence[int], top_k: int = 10) -> torch.Tensor:
    """acc [K, top_k] float64 (module docstring) on `sequences`: prompts of `prompt_lens` tokens (one count
    or one each) + their greedy continuations. As in decoding, heads read from each prompt's last token on;
    a guess is a token id of the draft vocabulary; a position counts where the head's target exists."""
    device, K, draft_ids = model.device, heads.num_heads, heads.draft_ids.to(model.device)
    if not 0 < top_k <= draft_ids.numel():
        raise ValueError(f"top_k={top_k} must be between 1 and the draft vocabulary's size {draft_ids.numel()}")
    hits, counts = torch.zeros(K, top_k, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for seq, first in with_head_targets(sequences, prompt_lens):
        x, y = torch.tensor([seq[:-1]], device=device), torch.tensor([seq[1:]], device=device)  # [1, T]
        targets = head_targets(y, K)[:, 0]  # [K, T] token ids, IGNORE where none
        following = next_tokens(y, K)[0]  # [T, K]: along a greedy continuation, the path greedy decoding takes
        _, hidden = model(x, logits_at=slice(0, 0))  # [1, T, C]
        for t in torch.arange(first, len(seq) - 2, device=device).split(POSITIONS):  # head 1 has a target
            guesses = draft_ids[heads(hidden[0, t], model, following=following[t]).topk(top_k, dim=-1).indices]
            hits += (guesses == targets[:, t, None]).sum(1).cpu()  # guesses [K, m, top_k] token ids
            counts += (targets[:, t] != IGNORE).sum(1).cpu()
    return hits / counts.clamp(min=1)[:, None]


@torch.no_grad()
def measure_sampled_acceptance(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                               prompt_lens: int | Sequence[int], temperature: float) -> torch.Tensor:
    """[K] float64: head k's Σ_x min(p(x), q_k(x)) averaged over `sequences` (prompts + continuations sampled at
    `temperature`), p the backbone's distribution of the token head k guesses, q_k the head's, both at that
    temperature: about the chance that rejection sampling accepts head k's one drawn candidate (decoding
    writes sampled text, though its steps do not start at every position alike). Where the greedy figure
    (`measure_head_accuracy`) asks for the right token, this asks for the right distribution."""
    device, K, ids = model.device, heads.num_heads, heads.draft_ids.to(model.device)
    total, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for seq, first in with_head_targets(sequences, prompt_lens):
        x, y = torch.tensor([seq[:-1]], device=device), torch.tensor([seq[1:]], device=device)  # [1, T]
        logits, hidden = model(x)  # [1, T, V], [1, T, C]
        p = sampling_probs(logits[0], temperature=temperature)[:, ids]  # [T, M]: q is 0 outside the draft ids
        following, T = next_tokens(y, K)[0], x.shape[1]  # [T, K]: the sampled path, which hydra heads read
        for t in torch.arange(first, T - 1, device=device).split(POSITIONS):  # head 1 has a target
            q = F.softmax(scaled(heads(hidden[0, t], model, following=following[t]), temperature), dim=-1)  # [K, m, M]
            for k in range(1, K + 1):
                ok = t + k < T  # [m] p of token t+k+1 is logits[t + k]
                total[k - 1] += torch.minimum(p[t[ok] + k], q[k - 1, ok]).sum().item()
                counts[k - 1] += ok.sum().item()
    return total / counts.clamp(min=1)


@torch.no_grad()
def measure_try_acceptance(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                           prompt_lens: int | Sequence[int], temperature: float, ranks: int = 10, draws: int = 4,
                           seed: int = 0) -> torch.Tensor:
    """acc [K, ranks] float64, the acceptance table of rejection sampling with drawn candidates: acc[k][r] =
    P(head k+1's r-th distinct draw from q is the candidate its tries accept), on `sequences` sampled at
    `temperature` as in `measure_sampled_acceptance`, averaged over `draws` sets of draws per position.

    Try r passes with chance min(1, p_r(x) / q_r(x)), p_r the residual its misses before it left
    (`sampling.speculative_try`, `acceptance.rejection_accept_drawn`), so a set of draws is worth
    Π_{j<r} (1 - a_j) · a_r to rank r, in expectation over the uniforms. At most one sibling passes, as at
    most one top-k guess is the greedy token: the table plays greedy's part in `tree.build_tree`, whose
    product rule then asks how far a drawn path gets. acc[k][0] averages to Σ min(p, q).
    """
    device, K, ids, V = model.device, heads.num_heads, heads.draft_ids.to(model.device), model.config.vocab_size
    R = min(ranks, ids.numel())
    g = torch.Generator(device=device).manual_seed(seed)
    passed, counts = torch.zeros(K, R, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for seq, first in with_head_targets(sequences, prompt_lens):
        x, y = torch.tensor([seq[:-1]], device=device), torch.tensor([seq[1:]], device=device)  # [1, T]
        logits, hidden = model(x)  # [1, T, V], [1, T, C]
        p_all = sampling_probs(logits[0], temperature=temperature)  # [T, V]
        following, T = next_tokens(y, K)[0], x.shape[1]  # [T, K]: the sampled path, which hydra heads read
        for t in torch.arange(first, T - 1, device=device).split(POSITIONS):  # head 1 has a target
            head_logits = heads(hidden[0, t], model, following=following[t])  # [K, m, M]
            for k in range(1, K + 1):
                ok = t + k < T  # [m] p of token t+k+1 is p_all[t + k]
                log_q = draft_log_probs(head_logits[k - 1, ok], ids, temperature=temperature, vocab_size=V)  # [m, V]
                for _ in range(draws):
                    p, left = p_all[t[ok] + k], torch.ones(len(log_q), dtype=torch.float64, device=device)  # [m, V], [m]
                    samples = gumbel_top_k(log_q, R, torch.rand(log_q.shape, generator=g, device=device))  # [m, R]
                    for r in range(R):
                        x_r = samples[:, r]  # [m]
                        q = without_earlier_draws(log_q, samples, torch.full_like(x_r, r), x_r)  # [m, V]
                        _, flat, residual = speculative_try(p, q, x_r, torch.zeros_like(p[:, 0]))
                        p_x, q_x = p.gather(1, x_r[:, None])[:, 0], q.gather(1, x_r[:, None])[:, 0]  # [m]
                        chance = torch.where(flat, (p_x > 0).float(), (p_x / q_x).clamp(max=1.0)).double()  # [m]
                        passed[k - 1, r] += (left * chance).sum().item() / draws
                        left = left * (1 - chance)
                        p = torch.where(flat[:, None], p, residual)  # after a miss, the residual is the target
                counts[k - 1] += ok.sum().item()
    return passed / counts.clamp(min=1)[:, None]


@torch.no_grad()
def measure_marginal_acceptance(model: GPT, sequences: list[list[int]], *, prompt_lens: int | Sequence[int],
                                temperature: float, roots: int = 64, every: int = 4) -> tuple[float, float]:
    """What head 1 would score in `measure_sampled_acceptance` if its q were the exact marginal: (mean Σ min,
    mean root mass covered). Head 1 at t guesses token t+2 without the token t+1 (the root r, drawn from
    p_t), so training on text sampled at T aims it at m = Σ_r p_t(r) p(· | r), every distribution at T;
    here m is taken over the `roots` likeliest roots (renormalised), over the whole vocabulary, at every
    `every`-th position, and Σ_x min(p(x | r), m(x)) is averaged over r ~ p_t. Not an upper bound (a q
    chosen for Σ min itself can score more), but the target of a Medusa head's training; a head that reads
    r (Hydra's) is not aimed at it. Two forwards per position: the context, then its `roots` rows."""
    device, V = model.device, model.config.vocab_size
    total = covered = positions = 0.0
    for seq, first in with_head_targets(sequences, prompt_lens):
        for t in range(first, len(seq) - 2, every):  # as in measure_sampled_acceptance
            context = torch.tensor(seq[: t + 1], device=device)  # [t + 1]
            p_root = sampling_probs(model(context[None])[0][0, -1], temperature=temperature)  # [V]
            w, r = p_root.topk(min(roots, V))  # [R] the likeliest roots and their probabilities
            x = torch.cat([context.expand(len(r), -1), r[:, None]], dim=1)  # [R, t + 2]
            p_next = sampling_probs(model(x)[0][:, -1], temperature=temperature)  # [R, V] p(· | r)
            share = w / w.sum()  # [R]
            marginal = share @ p_next  # [V]
            total += (share * torch.minimum(p_next, marginal).sum(-1)).sum().item()
            covered, positions = covered + w.sum().item(), positions + 1
    return total / max(positions, 1), covered / max(positions, 1)


def save_accuracy(directory: str | os.PathLike, acc: torch.Tensor, *, drawn: torch.Tensor | None = None,
                  meta: dict | None = None) -> None:
    """Write heads_accuracy.json atomically, one line per head: acc, the greedy table, then drawn, rejection
    sampling's table for drawn candidates (`measure_try_acceptance`), if measured, then `meta` (what they
    were measured on)."""
    def lines(table: torch.Tensor) -> str:
        return "[\n    " + ",\n    ".join(json.dumps([round(x, 6) for x in row]) for row in check_acc(table).tolist()) + "\n  ]"

    acc = check_acc(acc)
    tables = f'  "acc": {lines(acc)},\n' + (f'  "acc_drawn": {lines(drawn)},\n' if drawn is not None else "")
    rest = json.dumps({"top_k": acc.shape[1], "num_heads": acc.shape[0], **(meta or {})}, indent=2)
    atomic_write_text(os.path.join(directory, ACCURACY_FILE), "{\n" + tables + rest[2:] + "\n")


def load_accuracy(directory: str | os.PathLike, *, drawn: bool = False) -> torch.Tensor:
    """acc [K, R] float64 from heads_accuracy.json: the greedy table, or with `drawn` the table of drawn
    candidates where the file has one (files measured before it have not: greedy's then stands in); a
    one-line ValueError for a missing or bad file."""
    path = os.path.join(os.fspath(directory), ACCURACY_FILE)
    obj = read_json(path, hint=f"measure it with python -m medusa_mini.cli.measure --ckpt {directory}")
    key = "acc_drawn" if drawn and isinstance(obj, dict) and "acc_drawn" in obj else "acc"
    try:
        return check_acc(torch.tensor(obj[key], dtype=torch.float64))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f'{path} must hold {{"{key}": [[...], ...]}}: one row of numbers in [0, 1] per head, '
                         f"all of one length; {e}") from None


def format_accuracy(acc: torch.Tensor) -> str:
    """Per head: top-1 and top-5 cumulative acceptance (summed over the first 1 or 5 ranks)."""
    cum = check_acc(acc).cumsum(dim=1)
    lines = ["head  top-1  top-5   (cumulative: accepted among the first r guesses)"]
    lines += [f"{k + 1:>4}  {cum[k, 0]:.3f}  {cum[k, min(4, cum.shape[1] - 1)]:.3f}" for k in range(len(cum))]
    return "\n".join(lines)
