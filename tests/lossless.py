"""The apparatus of the lossless tests: exact sequence distributions by enumeration, sampled rows compared
with them under a rigorous bound, and drafters whose heads know the future.

The heads here read each row's tokens so far (which every proposer is given) and return the backbone's
own logits further ahead, so the top-ranked candidates are plain greedy's continuation and paths are
long. Which heads propose never changes what a lossless rule emits, only how fast: heads that help are
fair, and they reach the deep nodes where a wrong rule shows."""

import itertools
import math
from collections import Counter
from operator import itemgetter

import torch

from conftest import tiny_model
from medusa_mini import generate_batch, medusa_generate_batch, sampling_probs
from medusa_mini.proposal import HydraProposer, MedusaProposer

V = 4  # the vocabulary of the distribution tests: 4^n sequences of n tokens, enumerated
FALSE_ALARM = 1e-4  # the chance that an honest sampler's TV crosses `tv_bound`, per comparison


def small_model(seed: int, *, block_size: int = 16):
    """tiny_model on the 4-token vocabulary, its position embeddings as large as its token embeddings
    (tiny_model leaves them near zero), so a node scored at the wrong position gets a visibly different p."""
    model = tiny_model(seed, vocab_size=V, block_size=block_size)
    torch.nn.init.normal_(model.transformer.wpe.weight, 0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


@torch.no_grad()
def exact_sequence_probs(model, prompt, n, *, temperature, top_p=1.0, eos_id=None) -> dict:
    """P(x1..xn | prompt) of every sequence over the tiny vocabulary, by the chain rule in one forward.
    With eos_id a sequence ends at its first end token (kept), holding the mass of all that share it."""
    V, P = model.config.vocab_size, len(prompt)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # [V^n, n]
    logits, _ = model(torch.cat([torch.tensor(prompt).expand(len(seqs), P), seqs[:, :-1]], dim=1))
    p = sampling_probs(logits[:, P - 1 :], temperature=temperature, top_p=top_p)  # [V^n, n, V]
    probs = dict(zip(map(tuple, seqs.tolist()), p.gather(2, seqs[..., None])[..., 0].double().prod(dim=1).tolist()))
    return marginal(probs, lambda seq: seq[: seq.index(eos_id) + 1] if eos_id in seq else seq)


@torch.no_grad()
def last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """The backbone's logits after each sequence (its last block_size tokens): [len(seqs), V], one padded
    forward (causal: the padding after a sequence never reaches its last position)."""
    seqs = [s[-model.config.block_size :] for s in seqs]
    return model(torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True),
                 logits_at=torch.tensor([len(s) - 1 for s in seqs]))[0][:, 0]


class Remembering:
    """Mixed in before a proposer: keeps each step's history (every row's tokens, ending with its root) for heads."""

    def propose(self, roots, hidden, *, history, **kwargs):
        self.history = history
        return super().propose(roots, hidden, history=history, **kwargs)


class FutureHeads:
    """A Medusa drafter that knows the future: head k gives gamma x the backbone's logits after the root and
    the k - 1 greedy tokens after it (gamma = 1: head 1's q is p at the root; a large gamma makes q nearly a
    point mass on the top-k) over draft_ids (default all): its guesses depend on the depth alone."""

    class Proposer(Remembering, MedusaProposer):
        """Fills its tree from its heads' logits, which read each row's history."""

    def __init__(self, *, gamma: float = 1.0, draft_ids: torch.Tensor | None = None) -> None:
        self.gamma, self.draft_ids = gamma, draft_ids

    def proposer(self, model, tree):
        ids = torch.arange(model.config.vocab_size) if self.draft_ids is None else self.draft_ids

        def logits_of(*args):
            return self.gamma * self.ahead(model, proposer.history, *args)[..., ids]
        proposer = self.Proposer(tree, logits_of, draft_ids=ids, vocab_size=model.config.vocab_size,
                                 num_heads=tree.depth)  # as many heads as the tree asks for
        return proposer

    def ahead(self, model, history, hidden, num):
        """[B, num, V]: the backbone's logits after each row's root, then after 1, ..., num - 1 greedy tokens more."""
        seqs, out = [list(h) for h in history], []
        for _ in range(num):
            out.append(last_logits(model, seqs))
            seqs = [s + [t] for s, t in zip(seqs, out[-1].argmax(dim=-1).tolist())]
        return torch.stack(out, dim=1)


