"""`--compile`: the two decoding steps under torch.compile, the prefill left eager.

Decoding runs the model in three shapes: the prefill (T = prompt length, different for every prompt),
the plain step (T = 1) and the tree verify (T = N nodes, one shape per tree). The last two repeat every
step with static shapes (the cache length is a tensor, the masks are built from it on the device), so
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

from ..model import GPT, KVCache
from ..step import verify
from ..tree import Tree
from ..tune.clock import sync_device

RECOMPILE_LIMIT = 64


class CompiledSteps:
    """A stand-in for `GPT.forward`: cached 1-token steps and tree verifies compiled, the rest eager."""

    def __init__(self, forward, *, mode: str | None, backend: str | Callable = "inductor") -> None:
        self.eager = forward
        # dynamic=False: every shape gets its own specialised graph; there are only a handful of them.
        self.compiled = torch.compile(forward, fullgraph=True, dynamic=False, mode=mode, backend=backend)

    def __call__(self, idx: torch.Tensor, **kwargs):
        cache = kwargs.get("cache")
        if cache is not None and not getattr(cache, "static_for_compile", False):
            # A CUDA graph may write in place only into buffers that keep their address; marked so,
            # the cache is used where it lies instead of being copied in and out at every replay.
            for t in (*cache.k, *cache.v, cache._length):
                torch._dynamo.mark_static_address(t, guard=False)
            cache.static_for_compile = True
        is_step = cache is not None and (idx.shape[1] == 1 or kwargs.get("attn_mask") is not None)
        return (self.compiled if is_step else self.eager)(idx, **kwargs)


def compile_steps(model: GPT, *, backend: str | Callable = "inductor") -> GPT:
    """Route `model`'s plain steps and tree verifies through torch.compile (in place; returns model).

    mode "reduce-overhead" (CUDA graphs) on CUDA; the default mode on CPU, where there is no launch
    overhead to remove. A backend other than inductor (tests use "eager") checks the capture cheaply.
    """
    if isinstance(model.forward, CompiledSteps):
        return model
    # Every step shape is a specialisation of the one GPT.forward, which torch caps at 8 by default:
    # a deep tree's truncations, two trees and the plain step can pass that, and then run eagerly.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    mode = "reduce-overhead" if model.device.type == "cuda" and backend == "inductor" else None
    model.forward = CompiledSteps(model.forward, mode=mode, backend=backend)  # nn.Module.__call__ finds it
    return model


@torch.no_grad()
def warm_up(model: GPT, trees: list[Tree]) -> float:
    """Compile every step shape decoding can meet (T = 1; each tree and each of its truncations);
    returns the seconds it took. Runs on a scratch cache, so nothing of a later generation changes."""
    device = model.device
    sync_device(device)
    t0 = time.perf_counter()
    block = model.config.block_size
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    # The caches are the sizes decoding allocates (a mask spans the whole cache, so its size is a shape).
    plain_cache = KVCache(model.config, max_len=block, device=device, dtype=model.lm_head.weight.dtype)
    for _ in range(2):  # the second call of a CUDA graph is its first replay; both untimed
        plain_cache.length = 0
        model(token, cache=plain_cache)
    for tree in trees:
        cache = KVCache(model.config, max_len=block + tree.num_nodes, device=device, dtype=model.lm_head.weight.dtype)
        for depth in range(tree.depth + 1):
            t = tree.truncated(depth)
            for _ in range(2):
                cache.length = 0
                verify(model, cache, t, torch.zeros(t.num_nodes, dtype=torch.long, device=device))
    sync_device(device)
    return time.perf_counter() - t0
