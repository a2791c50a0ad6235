"""Dependent draft heads (Hydra, arXiv 2402.05109; Clover, arXiv 2405.00263) in Medusa's tree.

Medusa's head k guesses token t+k+1 from h_t alone: it cannot know which tokens the tree put before
its guess, so its q is a marginal over every path, and a node's children are the same top-k whatever
the node holds. A dependent head k reads h_t *and* the embeddings of the k tokens before its target
(x_{t+1} = the root, then the drafted path): q(x_{t+k+1} | h_t, x_{t+1..t+k}). So the tree is filled
depth by depth, each node's children drawn from its own conditional q, with one batched head call per
depth (every node of depth d - 1 at once).

Each head is Medusa's residual block with a wider input: z = h + SiLU(W_k [h; e(x_{t+1}); ...;
e(x_{t+k})] + b_k), W_k zero-initialised (so an untrained head, like Medusa's, starts as the backbone's
next-token prediction), then the backbone's shared lm_head; e is the backbone's token embedding (wte).
Only the input differs from Medusa's heads, so a comparison isolates what dependence buys.
Trained teacher-forced: at position t, head k reads the true tokens t+1..t+k (`next_tokens`).

Verification and acceptance are Medusa's, unchanged: greedy still emits plain greedy's tokens, and
rejection sampling stays exactly lossless because every node tries its children against the q they
were drawn from (`Draft.rows`: one q per parent node instead of one per depth).

Shapes: B batch, T tokens, K heads, C n_embd, V vocabulary, N tree nodes, M nodes of one depth,
R draws per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from .heads import HeadsConfig, MedusaHeads
from .proposal import Draft, Proposal, draft_log_probs
from .sampling import Sampling, draw_without_replacement
from .tree import Tree


class HydraHead(nn.Module):
    """Head k: h + SiLU(W [h; e_1; ...; e_k] + b), W zero-initialised (starts as the identity on h)."""

    def __init__(self, n_embd: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.linear = nn.Linear((k + 1) * n_embd, n_embd)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden [..., C], embeds [..., k, C] (the k tokens before the target) -> features [..., C]."""
        x = torch.cat([hidden, embeds.flatten(-2)], dim=-1)  # [..., (k + 1) C]
        return hidden + F.silu(self.linear(x))


class HydraHeads(nn.Module):
    """K dependent heads sharing the backbone's lm_head and token embedding (both passed at call time,
    so the state dict holds only the heads)."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.kind != "hydra":
            raise ValueError(f"HydraHeads needs a config of kind 'hydra', not {config.kind!r}")
        if config.own_lm_head:
            raise ValueError("hydra heads share the backbone's lm_head: own_lm_head is not supported")
        self.config = config
        self.blocks = nn.ModuleList([HydraHead(config.n_embd, k) for k in range(1, config.num_heads + 1)])

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_logits(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor, *, lm_head: nn.Module,
                    wte: nn.Embedding) -> torch.Tensor:
        """q's logits for head k (1-based): hidden [..., C], tokens [..., >= k] (x_{t+1}, ...) -> [..., V]."""
        embeds = wte(tokens[..., :k])  # [..., k, C]
        return lm_head(self.blocks[k - 1](hidden, embeds))

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, *, tokens: torch.Tensor | None = None,
                wte: nn.Embedding | None = None) -> torch.Tensor:
        """Teacher-forced: hidden [..., C], tokens [..., K] (the true x_{t+1..t+K}) -> logits [K, ..., V]."""
        if tokens is None or wte is None:
            raise ValueError("hydra heads read the tokens drafted before their target: pass tokens= and wte= "
                             "(hydra.next_tokens), or decode through medusa_mini.hydra.HydraProposer")
        return torch.stack([self.head_logits(k, hidden, tokens, lm_head=lm_head, wte=wte)
                            for k in range(1, self.num_heads + 1)])


def make_heads(config: HeadsConfig, *, lm_head_weight: torch.Tensor | None = None) -> nn.Module:
    """The heads a config describes: Medusa's (kind "medusa") or dependent ones (kind "hydra")."""
    if config.kind == "hydra":
        return HydraHeads(config)
    return MedusaHeads(config, lm_head_weight=lm_head_weight)


def next_tokens(y: torch.Tensor, k: int) -> torch.Tensor:
    """The k tokens after each position, teacher-forced: y [B, T] (y[:, t] = token t+1) -> [B, T, k].

    out[:, t, j] = y[:, t + j] (token t+j+1); 0 past the end, where no head has a target anyway.
    """
    B, T = y.shape
    out = torch.zeros(B, T, k, dtype=y.dtype, device=y.device)
    for j in range(min(k, T)):
        out[:, : T - j, j] = y[:, j:]
    return out


