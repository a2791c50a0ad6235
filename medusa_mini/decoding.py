"""The engine's decoding loops, for B prompts at once: plain `generate` and Medusa's `medusa_generate` (§2).

Medusa repeats one step (`step.medusa_step`) until every row has stopped; reference.py's `medusa_generate`
is the same loop for one prompt, written plainly. Both engine loops share prefill, stopping rules and
statistics: steps are backbone forward passes after the prefill; tokens per step counts the bonus token
(plain decoding: exactly 1.0); the prefill's token, emitted before the first step, is counted in neither.

A row stops at `max_new_tokens`, at an end token (kept) or when prompt + output fill the context. In a
batch each row accepts its own path and keeps its own cache length; a row that has stopped rides along,
masked, and never emits again. Prompts of different lengths are padded at their end for the prefill
only: the padding is never attended to and its slots are given back. Medusa's loop takes any *drafter*
whose `proposer(model, tree)` makes the candidates: Medusa or hydra heads, or `proposal.PromptLookup`.
"""

import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from .model import GPT, KVCache, at_each_row
from .proposal import Drafter
from .sampling import Sampling
from .step import Steps, has_room
from .tree import Tree

Prompt = list[int] | torch.Tensor  # token ids
RowCallback = Callable[[int, list[int]], None]  # (row, the tokens it just emitted)
CacheSource = Callable[[int, int], KVCache]  # (rows, slots) -> a KV cache of that size


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


