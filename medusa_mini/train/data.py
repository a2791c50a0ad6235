"""Training text: by default this interpreter's standard library (real, structured, offline), or the
user's; documents ``(name, text)`` of at most about 64 KB (cut at line ends), splits, batches."""

from __future__ import annotations

import os
import pathlib
import random
import sysconfig
from collections.abc import Sequence

import numpy as np
import tiktoken
import torch

from .device import to_device

Document = tuple[str, str]

DOCUMENT_CHARS = 64 * 1024
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _read_text(path: pathlib.Path) -> str | None:
    """The file's text, or None if it is unreadable or not UTF-8 text (NUL bytes mean binary)."""
    try:
        data = path.read_bytes()
        return None if b"\x00" in data else data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _chunk_lines(name: str, text: str) -> list[Document]:
    """``text`` as documents of about DOCUMENT_CHARS cut at line ends: ``name``, or ``name#0``, ``name#1``, ..."""
    if len(text) <= DOCUMENT_CHARS:
        return [(name, text)]
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if size and size + len(line) > DOCUMENT_CHARS:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    return [(f"{name}#{i}", piece) for i, piece in enumerate(pieces + ["".join(current)])]


def default_corpus_files(*, max_bytes: int = 3_000_000) -> list[pathlib.Path]:
    """Standard-library ``.py`` files, sorted by relative path, without tests, bundled packages, IDLE
    and non-UTF-8 files; taken in order while they fit into ``max_bytes`` (a file that would overflow
    is skipped, smaller later ones may still fit)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(".")]
        candidates += [pathlib.Path(folder, f) for f in filenames if f.endswith(".py")]
    chosen, total = [], 0
    for path in sorted(candidates, key=lambda p: p.relative_to(root).as_posix()):
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size and total + size <= max_bytes and _read_text(path) is not None:
            chosen.append(path)
            total += size
    return chosen


def load_corpus(path: str | os.PathLike[str] | None = None, *, max_bytes: int = 3_000_000) -> list[Document]:
    """Documents ``(name, text)`` from ``path``: None, the standard library capped at ``max_bytes``; a
    UTF-8 file; or a folder's UTF-8 text files, recursively and sorted, hidden ones skipped. User data
    is used whole; long files become ``name#0``, ``name#1``, ... ValueError when there is no text."""
    if path is None:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        docs = [doc for file in default_corpus_files(max_bytes=max_bytes)
                for doc in _chunk_lines(file.relative_to(root).as_posix(), file.read_bytes().decode("utf-8"))]
        if not docs:
            raise ValueError(f"no standard-library source found under {root}")
        return docs
    path = pathlib.Path(path)
    if path.is_file():
        text = _read_text(path)
        if text is None:
            raise ValueError(f"data file is not UTF-8 text: {path}")
        if not text.strip():
            raise ValueError(f"data file is empty: {path}")
        return _chunk_lines(path.name, text)
    if path.is_dir():
        docs = []
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            relative = file.relative_to(path)
            text = None if any(part.startswith(".") for part in relative.parts) else _read_text(file)
            if text and text.strip():
                docs += _chunk_lines(relative.as_posix(), text)
        if not docs:
            raise ValueError(f"data folder holds no non-empty UTF-8 text files: {path}")
        return docs
    raise ValueError(f"data path does not exist: {path}")


def split_documents(docs: Sequence[Document], *, val_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """(train, val), documents kept whole and in order, chosen by ``seed``, at least one on each side.
    A single document is cut at the line boundary nearest the ``1 - val_fraction`` point."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    docs = list(docs)
    if not docs:
        raise ValueError("cannot split an empty list of documents")
    if len(docs) == 1:
        name, text = docs[0]
        if len(text) < 2:
            raise ValueError(f"document {name!r} is too short to split")
        cut = _line_cut(text, round(len(text) * (1.0 - val_fraction)))
        return [(name, text[:cut])], [(name, text[cut:])]
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    val_ids = set(random.Random(seed).sample(range(len(docs)), n_val))
    return [d for i, d in enumerate(docs) if i not in val_ids], [d for i, d in enumerate(docs) if i in val_ids]


def _line_cut(text: str, target: int) -> int:
    """A cut position in (0, len(text)) at a line start near ``target``; mid-line if no newline."""
    target = min(max(target, 1), len(text) - 1)
    before = text.rfind("\n", 0, target)  # the cut goes just after this newline
    after = text.find("\n", target - 1)
    options = [i + 1 for i in (before, after) if i != -1 and 0 < i + 1 < len(text)]
    return min(options, key=lambda cut: abs(cut - target), default=target)


def encode_documents(enc: tiktoken.Encoding, docs: Sequence[Document], *, eot_id: int | None) -> np.ndarray:
    """All documents' token ids, ``eot_id`` between them when given; special-token strings in the text
    are ordinary text. uint16 when every id fits, else uint32."""
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    if eot_id is not None and not 0 <= eot_id < enc.n_vocab:
        raise ValueError(f"eot_id {eot_id} is outside the vocabulary of {enc.n_vocab} tokens")
    sep = [np.array([eot_id], dtype=dtype)] if eot_id is not None else []
    parts = [np.zeros(0, dtype=dtype)]
    for i, ids in enumerate(enc.encode_ordinary_batch([text for _, text in docs])):
        parts += (sep if i else []) + [np.asarray(ids, dtype=dtype)]
    return np.concatenate(parts)


def get_batch(tokens: np.ndarray, *, batch_size: int, block_size: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``x`` and next tokens ``y`` (int64 [batch_size, block_size]); the starts come from
    ``generator`` (CPU), so equal generator states give equal batches."""
    n_starts = len(tokens) - block_size
    if n_starts < 1:
        raise ValueError(f"need more than block_size={block_size} tokens, got {len(tokens)}")
    starts = torch.randint(n_starts, (batch_size,), generator=generator).numpy()
    windows = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)
    x, y = (torch.from_numpy(np.ascontiguousarray(w)) for w in (windows[:, :-1], windows[:, 1:]))
    return to_device(x, device), to_device(y, device)
