"""Shared fixtures: tiny random models and checkpoints, so the whole spec runs in seconds on a CPU."""

import functools
import itertools
import json
import math
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

from medusa_mini.decoding import generate  # noqa: E402
from medusa_mini.heads import DraftHeads, HeadsConfig, MedusaHeads, make_heads  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402
from medusa_mini.proposal import MedusaProposer  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.tree import Tree  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: no worker then idles at the end while the other runs a long test it met last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise


@torch.no_grad()
def peaked(model: GPT) -> GPT:
    """GPT-2's init gives nearly uniform logits; larger random weights give varied, peaked distributions,
    so acceptance actually happens and argmax ties are rare. A tied lm_head changes with wte, in place."""
    for name, p in model.named_parameters():
        if p.dim() == 2 and "wpe" not in name:
            p.normal_(0.0, 0.3)
    return model.eval()


def tiny_model(seed: int = 0, *, vocab_size: int = 64, block_size: int = 64, n_layer: int = 2) -> GPT:
    """A peaked GPT whose lm_head is untied too (a tied one makes a model that repeats its input)."""
    torch.manual_seed(seed)
    model = peaked(GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32)))
    model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, 32) * 0.3)
    return model


@torch.no_grad()
def scrambled(heads: DraftHeads) -> DraftHeads:
    """Zero-initialised heads all agree with the backbone; random weights make them differ."""
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.5)
    return heads.eval()


def random_heads(model: GPT, *, num_heads: int = 4, seed: int = 0, kind: str = "medusa", draft: int = 0) -> DraftHeads:
    """Heads of random weights; draft > 0: guessing among `draft` tokens of a random order (seeded too)."""
    torch.manual_seed(seed)
    V = model.config.vocab_size
    heads = scrambled(make_heads(HeadsConfig(num_heads=num_heads, n_embd=model.config.n_embd, vocab_size=V, kind=kind)))
    if draft:
        heads.use_draft_vocabulary(torch.randperm(V, generator=torch.Generator().manual_seed(seed)), draft)
    return heads


RULES = {  # every acceptance rule, at a temperature where candidates are often accepted
    "greedy": Sampling(), "typical": Sampling(acceptance="typical", temperature=0.8),
    "rejection": Sampling(temperature=0.8),  # candidates drawn from the heads' q
    "rejection-topk": Sampling(temperature=0.8, candidates="topk")}


# Acceptance tables acc[head][rank] shaped like measured ones: greedy's (top-1 guesses), and drawn candidates'.
VICUNA = torch.tensor([[a * 0.45**r for r in range(10)] for a in (0.56, 0.32, 0.20, 0.15)])
DRAWN = torch.tensor([[a * 0.3**r for r in range(10)] for a in (0.35, 0.28, 0.26, 0.25)])


def assert_frequency(count: int, n: int, p: float) -> None:
    """count of n draws is within five standard deviations (at most sqrt(1/4n)) of probability p."""
    assert abs(count / n - p) < 5 * math.sqrt(0.25 / n)


@pytest.fixture
def model() -> GPT:
    return tiny_model()


def random_tree(rng: random.Random) -> Tree:
    """Depth 1-5, up to 4 children per node (some nodes none), every prefix present."""
    depth, width, choices, frontier = rng.randint(1, 5), rng.randint(1, 4), [], [()]
    for _ in range(depth):
        frontier = [parent + (r,) for parent in frontier for r in range(rng.randint(0, width))] or [frontier[0] + (0,)]
        choices += frontier
    return Tree.from_choices(choices)


class OracleHeads:
    """Heads that know `sequences`, so deep acceptance and the compaction of many slots get exercised (random
    heads accept almost nothing). They find where they are from the hidden state alone (the nearest backbone
    state along them), so they serve the reference, the engine and batches alike. Head k's guess of the token
    k + 1 places after the root ranks r with chance true_rank_probs[r], else far below the top 10; they guess
    among `draft_ids` (default all); every other guess is random."""

    def __init__(self, model: GPT, sequences: list[list[int]], *, num_heads: int = 4, true_rank_probs=(1.0,),
                 seed: int = 0, draft_ids: torch.Tensor | None = None):
        self.num_heads, self.V = num_heads, model.config.vocab_size
        self.draft_ids = torch.arange(self.V) if draft_ids is None else draft_ids
        index = {t: i for i, t in enumerate(self.draft_ids.tolist())}
        with torch.no_grad():  # state t of a sequence produced its token t + 1, the root
            self.states = torch.cat([model(torch.tensor([s]))[1][0] for s in sequences]).float()  # [S, C]
        futures = [[index.get(s[t + k + 2], -1) if t + k + 2 < len(s) else -1 for k in range(num_heads)]
                   for s in sequences for t in range(len(s))]  # [S, K] draft indices
        gen, cum = torch.Generator().manual_seed(seed), torch.tensor(list(itertools.accumulate(true_rank_probs)))
        rank = torch.searchsorted(cum, torch.rand(len(futures), num_heads, generator=gen), right=True).tolist()
        self.logits = torch.rand(len(futures), num_heads, len(self.draft_ids), generator=gen)  # [S, K, M] in [0, 1)
        for j, k in itertools.product(range(len(futures)), range(num_heads)):
            tok, r = futures[j][k], rank[j][k]
            if tok >= 0:  # exactly r other tokens above the true one; far below the top 10 when "absent"
                top = self.logits[j, k].clone().index_fill_(0, torch.tensor([tok]), -1.0).sort(descending=True).values
                self.logits[j, k, tok] = 2.0 if r == 0 else (top[r - 1] + top[r]) / 2 if r < len(cum) else -1.0

    def proposer(self, model: GPT, tree) -> MedusaProposer:
        return MedusaProposer(tree, lambda hidden, num: self(hidden, model, num=num).transpose(0, 1),
                              draft_ids=self.draft_ids, vocab_size=self.V, num_heads=self.num_heads)

    def __call__(self, hidden: torch.Tensor, model: GPT, *, num: int | None = None, following=None) -> torch.Tensor:
        row = torch.cdist(hidden.reshape(-1, hidden.shape[-1]).float(), self.states).argmin(dim=1)  # [m]
        return self.logits[row].permute(1, 0, 2).reshape(self.num_heads, *hidden.shape[:-1], -1)[:num]  # [K', ..., M]