def teacher_forced_logits(heads, hidden: torch.Tensor, y: torch.Tensor, model, *,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
    """The heads' logits, teacher-forced: hidden [B, T', C] at `positions` [T'] of y (default all T),
    y [B, T] the true next tokens -> [K, B, T', V].

    Medusa's heads ignore y; dependent heads read the true tokens before their targets."""
    if heads.config.kind != "hydra":
        return heads(hidden, model.lm_head)
    tokens = next_tokens(y, heads.num_heads)  # [B, T, K]
    if positions is not None:
        tokens = tokens[:, positions]  # [B, T', K]
    return heads_logits(heads, hidden, model, tokens=tokens)


def heads_logits(heads, hidden: torch.Tensor, model, *, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [..., C] -> [K, ..., V] for either kind of heads; tokens [..., K] (x_{t+1..t+K}, teacher-forced)
    are read by dependent heads only."""
    if heads.config.kind == "hydra":
        return heads(hidden, model.lm_head, tokens=tokens, wte=model.transformer.wte)
    return heads(hidden, model.lm_head)


# ---- decoding: filling the tree depth by depth ---------------------------------------------------


@dataclass(frozen=True)
class Level:
    """The nodes of one depth d >= 1 and where their tokens come from (tensors on one device)."""

    depth: int
    parents: list[int]  # the M nodes of depth d - 1 with children
    parent_paths: torch.Tensor  # [M, d] each parent's path, root first (node indices)
    children: torch.Tensor  # [n] the nodes of depth d
    child_row: torch.Tensor  # [n] their parent's index in `parents`
    child_rank: torch.Tensor  # [n] their rank among the parent's candidates


@lru_cache(maxsize=64)
def tree_levels(tree: Tree, device: str) -> tuple[Level, ...]:
    """The tree cut into depths, built once per tree: filling it then costs D head calls per step."""
    paths = [[0]]
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents[i]] + [i])
    levels = []
    for d in range(1, tree.depth + 1):
        kids = [i for i in range(1, tree.num_nodes) if tree.depth_list[i] == d]
        parents = sorted({tree.parents[i] for i in kids})
        row = {p: j for j, p in enumerate(parents)}
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        levels.append(Level(depth=d, parents=parents, parent_paths=as_long([paths[p] for p in parents]),
                            children=as_long(kids), child_row=as_long([row[tree.parents[i]] for i in kids]),
                            child_rank=as_long([tree.choices[i - 1][-1] for i in kids])))
    return tuple(levels)


class HydraProposer:
    """A fixed tree filled by dependent heads, depth by depth: a node's children are the top-k of
    q(. | the node's path), or, for rejection sampling's sampled drafts, distinct draws from it (the
    Draft then has one q row per parent node, which acceptance tries the children against)."""

    def __init__(self, model: nn.Module, heads: HydraHeads, tree: Tree) -> None:
        tree.check_heads(heads.num_heads)
        self.model, self.heads, self.tree = model, heads, tree

    @torch.no_grad()
    def propose(self, roots: torch.Tensor, hidden: torch.Tensor, *, max_depth: int, sampling: Sampling,
                generator: torch.Generator | None) -> Proposal:
        """roots [B], hidden [B, C] -> tokens [B, N] and, for sampled drafts, their Draft; one batched
        head call per depth."""
        tree = self.tree.truncated(max(max_depth, 0))
        (B, C), device = hidden.shape, hidden.device
        tokens = torch.empty(B, tree.num_nodes, dtype=torch.long, device=device)  # [B, N]
        tokens[:, 0] = roots
        width = tree.max_rank + 1
        draws = sampling.draws_candidates and tree.num_nodes > 1
        rows = [-1] * tree.num_nodes  # node -> its row of log_q / samples (leaves have none)
        log_qs, samples, filled = [], [], 0
        for level in tree_levels(tree, str(device)):
            M, d = len(level.parents), level.depth
            path_tokens = tokens[:, level.parent_paths]  # [B, M, d]: root, then the drafted path
            logits = self.heads.head_logits(d, hidden[:, None].expand(B, M, C), path_tokens,
                                            lm_head=self.model.lm_head, wte=self.model.transformer.wte)  # [B, M, V]
            if draws:
                log_q = draft_log_probs(logits, temperature=sampling.temperature)  # [B, M, V]
                picks = draw_without_replacement(log_q, width, generator)  # [B, M, R]
                for j, p in enumerate(level.parents):
                    rows[p] = filled + j
                filled += M
                log_qs.append(log_q)
                samples.append(picks)
            else:
                picks = logits.topk(width, dim=-1).indices  # [B, M, R]
            tokens[:, level.children] = picks[:, level.child_row, level.child_rank]
        if not draws:
            return Proposal(tokens, tree)
        draft = Draft(log_q=torch.cat(log_qs, dim=1), samples=torch.cat(samples, dim=1), rows=tuple(rows))
        return Proposal(tokens, tree, draft)
