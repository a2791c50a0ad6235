"""Greedy decoding replayed from the heads' ranks: the exact tokens per step of any tree, and the ceiling.

Greedy decoding reproduces the backbone's greedy continuation token for token, whatever the tree, so
which path a step accepts depends only on where each head ranked its target at the position the step
reads. `greedy_ranks` writes those ranks down once per continuation (heads_accuracy.json stores them);
`replay_greedy` then gives any tree's tokens per step without decoding, and `replay_ceiling` the most
any tree of the heads' top guesses could give. Tree sizing (sizing.py) chooses budgets on the first;
the sweep and training's summary print the second, the room a better choice of nodes could still win.

Shapes: K heads, m positions, R ranks, L sequence length.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..hydra import heads_logits
from ..model import GPT
from ..tree import Tree
from .acceptance_tables import MISS, HeadsFn, _following, _with_prompt_lens


@torch.no_grad()
def greedy_ranks(
    model: GPT, heads: HeadsFn, sequences: list[list[int]] | torch.Tensor, *,
    prompt_lens: int | Sequence[int], top_k: int = 10,
) -> list[str]:
    """Per greedy continuation, per position: at which rank each head guessed its target.

    One string per sequence; for every hidden state decoding can read heads from (positions P-1 to
    L-2), K characters: head k's rank of token t + k + 2 ("0".."9"), or MISS when it is not among the
    top_k (<= 10) guesses or lies beyond the sequence, then a space. Greedy decoding of the prompt
    reproduces the continuation token for token, so these strings replay it exactly (`replay_greedy`).
    """
    seqs, plens = _with_prompt_lens(sequences, prompt_lens)
    top_k = min(top_k, 10)
    out = []
    for s, P in zip(seqs, plens):
        idx = torch.tensor([s], dtype=torch.long, device=model.device)  # [1, L]
        _, hidden = model(idx, logits_at=slice(0, 0))  # [1, L, C]
        t = torch.arange(max(P - 1, 0), len(s) - 1, device=model.device)  # [m]
        following = _following(heads, idx)
        tokens = None if following is None else following[0, t]  # [m, K]
        guesses = heads_logits(heads, hidden[0, t], model, tokens=tokens).topk(top_k, dim=-1).indices  # [K, m, R]
        K = guesses.shape[0]
        ahead = t[None] + torch.arange(2, K + 2, device=model.device)[:, None]  # [K, m]
        target = idx[0, ahead.clamp(max=len(s) - 1)]  # [K, m]
        match = (guesses == target[..., None]) & (ahead < len(s))[..., None]  # [K, m, R]
        rank = torch.where(match.any(-1), match.int().argmax(-1), top_k)  # [K, m]
        out.append(" ".join("".join(MISS if r == top_k else str(r) for r in col) for col in rank.t().tolist()))
    return out


def replay_greedy(ranks: list[str], tree: Tree) -> float:
    """Tokens per step that greedy Medusa decoding with `tree` makes on the sequences behind `ranks`.

    Exact, not an estimate: decoding reads the heads at one position per step and accepts the longest
    tree path whose ranks match there (accept a nodes: a + 1 tokens, the bonus counted; the next step
    reads a + 1 positions later). Near the end the tree is cut to the depth that still fits, as
    `medusa_generate` does. Unlike the product rule it sees that the heads' errors are correlated and
    that decoding meets the hard positions (where the last step stopped) more often than easy ones.
    """
    nodes = set(tree.choices)
    emitted = steps = 0
    for text in ranks:
        cols = text.split()
        n = len(cols)  # new tokens (positions P-1 .. L-2: one per new token)
        produced = 1
        while produced < n:
            col, path, accepted = cols[produced - 1], (), 0
            for r in col[: n - produced - 1]:  # deeper nodes would reach past the sequence
                if r == MISS or (path := path + (int(r),)) not in nodes:
                    break
                accepted += 1
            produced += accepted + 1
            emitted, steps = emitted + accepted + 1, steps + 1
    if steps == 0:
        raise ValueError("the rank strings hold no step to replay: continuations of 2+ tokens needed")
    return emitted / steps


def replay_ceiling(ranks: list[str], *, below: int = 10) -> float:
    """The most tokens per step any tree of the heads' top `below` guesses, fixed or dynamic, can make
    on the sequences behind `ranks`: an upper bound for `replay_greedy` of every tree with ranks < below.

    A step reading position i can accept at most run(i) nodes, the leading depths whose target is among
    the top `below` guesses there, and a tree may hold that path or only part of it; every sequence of
    n - 1 new tokens takes the fewest steps found by dynamic programming from its end. A tree that held
    each step's whole path comes close but not always to it: a longer jump can land on a harder position.
    The gap to a tree's replay is what choosing nodes could still win.
    """
    if not 1 <= below <= 10:
        raise ValueError(f"below must be a rank count from 1 to 10 (rank strings hold ranks 0-9), not {below}")
    emitted = steps = 0
    for text in ranks:
        cols = text.split()
        n = len(cols)
        fewest = [0] * (n + 1)  # fewest[i]: steps still needed once i tokens are produced
        for i in range(n - 1, 0, -1):
            run = 0
            for r in cols[i - 1][: n - i - 1]:
                if r == MISS or int(r) >= below:
                    break
                run += 1
            fewest[i] = 1 + min(fewest[i + a + 1] for a in range(run + 1))
        if n > 1:
            emitted, steps = emitted + n - 1, steps + fewest[1]
    if steps == 0:
        raise ValueError("the rank strings hold no step to replay: continuations of 2+ tokens needed")
    return emitted / steps
