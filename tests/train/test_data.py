"""Training text (train/data.py): the offline corpus, user text, splits, encoding and batches."""

import pathlib
import socket
import sysconfig
import types

import numpy as np
import pytest
import torch

from medusa_mini.io.tokenizer import make_encoding
from medusa_mini.train import data
from medusa_mini.train.data import default_corpus_files, encode_documents, get_batch, load_corpus, split_documents

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])


def lines_text(n_lines: int) -> str:
    return "".join(f"line {i}: {'x' * (i % 50)}\n" for i in range(n_lines))


def test_default_corpus_is_offline_sorted_capped_named_by_relative_path_without_tests_or_packages(monkeypatch):
    for owner, name in ((socket.socket, "connect"), (socket, "create_connection")):
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: pytest.fail("the network was used"))
    for cap in (50_000, 300_000):
        files = default_corpus_files(max_bytes=cap)
        relative = [f.relative_to(STDLIB).as_posix() for f in files]
        assert relative == sorted(relative) and all(f.suffix == ".py" for f in files)
        assert 0.9 * cap < sum(f.stat().st_size for f in files) <= cap
    assert (docs := load_corpus(max_bytes=300_000))[0][0] == relative[0] and all(text for _, text in docs)
    assert "".join(t for _, t in docs) == "".join(f.read_bytes().decode("utf-8") for f in files)
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    folders = [set(f.relative_to(STDLIB).parts[:-1]) for f in default_corpus_files(max_bytes=3_000_000)]
    assert any(folders) and not any(skipped & parts for parts in folders)  # packages' files too, but none of these
    pytest.raises(ValueError, load_corpus, max_bytes=10).match("no file of .* fits within --max-bytes 10: raise it")


def test_a_single_file_becomes_documents_cut_on_line_boundaries(tmp_path):
    (tmp_path / "corpus.txt").write_text(text := lines_text(8000), encoding="utf-8")  # a little over 250 KB
    assert len(docs := load_corpus(tmp_path / "corpus.txt")) >= 4 and "".join(t for _, t in docs) == text
    assert [name for name, _ in docs] == [f"corpus.txt#{i}" for i in range(len(docs))]
    assert all(t.endswith("\n") and len(t) <= 64 * 1024 for _, t in docs)
    long_line = "y" * 70_000 + "\n"  # a line longer than a document stays whole, and no document is empty
    (tmp_path / "long.txt").write_text(long_line + text[:100], encoding="utf-8")
    assert [t for _, t in load_corpus(tmp_path / "long.txt")] == [long_line, text[:100]]
    (tmp_path / "a.txt").write_bytes("héllo\r\nworld".encode())  # a small file: one document, bytes kept
    assert load_corpus(tmp_path / "a.txt") == [("a.txt", "héllo\r\nworld")]


def test_a_folder_loads_its_text_files_sorted_and_recursively(tmp_path):
    files = {"b.txt": b"bee\n", "sub/a.py": b"x = 1\n", "a.md": b"# a\n", "image.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00",
             "latin1.txt": "caf\xe9".encode("latin-1"), ".git/config": b"hidden\n", "out/mine/config.json": b"{}\n",
             "out/smoke/config.json": b"{}\n", "out/smoke/model.safetensors": b"\x00"}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    texts = [("a.md", "# a\n"), ("b.txt", "bee\n"), ("sub/a.py", "x = 1\n")]
    # checkpoints (out/smoke), and the folder a run writes (skip): not text to learn from
    assert load_corpus(tmp_path, skip=tmp_path / "out/mine") == texts
    assert load_corpus(tmp_path) == texts[:2] + [("out/mine/config.json", "{}\n")] + texts[2:]  # no checkpoint: text
    assert data.corpus_digest([("a", "bc")]) != data.corpus_digest([("ab", "c")])  # --resume: names, texts apart
    for folder, out in [("out/mine", "out/mine"), ("out/mine", "out"), ("out/smoke", None)]:  # in --out, a checkpoint
        pytest.raises(ValueError, load_corpus, tmp_path / folder, skip=out and tmp_path / out).match("output folder")


@pytest.mark.parametrize("file", [None, b"  \n", bytes(range(128)), "na\xefve caf\xe9".encode("latin-1")])
@pytest.mark.parametrize("in_folder", [False, True])
def test_missing_empty_or_binary_data_is_a_one_line_error(tmp_path, file, in_folder):
    target = tmp_path / "data"
    if in_folder:
        target.mkdir()
    if file is not None:
        (target / "blob" if in_folder else target).write_bytes(file)
    info = pytest.raises(ValueError, load_corpus, target)
    assert str(target) in str(info.value) and "\n" not in str(info.value)


