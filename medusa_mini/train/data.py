"""Training text: by default this interpreter's standard library (real, structured, offline), or the
user's; documents ``(name, text)`` of at most about 64 KB (cut at line ends), splits, batches, held-out prompts."""

import hashlib
import os
import pathlib
import random
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby

import numpy as np
import tiktoken
import torch

from .device import to_device

Document = tuple[str, str]

DOCUMENT_CHARS = 64 * 1024
STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _read_text(path: pathlib.Path) -> str | None:
    """The file's text, or None if it is unreadable, not UTF-8 text (NUL bytes mean binary) or blank."""
    try:
        data = path.read_bytes()
        return None if b"\x00" in data or not data.strip() else data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _pieces(lines: Iterable[str], limit: int) -> Iterator[str]:
    """Consecutive `lines` joined into pieces of at most `limit` characters (a longer line is a piece alone)."""
    piece = ""
    for line in lines:
        if piece and len(piece) + len(line) > limit:
            yield piece
            piece = ""
        piece += line
    yield piece


def default_corpus_files(*, max_bytes: int = 3_000_000) -> list[pathlib.Path]:
    """Standard-library ``.py`` text files in order of relative path, without tests, bundled packages and
    IDLE, while they fit into ``max_bytes`` (a file that would overflow is skipped)."""
    candidates = []
    for folder, dirnames, filenames in os.walk(STDLIB):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(".")]
        candidates += [pathlib.Path(folder, f) for f in filenames if f.endswith(".py")]
    chosen, total = [], 0
    for path in sorted(candidates, key=lambda p: p.relative_to(STDLIB).as_posix()):
        size = path.stat().st_size if path.is_file() else 0  # not a dangling link
        if 0 < size and total + size <= max_bytes and _read_text(path) is not None:
            chosen.append(path)
            total += size
    return chosen


def load_corpus(path: str | os.PathLike[str] | None = None, *, max_bytes: int = 3_000_000,
                skip: str | os.PathLike[str] | None = None) -> list[Document]:
    """Documents ``(name, text)`` named by path: the standard library capped at ``max_bytes`` (path None), a UTF-8
    file, or a folder's UTF-8 text files, sorted, whole, but hidden files, the folder ``skip`` and checkpoints (a
    run's output is no text to learn from, and a resume must read what it began with). ValueError: no text."""
    if path is None:
        root, files = STDLIB, default_corpus_files(max_bytes=max_bytes)
    elif (root := pathlib.Path(path)).is_dir():
        skipped = [p.parent.resolve() for p in root.rglob("model.safetensors")]
        skipped += [pathlib.Path(skip).resolve()] if skip is not None else []
        if any(root.resolve().is_relative_to(folder) for folder in skipped):  # else "no text" would puzzle
            raise ValueError(f"data folder {path} is a checkpoint or in the output folder: a run's files are no text")
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts)
                       and not any(p.resolve().is_relative_to(folder) for folder in skipped))
    elif root.is_file():
        root, files = root.parent, [root]
    else:
        raise ValueError(f"data path does not exist: {path}")
    docs = []
    for file in files:  # a longer text: documents of about DOCUMENT_CHARS cut at line ends, name#0, name#1, ...
        if text := _read_text(file):
            name, cut = file.relative_to(root).as_posix(), _pieces(text.splitlines(keepends=True), DOCUMENT_CHARS)
            docs += [(name, text)] if len(text) <= DOCUMENT_CHARS else [(f"{name}#{i}", t) for i, t in enumerate(cut)]
    if not docs:  # the standard library has text: there, every file was larger than the cap
        raise ValueError(f"no non-empty UTF-8 text in {path}" if path is not None else
                         f"no file of {root} fits within --max-bytes {max_bytes:,}: raise it")
    return docs


def corpus_digest(docs: Sequence[Document]) -> str:
    """A SHA-256 of the documents' names and texts: --resume refuses a run whose data changed under it."""
    return hashlib.sha256("".join(f"{len(name)}:{name}{len(text)}:{text}" for name, text in docs).encode()).hexdigest()


def split_documents(docs: Sequence[Document], *, val_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """(train, val), documents kept whole and in order, chosen by ``seed``, at least one on each side; fewer than
    1 / val_fraction documents (one held out would be more than val_fraction of them) are cut at the line end nearest
    the ``1 - val_fraction`` point of their lines, one document's lines on each side staying one document."""
    if len(docs) * val_fraction < 1:
        pieces = [(name, line) for name, text in docs  # a lone document without a line end: its characters
                  for line in (text.splitlines(keepends=True) if len(docs) > 1 or "\n" in text[:-1] else text)]
        cut = min(max(round(len(pieces) * (1.0 - val_fraction)), 1), len(pieces) - 1)
        return tuple([(name, "".join(line for _, line in group)) for name, group in groupby(side, lambda x: x[0])]
                     for side in (pieces[:cut], pieces[cut:]))
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    val_ids = set(random.Random(seed).sample(range(len(docs)), n_val))
    return [d for i, d in enumerate(docs) if i not in val_ids], [d for i, d in enumerate(docs) if i in val_ids]


def encode_documents(enc: tiktoken.Encoding, docs: Sequence[Document]) -> np.ndarray:
    """All documents' token ids, end-of-text between them, special-token strings as text; uint16 where ids fit."""
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    eot = np.array([enc.eot_token], dtype=dtype)
    parts = [np.asarray(ids, dtype=dtype) for ids in enc.encode_ordinary_batch([text for _, text in docs])]
    return np.concatenate([x for part in parts for x in (eot, part)][1:])


def get_batch(tokens: np.ndarray, *, batch_size: int, block_size: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``x`` and next tokens ``y`` (int64 [batch_size, block_size]) of ``tokens`` (more than
    block_size); the starts come from ``generator`` (CPU), so equal generator states give equal batches."""
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator).numpy()
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))
    return to_device(windows[:, :-1].contiguous(), device), to_device(windows[:, 1:].contiguous(), device)


def held_out_prompts(val_docs: Sequence[Document], enc: tiktoken.Encoding, *, count: int, seed: int,
                     block_size: int) -> list[str]:
    """`count` distinct snippets of held-out text (at most 240 characters, line to line, under a third of the context;
    shorter where too few fit): decode.py's default prompts (prompts.json), text the model never trained on."""
    rng, prompts, texts = random.Random(seed), [], [t for _, t in val_docs if t.strip()]
    for limit in (240, 60, 15):
        for _ in range(count * 50 if texts else 0):
            if len(prompts) == count:
                break
            lines = texts[rng.randrange(len(texts))].splitlines(keepends=True)
            snippet = next(_pieces(lines[rng.randrange(len(lines)):], limit))[:limit]
            if snippet.strip() and snippet not in prompts and 0 < len(enc.encode_ordinary(snippet)) < block_size // 3:
                prompts.append(snippet)
    return prompts
