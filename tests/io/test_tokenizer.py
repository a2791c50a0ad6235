"""Byte-level BPE: the textbook algorithm's merges, used through tiktoken, saved and loaded back."""

import base64
import json
import random
import types
from collections import Counter

import pytest
import regex
import tiktoken

from medusa_mini.io.tokenizer import GPT2_SPLIT_PATTERN, load_tokenizer, make_encoding, save_tokenizer, train_bpe
from medusa_mini.train.data import load_corpus


@pytest.fixture(scope="module")
def small_text() -> str:
    return "".join(text for _, text in load_corpus(max_bytes=12_000))[:12_000]


@pytest.fixture(scope="module")
def small_encoding(small_text):
    return make_encoding(train_bpe(small_text, vocab_size=350))


def reference_bpe(text: str, n_ranks: int) -> dict[bytes, int]:
    """The textbook algorithm: recount every pair from scratch before each merge. A word is a string of one character
    per token, chr(its rank), so str.replace merges a pair left to right without overlaps."""
    ranks = {bytes([b]): b for b in range(256)}  # in rank order, as a merge appends its token
    words = Counter("".join(map(chr, w.encode("utf-8"))) for w in regex.findall(GPT2_SPLIT_PATTERN, text))
    while len(ranks) < n_ranks:
        counts: Counter = Counter()
        for word, n in words.items():
            for left, right in zip(word, word[1:]):
                counts[left + right] += n
        pair = min(counts, key=lambda p: (-counts[p], p), default=None)  # ties: the smallest ranks, left one first
        if pair is None or counts[pair] < 2:
            break
        tokens = list(ranks)
        new = chr(ranks.setdefault(tokens[ord(pair[0])] + tokens[ord(pair[1])], len(ranks)))
        words = Counter({word.replace(pair, new): n for word, n in words.items()})  # their bytes kept: still distinct
    return ranks


POOLS = [  # mixed scripts, emoji, combining marks, control characters, whitespace runs
    "abcdefghijklmnopqrstuvwxyz ABCXYZ 0123456789", " \t\n\r\n    \u00a0\u2003\u3000", "<|endoftext|>",
    "'s 're 've 'll 'd ... !?;:()[]{}<>@#$%^&*_+-=/\\|\"`~", "äöüßéèêçñåøæœ ÄÖÜ", "😀🎉👍🏽🧑‍💻🇩🇪✨",
    "Ελληνικά русский עברית العربية हिन्दी 中文字符 日本語 한국어", "e\u0301a\u0308\u200b\u200d\ufeff\x00\x01\x7f"]


