"""All of Medusa in one file that runs: read this first (paper: Cai et al. 2024, arXiv 2401.10774).

Words, each with one meaning here and in every decoding module:
  node    one token in the tree: node 0 is the root, every other a candidate. Nodes are numbered parents first.
  root    the last token already emitted, not yet in the KV cache; every path starts at it.
  choice  a node's address as a tuple of ranks, e.g. (0, 2): head 1's rank 0, then head 2's rank 2.
  rank    a position in one head's guesses: rank 0 is its most likely (or first drawn) token (DDP's: a process).
  path    the nodes from the root down to a node; the accepted path is what a step keeps.
  bonus   the token the backbone itself writes after the last accepted node (from the same pass).
  p       the backbone's (target) distribution at a node, after temperature and top-p.
  q       a head's (draft) distribution; drawn candidates come from it, each from q without the earlier draws.
  draft   to propose candidates: a drafter is draft heads (Medusa's, Hydra's) or prompt lookup.
  draft vocabulary  the tokens heads guess among (the most frequent ones; q = 0 elsewhere).
  host read  a copy of device results into Python (.tolist()): it waits for the device to finish.

One step (§2): the heads guess tokens 2, 3, ... places ahead from the last hidden state; their guesses
fill a tree; ONE forward pass of the backbone scores every node under a tree attention mask; an
acceptance rule keeps a path of candidates the backbone accepts, plus the bonus; the KV cache keeps
only that path. Greedy acceptance writes exactly plain greedy's tokens; rejection sampling exactly
plain sampling's distribution; typical acceptance (§2.3.1) trades that guarantee for longer paths.

This file is batch 1 and plain: Python ints and lists, node-by-node walks, a KV cache that grows by
torch.cat. The engine (step.py, decoding.py, acceptance.py) makes the same decisions with static
shapes, batches and one host read per step; tests hold the two to the same tokens. Inputs here are trusted.
"""

import math
from typing import TYPE_CHECKING

import torch

from .sampling import (
    Sampling,
    gumbel_top_k,
    inverse_cdf,
    q_log_probs,
    residual_after_miss,
    try_accepts,
    typical_threshold,
    without_earlier_draws,
)

if TYPE_CHECKING:  # names for the type hints only: the model and heads are passed in, never imported
    from .heads import MedusaHeads
    from .model import GPT
    from .tree import Tree


