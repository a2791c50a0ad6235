"""`--compile`: the plain step and Medusa's as whole graphs, CUDA graphs on a GPU, which remove the kernel launches that
dominate decoding at batch 1. Every shape is fixed: a step reads the whole KV cache and verifies the whole tree. Through
`step.Steps` they make the eager steps' decisions from the same logits, draw for draw (in bfloat16 the longer read and
inductor's fusions may part a near-tie); prompt lookup's chains come from its eager proposer, one graph per chain
length; the prefill runs eagerly. A CUDA graph replays on the addresses it recorded and overwrites its outputs at its
next replay: `static_caches` keeps each shape's cache at one address, the steps copy out what the next call needs,
`warm_up` records each shape first. Shapes: B rows, N nodes, C n_embd, V vocabulary, Q the q a drawn tree draws from."""

import copy
from functools import lru_cache, partial
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..acceptance import Accepted, accept, acceptance_uniforms, check_uniforms
from ..decoding import CacheSource, reuse_cache
from ..model import GPT, KVCache, at_each_row
from ..proposal import Drawn, Proposal, Proposer
from ..sampling import Sampling
from ..step import StepResult, Steps, keep_path, place_tree, plain_step, read_step, usable_nodes, verify
from ..tree import TreeTensors
from .common import timed


def draft_tree(model: GPT, heads: torch.nn.Module, roots: torch.Tensor, hidden: torch.Tensor, *, tree: TreeTensors,
               temperature: float, u: torch.Tensor | None) -> tuple[torch.Tensor, Drawn | None]:
    """The heads' proposer's tree as a pure function of their weights (in a graph the draft vocabulary's
    lm_head rows are gathered at each call, a copy cheaper than launching the eager heads): roots [B],
    hidden [B, C] -> tokens [B, N] and, given the uniforms u [B, Q, V], how they were drawn."""
    return heads.proposer_class.fill_tree(tree, roots, hidden, heads.logits_of(model), draft_ids=heads.draft_ids,
                                          vocab_size=heads.config.vocab_size, temperature=temperature, u=u)


def verify_and_accept(model: GPT, cache: KVCache, tokens: torch.Tensor, *, tree: TreeTensors, stop_at: torch.Tensor,
                      sampling: Sampling, u: torch.Tensor | None, drawn: Drawn | None = None,
                      heads: torch.nn.Module | None = None, u_next: torch.Tensor | None = None,
                      attended: int | None = None) -> tuple[Accepted, torch.Tensor, torch.Tensor | None, Drawn | None]:
    """All of `step.medusa_step` after its proposal (tokens [B, N]) as one graph a step (two would hand the verify's
    logits across, which CUDA graphs free between calls): verify, accept, keep the path, and with `heads` draft the
    next step's tree (u_next its uniforms); attended: the cache slots read (compiled: None, all, one shape).
    Returns (accepted, next hidden [B, C], next tokens [B, N] or None, how they were drawn or None)."""
    check_uniforms(sampling, u)  # before the verify writes the cache
    usable, placed = usable_nodes(tree, cache.length_buffer, stop_at), place_tree(cache, tree)  # [B, N], [B, N, 2D + 5]
    logits, hiddens = verify(model, cache, tokens, tree=tree, placed=placed, attended=attended)  # [B, N, V], [B, N, C]
    accepted = accept(tree, tokens, logits, sampling=sampling, u=u, drawn=drawn, usable=usable)
    keep_path(cache, accepted, placed=placed, active=usable[:, 0])
    hidden = at_each_row(hiddens, accepted.last)  # [B, C] the hidden state that proposes next
    drafted = (None, None) if heads is None else draft_tree(model, heads, accepted.bonus, hidden, tree=tree,
                                                            temperature=sampling.temperature, u=u_next)
    return accepted, hidden, *drafted


def copied(drawn: Drawn | None) -> Drawn | None:
    """A copy in new tensors: a graph's outputs do not outlive its next replay."""
    return None if drawn is None else Drawn(drawn.log_q.clone(), drawn.draws.clone(), drawn.q_index.clone())