class ContinuationHeads(OracleHeads):
    def __init__(self, model: GPT, *prompts: list[int], max_new_tokens: int, **kwargs):
        super().__init__(model, [list(p) + generate(model, p, max_new_tokens=max_new_tokens)[0] for p in prompts],
                         **kwargs)


# ---- checkpoint directories, as train_tiny.py leaves them (the io wing, imported only here) -----

WORDS = "the a cat dog sat ran on under mat tree house red blue big small quickly slowly and then".split()
PROMPTS = ["the cat sat on the", "a big dog ran", "then the small red"]
FAST = ["--preset", "smoke", "--max-bytes", "60000", "--vocab-size", "300", "--backbone-steps", "6",
        "--heads-steps", "4", "--distill-prompts", "8", "--distill-tokens", "12", "--eval-prompts", "2",
        "--batch-size", "4", "--block-size", "64", "--n-embd", "32", "--log-every", "1000"]  # train_tiny.py in seconds


def save_tiny(directory, *, kind: str | None) -> str:
    """A peaked two-layer GPT (random heads of `kind`, or None), its tokenizer and prompts.json; the folder."""
    from medusa_mini.io.tokenizer import make_encoding, train_bpe

    rng = random.Random(0)  # a corpus of 300 random sentences
    text = ".\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(300)) + "."
    enc = make_encoding(train_bpe(text, vocab_size=300))
    torch.manual_seed(0)
    model = peaked(GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=64, n_layer=2, n_head=2, n_embd=32)))
    torch.nn.init.zeros_(model.transformer.wte.weight[enc.eot_token])  # rarely chosen, so runs reach their limits
    heads = scrambled(make_heads(HeadsConfig(4, 32, enc.n_vocab, kind=kind))) if kind else None
    save_directory(directory, model, heads, enc, PROMPTS, extra={"eot_id": enc.eot_token})
    return str(directory)


def save_small_checkpoint(directory) -> None:
    """A one-layer GPT, three fresh heads (each guessing the backbone's next token), tokenizer, prompts.json."""
    from medusa_mini.io.tokenizer import make_encoding, train_bpe

    enc = make_encoding(train_bpe("the cat sat on the mat and the dog sat on the log. " * 40, vocab_size=300))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    heads = MedusaHeads(HeadsConfig(num_heads=3, n_embd=32, vocab_size=300))
    save_directory(directory, model, heads, enc, ["the cat sat", "on the mat and", "the dog", "sat on the log. the"])


def save_directory(directory, model: GPT, heads, enc, prompts: list[str], **kwargs) -> None:
    from medusa_mini.io.checkpoint import save_checkpoint
    from medusa_mini.io.tokenizer import save_tokenizer

    save_checkpoint(directory, model, heads=heads, **kwargs)
    save_tokenizer(enc, directory)
    with open(os.path.join(directory, "prompts.json"), "w") as f:
        json.dump({"prompts": prompts}, f)


# ---- what the command-line tests share ------------------------------------------------------


@pytest.fixture
def one_thread():
    """One torch thread: a model this small gains nothing from threads, and on a busy machine their
    spinning costs seconds (command lines run with whatever the session left)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def refused(capsys, main, argv: list[str]) -> str:
    """What `main` writes to stderr as it refuses argv: one line, nothing on stdout, exit status 2."""
    exc, (out, err) = pytest.raises(SystemExit, main, argv), capsys.readouterr()
    assert exc.value.code == 2 and err.count("\n") == 1 and out == "", (err, out)
    return err


@pytest.fixture
def one_run_each(monkeypatch):
    """decode.py --compare times each generation once, not the fastest of three: the same tokens."""
    import decode
    from medusa_mini.cli.runs import compare

    monkeypatch.setattr(decode, "compare", functools.partial(compare, repeat=1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("ckpt"), kind="medusa")