def children(parents: list[int], node: int) -> list[int]:
    """The nodes whose parent is `node`, in rank order (parents[i] is node i's parent, -1 for the root)."""
    return [c for c in range(len(parents)) if parents[c] == node]


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool, True where node i may attend to node j: j is i itself or one of its ancestors (Fig. 2).
    Siblings never see each other, so every path is scored as if it were the only continuation."""
    N = len(parents)
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j != -1 and not mask[i, j]:  # parents that are no tree (a cycle) end too
            mask[i, j] = True
            j = parents[j]
    return mask


LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [nh, L, hs] each


def forward(model: "GPT", tokens: list[int], positions: list[int], cache: list[LayerKV | None], mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """T new tokens through the backbone's own weights -> (logits [T, V], hidden [T, C]).

    cache: per layer, (keys, values) [nh, L, hs] of the L earlier tokens (None before the first call),
    grown here by the T new ones. mask: [T, L + T] bool, what each new token may attend to. Positions
    are explicit: a tree node sits at prefix length + its depth, whatever its order in `tokens`.
    """
    device = model.lm_head.weight.device
    mask = mask.to(device)
    x = model.transformer.wte(torch.tensor(tokens, device=device))
    x = x + model.transformer.wpe(torch.tensor(positions, device=device))  # [T, C]
    T, C = x.shape
    nh = model.config.n_head
    hs = C // nh
    for i, block in enumerate(model.transformer.h):
        query, key, value = block.attn.c_attn(block.ln_1(x)).split(C, dim=-1)  # 3 x [T, C] (not q: q is the draft's)
        query, key, value = (t.view(T, nh, hs).transpose(0, 1) for t in (query, key, value))  # [nh, T, hs]
        if cache[i] is not None:
            key, value = torch.cat([cache[i][0], key], dim=1), torch.cat([cache[i][1], value], dim=1)  # [nh, L + T, hs]
        cache[i] = (key, value)
        att = (query @ key.transpose(1, 2)) / math.sqrt(hs)  # [nh, T, L + T]
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ value).transpose(0, 1).reshape(T, C)  # [T, C]
        x = x + block.attn.c_proj(y)
        x = x + block.mlp(block.ln_2(x))
    hidden = model.transformer.ln_f(x)  # [T, C]
    return model.lm_head(hidden), hidden


def propose(head_logits: torch.Tensor, draft_ids: torch.Tensor, tree: "Tree", root: int, *, vocab_size: int,
            sampling: Sampling, generator: torch.Generator | None) -> tuple[list[int], list | None]:
    """Fill the tree (§2.1.1-2.1.2) -> (its tokens, root first; per node, how its children were drawn, or None):
    the node of choice (r1, ..., rd) holds head d's rank-rd guess.

    head_logits: [D', M] over the draft vocabulary draft_ids [M], one row per head of the whole tree, of which the
    first D = tree.depth are this (maybe cut) tree's. Greedy, typical and top-k rejection take each head's top-k (None);
    drawn candidates (rejection's default) come from each head's q: per node, the log q [V] its children were
    drawn from and the draws in order (`rejection_accept` needs both)."""
    D, R = tree.depth, tree.max_rank + 1
    if not sampling.draws_candidates:
        guesses = draft_ids[head_logits[:D].topk(R, dim=-1).indices].tolist()  # [D][R] token ids
        return [root] + [guesses[len(c) - 1][c[-1]] for c in tree.choices], None
    # Draw for all D' heads, use the first D: a tree cut near the end uses the same random numbers as the whole one.
    log_q = q_log_probs(head_logits, draft_ids, temperature=sampling.temperature, vocab_size=vocab_size)  # [D', V]
    u = torch.rand(log_q.shape, generator=generator, device=log_q.device)  # [D', V]: Gumbel noise's uniforms
    guesses = gumbel_top_k(log_q, R, u).tolist()  # [D'][R]
    drawn = [(log_q[d], guesses[d]) if d < D else None for d in tree.depths]  # depth d: head d + 1's q, row d
    return [root] + [guesses[len(c) - 1][c[-1]] for c in tree.choices], drawn


def verify(model: "GPT", tokens: list[int], tree: "Tree", cache: list[LayerKV | None], *, prefix: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every node in ONE forward pass (§2.1.2) -> (logits [N, V], hiddens [N, C]); `cache` grows by all N. A
    node sees the `prefix` cached tokens, its ancestors and itself, at position prefix + its depth, as if alone."""
    mask = torch.cat([torch.ones(tree.num_nodes, prefix, dtype=torch.bool), tree_attention_mask(tree.parents)], 1)
    return forward(model, tokens, [prefix + d for d in tree.depths], cache, mask)


def walk(parents: list[int], tokens: list[int], y: list[int]) -> tuple[list[int], int]:
    """From the root, descend while the backbone's token at the node, y[node], is a child's token.

    y: [N] the token the backbone writes after each node's path. Returns (accepted path, root first;
    the bonus y at the last accepted node)."""
    node, path = 0, [0]
    while (child := next((c for c in children(parents, node) if tokens[c] == y[node]), None)) is not None:
        node = child
        path.append(node)
    return path, y[node]


def greedy_accept(parents: list[int], tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance (exact): `walk` with y = the argmax of logits [N, V] at every node.

    Every emitted token is the backbone's argmax after the tokens before it: plain greedy's output, in fewer passes."""
    return walk(parents, tokens, logits.argmax(dim=-1).tolist())


def typical_accept(parents: list[int], tokens: list[int], logits: torch.Tensor, *, sampling: Sampling,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """Typical acceptance (§2.3.1): a candidate x passes if p(x) > min(ε, δ·exp(−H(p))) at its parent.

    A node is accepted if it and all its ancestors pass; the deepest accepted node wins, ties broken by
    the larger sum of log p along its path, then by the smaller node index. The bonus is drawn from p
    at the winner (the paper: its argmax). Faster than rejection sampling when p is flat, NOT p's distribution.
    p is the one sampling draws from, top-p included: a token outside the nucleus has p = 0, never passing.
    """
    p = sampling.probs(logits)  # [N, V]
    bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta).tolist()  # [N]
    N = len(parents)
    paths, ok, score, best = [[0] for _ in range(N)], [True] + [False] * (N - 1), [0.0] * N, 0  # paths[i]: root to i
    for i in range(1, N):  # parents come first, so one sweep settles every node
        par = parents[i]
        p_x = p[par, tokens[i]]
        paths[i] = paths[par] + [i]
        ok[i] = ok[par] and float(p_x) > bar[par]
        if ok[i]:
            score[i] = score[par] + float(torch.log(p_x.clamp_min(1e-30)))
            if (len(paths[i]), score[i]) > (len(paths[best]), score[best]):  # deeper, then more likely
                best = i
    u = torch.rand((), generator=generator, device=logits.device)
    return paths[best], int(inverse_cdf(sampling.probs(logits[best]), u))


def try_children(r: torch.Tensor, candidates: list[int], drawn: tuple[torch.Tensor, list[int]], u: torch.Tensor
                 ) -> tuple[int | None, torch.Tensor]:
    """Speculative sampling's tries at one node: candidates x1, x2, ... drawn from q without replacement, against
    the target r [V] (p at first), each with its own uniform u [len(candidates)]. x_i's own q_i is q without the
    draws before it (`without_earlier_draws`); after x_i misses, the next is tried against r = norm(max(0, r - q_i))
    (`residual_after_miss`). drawn: (log q [V], the draws in order). Returns (index of the accepted candidate or
    None, the r the bonus is drawn from when none is)."""
    log_q, draws = drawn
    for i, x in enumerate(candidates):
        q = without_earlier_draws(log_q, torch.tensor(draws, device=r.device), rank=draws.index(x))  # x's own q
        residual, mass = residual_after_miss(r, q)  # its mass says whether r = q up to rounding: the try needs it
        if try_accepts(r[x], q[x], u[i], live=mass > 0):
            return i, r
        if mass == 0:  # r = q up to rounding: nothing is left to try another candidate against
            return None, r
        r = residual
    return None, r


def rejection_accept(parents: list[int], tokens: list[int], logits: torch.Tensor, *, sampling: Sampling,
                     generator: torch.Generator | None, drawn: list | None = None, nodes: int | None = None
                     ) -> tuple[list[int], int]:
    """Lossless rejection sampling on a tree (Leviathan et al. 2023; for draws without replacement, recursive
    speculative decoding, arXiv 2402.14160): every emitted sequence is exactly a sample of the backbone.

    One uniform number per node is drawn first, u [N], each used at most once (`nodes`: the whole tree's
    count, of which a tree cut near the end uses the first N, only to draw what the engine draws).
    Top-k candidates (drawn None) are point masses, and then trying a node's children in turn is the
    same as drawing y from p once: child x is accepted exactly when y = x, and when no child is, y is a
    draw from p with the children removed, the bonus. So it is `walk` with y drawn from p at every node,
    node i's with u[i]. Drawn candidates (`propose`'s q per node) try each child c with u[c]
    (`try_children`); if none is accepted, the bonus is drawn from what is left of p with u[0] (no try uses the root's).
    """
    u = torch.rand(nodes or len(parents), generator=generator, device=logits.device)[: len(parents)]  # [N]
    if drawn is None:
        return walk(parents, tokens, inverse_cdf(sampling.probs(logits), u).tolist())
    node, path = 0, [0]
    while True:
        kids = children(parents, node)
        p = sampling.probs(logits[node])  # [V]
        i, r = (None, p) if not kids else try_children(p, [tokens[c] for c in kids], drawn[node], u[kids])
        if i is None:
            return path, int(inverse_cdf(r, u[0]))
        node = kids[i]
        path.append(node)


def accept(parents: list[int], tokens: list[int], logits: torch.Tensor, *, sampling: Sampling,
           generator: torch.Generator | None, drawn: list | None = None, nodes: int | None = None
           ) -> tuple[list[int], int]:
    """The acceptance rule `sampling` names: (accepted path, root first; bonus token); `nodes`: the whole
    tree's, for rejection sampling's uniforms."""
    if sampling.acceptance == "greedy":
        return greedy_accept(parents, tokens, logits)
    if sampling.acceptance == "typical":
        return typical_accept(parents, tokens, logits, sampling=sampling, generator=generator)
    return rejection_accept(parents, tokens, logits, sampling=sampling, generator=generator, drawn=drawn, nodes=nodes)


@torch.no_grad()
def medusa_generate(model: "GPT", heads: "MedusaHeads", prompt: list[int], *, tree: "Tree", max_new_tokens: int,
                    sampling: Sampling = Sampling(), eos_id: int | None = None,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa decoding, batch 1: returns (new tokens, backbone forward passes after the prefill).

    It stops at `max_new_tokens`, at the end of the context, or after `eos_id` (kept). Near the end the
    tree loses the depths whose tokens could no longer be used; its random numbers are drawn for the
    whole tree still, only so that the engine, which masks those nodes instead, makes the same draws.
    """
    tree.check_heads(heads.num_heads)  # one head per depth
    stop_at = min(len(prompt) + max_new_tokens, model.config.block_size)  # the length where we stop
    cache = [None] * model.config.n_layer
    L = len(prompt)
    logits, hidden = forward(model, prompt, list(range(L)), cache, torch.ones(L, L, dtype=torch.bool).tril())
    u = sampling.uniforms((), generator, device=logits.device)
    root, hidden = int(sampling.next_token(logits[-1], u)), hidden[-1]  # prefill: the first token
    out, steps = [root], 0
    while L + 1 < stop_at and eos_id not in out:  # L + 1 = the prompt and every emitted token
        cut = tree.truncated(stop_at - 2 - L)  # L + 1 tokens so far, and depth d adds d + 1
        head_logits = heads(hidden[None], model, num=tree.depth)[:, 0]  # [D', M]: the whole tree's heads
        tokens, drawn = propose(head_logits, heads.draft_ids, cut, root, vocab_size=model.config.vocab_size,
                                sampling=sampling, generator=generator)
        logits, hiddens = verify(model, tokens, cut, cache, prefix=L)
        path, root = accept(cut.parents, tokens, logits, sampling=sampling, generator=generator, drawn=drawn,
                            nodes=tree.num_nodes)
        keep = list(range(L)) + [L + i for i in path]  # the prefix, the root and the accepted nodes
        cache = [(k[:, keep], v[:, keep]) for k, v in cache]
        out += [tokens[i] for i in path[1:]] + [root]  # the accepted candidates, then the bonus
        L, steps, hidden = L + len(path), steps + 1, hiddens[path[-1]]
    out = out[: stop_at - len(prompt)]
    return (out[: out.index(eos_id) + 1] if eos_id in out else out), steps