def _check_prompt(model: GPT, prompt: list[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt, str):  # torch's own error would say "invalid data type 'str'"
        raise ValueError(f"a prompt is token ids, not text: encode it first (enc.encode_ordinary({prompt[:20]!r}))")
    ids, block = torch.as_tensor(prompt), model.config.block_size
    if not (ids.dim() == 1 or ids.dim() == 2 and len(ids) == 1):  # [T] or [1, T]; a bare id or [B, T] is a slip
        shape = "one id" if ids.dim() == 0 else f"a tensor of shape {list(ids.shape)}"
        raise ValueError(f"a prompt is a list of token ids, not {shape}; the batch functions take a list of prompts")
    if ids.is_floating_point() and ids.numel() or ids.dtype == torch.bool:  # as long ids, 96.7 would be 96
        raise ValueError(f"a prompt holds integer token ids, not {ids.dtype} values")
    ids = ids.flatten().tolist()
    if not ids or len(ids) >= block:
        raise ValueError("the prompt is empty: give at least one token" if not ids else
                         f"the prompt has {len(ids)} tokens; the context holds {block}, so the prompt must be shorter")
    if min(ids) < 0 or max(ids) >= model.config.vocab_size:  # else an IndexError, on a GPU a device-side assert
        raise ValueError(f"the prompt holds token ids outside the vocabulary, 0 to {model.config.vocab_size - 1}")
    return ids


def reuse_cache(cache: KVCache | CacheSource | None, model: GPT, *, batch_size: int, max_len: int) -> KVCache:
    """`cache` emptied for a new generation, or a new one of batch_size rows and max_len slots when None; a callable
    is asked for the cache of that size (`cache(batch_size, max_len)`: cli/compiled.py keeps one per size, at fixed
    addresses). A cache to reuse must be the one this would make: its size, layers, heads, dtype and device."""
    cache, c, dtype = cache(batch_size, max_len) if callable(cache) else cache, model.config, model.lm_head.weight.dtype
    if cache is None:
        return KVCache(c, batch_size=batch_size, max_len=max_len, device=model.device, dtype=dtype)
    have = (tuple(cache.kv.shape), cache.kv.dtype, cache.kv.device)
    need = (KVCache.kv_shape(c, batch_size, max_len), dtype, model.device)
    if have != need:  # [n_layer, 2, B, nh, max_len, hs]
        say = lambda s, t, d: f"{s[2]} rows of {s[4]} slots ({s[0]} layers, {s[3]} attn heads of {s[5]}) in {t} on {d}"
        raise ValueError(f"the KV cache to reuse has {say(*have)}; this generation needs {say(*need)}")
    cache.lengths = 0
    return cache


@torch.no_grad()
def prefill(model: GPT, ids: torch.Tensor, cache: KVCache, *, lengths: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts ids [B, T] into the cache, emptied first; return each row's last logits [B, V], hidden [B, C].

    lengths: each row's prompt length when the rows were padded at their end to T (default: all T). The padding
    follows the prompt, so causal attention keeps every prompt token from seeing it; the cache's lengths are then set
    to the prompts', giving the padding's slots back."""
    B, T = ids.shape
    last = torch.tensor([n - 1 for n in lengths] if lengths else [T - 1] * B, device=ids.device)  # [B]
    cache.lengths = 0  # a prefill starts a generation at slot 0; old entries past the lengths are never read
    logits, hidden = model(ids, cache=cache, logits_at=last, attended=T)  # [B, 1, V], [B, T, C]
    if lengths is not None:
        cache.lengths = torch.tensor(lengths, device=ids.device)
    return logits[:, 0], at_each_row(hidden, last)  # [B, V], [B, C]


def length_stop_reason(prompt_tokens: int, max_new_tokens: int, block_size: int) -> str:
    """What stops a row that meets no end token: its token budget if prompt and budget fit the context (a
    budget that ends exactly at the context's end included), else the context."""
    return "max_new_tokens" if prompt_tokens + max_new_tokens <= block_size else "context"


class Generations:
    """Each row's output, statistics and stop rule on the host, from the tokens steps read; stop lengths on both."""

    def __init__(self, model: GPT, prompts: list[Prompt], *, max_new_tokens: int, eos_id: int | None,
                 on_step: RowCallback | None) -> None:
        if not (isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool)
                and max_new_tokens >= 0):  # numpy's integers too
            raise ValueError(f"max_new_tokens must be an integer >= 0, not {max_new_tokens!r}")
        if not (eos_id is None or isinstance(eos_id, numbers.Integral) and 0 <= eos_id < model.config.vocab_size):
            raise ValueError(f"eos_id is one token id, 0 to {model.config.vocab_size - 1}, or None, not {eos_id!r}")
        self.prompts = [_check_prompt(model, prompt) for prompt in prompts]
        if not self.prompts:
            raise ValueError("no prompts: give at least one")
        block = model.config.block_size
        # Row b stops when prompt + output reach stop_at[b] tokens.
        self.stop_at = [min(len(prompt) + max_new_tokens, block) for prompt in self.prompts]
        # The same [B] on the device: 0 once a row stops while others go on, so it accepts nothing and stays put.
        self.stop_at_device = torch.tensor(self.stop_at, device=model.device)
        self.why = [length_stop_reason(len(prompt), max_new_tokens, block) for prompt in self.prompts]
        self.eos_id, self.on_step = eos_id, on_step
        self.out: list[list[int]] = [[] for _ in self.prompts]
        self.stats = [GenerationStats(prompt_tokens=len(prompt)) for prompt in self.prompts]
        self.active = list(range(len(self.prompts)))

    def emit(self, new: list[list[int]], *, step: bool, accepted: list[int] | None = None) -> None:
        """Give each active row b its new tokens new[b], cut at its stop rule (stopped: device stop length 0)."""
        stopped = []
        for b in list(self.active):
            out, stats = self.out[b], self.stats[b]
            room = self.stop_at[b] - len(self.prompts[b]) - len(out)
            kept, reason = new[b][:room], self.why[b] if len(new[b]) >= room else ""
            if self.eos_id is not None and self.eos_id in kept:
                kept, reason = kept[: kept.index(self.eos_id) + 1], "eos"
            out += kept
            if step:
                stats.steps += 1
                stats.step_tokens.append(len(kept))
                if accepted is not None:
                    stats.accepted_nodes.append(accepted[b])
            if self.on_step and kept:
                self.on_step(b, kept)
            if reason:
                stats.stop_reason = reason
                self.active.remove(b)
                stopped.append(b)
        if stopped and self.active:  # for the steps still to come
            self.stop_at_device[stopped] = 0

    def start(self, model: GPT, cache: KVCache | CacheSource | None, *, slots: int, sampling: Sampling,
              generator: torch.Generator | None) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
        """The prefill into a cache of `slots` slots per row (`reuse_cache`) and every row's first token, emitted:
        (cache, first tokens [B] on the device, hidden states [B, C] that chose them)."""
        if not isinstance(sampling, Sampling):  # else an AttributeError after the prefill
            raise TypeError(f"sampling is a Sampling, e.g. Sampling(temperature=0.8), not {sampling!r}")
        B, device, T = len(self.prompts), model.device, max(map(len, self.prompts))
        cache = reuse_cache(cache, model, batch_size=B, max_len=slots)
        # [B, T]: each prompt padded at its end with its own last token (never attended to)
        padded = torch.tensor([prompt + prompt[-1:] * (T - len(prompt)) for prompt in self.prompts], device=device)
        logits, hidden = prefill(model, padded, cache, lengths=list(map(len, self.prompts)))
        first = sampling.next_token(logits, sampling.uniforms((B,), generator, device=device))  # [B]
        self.emit([[t] for t in first.tolist()], step=False)
        return cache, first, hidden

    def history(self) -> list[list[int]]:
        """Each row's prompt and output so far (the last token is the next step's root)."""
        return [prompt + out for prompt, out in zip(self.prompts, self.out)]


@torch.no_grad()
def generate_batch(model: GPT, prompts: list[Prompt], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                   eos_id: int | None = None, generator: torch.Generator | None = None,
                   on_step: RowCallback | None = None, cache: KVCache | CacheSource | None = None,
                   steps: Steps = Steps()) -> list[tuple[list[int], GenerationStats]]:
    """Plain autoregressive decoding of B prompts with the KV cache: one forward pass per token per row.

    Each token is `sampling.next_token`'s: the argmax at temperature 0, else a draw from p (temperature, top-p), chosen
    by the step (`plain_step`); the acceptance settings play no part here. One host read per step. `cache`: one to reuse
    (see `reuse_cache`), B rows of block_size slots; by default a new one. `steps`: the eager steps, or compiled ones.
    """
    rows = Generations(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, on_step=on_step)
    B, device = len(rows.prompts), model.device
    cache, tok, _ = rows.start(model, cache, slots=model.config.block_size, sampling=sampling, generator=generator)
    longest = max(map(len, rows.prompts))  # every row's cache length is at most this, on the host
    while rows.active:
        start = cache.lengths  # [B], a snapshot: the step advances the buffer; a stopped row goes back to it
        longest += 1
        u = sampling.uniforms((B,), generator, device=device)
        tok, _, _ = steps.plain(model, cache, tok[:, None], sampling=sampling, u=u, attended=longest)
        if len(rows.active) < B:  # a stopped row's write does not move its length
            cache.lengths = torch.where(start + 1 < rows.stop_at_device, start + 1, start)
        rows.emit([[t] for t in tok.tolist()], step=True)  # the step's one host read
    return list(zip(rows.out, rows.stats))


@torch.no_grad()
def medusa_generate_batch(
    model: GPT, drafter: Drafter, prompts: list[Prompt], *, tree: Tree, max_new_tokens: int,
    sampling: Sampling = Sampling(), eos_id: int | None = None, generator: torch.Generator | None = None,
    on_step: RowCallback | None = None, cache: KVCache | CacheSource | None = None, steps: Steps = Steps(),
) -> list[tuple[list[int], GenerationStats]]:
    """Medusa decoding of B prompts: propose -> verify -> accept -> compact, until every row has stopped.

    drafter: heads (or `PromptLookup`), whose `proposer(model, tree)` fills each step's tree from each
    row's last accepted node. With greedy or rejection acceptance each row's output is plain decoding's,
    in distribution and, when greedy, token for token. `cache`: one to reuse (see `reuse_cache`), B rows
    of block_size + N slots; by default a new one. `steps`: the eager steps, or compiled ones.
    """
    if not isinstance(tree, Tree):  # else an AttributeError in the proposer
        raise TypeError(f"tree is a Tree, e.g. tree.preset('cpu') or Tree.from_choices([[0], [1]]), not {tree!r}")
    if not hasattr(drafter, "proposer"):  # else an AttributeError here
        raise TypeError(f"drafter is heads (heads.make_heads) or a PromptLookup(), not {drafter!r}")
    proposer = drafter.proposer(model, tree)
    rows = Generations(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, on_step=on_step)
    B, N = len(rows.prompts), proposer.tree.num_nodes
    # Slots beyond block_size hold a tree's nodes; their positions are still < block_size.
    cache, roots, hidden = rows.start(model, cache, slots=model.config.block_size + N, sampling=sampling,
                                      generator=generator)
    lengths = list(map(len, rows.prompts))
    while rows.active:
        # Room for the whole tree in every row (the usual step): no node to mask.
        room = len(rows.active) == B and all(has_room(n, proposer.tree.depth, s) for n, s in zip(lengths, rows.stop_at))
        step = steps.medusa(model, cache, proposer, roots, hidden, history=rows.history(),
                            stop_at=None if room else rows.stop_at_device, sampling=sampling, generator=generator,
                            attended=max(lengths) + N)
        for b in rows.active:
            lengths[b] += len(step.paths[b])
        rows.emit(step.new_tokens, step=True, accepted=[len(path) - 1 for path in step.paths])
        roots, hidden = step.next_roots, step.next_hidden
    return list(zip(rows.out, rows.stats))


def _one_row(on_step: Callable[[list[int]], None] | None) -> RowCallback | None:
    return None if on_step is None else (lambda b, tokens: on_step(tokens))


def generate(model: GPT, prompt: list[int] | torch.Tensor, *, on_step: Callable[[list[int]], None] | None = None,
             **kwargs) -> tuple[list[int], GenerationStats]:
    """`generate_batch` for one prompt: (new tokens, statistics). on_step(tokens) after every step."""
    return generate_batch(model, [prompt], on_step=_one_row(on_step), **kwargs)[0]


def medusa_generate(model: GPT, drafter: Drafter, prompt: list[int] | torch.Tensor, *,
                    on_step: Callable[[list[int]], None] | None = None, **kwargs) -> tuple[list[int], GenerationStats]:
    """`medusa_generate_batch` for one prompt: (new tokens, statistics). on_step(tokens) after every step."""
    return medusa_generate_batch(model, drafter, [prompt], on_step=_one_row(on_step), **kwargs)[0]
