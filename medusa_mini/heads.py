"""Draft heads (paper §2.1.1): K extra heads that guess tokens further ahead from one hidden state.

Head k (1-based) reads the backbone's last hidden state h_t and guesses token t+k+1, while the
backbone's own lm_head predicts t+1. Two kinds, one interface:

- `MedusaHeads`: head k is `h + SiLU(W_k h + b_k)`, W_k zero-initialised, so an untrained head starts as
  the backbone's next-token prediction. It cannot know which tokens the tree put before its guess, so
  its q is a marginal, and every node of one depth gets the same guesses.
- `HydraHeads` (Hydra, arXiv 2402.05109): head k also reads the embeddings of the k tokens before its
  target, `h + SiLU(W_k [h; e(x_{t+1}); ...; e(x_{t+k})] + b_k)` (Hydra's own heads add a learned projection of
  these inputs where this one adds h), so each node's children come from their own q: the tree fills depth by depth.

Both project through the backbone's own lm_head (shared; the paper: a copy per head) onto a *draft vocabulary*:
the M most frequent tokens of the text the heads learned from (FR-Spec, arXiv 2502.14856). At a real vocabulary
this projection is most of what the heads cost; the backbone still verifies over the whole vocabulary, so every
acceptance rule stays what it is (rejection sampling's residual carries the tokens q never proposes).

Each kind carries what differs, so no caller asks which kind it holds: its logits (`forward`: training,
measuring, the reference's decoding; Hydra's teacher-forced), the engine's (`logits_of`), its proposer's class and
its `description`. The proposer class's `fill_tree` is the one function that fills the engine's trees.

Shapes: K heads, C n_embd, V vocabulary, M draft vocabulary, B rows, `...` any leading dims.
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .proposal import HeadsProposer, HydraProposer, MedusaProposer
from .tree import Tree

HEAD_KINDS = ("medusa", "hydra")
IGNORE = -100  # F.cross_entropy's default ignore_index: a position with no target


@dataclass
class HeadsConfig:
    num_heads: int = 4
    n_embd: int = 256
    vocab_size: int = 2048
    draft_vocab_size: int = 0  # M: guesses come from vocab_order's first M (`use_draft_vocabulary`; 0: all)
    kind: str = "medusa"  # see HEAD_KINDS

    def __post_init__(self) -> None:
        least = {"num_heads": 1, "n_embd": 1, "vocab_size": 1, "draft_vocab_size": 0}
        if bad := [k for k, n in least.items() if not (isinstance(getattr(self, k), int) and getattr(self, k) >= n)]:
            raise ValueError(f"{bad[0]} must be an integer >= {least[bad[0]]}, not {getattr(self, bad[0])!r}")
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}: use one of {', '.join(HEAD_KINDS)}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be 0 (the whole vocabulary) to {self.vocab_size}, "
                             f"not {self.draft_vocab_size}")
        if self.draft_vocab_size == self.vocab_size:  # one spelling of the whole vocabulary: 0
            self.draft_vocab_size = 0


def make_heads(config: HeadsConfig) -> "DraftHeads":
    """The heads a config describes: the one place that reads `config.kind`."""
    return {"medusa": MedusaHeads, "hydra": HydraHeads}[config.kind](config)


def next_tokens(y: torch.Tensor, k: int, *, fill: int = 0) -> torch.Tensor:
    """The k tokens after each position, teacher-forced: y [B, T] (y[:, t] = token t+1) -> [B, T, k].
    out[:, t, j] = y[:, t + j] (token t+j+1); `fill` past the end (0, unread; `head_targets`' IGNORE: no target)."""
    B, T = y.shape
    out = torch.full((B, T, k), fill, dtype=y.dtype, device=y.device)
    for j in range(min(k, T)):
        out[:, : T - j, j] = y[:, j:]
    return out


def frequency_order(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids [V], most frequent in `tokens` first (ties: the smaller id): the draft vocabulary's order."""
    counts = torch.bincount(tokens.flatten().cpu().long(), minlength=vocab_size)[:vocab_size]
    return counts.argsort(descending=True, stable=True)


class DraftHeads(nn.Module):
    """What both kinds share: the config and the draft vocabulary."""

    name = ""  # what reports call them
    description = ""
    reads_the_draft = False  # True for Hydra's: they read the drafted tokens, so reference.py cannot decode them

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        # vocab_order: token ids, most frequent first (saved). draft_ids [M]: its first M, ascending (not saved),
        # sorted only when the order is set or loaded, never per step.
        self.register_buffer("vocab_order", torch.arange(config.vocab_size))
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size or config.vocab_size), persistent=False)
        self.register_load_state_dict_post_hook(DraftHeads.sort_draft_ids)  # for a loaded order

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def sort_draft_ids(self, *_load_result) -> None:
        self.draft_ids = self.vocab_order[: self.config.draft_vocab_size or self.config.vocab_size].sort().values

    def use_draft_vocabulary(self, order: torch.Tensor, size: int) -> None:
        """Guess among the first `size` tokens of `order` [V] (0 or V: the whole vocabulary)."""
        if sorted(order.tolist()) != list(range(self.config.vocab_size)):
            raise ValueError("the draft vocabulary's order must hold every token id once")
        self.config = replace(self.config, draft_vocab_size=size)  # checked anew; a copy: other heads keep theirs
        self.vocab_order.copy_(order)
        self.sort_draft_ids()

    def draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids [...] (IGNORE where none) as indices into the draft vocabulary; a token outside
        it becomes IGNORE too: the heads cannot guess it, so training does not ask them to."""
        if not self.config.draft_vocab_size:
            return tokens
        ids = self.draft_ids.to(tokens.device)
        index = torch.full((self.config.vocab_size,), IGNORE, dtype=torch.long, device=tokens.device)
        index[ids] = torch.arange(ids.numel(), device=tokens.device)
        return torch.where(tokens == IGNORE, IGNORE, index[tokens.clamp(min=0)])

    def draft_weight(self, model: nn.Module) -> torch.Tensor:
        """[M, C]: the rows of the backbone's lm_head for the draft vocabulary (the whole matrix for all V)."""
        weight = model.lm_head.weight
        return weight[self.draft_ids] if self.config.draft_vocab_size else weight

    proposer_class: type[HeadsProposer]  # each kind's, whose `fill_tree` makes every tree of these heads

    def logits_of(self, model: nn.Module) -> Callable:
        """The heads' logits for decoding, the function the kind's proposer calls, with
        what every call shares (the draft vocabulary's lm_head rows, ...) made once, here, and detached: Medusa's
        takes (hidden [B, C], num) -> [B, num, M]; Hydra's (k, hidden [B, n, C], tokens [B, n, k]) -> [B, n, M]."""
        raise NotImplementedError

    def proposer(self, model: nn.Module, tree: Tree) -> HeadsProposer:
        """The proposer of one generation (`logits_of` made once, here, not at every step) of heads that fit `model`."""
        w = model.transformer.wte.weight  # [V, C]
        ours = (self.config.n_embd, self.config.vocab_size, self.blocks[0].linear.weight.dtype, self.vocab_order.device)
        if ours != (theirs := (w.shape[1], w.shape[0], w.dtype, w.device)):
            raise ValueError("heads of width {}, {} tokens, {} on {} cannot draft for a backbone of width {}, {} "
                             "tokens, {} on {}".format(*ours, *theirs))
        return self.proposer_class(tree, self.logits_of(model), draft_ids=self.draft_ids,
                                   vocab_size=self.config.vocab_size, num_heads=self.num_heads, heads=self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero, so the block starts as the identity."""

    def __init__(self, n_in: int, n_embd: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_embd)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., C] -> [..., C]; `inputs` [..., n_in] (default x) is what W reads."""
        return x + F.silu(self.linear(x if inputs is None else inputs))


class MedusaHeads(DraftHeads):
    """K residual blocks on h_t, then the draft vocabulary's rows of the backbone's lm_head."""

    name = "Medusa"
    proposer_class = MedusaProposer
    description = ("Medusa heads: head k reads only this hidden state, so every node of one depth holds "
                   "the same head's guesses.")

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList([ResBlock(config.n_embd, config.n_embd) for _ in range(config.num_heads)])

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's W_k and b_k stacked, [K C, C] and [K C]: one matmul runs all the heads' blocks."""
        return (torch.cat([block.linear.weight for block in self.blocks]),
                torch.cat([block.linear.bias for block in self.blocks]))

    def residual(self, hidden: torch.Tensor, num: int, blocks: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Head k's h + SiLU(W_k h + b_k) for the first `num` heads, hidden [..., C] -> [..., num, C], with every
        head's block in one matmul (blocks: `stacked`)."""
        C, (w, b) = self.config.n_embd, blocks
        z = F.linear(hidden, w[: num * C], b[: num * C]).unflatten(-1, (num, C))  # [..., num C] -> [..., num, C]
        return hidden.unsqueeze(-2) + F.silu(z)  # [..., 1, C] + [..., num, C]

    def forward(self, hidden: torch.Tensor, model: nn.Module, *, following: torch.Tensor | None = None,
                num: int | None = None) -> torch.Tensor:
        """hidden [..., C] -> logits [K', ..., M] of the first `num` heads (default all K); `following` unread."""
        z = self.residual(hidden, self.num_heads if num is None else num, self.stacked())  # [..., K', C]
        return F.linear(z.movedim(-2, 0), self.draft_weight(model))  # [K', ..., M]

    def logits_of(self, model: nn.Module) -> Callable:
        """logits_of(hidden [B, C], num) -> [B, num, M], the first `num` heads' logits for decoding: the
        blocks' stacked weights and the draft vocabulary's lm_head rows made once, detached, and one
        matmul over B·num rows (no copy of any weight at a call)."""
        blocks, weight = tuple(t.detach() for t in self.stacked()), self.draft_weight(model).detach()
        return lambda hidden, num: F.linear(self.residual(hidden, num, blocks), weight)


class HydraHeads(DraftHeads):
    """K dependent heads: head k reads h_t and the embeddings (the backbone's wte) of x_{t+1..t+k}."""

    name = "Hydra"
    reads_the_draft = True
    proposer_class = HydraProposer
    description = ("Dependent (hydra) heads: head k reads this hidden state and the k tokens before its "
                   "guess (the root, then the drafted path), so every node's children come from that "
                   "node's own q; the tree is filled depth by depth, one head call per depth.")

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        C = config.n_embd
        self.blocks = nn.ModuleList([ResBlock((k + 1) * C, C) for k in range(1, config.num_heads + 1)])

    def one_head_logits(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor, model: nn.Module, *,
                        weight: torch.Tensor) -> torch.Tensor:
        """Head k (1-based): hidden [..., C], tokens [..., >= k] (x_{t+1}, ...), weight [M, C] -> logits [..., M]."""
        embeds = model.transformer.wte(tokens[..., :k]).flatten(-2)  # [..., k C]
        z = self.blocks[k - 1](hidden, torch.cat([hidden, embeds], dim=-1))  # [..., C]
        return F.linear(z, weight)

    def forward(self, hidden: torch.Tensor, model: nn.Module, *, following: torch.Tensor | None = None,
                num: int | None = None) -> torch.Tensor:
        """Teacher-forced: hidden [..., C], following [..., K] (`next_tokens`: x_{t+1..t+K}) -> logits [K', ..., M]."""
        if following is None:
            raise ValueError("hydra heads read the tokens drafted before their target: pass following= "
                             "(heads.next_tokens), or decode through heads.proposer")
        weight = self.draft_weight(model)
        logits = [self.one_head_logits(k, hidden, following, model, weight=weight)
                  for k in range(1, (self.num_heads if num is None else num) + 1)]
        return torch.stack(logits) if logits else F.linear(hidden[None][:0], weight)  # [K', ..., M] (K' may be 0)

    def logits_of(self, model: nn.Module) -> Callable:
        """logits_of(k, hidden [B, n, C], tokens [B, n, k]) -> [B, n, M], head k's logits for decoding: the
        draft vocabulary's lm_head rows gathered once, detached."""
        weight = self.draft_weight(model).detach()
        return lambda k, hidden, tokens: self.one_head_logits(k, hidden, tokens, model, weight=weight)
