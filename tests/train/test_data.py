"""Spec for medusa_mini.data: the offline corpus, user text, splits, encoding and batches."""

from __future__ import annotations

import pathlib
import socket
import sysconfig

import numpy as np
import pytest
import torch

from medusa_mini.io.tokenizer import make_encoding, train_bpe
from medusa_mini.train.data import (
    default_corpus_files,
    encode_documents,
    get_batch,
    load_corpus,
    split_documents,
)

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def enc():
    text = "".join(t for _, t in load_corpus(max_bytes=8_000))
    return make_encoding(train_bpe(text, vocab_size=300))


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lines_text(n_lines: int) -> str:
    return "".join(f"line {i}: {'x' * (i % 50)}\n" for i in range(n_lines))


def test_default_corpus_is_deterministic_and_offline(no_network):
    files = default_corpus_files(max_bytes=500_000)
    assert files == default_corpus_files(max_bytes=500_000)
    relative = [f.relative_to(STDLIB).as_posix() for f in files]
    assert relative == sorted(relative)
    assert len(files) > 10
    assert all(f.suffix == ".py" for f in files)
    docs = load_corpus(max_bytes=100_000)
    assert docs == load_corpus(max_bytes=100_000)


def test_default_corpus_respects_the_byte_cap():
    for cap in (50_000, 300_000):
        files = default_corpus_files(max_bytes=cap)
        total = sum(f.stat().st_size for f in files)
        assert 0.9 * cap < total <= cap


def test_default_corpus_skips_tests_and_bundled_packages():
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    for f in default_corpus_files(max_bytes=3_000_000):
        assert not skipped & set(f.relative_to(STDLIB).parts[:-1])
        f.read_bytes().decode("utf-8")  # valid UTF-8


def test_default_documents_are_named_by_relative_path():
    docs = load_corpus(max_bytes=100_000)
    files = default_corpus_files(max_bytes=100_000)
    assert docs[0][0] == files[0].relative_to(STDLIB).as_posix()
    assert all(text for _, text in docs)
    assert "".join(t for _, t in docs) == "".join(f.read_text(encoding="utf-8") for f in files)


def test_a_single_file_becomes_documents_cut_on_line_boundaries(tmp_path):
    text = lines_text(8000)  # a little over 250 KB
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    docs = load_corpus(tmp_path / "corpus.txt")
    assert len(docs) >= 4
    assert "".join(t for _, t in docs) == text
    assert [name for name, _ in docs] == [f"corpus.txt#{i}" for i in range(len(docs))]
    assert all(t.endswith("\n") and len(t) <= 64 * 1024 for _, t in docs)
    # a line longer than a document stays whole, and no document is empty
    long_line = "y" * 70_000 + "\n"
    (tmp_path / "long.txt").write_text(long_line + text[:100], encoding="utf-8")
    assert [t for _, t in load_corpus(tmp_path / "long.txt")] == [long_line, text[:100]]


def test_a_small_file_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\r\nworld", encoding="utf-8")
    assert load_corpus(tmp_path / "a.txt") == [("a.txt", "héllo\r\nworld")]


