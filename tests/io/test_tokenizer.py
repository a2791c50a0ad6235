"""Spec for medusa_mini.tokenizer: byte-level BPE training and its tiktoken wrapping."""

from __future__ import annotations

import base64
import json
import random
from collections import Counter

import pytest
import regex
import tiktoken

from medusa_mini.io.tokenizer import (
    CONFIG_FILE,
    GPT2_SPLIT_PATTERN,
    RANKS_FILE,
    encoding_bytes_per_token,
    load_tokenizer,
    make_encoding,
    save_tokenizer,
    save_tokenizer_reference,
    train_bpe,
)
from medusa_mini.train.data import load_corpus


@pytest.fixture(scope="module")
def small_text() -> str:
    docs = load_corpus(max_bytes=12_000)
    return "".join(text for _, text in docs)[:12_000]


@pytest.fixture(scope="module")
def small_encoding(small_text):
    return make_encoding(train_bpe(small_text, vocab_size=350))


def reference_bpe(text: str, n_ranks: int) -> dict[bytes, int]:
    """The textbook algorithm: recount every pair from scratch before each merge."""
    words = Counter(w.encode("utf-8") for w in regex.findall(GPT2_SPLIT_PATTERN, text))
    split = [(list(w), n) for w, n in words.items()]
    vocab = [bytes([b]) for b in range(256)]
    ranks = {t: i for i, t in enumerate(vocab)}
    while len(vocab) < n_ranks:
        counts: Counter = Counter()
        for word, n in split:
            for pair in zip(word, word[1:]):
                counts[pair] += n
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        if counts[pair] < 2:
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        if merged not in ranks:
            ranks[merged] = len(vocab)
            vocab.append(merged)
        new_id = ranks[merged]
        for k, (word, n) in enumerate(split):
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == list(pair):
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            split[k] = (out, n)
    return ranks


def random_text(rng: random.Random, length: int) -> str:
    """Mixed scripts, emoji, combining marks, control characters and whitespace runs."""
    pools = [
        "abcdefghijklmnopqrstuvwxyz ABCXYZ 0123456789",
        " \t\n\r\n    \u00a0\u2003\u3000",
        "'s 're 've 'll 'd ... !?;:()[]{}<>@#$%^&*_+-=/\\|\"`~",
        "äöüßéèêçñåøæœ ÄÖÜ",
        "Ελληνικά русский עברית العربية हिन्दी 中文字符 日本語 한국어",
        "😀🎉👍🏽🧑‍💻🇩🇪✨",
        "e\u0301a\u0308\u200b\u200d\ufeff\x00\x01\x7f",
        "<|endoftext|>",
    ]
    out = []
    while sum(map(len, out)) < length:
        roll = rng.random()
        if roll < 0.1:
            # any code point outside the surrogate range
            cp = rng.randrange(0x110000 - 0x800)
            out.append(chr(cp if cp < 0xD800 else cp + 0x800))
        else:
            pool = rng.choice(pools)
            start = rng.randrange(len(pool))
            out.append(pool[start : start + rng.randrange(1, 12)])
    return "".join(out)