class FutureHydraHeads(FutureHeads):
    """Dependent heads that know the future: head k, given the root and the path drafted below it, gives
    gamma x the backbone's logits after exactly that path, so each node's children come from its own q."""

    class Proposer(Remembering, HydraProposer):
        """Fills its tree depth by depth from its heads' logits, which read each row's history."""

    def ahead(self, model, history, k, hidden, paths):
        """paths [B, n, >= k] (each row's root, then the drafted path) -> [B, n, V]."""
        seqs = [tokens[:-1] + path for tokens, drafted in zip(history, paths[..., :k].tolist()) for path in drafted]
        return last_logits(model, seqs).view(*paths.shape[:2], -1)


def sample_rows(model, drafter, prompts, *, rows: int, seed: int, tree, **settings):
    """Per prompt, [(tokens, stats)] of its `rows` rows in one medusa_generate_batch (drafter None:
    generate_batch, plain sampling) over copies of `prompts` interleaved: rows are independent samples."""
    gen = torch.Generator().manual_seed(seed)
    results = (generate_batch(model, prompts * rows, generator=gen, **settings) if drafter is None else
               medusa_generate_batch(model, drafter, prompts * rows, generator=gen, tree=tree, **settings))
    return [results[i :: len(prompts)] for i in range(len(prompts))]


def deepest(rows) -> int:
    return max(max(stats.accepted_nodes, default=0) for _, stats in rows)


def tv_bound(exact: dict, M: int) -> float:
    """What the TV between M honest samples and `exact` exceeds with probability < FALSE_ALARM: its mean
    is at most 1/2 Σ sqrt(p(1-p)/M) (Jensen), and one sample moves it by at most 1/M, so by McDiarmid's
    inequality P(TV > mean + t) <= exp(-2 M t^2). Rigorous for any number of outcomes, large or small."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / M) for p in exact.values())
    return mean + math.sqrt(math.log(1 / FALSE_ALARM) / (2 * M))


def marginal(dist: dict, key) -> dict:
    """The distribution of key(seq) when seq is distributed as `dist`."""
    out: dict = {}
    for seq, p in dist.items():
        out[key(seq)] = out.get(key(seq), 0.0) + p
    return out


def failures(rows, exact: dict) -> list[str]:
    """How the sampled rows betray a sampler that is not `exact`: any sequence of probability 0, and each
    view whose TV crosses `tv_bound` (the whole sequence, each token, each two neighbours: slices, so
    sequences an end token cut short have their own outcomes). Empty for an honest one but for < 1e-4 a view."""
    seqs = [tuple(tokens) for tokens, _ in rows]
    found = {s: c / len(seqs) for s, c in Counter(seqs).items()}
    out = [f"{sum(exact.get(s, 0.0) == 0 for s in seqs)} sequences of probability 0"] if any(
        exact.get(s, 0.0) == 0 for s in found) else []
    n = max(map(len, exact))
    views = {"joint": slice(None), **{f"token {i + 1}": slice(i, i + 1) for i in range(n)},
             **{f"tokens {i + 1}-{i + 2}": slice(i, i + 2) for i in range(n - 1)}}
    for name, view in views.items():
        got, want = marginal(found, itemgetter(view)), marginal(exact, itemgetter(view))
        tv = 0.5 * sum(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))
        bound = tv_bound(want, len(seqs))
        if tv >= bound:
            out.append(f"{name}: TV {tv:.4f} >= bound {bound:.4f}")
    return out