def random_text(rng: random.Random, pieces: int) -> str:
    """Pieces of POOLS, and now and then any code point outside the surrogates."""
    return "".join(rng.choice(POOLS)[rng.randrange(40):][: rng.randrange(1, 12)] if rng.random() < 0.9 else
                   chr(rng.choice([rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(pieces))


@pytest.mark.parametrize("text, merges", [("", []),  # only the 256 single bytes
    ("ab ab ab cd", [b"ab", b" ab"]),  # (a, b) occurs 3 times, then (" ", ab) twice; then no pair twice
    ("ab xy ab xy", [b" x", b"ab", b" xy"]),  # ties go to the smallest pair: byte 32 < 97 < 120
    ("<|endoftext|>" * 50, [])])  # the end-of-text token's string is never learned as ordinary merges
def test_bpe_merges_the_most_frequent_pair_first_and_breaks_ties_toward_the_smallest(text, merges):
    expected = {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    assert train_bpe(text, vocab_size=400) == expected


def test_incremental_training_matches_recounting_from_scratch(small_text):
    text = small_text[:6000]
    assert "<|endoftext|>" not in text and train_bpe(text, vocab_size=381) == reference_bpe(text, 380)


def test_too_small_vocab_or_ranks_without_every_byte_are_rejected():
    pytest.raises(ValueError, train_bpe, "hello", vocab_size=256).match("vocab_size")
    assert train_bpe("hello hello", vocab_size=257) == {bytes([b]): b for b in range(256)}  # and <|endoftext|>
    pytest.raises(ValueError, make_encoding, {bytes([b]): b for b in range(255)}).match("single-byte")


def test_the_encoding_fills_vocab_size_compresses_and_round_trips_any_text_exactly(small_text, small_encoding):
    assert (small_encoding.n_vocab, small_encoding.eot_token) == (350, 349)  # end of text: the last id
    ids = small_encoding.encode_ordinary(small_text)  # text like the training text compresses
    assert len(ids) < 0.7 * len(small_text.encode("utf-8")) and 256 <= max(ids) < 349
    rng = random.Random(1234)
    texts = [random_text(rng, rng.randrange(0, 60)) for _ in range(200)]
    for text in texts + ["", " ", "\n\n\n", "   \t \n  x", "a" * 1000, " " * 257, "💥" * 40, "\r\n" * 9]:
        assert small_encoding.decode(small_encoding.encode_ordinary(text)) == text


def test_a_saved_tokenizer_is_in_tiktokens_format_and_loads_back_identical(tmp_path, monkeypatch, small_encoding):
    save_tokenizer(small_encoding, tmp_path)
    save_tokenizer(small_encoding, tmp_path)  # overwriting works too, and leaves no temporary files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.tiktoken", "tokenizer_config.json"]
    lines = (tmp_path / "tokenizer.tiktoken").read_text().splitlines()
    token, rank = lines[300].split(" ")
    assert len(lines) == 349 and base64.b64decode(token) == small_encoding.decode_single_token_bytes(int(rank))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "type": "bpe", "name": "medusa_mini", "pattern": GPT2_SPLIT_PATTERN, "special_tokens": {"<|endoftext|>": 349}}
    loaded = load_tokenizer(tmp_path)
    assert all(loaded.decode_single_token_bytes(i) == small_encoding.decode_single_token_bytes(i) for i in range(349))
    text = random_text(random.Random(7), 600)
    assert loaded.encode(text, allowed_special="all") == small_encoding.encode(text, allowed_special="all")
    # one of tiktoken's own encodings is saved whole too: loading it fetches nothing (an older save names it)
    gpt2 = types.SimpleNamespace(name="gpt2")  # tiktoken's real one would be fetched from the network
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: {"gpt2": gpt2}[name])
    named = tiktoken.Encoding("gpt2", pat_str=f"(?:{GPT2_SPLIT_PATTERN})", special_tokens={"<|endoftext|>": 349},
                              mergeable_ranks={small_encoding.decode_single_token_bytes(i): i for i in range(349)})
    assert (ref := load_tokenizer(save_tokenizer(named, tmp_path / "ref"))).encode(text) == small_encoding.encode(text)
    assert ref._pat_str == named._pat_str  # its own pattern saved: tiktoken's gpt2 is not GPT2_SPLIT_PATTERN
    (tmp_path / "ref" / "tokenizer_config.json").write_text(json.dumps({"type": "tiktoken", "name": "gpt2"}))
    assert load_tokenizer(tmp_path / "ref") is gpt2


DAMAGE = {  # name: (the file the error must name, what is done to it, f)
    "no config": ("tokenizer_config.json", lambda f: f.unlink()),
    "config a folder": ("tokenizer_config.json", lambda f: f.unlink() or f.mkdir()),
    "config not json": ("tokenizer_config.json", lambda f: f.write_text("{not json")),
    "unknown type": ("tokenizer_config.json", lambda f: f.write_text('{"type": "sentencepiece"}')),
    "no ranks": ("tokenizer.tiktoken", lambda f: f.unlink()),
    "bad base64": ("tokenizer.tiktoken", lambda f: f.write_text(f.read_text() + "!!!! 400\n")),
    "bad rank": ("tokenizer.tiktoken", lambda f: f.write_text(f.read_text() + "QUJD x\n")),
    "duplicate rank": ("tokenizer.tiktoken", lambda f: f.write_text(f.read_text() + "QUJDREVG 3\n")),
    "duplicate token": ("tokenizer.tiktoken", lambda f: f.write_text((t := f.read_text()) + t.split()[0] + " 9999\n")),
    "missing byte": ("tokenizer.tiktoken", lambda f: f.write_text(f.read_text().split("\n", 1)[1])),
    "negative rank": ("tokenizer.tiktoken", lambda f: f.write_text(f.read_text() + "QUJD -1\n")),
    "special id a rank": ("tokenizer.tiktoken", lambda f: (c := f.with_name("tokenizer_config.json")).write_text(
        c.read_text().replace(": 349", ": 3")))}


@pytest.mark.parametrize("culprit, damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_missing_or_corrupt_tokenizer_gives_one_line_naming_the_file(tmp_path, small_encoding, damage, culprit):
    damage(path := save_tokenizer(small_encoding, tmp_path / "a" / "tok") / culprit)
    err = str(pytest.raises(ValueError, load_tokenizer, path.parent).value)
    assert "\n" not in err and culprit in err and (f"{culprit} is missing" in err) == (not path.exists())
    assert ("is a folder, not a file; save the tokenizer again" in err) == path.is_dir()