class CompiledMedusa:
    """`step.medusa_step`'s signature and decisions, one graph a step reading the whole cache (`attended` ignored).
    A graph that drafts the next tree of drawn candidates takes its uniforms after its own acceptance's, as the
    next eager step would draw them (one set more at a generation's last step, where a reused generator goes on)."""

    def __init__(self, compile: Callable) -> None:
        self.verify_and_accept, self.draft_tree = compile(verify_and_accept), compile(draft_tree)
        self.ahead: tuple | None = None  # (roots, proposer, sampling) the last graph drafted for, and its proposal

    def proposal(self, model: GPT, proposer: Proposer, roots: torch.Tensor, hidden: torch.Tensor, *,
                 history: list[list[int]], sampling: Sampling, generator: torch.Generator | None) -> Proposal:
        """The tree the last step drafted for these roots, else a first drawn tree in its graph, else the eager one."""
        if self.ahead is not None and all(a is b for a, b in zip(self.ahead[0], (roots, proposer, sampling))):
            return self.ahead[1]
        u = proposer.uniforms(sampling, len(roots), generator, device=roots.device)
        if u is None or proposer.heads is None or proposer.tree.depth == 0:
            return proposer.propose(roots, hidden, history=history, sampling=sampling, u=u)
        tokens, drawn = self.draft_tree(model, proposer.heads, roots.clone(), hidden.clone(),
                                        tree=proposer.tree.tensors(roots.device), temperature=sampling.temperature, u=u)
        return Proposal(tokens.clone(), proposer.tree, copied(drawn))

    @torch.no_grad()
    def __call__(self, model: GPT, cache: KVCache, proposer: Proposer, roots: torch.Tensor, hidden: torch.Tensor, *,
                 history: list[list[int]], stop_at: torch.Tensor | None, sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None, attended: int | None = None) -> StepResult:
        B, device, kw = len(roots), roots.device, dict(history=history, sampling=sampling, generator=generator)
        if stop_at is None:  # every node usable, as a tensor: one graph whatever the room
            stop_at = torch.full((B,), model.config.block_size, device=device)
        proposal = self.proposal(model, proposer, roots, hidden, **kw)
        u = acceptance_uniforms(sampling, B, proposer.tree.num_nodes, generator, device=device)
        if u is not None and u.dim() == 2 and u.shape[1] != (n := proposal.tree.num_nodes):  # for lookup's whole chain
            u = u[:, :n].clone(memory_format=torch.contiguous_format)  # fresh: a graph is made for its inputs' strides
        heads = proposer.heads if proposal.tree.depth else None  # a root alone has no next tree to draft
        u_next = proposer.uniforms(sampling, B, generator, device=device) if heads is not None else None
        accepted, next_hidden, tokens, drawn = self.verify_and_accept(
            model, cache, proposal.tokens, tree=proposal.tree.tensors(device), stop_at=stop_at, sampling=sampling,
            u=u, drawn=proposal.drawn, heads=heads, u_next=u_next)
        paths, new_tokens = read_step(proposal, accepted)
        result = StepResult(paths, new_tokens, next_roots=accepted.bonus.clone(), next_hidden=next_hidden.clone())
        drafted = None if tokens is None else Proposal(tokens.clone(), proposal.tree, copied(drawn))
        self.ahead = None if drafted is None else ((result.next_roots, proposer, sampling), drafted)
        return result