def test_split_pattern_is_gpt2s():
    assert GPT2_SPLIT_PATTERN == (
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    pieces = regex.findall(GPT2_SPLIT_PATTERN, "it's  x1 ok!")
    assert pieces == ["it", "'s", " ", " x", "1", " ok", "!"]


def test_bpe_starts_from_the_256_single_bytes():
    ranks = train_bpe("", vocab_size=300)
    assert ranks == {bytes([b]): b for b in range(256)}


def test_bpe_merges_the_most_frequent_pair_first():
    # words "ab", " ab", " ab", " cd": (a, b) occurs 3 times, (" ", a) twice, the rest once
    ranks = train_bpe("ab ab ab cd", vocab_size=400)
    assert ranks[b"ab"] == 256
    assert ranks[b" ab"] == 257
    assert len(ranks) == 258  # then no pair occurs twice: training stops early


def test_bpe_breaks_ties_toward_the_smallest_pair():
    # (" ", "x"), ("a", "b") and ("x", "y") all occur twice; byte 32 < 97 < 120
    ranks = train_bpe("ab xy ab xy", vocab_size=400)
    new = sorted((r, t) for t, r in ranks.items() if r >= 256)
    assert new == [(256, b" x"), (257, b"ab"), (258, b" xy")]


def test_bpe_stops_at_vocab_size_minus_special_tokens(small_text):
    ranks = train_bpe(small_text, vocab_size=300, special_tokens=("<|a|>", "<|b|>"))
    assert sorted(ranks.values()) == list(range(298))
    enc = make_encoding(ranks, special_tokens=("<|a|>", "<|b|>"))
    assert enc.n_vocab == 300


def test_incremental_training_matches_recounting_from_scratch(small_text):
    text = small_text[:6000]
    assert train_bpe(text, vocab_size=380, special_tokens=()) == reference_bpe(text, 380)


def test_special_token_strings_are_not_learned_as_merges():
    text = "<|endoftext|>" * 50
    ranks = train_bpe(text, vocab_size=400)
    assert not any(b"<|" in token or b"|>" in token for token in ranks)


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe("hello", vocab_size=256)


def test_bpe_round_trips_any_text_exactly(small_encoding):
    rng = random.Random(1234)
    for _ in range(200):
        text = random_text(rng, rng.randrange(0, 300))
        assert small_encoding.decode(small_encoding.encode_ordinary(text)) == text
    for text in ["", " ", "\n\n\n", "   \t \n  x", "a" * 1000, " " * 257, "💥" * 40, "\r\n" * 9]:
        assert small_encoding.decode(small_encoding.encode_ordinary(text)) == text


def test_encoding_uses_the_learned_merges(small_text, small_encoding):
    # Text like the training text compresses; every id decodes to a learned token.
    ids = small_encoding.encode_ordinary(small_text)
    assert len(ids) < 0.7 * len(small_text.encode("utf-8"))
    assert 256 <= max(ids) < 349


def test_special_tokens_get_ids_after_the_ranks(small_encoding):
    assert small_encoding.eot_token == 349
    assert small_encoding.n_vocab == 350
    ids = small_encoding.encode("hi<|endoftext|>", allowed_special="all")
    assert ids[-1] == 349
    assert small_encoding.decode(ids) == "hi<|endoftext|>"


def test_make_encoding_rejects_ranks_without_every_byte():
    with pytest.raises(ValueError, match="single-byte"):
        make_encoding({bytes([b]): b for b in range(255)})


def test_saved_tokenizer_loads_to_identical_encoding(tmp_path, small_encoding):
    save_tokenizer(small_encoding, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.n_vocab == small_encoding.n_vocab
    assert loaded.special_tokens_set == small_encoding.special_tokens_set
    assert loaded.eot_token == small_encoding.eot_token
    for i in range(small_encoding.n_vocab - 1):
        assert loaded.decode_single_token_bytes(i) == small_encoding.decode_single_token_bytes(i)
    text = random_text(random.Random(7), 3000)
    assert loaded.encode(text, disallowed_special=()) == small_encoding.encode(
        text, disallowed_special=()
    )


def test_saving_bare_ranks_adds_the_special_tokens(tmp_path, small_text):
    ranks = train_bpe(small_text, vocab_size=300)
    save_tokenizer(ranks, tmp_path, special_tokens=("<|endoftext|>", "<|pad|>"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("<|pad|>", allowed_special="all") == [300]
    assert loaded.n_vocab == 301


def test_rank_file_is_in_tiktokens_format_and_saving_leaves_no_temporary_files(tmp_path, small_encoding):
    save_tokenizer(small_encoding, tmp_path)
    save_tokenizer(small_encoding, tmp_path)  # overwriting works too
    assert sorted(p.name for p in tmp_path.iterdir()) == [RANKS_FILE, CONFIG_FILE]
    lines = (tmp_path / RANKS_FILE).read_text().splitlines()
    assert len(lines) == small_encoding.n_vocab - 1
    token, rank = lines[300].split(" ")
    assert base64.b64decode(token) == small_encoding.decode_single_token_bytes(int(rank))
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["type"] == "bpe"
    assert config["pattern"] == GPT2_SPLIT_PATTERN
    assert config["special_tokens"] == {"<|endoftext|>": 349}


def test_reference_tokenizer_loads_the_named_tiktoken_encoding(
    tmp_path, monkeypatch, small_encoding
):
    asked = []

    def fake_get_encoding(name):
        asked.append(name)
        return small_encoding

    monkeypatch.setattr(tiktoken, "get_encoding", fake_get_encoding)
    save_tokenizer_reference(tmp_path, name="gpt2")
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == {"type": "tiktoken", "name": "gpt2"}
    assert load_tokenizer(tmp_path) is small_encoding
    assert asked == ["gpt2"]


DAMAGE = {  # name: (the file the error must name, what is done to the saved tokenizer)
    "no directory": (CONFIG_FILE, None),
    "no config": (CONFIG_FILE, lambda config, ranks, lines: config.unlink()),
    "config not json": (CONFIG_FILE, lambda config, ranks, lines: config.write_text("{not json")),
    "unknown type": (CONFIG_FILE, lambda config, ranks, lines: config.write_text('{"type": "sentencepiece"}')),
    "no ranks": (RANKS_FILE, lambda config, ranks, lines: ranks.unlink()),
    "bad base64": (RANKS_FILE, lambda config, ranks, lines: ranks.write_text("".join(lines) + "!!!! 400\n")),
    "bad rank": (RANKS_FILE, lambda config, ranks, lines: ranks.write_text("".join(lines) + "QUJD x\n")),
    "duplicate rank": (RANKS_FILE, lambda config, ranks, lines: ranks.write_text("".join(lines) + "QUJDREVG 3\n")),
    "missing byte": (RANKS_FILE, lambda config, ranks, lines: ranks.write_text("".join(lines[1:]))),
}


@pytest.mark.parametrize("culprit, damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_missing_or_corrupt_tokenizer_is_a_clear_error(tmp_path, small_encoding, damage, culprit):
    directory = tmp_path / "tok"
    save_tokenizer(small_encoding, directory)
    config, ranks = directory / CONFIG_FILE, directory / RANKS_FILE
    if damage is None:
        directory = tmp_path / "elsewhere"
    else:
        damage(config, ranks, ranks.read_text().splitlines(keepends=True))
    with pytest.raises(ValueError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert "\n" not in message
    assert culprit in message


def test_tokenizer_trained_on_the_default_corpus_compresses_and_round_trips():
    docs = load_corpus(max_bytes=200_000)
    texts = [text for _, text in docs]
    enc = make_encoding(train_bpe("".join(texts), vocab_size=640))
    assert enc.n_vocab == 640
    assert encoding_bytes_per_token(enc, texts) > 2.5
    for text in texts[:20]:
        assert enc.decode(enc.encode_ordinary(text)) == text
