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

from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.io.checkpoint import save_checkpoint  # noqa: E402
from medusa_mini.io.tokenizer import make_encoding, save_tokenizer, train_bpe  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402


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


def random_heads(model: GPT, *, num_heads: int = 4, seed: int = 0, own_lm_head: bool = False) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = model.config
    heads = MedusaHeads(
        HeadsConfig(num_heads=num_heads, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, own_lm_head=own_lm_head),
        lm_head_weight=model.lm_head.weight,
    )
    with torch.no_grad():  # zero-initialised heads all agree with the backbone; make them differ
        for block in heads.blocks:
            torch.nn.init.normal_(block.linear.weight, std=0.5)
    return heads.eval()


@pytest.fixture
def model() -> GPT:
    return tiny_model()


class ContinuationHeads:
    """Heads that know the future, so deep acceptance and the compaction of many slots get exercised
    (random heads accept almost nothing). They know the backbone's greedy continuation of one prompt
    and are not told the step: they recognise where they are from the hidden state alone (the nearest
    of the backbone's states along prompt + continuation), so they serve the reference, the engine and
    batches alike.

    At a hidden state that produced token t of the continuation, head k's rank-0 guess is the token k
    places after t; other ranks are random. Off the greedy continuation (sampling), every rank is random.
    """

    def __init__(self, model: GPT, prompt: list[int], *, max_new_tokens: int, num_heads: int = 4, seed: int = 0):
        from medusa_mini.decoding import generate

        self.num_heads, self.V = num_heads, model.config.vocab_size
        self.seq = list(prompt) + generate(model, prompt, max_new_tokens=max_new_tokens)[0]
        with torch.no_grad():
            self.states = model(torch.tensor([self.seq]))[1][0]  # [S, C]: state j produced seq[j + 1]
        self.gen = torch.Generator().manual_seed(seed)
        self.config = HeadsConfig(num_heads=num_heads, n_embd=model.config.n_embd, vocab_size=self.V)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, lm_head: torch.nn.Module, *, num: int | None = None) -> torch.Tensor:
        B = hidden.shape[0]
        logits = torch.rand(self.num_heads, B, self.V, generator=self.gen)
        distance = torch.cdist(hidden.float(), self.states.float())  # [B, S]
        nearest = distance.min(dim=-1)
        for b in range(B):
            if nearest.values[b] < 0.05:  # rounding apart: the same prefix (other prefixes are ~1 away)
                j = int(nearest.indices[b])  # this state produced seq[j + 1], the root
                for k, tok in enumerate(self.seq[j + 2 : j + 2 + self.num_heads]):
                    logits[k, b, tok] = 10.0
        return logits[:num].to(hidden.device)


# ---- checkpoint directories, as train_tiny.py leaves them ------------------------------------

WORDS = "the a cat dog sat ran on under mat tree house red blue big small quickly slowly and then".split()
PROMPTS = ["the cat sat on the", "a big dog ran", "then the small red"]


def corpus(n_sentences: int = 300) -> str:
    rng = random.Random(0)
    sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(n_sentences))
    return ".\n".join(sentences) + "."


def save_tiny(directory, *, with_heads: bool) -> None:
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
        heads = MedusaHeads(HeadsConfig(num_heads=4, n_embd=32, vocab_size=enc.n_vocab))
        with torch.no_grad():
            for block in heads.blocks:
                torch.nn.init.normal_(block.linear.weight, std=0.5)
    save_checkpoint(directory, model, heads=heads, extra={"eot_id": enc.eot_token})
    save_tokenizer(enc, directory)
    with open(os.path.join(directory, "prompts.json"), "w") as f:
        json.dump({"prompts": PROMPTS}, f)


def save_small_checkpoint(directory):
    """A one-layer GPT with three heads, its tokenizer and prompts.json, as train_tiny.py leaves them."""
    text = "the cat sat on the mat and the dog sat on the log. " * 40
    enc = make_encoding(train_bpe(text, vocab_size=300))
    save_tokenizer(enc, directory)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    heads = MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=300), lm_head_weight=model.lm_head.weight)
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
