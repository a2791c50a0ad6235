"""benchmarks/peers.py on a tiny checkpoint: every row is there, every greedy row reproduces transformers'
greedy output token for token, and the forward-pass counts add up."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

pytest.importorskip("transformers")

from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.io.checkpoint import save_checkpoint  # noqa: E402
from medusa_mini.io.tokenizer import make_encoding, save_tokenizer, train_bpe  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks import peers  # noqa: E402

WORDS = "the a cat dog sat ran on under mat tree house red blue big small quickly slowly and then".split()
PROMPTS = ["the cat sat on the", "a big dog ran under the red"]
NEW = 12
GREEDY = ("transformers_greedy", "transformers_prompt_lookup", "transformers_assisted", "plain_greedy",
          "medusa_greedy")
SAMPLING = ("medusa_typical", "medusa_rejection", "transformers_sampling", "plain_sampling")


def save_tiny(
    directory, enc, *, n_layer: int, n_embd: int, seed: int, with_heads: bool, eot_scale: float = 1.0
) -> None:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=64, n_layer=n_layer, n_head=2, n_embd=n_embd)).eval()
    with torch.no_grad():
        # Larger weights than GPT-2's init give clear argmaxes, so a numerical difference between the two
        # implementations cannot hide behind a near-tie. wte stays tied to lm_head (one tensor, in place).
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wpe" not in name:
                p.normal_(0.0, 0.3)
        # A larger end-token embedding makes greedy decoding emit it mid-output: no row may stop there.
        model.transformer.wte.weight[enc.eot_token] *= eot_scale
    heads = None
    if with_heads:
        heads = MedusaHeads(HeadsConfig(num_heads=4, n_embd=n_embd, vocab_size=enc.n_vocab))
        with torch.no_grad():
            for block in heads.blocks:
                torch.nn.init.normal_(block.linear.weight, std=0.5)
    save_checkpoint(directory, model, heads=heads, extra={"eot_id": enc.eot_token}, eos_token_id=enc.eot_token)
    save_tokenizer(enc, directory)
    with open(os.path.join(directory, "prompts.json"), "w") as f:
        json.dump({"prompts": PROMPTS}, f)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    rng = random.Random(0)
    text = ".\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(300))
    enc = make_encoding(train_bpe(text, vocab_size=300))
    ckpt, draft = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("draft")
    save_tiny(ckpt, enc, n_layer=2, n_embd=32, seed=0, with_heads=True, eot_scale=1.5)
    save_tiny(draft, enc, n_layer=1, n_embd=16, seed=1, with_heads=False)
    return str(ckpt), str(draft), enc.eot_token


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_peers(capsys, *args: str) -> dict:
    code = peers.main([*args, "--json", "--max-new-tokens", str(NEW), "--num-prompts", "2", "--threads", "1"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_every_row_runs_greedy_rows_equal_transformers_greedy_and_pass_counts_add_up(dirs, capsys):
    ckpt, draft, eot = dirs
    result = run_peers(capsys, "--ckpt", ckpt, "--draft", draft)
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ["transformers_greedy", "transformers_prompt_lookup", "transformers_assisted",
                          "plain_greedy", "medusa_greedy", "medusa_typical", "medusa_rejection",
                          "transformers_sampling", "plain_sampling"]
    base = rows["transformers_greedy"]["tokens"]
    assert len(base) == len(PROMPTS) and all(len(t) == NEW for t in base)
    assert any(eot in t[:-1] for t in base)  # generation went on past an end token
    for key in GREEDY:
        assert rows[key]["tokens"] == base, key
        assert rows[key]["identical_to_greedy"] is True
    for key in SAMPLING:
        assert rows[key]["identical_to_greedy"] is None
        assert all(len(t) == NEW for t in rows[key]["tokens"])
    assert result["notes"] == []
    plain = len(PROMPTS) * (NEW - 1)  # one pass per token after the prefill's
    for key in ("transformers_greedy", "plain_greedy", "transformers_sampling", "plain_sampling"):
        assert rows[key]["steps"] == plain, key
        assert rows[key]["tokens_per_step"] == 1.0
    for key in ("transformers_prompt_lookup", "transformers_assisted", "medusa_greedy", "medusa_typical",
                "medusa_rejection"):
        assert 1 <= rows[key]["steps"] <= plain, key
        assert rows[key]["tokens_per_step"] == pytest.approx(plain / rows[key]["steps"])
    assert rows["transformers_greedy"]["speedup"] == 1.0


def test_without_draft_the_assisted_row_is_skipped_with_a_note(dirs, capsys):
    ckpt, _, _ = dirs
    result = run_peers(capsys, "--ckpt", ckpt)
    keys = [r["key"] for r in result["rows"]]
    assert "transformers_assisted" not in keys and "medusa_greedy" in keys
    assert any("assisted" in note and "--draft" in note for note in result["notes"])


def test_table_shows_machine_facts_and_command(dirs, capsys):
    ckpt, _, _ = dirs
    assert peers.main(["--ckpt", ckpt, "--max-new-tokens", "4", "--num-prompts", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for text in ("transformers greedy", "medusa_mini Medusa greedy", "torch ", "transformers ", "threads 1",
                 "max-new-tokens 4", "tree cpu", "command: python benchmarks/peers.py --ckpt"):
        assert text in out, text


def test_too_long_a_budget_and_a_foreign_draft_are_one_line_errors(dirs, tmp_path, capsys):
    ckpt, _, _ = dirs
    with pytest.raises(SystemExit) as e:
        peers.main(["--ckpt", ckpt, "--max-new-tokens", "100", "--threads", "1"])
    assert e.value.code == 2 and "context" in capsys.readouterr().err
    other = make_encoding(train_bpe("completely different text " * 50, vocab_size=280))
    save_tiny(tmp_path, other, n_layer=1, n_embd=16, seed=2, with_heads=False)
    with pytest.raises(SystemExit) as e:
        peers.main(["--ckpt", ckpt, "--draft", str(tmp_path), "--max-new-tokens", "4", "--threads", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "tokenizer" in err and len(err.strip().splitlines()) == 1


def test_a_row_that_breaks_the_token_budget_is_a_one_line_error(dirs, monkeypatch, capsys):
    message = "medusa_mini plain greedy did not generate exactly 4 tokens per prompt"

    def broken_benchmark(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(peers, "benchmark", broken_benchmark)
    with pytest.raises(SystemExit) as e:
        peers.main(["--ckpt", dirs[0], "--max-new-tokens", "4", "--threads", "1"])
    assert e.value.code == 2 and capsys.readouterr().err == f"peers.py: error: {message}\n"


def test_without_transformers_exit_2_names_the_extra(dirs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SystemExit) as e:
        peers.main(["--ckpt", dirs[0]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("peers.py: error: ") and '.[peers]' in err


def test_repeats_keep_the_fastest_run_and_must_make_the_same_tokens(monkeypatch):
    seconds = iter([5.0, 2.0, 9.0])  # three timed runs after an untimed warm-up: the fastest counts
    monkeypatch.setattr(peers, "timed", lambda device, fn: (fn(), next(seconds)))
    calls = []
    method = peers.Method("m", "m", True, lambda ids, n: calls.append(ids) or ([7] * n, 3))
    rows = peers.benchmark([method], [[1, 2]], max_new_tokens=4, device=torch.device("cpu"), repeat=3)
    assert rows[0]["seconds"] == 2.0 and len(calls) == 4

    outputs = iter([[1] * 4, [1] * 4, [2] * 4])  # the warm-up, then a run that repeats differently
    flaky = peers.Method("f", "flaky", True, lambda ids, n: (next(outputs), 3))
    monkeypatch.setattr(peers, "timed", lambda device, fn: (fn(), 1.0))
    with pytest.raises(RuntimeError, match="other tokens on a repeat"):
        peers.benchmark([flaky], [[1, 2]], max_new_tokens=4, device=torch.device("cpu"), repeat=2)
