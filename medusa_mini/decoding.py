"""Decoding loops: plain autoregressive `generate` and Medusa's `medusa_generate` (paper §2).

Medusa repeats one step (`step.medusa_step`: propose -> verify -> accept -> keep the accepted path's
K/V) until a stop rule fires. Both loops share prefill, stopping rules and statistics, so their
numbers are comparable:

- steps: backbone forward passes after the prefill;
- tokens per step: tokens emitted by those steps / steps, the bonus token counted (plain decoding is
  exactly 1.0). The prefill's token is emitted before the first step and counted in neither.

Both stop cleanly at `max_new_tokens`, at an end token (kept in the output) or when prompt + output
reach the context length. Batch size is 1, as in the paper's latency setting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .acceptance import ACCEPTANCE_RULES, sample, sampling_probs
from .model import GPT, KVCache
from .step import DRAFTS, medusa_step
from .tree import Tree

StepCallback = Callable[[list[int]], None]


@dataclass
class GenerationStats:
    prompt_tokens: int
    steps: int = 0
    step_tokens: list[int] = field(default_factory=list)  # tokens each step emitted, bonus included
    accepted_nodes: list[int] = field(default_factory=list)  # candidates accepted each step (Medusa)
    seconds: float = 0.0  # wall time, prefill included
    stop_reason: str = ""  # "max_new_tokens" | "eos" | "context"

    @property
    def tokens_per_step(self) -> float:
        return sum(self.step_tokens) / self.steps if self.steps else 0.0


def sync_device(device: torch.device) -> None:
    """Wait for `device` to finish its queued work; a no-op on the CPU.

    CUDA runs kernels asynchronously: a clock read before synchronizing measures only their launch.
    Synchronize before every clock read that times GPU work.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_prompt(model: GPT, prompt: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device).flatten()
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if ids.numel() >= model.config.block_size:
        raise ValueError(
            f"the prompt has {ids.numel()} tokens; the context holds {model.config.block_size}, "
            "so the prompt must be shorter"
        )
    return ids


def choose_token(logits: torch.Tensor, *, temperature: float, top_p: float, generator) -> int:
    """The backbone's next token from logits [V]: argmax at temperature 0, else a draw from p."""
    if temperature == 0:
        return int(logits.argmax())
    return sample(sampling_probs(logits, temperature=temperature, top_p=top_p), generator)


def _limit(out: list[int], new: list[int], *, max_new_tokens: int, room: int, eos_id: int | None):
    """Cut `new` at the token budget or the context, then at the end token; return (kept, stop reason)."""
    cap = min(max_new_tokens - len(out), room - len(out))
    reason = ""
    if len(new) >= cap:
        new, reason = new[:cap], "max_new_tokens" if max_new_tokens <= room else "context"
    if eos_id is not None and eos_id in new:
        return new[: new.index(eos_id) + 1], "eos"
    return new, reason


@torch.no_grad()
def prefill(model: GPT, ids: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt ids [P] through the model; return the last logits [V] and hidden state [C]."""
    logits, hidden = model(ids[None], cache=cache, logits_at=slice(-1, None))
    return logits[0, -1], hidden[0, -1]


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: StepCallback | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain autoregressive decoding with the KV cache: one forward pass per token."""
    ids = _check_prompt(model, prompt)
    device = model.device
    room = model.config.block_size - ids.numel()  # tokens the context still holds
    stats = GenerationStats(prompt_tokens=ids.numel())
    sync_device(device)
    t0 = time.perf_counter()
    cache = KVCache(model.config, max_len=model.config.block_size, device=device, dtype=model.lm_head.weight.dtype)
    logits, _ = prefill(model, ids, cache)
    tok = choose_token(logits, temperature=temperature, top_p=top_p, generator=generator)
    out, reason = _limit([], [tok], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
    if on_step and out:
        on_step(list(out))
    while not reason and out:
        logits, _ = model(torch.tensor([[out[-1]]], device=device), cache=cache)
        stats.steps += 1
        tok = choose_token(logits[0, -1], temperature=temperature, top_p=top_p, generator=generator)
        new, reason = _limit(out, [tok], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
        out += new
        stats.step_tokens.append(len(new))
        if on_step:
            on_step(new)
    sync_device(device)
    stats.seconds = time.perf_counter() - t0
    stats.stop_reason = reason or "max_new_tokens"
    return out, stats


@torch.no_grad()
def medusa_generate(
    model: GPT,
    heads: Callable[[torch.Tensor, torch.nn.Module], torch.Tensor],
    prompt: list[int] | torch.Tensor,
    *,
    tree: Tree,
    max_new_tokens: int,
    acceptance: str = "greedy",
    temperature: float = 0.0,
    top_p: float = 1.0,
    epsilon: float = 0.09,
    delta: float = 0.3,
    draft: str = "sampled",
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: StepCallback | None = None,
) -> tuple[list[int], GenerationStats]:
    """Medusa decoding: propose -> verify -> accept -> compact, until a stop rule fires.

    heads(hidden [1, C], lm_head) -> logits [K, 1, V]; evaluated once per step, only at the last
    accepted node (the one whose hidden state predicts what follows the bonus token).
    `on_step` receives each step's emitted tokens before the next proposal is made. `draft` applies
    to rejection sampling only: "sampled" draws the candidates from the heads' distributions (more
    accepted per node), "topk" takes their top-k; both are lossless.
    """
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}: use greedy, typical or rejection")
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r}: use sampled or topk")
    if acceptance == "greedy" and temperature > 0:
        raise ValueError("greedy acceptance is for temperature 0; sample with rejection (lossless) or typical")
    num_heads = getattr(heads, "num_heads", None)
    if num_heads is not None:
        tree.check_heads(num_heads)
    ids = _check_prompt(model, prompt)
    device, block = model.device, model.config.block_size
    room = block - ids.numel()
    stats = GenerationStats(prompt_tokens=ids.numel())
    sync_device(device)
    t0 = time.perf_counter()
    # Slots beyond block_size hold a tree's nodes; their positions are still < block_size.
    cache = KVCache(model.config, max_len=block + tree.num_nodes, device=device, dtype=model.lm_head.weight.dtype)
    logits, hidden = prefill(model, ids, cache)
    root = choose_token(logits, temperature=temperature, top_p=top_p, generator=generator)
    out, reason = _limit([], [root], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
    if on_step and out:
        on_step(list(out))
    head_logits = heads(hidden[None], model.lm_head)[:, 0]  # [K, V]
    while not reason and out:
        L = cache.length  # every committed token but the root
        # Near the end, deeper nodes could not be used (or could not be positioned): trim the tree.
        max_depth = min(block - 1 - L, max_new_tokens - len(out) - 1, room - len(out) - 1)
        step_tree = tree if tree.depth <= max_depth else tree.truncated(max(max_depth, 0))
        step = medusa_step(
            model, cache, step_tree, root, head_logits, acceptance=acceptance, temperature=temperature,
            top_p=top_p, epsilon=epsilon, delta=delta, draft=draft, generator=generator,
        )
        stats.steps += 1
        new, reason = _limit(out, step.emitted(), max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
        out += new
        stats.step_tokens.append(len(new))
        stats.accepted_nodes.append(len(step.path) - 1)
        if on_step:
            on_step(new)
        if reason:
            break
        root = step.bonus
        head_logits = heads(step.hidden[step.path[-1]][None], model.lm_head)[:, 0]  # [K, V]
    sync_device(device)
    stats.seconds = time.perf_counter() - t0
    stats.stop_reason = reason or "max_new_tokens"
    return out, stats
