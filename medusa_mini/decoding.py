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

from dataclasses import dataclass, field
from typing import Callable

import torch

from .hydra import heads_input
from .model import GPT, KVCache
from .sampling import Sampling
from .step import medusa_step
from .tree import Tree

StepCallback = Callable[[list[int]], None]


@dataclass
class GenerationStats:
    prompt_tokens: int
    steps: int = 0
    step_tokens: list[int] = field(default_factory=list)  # tokens each step emitted, bonus included
    accepted_nodes: list[int] = field(default_factory=list)  # candidates accepted each step (Medusa)
    seconds: float = 0.0  # wall time, set by the caller that timed the call (the loops keep no clock)
    stop_reason: str = ""  # "max_new_tokens" | "eos" | "context"

    @property
    def tokens_per_step(self) -> float:
        return sum(self.step_tokens) / self.steps if self.steps else 0.0


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


def _limit(out: list[int], new: list[int], *, max_new_tokens: int, room: int, eos_id: int | None):
    """Cut `new` at the token budget or the context, then at the end token; return (kept, stop reason)."""
    cap = min(max_new_tokens - len(out), room - len(out))
    reason = ""
    if len(new) >= cap:
        new, reason = new[:cap], "max_new_tokens" if max_new_tokens <= room else "context"
    if eos_id is not None and eos_id in new:
        return new[: new.index(eos_id) + 1], "eos"
    return new, reason


def reuse_cache(cache: KVCache | None, model: GPT, *, max_len: int) -> KVCache:
    """`cache` emptied for a new generation, or a new one of max_len slots when None.

    Reusing one cache keeps its tensors at fixed addresses from one generation to the next, which a
    captured CUDA graph needs (a new address means recording the graph again). Its size must be the
    one asked for: the attention mask spans the whole cache, so another size is another shape.
    """
    if cache is None:
        return KVCache(model.config, max_len=max_len, device=model.device, dtype=model.lm_head.weight.dtype)
    if cache.max_len != max_len:
        raise ValueError(f"the KV cache to reuse has {cache.max_len} slots; this generation needs {max_len}")
    cache.length = 0
    return cache


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
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: StepCallback | None = None,
    cache: KVCache | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain autoregressive decoding with the KV cache: one forward pass per token.

    Each token is `sampling.choose`: the argmax at temperature 0, else a draw from p (temperature,
    top-p); the acceptance settings play no part here. `cache`: one to reuse (see `reuse_cache`),
    block_size slots; by default a new one.
    """
    ids = _check_prompt(model, prompt)
    room = model.config.block_size - ids.numel()  # tokens the context still holds
    stats = GenerationStats(prompt_tokens=ids.numel())
    cache = reuse_cache(cache, model, max_len=model.config.block_size)
    logits, _ = prefill(model, ids, cache)
    tok = sampling.next_token(logits, generator)  # [] on the device: the next input, without the host
    out, reason = _limit([], [int(tok)], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
    if on_step and out:
        on_step(list(out))
    while not reason and out:
        logits, _ = model(tok.view(1, 1), cache=cache)
        stats.steps += 1
        tok = sampling.next_token(logits[0, -1], generator)
        new, reason = _limit(out, [int(tok)], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)  # the sync
        out += new
        stats.step_tokens.append(len(new))
        if on_step:
            on_step(new)
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
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: StepCallback | None = None,
    cache: KVCache | None = None,
) -> tuple[list[int], GenerationStats]:
    """Medusa decoding: propose -> verify -> accept -> compact, until a stop rule fires.

    heads(hidden [1, C], lm_head) -> logits [K, 1, V]; evaluated once per step, only at the last
    accepted node (the one whose hidden state predicts what follows the bonus token). Dependent heads
    (hydra.HydraHeads) are read there too, node by node while the tree is filled (`hydra.heads_input`).
    `on_step` receives each step's emitted tokens before the next proposal is made. `sampling` holds
    the acceptance rule and its settings (sampling.py); with greedy or rejection acceptance the output
    is plain `generate`'s, in distribution and, when greedy, token for token. `cache`: one to reuse
    (see `reuse_cache`), block_size + tree.num_nodes slots; by default a new one.
    """
    num_heads = getattr(heads, "num_heads", None)
    if num_heads is not None:
        tree.check_heads(num_heads)
    ids = _check_prompt(model, prompt)
    block = model.config.block_size
    room = block - ids.numel()
    stats = GenerationStats(prompt_tokens=ids.numel())
    # Slots beyond block_size hold a tree's nodes; their positions are still < block_size.
    cache = reuse_cache(cache, model, max_len=block + tree.num_nodes)
    logits, hidden = prefill(model, ids, cache)
    root = sampling.next_token(logits, generator)  # [] on the device, as every later root
    out, reason = _limit([], [int(root)], max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
    if on_step and out:
        on_step(list(out))
    head_logits = heads_input(heads, hidden, model)  # [K, V], or a HydraContext for dependent heads
    L = ids.numel()  # every committed token but the root: the cache's length, counted on the host
    while not reason and out:
        # Near the end, deeper nodes could not be used (or could not be positioned): trim the tree.
        max_depth = min(block - 1 - L, max_new_tokens - len(out) - 1, room - len(out) - 1)
        step_tree = tree if tree.depth <= max_depth else tree.truncated(max(max_depth, 0))
        step = medusa_step(model, cache, step_tree, root, head_logits, sampling=sampling, generator=generator)
        L += len(step.path)
        stats.steps += 1
        new, reason = _limit(out, step.emitted(), max_new_tokens=max_new_tokens, room=room, eos_id=eos_id)
        out += new
        stats.step_tokens.append(len(new))
        stats.accepted_nodes.append(len(step.path) - 1)
        if on_step:
            on_step(new)
        if reason:
            break
        root = step.next_root
        head_logits = heads_input(heads, step.next_hidden, model)
    stats.stop_reason = reason or "max_new_tokens"
    return out, stats