def test_a_folder_loads_its_text_files_sorted_and_recursively(tmp_path):
    (tmp_path / "b.txt").write_text("bee\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "a.md").write_text("# a\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden\n")
    assert load_corpus(tmp_path) == [("a.md", "# a\n"), ("b.txt", "bee\n"), ("sub/a.py", "x = 1\n")]


@pytest.mark.parametrize(
    "case",
    ["missing", "empty file", "binary file", "latin-1 file", "empty folder", "binary folder"],
)
def test_missing_or_binary_data_is_a_clear_error(tmp_path, case):
    target = tmp_path / "data"
    if case == "empty file":
        target.write_text("  \n")
    elif case == "binary file":
        target.write_bytes(bytes(range(256)))
    elif case == "latin-1 file":
        target.write_bytes("na\xefve caf\xe9".encode("latin-1"))
    elif case == "empty folder":
        target.mkdir()
    elif case == "binary folder":
        target.mkdir()
        (target / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ValueError) as info:
        load_corpus(target)
    message = str(info.value)
    assert str(target) in message and "\n" not in message


def test_split_keeps_documents_whole():
    docs = [(f"doc{i}", f"text {i}\n" * (i + 1)) for i in range(40)]
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert len(val) == 4 and len(train) == 36
    assert sorted(train + val) == sorted(docs)
    # each side keeps the original order
    assert train == [d for d in docs if d in train] and val == [d for d in docs if d in val]


def test_split_is_deterministic_by_seed():
    docs = [(f"doc{i}", "x\n") for i in range(100)]
    assert split_documents(docs, seed=1) == split_documents(docs, seed=1)
    assert split_documents(docs, seed=1)[1] != split_documents(docs, seed=2)[1]


@pytest.mark.parametrize("val_fraction", [0.001, 0.5, 0.999])
def test_split_puts_at_least_one_document_on_each_side(val_fraction):
    docs = [("a", "1\n"), ("b", "2\n")]
    train, val = split_documents(docs, val_fraction=val_fraction)
    assert len(train) == 1 and len(val) == 1


def test_a_single_document_is_split_at_a_line_boundary():
    text = lines_text(1000)
    train, val = split_documents([("one", text)], val_fraction=0.1)
    (_, head), (_, tail) = train[0], val[0]
    assert head + tail == text
    assert head.endswith("\n")
    assert 0.85 < len(head) / len(text) < 0.95
    # without any newline the cut falls mid-text, still leaving both sides non-empty
    train, val = split_documents([("flat", "abcdefghij")], val_fraction=0.2)
    assert (train[0][1], val[0][1]) == ("abcdefgh", "ij")


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        split_documents([], val_fraction=0.1)
    with pytest.raises(ValueError):
        split_documents([("a", "x\n"), ("b", "y\n")], val_fraction=0.0)


def test_encoded_documents_are_separated_by_eot(enc):
    docs = [("a", "def f():\n"), ("b", "    return 1\n"), ("c", "")]
    tokens = encode_documents(enc, docs, eot_id=enc.eot_token)
    pieces = [enc.encode_ordinary(t) for _, t in docs]
    expected = pieces[0] + [enc.eot_token] + pieces[1] + [enc.eot_token] + pieces[2]
    assert tokens.tolist() == expected
    assert encode_documents(enc, docs, eot_id=None).tolist() == pieces[0] + pieces[1]


def test_special_token_text_in_documents_is_encoded_as_ordinary_text(enc):
    tokens = encode_documents(enc, [("a", "<|endoftext|>")], eot_id=enc.eot_token)
    assert enc.eot_token not in tokens.tolist()
    assert enc.decode(tokens.tolist()) == "<|endoftext|>"


def test_encoded_tokens_use_the_smallest_unsigned_dtype(enc):
    assert encode_documents(enc, [("a", "x = 1\n")], eot_id=None).dtype == np.uint16

    class BigVocab:
        n_vocab = 100_000

        def encode_ordinary_batch(self, texts):
            return [[99_999, 7] for _ in texts]

    tokens = encode_documents(BigVocab(), [("a", "?"), ("b", "?")], eot_id=70_000)
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [99_999, 7, 70_000, 99_999, 7]


def test_eot_outside_the_vocabulary_is_rejected(enc):
    with pytest.raises(ValueError, match="eot_id"):
        encode_documents(enc, [("a", "x")], eot_id=enc.n_vocab)


def test_batch_targets_are_inputs_shifted_by_one():
    tokens = np.arange(5000, dtype=np.uint16)
    x, y = get_batch(tokens, batch_size=8, block_size=32, generator=seeded(0), device="cpu")
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # consecutive tokens: each window is a contiguous slice
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) + 1 <= int(y.max()) < 5000


def test_batches_are_deterministic_given_the_generator():
    tokens = np.random.default_rng(0).integers(0, 300, size=10_000).astype(np.uint16)

    def batch(seed):
        return get_batch(tokens, batch_size=4, block_size=16, generator=seeded(seed), device="cpu")

    assert all(torch.equal(a, b) for a, b in zip(batch(1), batch(1)))
    assert not torch.equal(batch(1)[0], batch(2)[0])


def test_batches_reach_the_end_of_the_tokens():
    tokens = np.arange(10, dtype=np.uint32)
    x, y = get_batch(tokens, batch_size=64, block_size=9, generator=seeded(0), device="cpu")
    assert torch.equal(x, torch.arange(9).expand(64, 9))
    assert torch.equal(y, torch.arange(1, 10).expand(64, 9))


def test_batch_needs_more_tokens_than_block_size():
    with pytest.raises(ValueError, match="block_size"):
        get_batch(np.arange(8, dtype=np.uint16), batch_size=1, block_size=8, generator=seeded(0))
