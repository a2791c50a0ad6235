"""`--compile`: the plain step (T = 1, and the token it chooses), `verify_and_accept` (the tree verify, the
acceptance, keeping the path and the heads' next tree, top-k or drawn) and `draft_drawn` (a generation's
first drawn candidates) compiled by name, whole graphs, one per shape and rule, on CUDA as CUDA graphs
(mode "reduce-overhead"), which remove the kernel launches that dominate batch-1 decoding; the tree verify
alone too, which only benchmarks/bench_step.py times on its own. The prefill stays eager. A CUDA graph
replays on the addresses it recorded and overwrites its outputs at its next replay: `StaticCaches` keeps
one KV cache per shape, marked static, and `warm_up` records every shape before anything is timed."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .. import step
from ..acceptance import acceptance_uniforms
from ..model import GPT, KVCache
from ..proposal import HeadsProposer, Proposer
from ..sampling import Sampling
from .common import timed


def compile_steps(device: torch.device | str, *, backend: str | Callable = "inductor") -> step.Steps:
    """Every stage `step.Steps` names under torch.compile; CUDA graphs on CUDA (a backend other than
    inductor, as the tests use, checks the capture cheaply)."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" and backend == "inductor" else None
    options = dict(fullgraph=True, dynamic=False, mode=mode, backend=backend)
    return step.Steps(plain=torch.compile(step.plain_step, **options), verify=torch.compile(step.verify, **options),
                      verify_and_accept=torch.compile(step.verify_and_accept, **options),
                      draft_drawn=torch.compile(step.draft_drawn, **options), static=True)


class StaticCaches:
    """One KV cache per (rows, slots), shared by the warm-up and every generation of that shape."""

    def __init__(self, model: GPT) -> None:
        self.model, self.caches = model, {}

    def __call__(self, rows: int, slots: int) -> KVCache:
        if (rows, slots) not in self.caches:
            cache = KVCache(self.model.config, batch_size=rows, max_len=slots, device=self.model.device,
                            dtype=self.model.lm_head.weight.dtype)
            for t in (*cache.k, *cache.v, cache.length_buffer):
                torch._dynamo.mark_static_address(t, guard=False)
            self.caches[rows, slots] = cache
        return self.caches[rows, slots]


@torch.no_grad()
def warm_up(model: GPT, steps: step.Steps, caches: StaticCaches, *, rows: int, plain: Iterable[Sampling] = (),
            proposers: list[tuple[Proposer, Sampling]] = ()) -> float:
    """Run every shape decoding `rows` rows can meet: the plain step under each rule of `plain` (it chooses
    its token in its graph, greedy or drawn), and every tree a static step of each proposer verifies
    (`Proposer.trees`: the heads' whole tree, prompt lookup's chains) under its rule through
    `steps.verify_and_accept` (the whole tree with the proposer's heads, which draft the next one in the
    graph, top-k or drawn) and, for a first tree drawn from the heads' q, `steps.draft_drawn`: only the
    graphs the run uses. Three calls each: under CUDA graphs the first runs eagerly, the second
    records, the third replays. Returns the seconds."""
    device, block = model.device, model.config.block_size
    # (slots, tree, heads, rule, proposer): the proposer only where candidates are drawn (it makes the draft)
    shapes = {(p.tree.num_nodes, t, step.heads_in_graph(p, t, s, static=True), s,
               p if s.draws_candidates and isinstance(p, HeadsProposer) else None)
              for p, s in proposers for t in p.trees()}
    plain = set(plain)
    config = torch._dynamo.config  # each shape is one more specialisation of its function
    config.recompile_limit += len(shapes) + len(plain)
    config.accumulated_recompile_limit += len(shapes) + len(plain)

    def every_shape() -> None:
        for sampling in plain:
            for _ in range(3):
                cache = caches(rows, block)
                cache.lengths = 0
                u = sampling.uniforms((rows,), torch.Generator(device), device=device)  # not the run's
                steps.plain(model, cache, torch.zeros(rows, 1, dtype=torch.long, device=device), sampling=sampling, u=u)
        for nodes, t, heads, sampling, drawing in shapes:
            cache, tensors = caches(rows, block + nodes), t.tensors(device)
            tokens = torch.zeros(rows, t.num_nodes, dtype=torch.long, device=device)
            start = torch.zeros(rows, dtype=torch.long, device=device)
            usable = step.usable_nodes(t, start, torch.full_like(start, block))  # [rows, N]
            u = acceptance_uniforms(sampling, rows, t.num_nodes, torch.Generator(device), device=device)  # not the run's
            hidden = torch.zeros(rows, model.config.n_embd, device=device, dtype=model.lm_head.weight.dtype)
            draft = None
            if drawing is not None and steps.draft_drawn is not None and drawing.heads is not None and t.depth:
                for _ in range(3):  # a generator of its own, here and below: not the run's
                    drawn = steps.draft_drawn(model, drawing.heads, start, hidden, tree=tensors,
                                              temperature=sampling.temperature,
                                              u=drawing.draw_uniforms(rows, torch.Generator(device), device=device))
                # what decoding hands the verify (copies, `step.medusa_step`): the layouts its graph is made for
                tokens, draft = drawn[0].clone(), drawn[1].clone()
            elif drawing is not None:
                draft = drawing.propose(start, hidden, max_depth=t.depth, sampling=sampling,
                                        generator=torch.Generator(device)).draft
            # the next tree's uniforms, where the graph draws it (`step.medusa_step`)
            u_next = drawing.draw_uniforms(rows, torch.Generator(device), device=device) \
                if heads is not None and drawing else None
            for _ in range(3):
                cache.lengths = 0
                steps.verify_and_accept(model, cache, tokens, tree=tensors, usable=usable, sampling=sampling, u=u,
                                        draft=draft, heads=heads, u_next=u_next)
    return timed(device, every_shape)[1]
