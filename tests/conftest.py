"""Shared fixtures: tiny random models and checkpoints, so the whole spec runs in seconds on a CPU."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the command-line scripts (decode.py, train_tiny.py, benchmarks/) are tested too
    sys.path.insert(0, ROOT)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2`: one core per worker, or the workers' threads fight
    torch.set_num_threads(1)

from medusa_mini.heads import DraftHeads, HeadsConfig, MedusaHeads, make_heads  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402
from medusa_mini.proposal import MedusaProposer  # noqa: E402
from medusa_mini.tree import Tree  # noqa: E402


def tiny_model(seed: int = 0, *, vocab_size: int = 64, block_size: int = 64, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32)
    model = GPT(config).eval()
    # GPT-2's init gives nearly uniform logits and, with tied embeddings, a model that repeats its
    # input. Larger random weights and an untied output layer give varied, peaked distributions, so
    # acceptance actually happens and argmax ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and "wpe" not in name:
                p.normal_(0.0, 0.3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, 32) * 0.3)
    return model


def random_heads(model: GPT, *, num_heads: int = 4, seed: int = 0, kind: str = "medusa") -> DraftHeads:
    torch.manual_seed(seed)
    cfg = model.config
    heads = make_heads(HeadsConfig(num_heads=num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, kind=kind))
    with torch.no_grad():  # zero-initialised heads all agree with the backbone; make them differ
        for block in heads.blocks:
            torch.nn.init.normal_(block.linear.weight, std=0.5)
    return heads.eval()


@pytest.fixture
def model() -> GPT:
    return tiny_model()


def random_tree(rng: random.Random) -> Tree:
    """Depth 1-5, up to 4 children per node (some nodes none), every prefix present."""
    depth, width = rng.randint(1, 5), rng.randint(1, 4)
    choices, frontier = [], [()]
    for _ in range(depth):
        frontier = [parent + (r,) for parent in frontier for r in range(rng.randint(0, width))] or [frontier[0] + (0,)]
        choices += frontier
    return Tree.from_choices(choices)


class ContinuationHeads:
    """Heads that know the future, so deep acceptance and the compaction of many slots get exercised
    (random heads accept almost nothing). They know the backbone's greedy continuation of each prompt and
    recognise where they are from the hidden state alone (the nearest of the backbone's states along a
    prompt and its continuation), so they serve the reference, the engine and batches alike. There, head
    k's rank-0 guess is the token k places ahead (if `draft_ids` holds it); every other guess is random.
    """

    def __init__(self, model: GPT, *prompts: list[int], max_new_tokens: int, num_heads: int = 4, seed: int = 0,
                 draft_ids: torch.Tensor | None = None):
        from medusa_mini.decoding import generate

        self.num_heads, self.V = num_heads, model.config.vocab_size
        self.seqs = [list(p) + generate(model, p, max_new_tokens=max_new_tokens)[0] for p in prompts]
        with torch.no_grad():  # per continuation [S, C]: state j produced seq[j + 1]
            self.states = [model(torch.tensor([seq]))[1][0] for seq in self.seqs]
        self.gen = torch.Generator().manual_seed(seed)
        self.config = HeadsConfig(num_heads=num_heads, n_embd=model.config.n_embd, vocab_size=self.V)
        self.draft_ids = torch.arange(self.V) if draft_ids is None else draft_ids  # the tokens it guesses among

    def proposer(self, model: GPT, tree) -> MedusaProposer:
        return MedusaProposer(tree, lambda hidden, num: self(hidden, model, num=num).transpose(0, 1),
                              draft_ids=self.draft_ids, vocab_size=self.V, num_heads=self.num_heads)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, model: GPT, *, num: int | None = None, following=None) -> torch.Tensor:
        B = hidden.shape[0]
        logits = torch.rand(self.num_heads, B, self.V, generator=self.gen)
        for seq, states in zip(self.seqs, self.states):
            nearest = torch.cdist(hidden.float(), states.float()).min(dim=-1)  # [B]
            for b in range(B):
                if nearest.values[b] < 0.05:  # rounding apart: the same prefix (other prefixes are ~1 away)
                    j = int(nearest.indices[b])  # this state produced seq[j + 1], the root
                    for k, tok in enumerate(seq[j + 2 : j + 2 + self.num_heads]):
                        logits[k, b, tok] = 10.0
        return logits[:num, ..., self.draft_ids].to(hidden.device)  # [K', B, M]


# ---- checkpoint directories, as train_tiny.py leaves them (the io wing, imported only here) -----

WORDS = "the a cat dog sat ran on under mat tree house red blue big small quickly slowly and then".split()
PROMPTS = ["the cat sat on the", "a big dog ran", "then the small red"]


def corpus(n_sentences: int = 300) -> str:
    rng = random.Random(0)
    sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(n_sentences))
    return ".\n".join(sentences) + "."


def save_tiny(directory, *, with_heads: bool) -> None:
    from medusa_mini.io.checkpoint import save_checkpoint
    from medusa_mini.io.tokenizer import make_encoding, save_tokenizer, train_bpe

    enc = make_encoding(train_bpe(corpus(), vocab_size=300))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        # GPT-2's small init makes near-uniform logits; larger weights give clear argmaxes. The tie of
        # wte and lm_head survives because both names point at one tensor, changed in place.
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wpe" not in name:
                p.normal_(0.0, 0.3)
        model.transformer.wte.weight[enc.eot_token].zero_()  # rarely chosen, so runs reach their limits
    heads = None
    if with_heads:
        heads = MedusaHeads(HeadsConfig(num_heads=4, n_embd=32, vocab_size=enc.n_vocab))  # the backbone's lm_head
        with torch.no_grad():
            for block in heads.blocks:
                torch.nn.init.normal_(block.linear.weight, std=0.5)
    save_checkpoint(directory, model, heads=heads, extra={"eot_id": enc.eot_token})
    save_tokenizer(enc, directory)
    with open(os.path.join(directory, "prompts.json"), "w") as f:
        json.dump({"prompts": PROMPTS}, f)


def save_small_checkpoint(directory):
    """A one-layer GPT with three heads, its tokenizer and prompts.json, as train_tiny.py leaves them."""
    from medusa_mini.io.checkpoint import save_checkpoint
    from medusa_mini.io.tokenizer import make_encoding, save_tokenizer, train_bpe

    text = "the cat sat on the mat and the dog sat on the log. " * 40
    enc = make_encoding(train_bpe(text, vocab_size=300))
    save_tokenizer(enc, directory)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    heads = MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=300))
    save_checkpoint(directory, model, heads=heads)
    prompts = ["the cat sat", "on the mat and", "the dog", "sat on the log. the"]
    (directory / "prompts.json").write_text(json.dumps({"prompts": prompts}))


# ---- what the command-line tests share ------------------------------------------------------


@pytest.fixture
def one_thread():
    """One torch thread for the test: a model this small gains nothing from threads, and on a busy
    machine their spinning costs seconds (command lines run with whatever the session left)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with Medusa heads, saved as train_tiny.py leaves one."""
    d = tmp_path_factory.mktemp("ckpt")
    save_tiny(d, with_heads=True)
    return str(d)