class AlignedHead(torch.nn.Module):
    """The lm_head with its V rows padded to a multiple of 64 (zeros, in a copy): logits [..., V] are a slice of
    [..., V + pad], rows whose stride cuBLAS can align. At an odd V (GPT-2's 50,257) it picks a kernel for unaligned
    rows, several times slower over a tree's nodes on an H200 (6c5e069 gives the kernels' times)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = len(weight)
        self.register_buffer("padded", F.pad(weight.detach(), (0, 0, 0, -len(weight) % 64)))  # [V + pad, C]

    @property
    def weight(self) -> torch.Tensor:  # [V, C], what the heads and the caches read
        return self.padded[: self.vocab_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.padded)[..., : self.vocab_size]


def with_aligned_head(model: GPT, *, devices: tuple[str, ...] = ("cuda",)) -> GPT:
    """On those devices a twin of `model` sharing every weight but its lm_head, an `AlignedHead`; elsewhere, or
    where V is a multiple of 64 already, `model` (a CPU gains nothing, and may round a logit's last bit otherwise)."""
    if model.device.type not in devices or model.config.vocab_size % 64 == 0:
        return model
    twin = copy.copy(model)
    twin._modules = dict(model._modules)  # its own: the lm_head set below leaves `model`'s as it is
    twin.lm_head = AlignedHead(model.lm_head.weight)
    return twin


def compile_options(device: torch.device | str, *, backend: str | Callable = "inductor") -> dict:
    """torch.compile's settings (a backend other than inductor, as the tests use, checks the capture cheaply)."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" and backend == "inductor" else None
    return dict(fullgraph=True, dynamic=False, mode=mode, backend=backend)


def compile_steps(device: torch.device | str, *, backend: str | Callable = "inductor",
                  compile: Callable | None = None) -> Steps:
    """The compiled steps (`compile`: how to compile a function; the identity runs the fixed-shape steps eagerly)."""
    compile = compile or (lambda fn: torch.compile(fn, **compile_options(device, backend=backend)))
    compiled_plain = compile(plain_step)

    def plain(model: GPT, cache: KVCache, tokens: torch.Tensor, *, sampling: Sampling = Sampling(),
              u: torch.Tensor | None = None, attended: int | None = None):  # the whole cache read: `attended` ignored
        token, logits, hidden = compiled_plain(model, cache, tokens, sampling=sampling, u=u)
        return token.clone(), logits, hidden
    return Steps(plain=plain, medusa=CompiledMedusa(compile))


def static_caches(model: GPT) -> CacheSource:
    """One KV cache per (rows, slots), shared by the warm-up and every generation of that shape."""
    @lru_cache(maxsize=None)  # positional only: a keyword call would be a second key, and cache, of one size
    def cache_of(rows: int, slots: int, /) -> KVCache:
        cache = reuse_cache(None, model, batch_size=rows, max_len=slots)
        for t in (cache.kv, cache.length_buffer, cache.rows, cache.layers):
            torch._dynamo.mark_static_address(t, guard=False)
        return cache
    return cache_of


@torch.no_grad()
def warm_up(model: GPT, steps: Steps, caches: CacheSource, *, rows: int, plain: Iterable[Sampling] = (),
            proposers: list[tuple[Proposer, Sampling]] = ()) -> float:
    """Run every shape decoding `rows` rows meets three times (under CUDA graphs the first call runs eagerly, the second
    records, the third replays): the plain step under each rule of `plain`, and for each proposer and rule every tree it
    proposes through `verify_and_accept` (and `draft_tree` where it draws a first tree), with generators of its own."""
    device, block, medusa = model.device, model.config.block_size, steps.medusa
    shapes, plain = {(p, t, s) for p, s in proposers for t in p.trees()}, set(plain)
    config = torch._dynamo.config  # each shape is one more specialisation of its function
    config.recompile_limit += len(shapes) + len(plain)
    config.accumulated_recompile_limit += len(shapes) + len(plain)
    zeros = partial(torch.zeros, dtype=torch.long, device=device)  # token ids, unless told another dtype

    def every_shape() -> None:
        for sampling in plain:
            for _ in range(3):  # each call on an emptied cache, as the decoding loops take theirs
                steps.plain(model, reuse_cache(caches, model, batch_size=rows, max_len=block), zeros(rows, 1),
                            sampling=sampling, u=sampling.uniforms((rows,), torch.Generator(device), device=device))
        for proposer, tree, sampling in shapes:
            t, hidden = tree.tensors(device), zeros(rows, model.config.n_embd, dtype=model.lm_head.weight.dtype)
            heads = proposer.heads if tree.depth else None
            u_draw = proposer.uniforms(sampling, rows, torch.Generator(device), device=device) if heads else None
            tokens, drawn = zeros(rows, tree.num_nodes), None
            for _ in range(3 if u_draw is not None else 0):
                tokens, drawn = medusa.draft_tree(model, heads, zeros(rows), hidden, tree=t,
                                                  temperature=sampling.temperature, u=u_draw)
            tokens, drawn = tokens.clone(), copied(drawn)  # what a step hands its graph
            u = acceptance_uniforms(sampling, rows, tree.num_nodes, torch.Generator(device), device=device)
            for _ in range(3):
                cache = reuse_cache(caches, model, batch_size=rows, max_len=block + proposer.tree.num_nodes)
                medusa.verify_and_accept(model, cache, tokens, tree=t, stop_at=zeros(rows) + block, sampling=sampling,
                                         u=u, drawn=drawn, heads=heads, u_next=u_draw)
    return timed(device, every_shape)[1]