def test_split_keeps_documents_whole_in_order_by_the_seed_and_cuts_a_single_one_at_a_line_end():
    docs = [(f"doc{i}", f"text {i}\n" * (i + 1)) for i in range(40)]
    (train, val), again, other = (split_documents(docs, val_fraction=0.1, seed=s) for s in (3, 3, 4))
    assert len(val) == 4 and len(train) == 36 and sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in train] and val == [d for d in docs if d in val]
    assert again == (train, val) != other  # the seed chooses
    text = lines_text(1000)
    (_, head), (_, tail) = (side[0] for side in split_documents([("one", text)], val_fraction=0.1))
    assert head + tail == text and head.endswith("\n") and 0.85 < len(head) / len(text) < 0.95
    for name, s, f, cut in (("flat", "abcdefghij", 0.2, 8), ("one", "abcdef\ng", 0.5, 7)):  # flat: between characters
        assert split_documents([(name, s)], val_fraction=f) == ([(name, s[:cut])], [(name, s[cut:])])
    few = [(f"f#{i}", "line\n" * 100) for i in range(3)]  # 3 documents: one held out whole would be a third, not 5%
    train, val = split_documents(few, val_fraction=0.05)
    assert train == few[:2] + [("f#2", "line\n" * 85)] and val == [("f#2", "line\n" * 15)]
    for docs in ([("a", "1\n"), ("b", "2\n")], [("one", "1\n2\n")], [("flat", "12")]):  # at least one on each side
        for train, val in (split_documents(docs, val_fraction=f) for f in (0.001, 0.5, 0.999)):
            assert len(train) == len(val) == 1 and train[0][1] and val[0][1]


def test_encoded_documents_are_separated_by_end_of_text_in_the_smallest_unsigned_type():
    enc = make_encoding({bytes([b]): b for b in range(256)})
    docs = [("a", "def f():\n"), ("b", "    return 1\n"), ("c", "")]
    tokens, pieces = encode_documents(enc, docs), [enc.encode_ordinary(t) for _, t in docs]
    assert tokens.tolist() == pieces[0] + [enc.eot_token] + pieces[1] + [enc.eot_token] + pieces[2]
    assert tokens.dtype == np.uint16
    special = encode_documents(enc, [("a", "<|endoftext|>")]).tolist()
    assert enc.eot_token not in special and enc.decode(special) == "<|endoftext|>"  # ordinary text
    big = types.SimpleNamespace(n_vocab=100_000, eot_token=70_000,
                                encode_ordinary_batch=lambda texts: [[99_999, 7] for _ in texts])
    tokens = encode_documents(big, [("a", "?"), ("b", "?")])
    assert tokens.dtype == np.uint32 and tokens.tolist() == [99_999, 7, 70_000, 99_999, 7]


def test_batches_are_contiguous_windows_with_next_token_targets_drawn_from_the_generator():
    tokens = np.arange(5000, dtype=np.uint16)  # consecutive tokens: a contiguous window counts up
    x, y = get_batch(tokens, batch_size=8, block_size=32, generator=torch.Generator().manual_seed(0), device="cpu")
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, :1] + torch.arange(32), x) and torch.equal(y, x + 1)
    again, other = (get_batch(tokens, batch_size=8, block_size=32, generator=torch.Generator().manual_seed(seed))[0]
                    for seed in (0, 1))
    assert torch.equal(again, x) and not torch.equal(other, x)
    x, y = get_batch(tokens[:10], batch_size=64, block_size=9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(y, torch.arange(1, 10).expand(64, 9))  # the last window reached


def test_held_out_prompts_are_snippets_of_held_out_text_under_a_third_of_the_context():
    enc, docs = make_encoding({bytes([b]): b for b in range(256)}), [("v", lines_text(300)), ("blank", " \n")]
    prompts = data.held_out_prompts(docs, enc, count=4, seed=0, block_size=150)  # a token a byte: 240 bytes do not fit
    assert len(prompts) == 4 and all(p in docs[0][1] and 0 < len(enc.encode_ordinary(p)) < 50 for p in prompts)
    assert data.held_out_prompts(docs[1:], enc, count=2, seed=0, block_size=60) == []  # blank text gives none
    assert data.held_out_prompts([("a", "ab\n")], enc, count=1, seed=0, block_size=9) == []  # 3 tokens, not < 9 // 3
    few = data.held_out_prompts([("a", "a\n" * 3)], enc, count=4, seed=0, block_size=60)  # three distinct snippets
    assert sorted(few) == ["a\n", "a\na\n", "a\na\na\n"]
