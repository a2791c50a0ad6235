"""`--compile`: the two decoding steps under torch.compile, the prefill left eager.

Decoding runs the model in three shapes: the prefill (T = prompt length, different for every prompt),
the plain step (T = 1) and the tree verify (T = N nodes, one shape per tree). The last two repeat every
step with static shapes (the cache lengths are a tensor, the masks are built from them on the device), so
each is captured once as a whole graph and replayed; on CUDA with mode="reduce-overhead", as a CUDA
graph, which removes the per-kernel launch cost that dominates batch-1 decoding. Prefills stay eager:
compiling one per prompt length would cost more than it saves.

The first call of each shape pays for the compilation; `warm_up` makes those calls before anything is
timed, for every shape a generation can meet (a tree is truncated near the end of a generation), and
reports the seconds it took so that callers can print it apart from the timings.

Under CUDA graphs a step's outputs live in the graph's own buffers until its next replay: decoding
reads each step's logits and hidden state before it runs the next step, as it must.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from ..model import GPT, KVCache
from ..step import verify
from ..tree import Tree
from .common import sync_device

RECOMPILE_LIMIT = 64


class CompiledSteps(nn.Module):
    """A GPT whose cached 1-token steps and tree verifies run compiled, everything else eager.

    Like `torch.compile(model)` it wraps the model and leaves it untouched (the eager model stays usable),
    and every attribute it does not have (config, device, lm_head, ...) is the model's, so decoding takes
    either. Unlike it, a prefill (a new shape per prompt length) stays eager.
    """

    def __init__(self, model: GPT, *, mode: str | None, backend: str | Callable = "inductor") -> None:
        super().__init__()
        self.model = model
        self.caches: dict[tuple[int, int], KVCache] = {}  # (rows, max_len) -> the one cache every generation reuses
        # dynamic=False: every shape gets its own specialised graph; there are only a handful of them.
        self.compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode, backend=backend)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules: nn.Module's own lookup
        except AttributeError:
            return getattr(self._modules["model"], name)

    def cache(self, max_len: int, *, batch_size: int = 1) -> KVCache:
        """The cache of batch_size rows and max_len slots that warm-up and every generation share: a CUDA
        graph replays on the addresses it was recorded with, so a new cache per generation would mean
        new recordings."""
        key = (batch_size, max_len)
        if key not in self.caches:
            cache = KVCache(self.model.config, batch_size=batch_size, max_len=max_len, device=self.model.device,
                            dtype=self.model.lm_head.weight.dtype, separate=True)
            # Marked static, a CUDA graph writes into the cache where it lies instead of copying it in
            # and out at every replay.
            for t in (*cache.k, *cache.v, cache._lengths):
                torch._dynamo.mark_static_address(t, guard=False)
            self.caches[key] = cache
        return self.caches[key]

    def forward(self, idx: torch.Tensor, **kwargs):
        cache = kwargs.get("cache")
        # A prefill asks for its last logits only (logits_at); a 1-token prompt's prefill stays eager too.
        is_step = cache is not None and kwargs.get("logits_at") is None and (
            idx.shape[1] == 1 or kwargs.get("attn_mask") is not None)
        if is_step:  # a captured step reads the whole cache: one shape for every step
            kwargs.pop("span", None)
        return (self.compiled if is_step else self.model)(idx, **kwargs)


def step_cache(model: GPT | CompiledSteps, max_len: int, *, batch_size: int = 1) -> KVCache | None:
    """For a model whose steps are compiled, the shared cache of batch_size rows and max_len slots;
    else None (decoding then makes its own)."""
    return model.cache(max_len, batch_size=batch_size) if isinstance(model, CompiledSteps) else None


def compile_steps(model: GPT | CompiledSteps, *, backend: str | Callable = "inductor") -> CompiledSteps:
    """`model` with its plain steps and tree verifies routed through torch.compile (`CompiledSteps`).

    mode "reduce-overhead" (CUDA graphs) on CUDA; the default mode on CPU, where there is no launch
    overhead to remove. A backend other than inductor (tests use their own) checks the capture cheaply.
    """
    if isinstance(model, CompiledSteps):
        return model
    # Every step shape is a specialisation of the one GPT.forward, which torch caps at 8 by default: a
    # deep tree's truncations, two trees and the plain step can pass that, and fullgraph then fails.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    mode = "reduce-overhead" if model.device.type == "cuda" and backend == "inductor" else None
    return CompiledSteps(model, mode=mode, backend=backend)


@torch.no_grad()
def warm_up(model: CompiledSteps, tree: Tree | None, *, batch_size: int = 1) -> float:
    """Compile every step shape decoding can meet (T = 1; the tree and each of its truncations, which
    the last steps of a generation verify), on the very caches
    decoding will reuse; returns the seconds it took. Each shape runs three times: under CUDA graphs
    the first call runs eagerly, the second records and the third is the first replay."""
    if not isinstance(model, CompiledSteps):
        raise ValueError("warm_up needs a model whose steps are compiled: call compile_steps first")
    device, B = model.device, batch_size
    sync_device(device)
    t0 = time.perf_counter()
    block = model.config.block_size
    plain_cache = model.cache(block, batch_size=B)
    for _ in range(3):
        plain_cache.lengths = 0
        model(torch.zeros(B, 1, dtype=torch.long, device=device), cache=plain_cache)
    if tree is not None:
        cache = model.cache(block + tree.num_nodes, batch_size=B)
        for t in {tree.truncated(depth) for depth in range(tree.depth + 1)}:
            tokens = torch.zeros(B, t.num_nodes, dtype=torch.long, device=device)
            for _ in range(3):
                cache.lengths = 0
                verify(model, cache, t, tokens)
    sync_device(device)
    return time.perf_counter() - t0
