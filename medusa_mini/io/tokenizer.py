"""Byte-level BPE tokenizer: train merges on a corpus (GPT-2's recipe: GPT-2's pre-token regex, the 256
single bytes, then the most frequent adjacent pair merged again and again), use them through tiktoken.

On disk a tokenizer is a directory with ``tokenizer.tiktoken`` (tiktoken's rank file, one
``<base64 token bytes> <rank>`` per line) and ``tokenizer_config.json`` (``{"type": "bpe", "pattern":
..., "special_tokens": {...}}``, or ``{"type": "tiktoken", "name": "gpt2"}`` for a named encoding).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import heapq
import json
import os
import pathlib
from collections import Counter
from collections.abc import Mapping, Sequence

import regex
import tiktoken

from .safetensors import atomic_write_text, read_json

GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>",)
RANKS_FILE = "tokenizer.tiktoken"
CONFIG_FILE = "tokenizer_config.json"

Pair = tuple[int, int]


def _count_words(text: str, special_tokens: Sequence[str]) -> Counter[bytes]:
    """Frequencies of the distinct pre-tokens, as UTF-8 bytes."""
    # Special-token strings in the text must not be learned as ordinary merges, or encode_ordinary and
    # encode would disagree on them.
    chunks = regex.split("|".join(map(regex.escape, special_tokens)), text) if special_tokens else [text]
    pattern = regex.compile(GPT2_SPLIT_PATTERN)
    counts: Counter[str] = Counter()
    for chunk in chunks:
        counts.update(pattern.findall(chunk))
    return Counter({word.encode("utf-8"): n for word, n in counts.items()})


def _pairs(word: list[int]) -> Counter[Pair]:
    return Counter(zip(word, word[1:]))


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace non-overlapping occurrences of ``pair``, scanning left to right."""
    first, second = pair
    out: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(
    text: str, *, vocab_size: int = 2048, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS
) -> dict[bytes, int]:
    """Learn byte-level BPE merges on ``text``; return mergeable ranks {token bytes: rank} (0..255 are
    the bytes). Stops at ``vocab_size - len(special_tokens)`` ranks or once no pair occurs twice; ties go
    to the smallest (left rank, right rank) pair, so the result is deterministic."""
    n_ranks = vocab_size - len(special_tokens)
    if n_ranks < 256:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for the 256 byte tokens and "
            f"{len(special_tokens)} special tokens"
        )
    word_counts = _count_words(text, special_tokens)
    words = [list(word) for word in word_counts]
    freqs = list(word_counts.values())
    vocab = [bytes([b]) for b in range(256)]
    ranks = {token: rank for rank, token in enumerate(vocab)}

    # Incremental bookkeeping: a merge only touches the words that contain the merged pair, so
    # re-counting every pair after every merge (quadratic on a real corpus) is never needed.
    pair_counts: dict[Pair, int] = {}
    pair_words: dict[Pair, set[int]] = {}
    for wid, word in enumerate(words):
        for pair, n in _pairs(word).items():
            pair_counts[pair] = pair_counts.get(pair, 0) + n * freqs[wid]
            pair_words.setdefault(pair, set()).add(wid)

    # Max-heap keyed by (count, then smallest pair). Entries go stale when counts change; every
    # change pushes a fresh entry, and a popped entry is trusted only if its count is current.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < n_ranks and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue
        if -neg_count < 2:
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        # Two different splits can build the same bytes; reuse the existing token so ranks stay
        # unique (tiktoken requires a one-to-one map between bytes and ranks).
        if merged not in ranks:
            ranks[merged] = len(vocab)
            vocab.append(merged)
        new_id = ranks[merged]

        changed: dict[Pair, int] = {}
        for wid in pair_words.pop(pair):
            word = words[wid]
            old_pairs = _pairs(word)
            if pair not in old_pairs:
                continue  # stale membership: an earlier merge already consumed this occurrence
            new_word = _merge_word(word, pair, new_id)
            words[wid] = new_word
            new_pairs = _pairs(new_word)
            freq = freqs[wid]
            for p in old_pairs.keys() | new_pairs.keys():
                delta = (new_pairs.get(p, 0) - old_pairs.get(p, 0)) * freq
                if delta:
                    changed[p] = changed.get(p, 0) + delta
            for p in new_pairs:
                if p not in old_pairs:
                    pair_words.setdefault(p, set()).add(wid)
        for p, delta in changed.items():
            count = pair_counts.get(p, 0) + delta
            if count > 0:
                pair_counts[p] = count
                heapq.heappush(heap, (-count, p))
            else:
                pair_counts.pop(p, None)
                pair_words.pop(p, None)
    return ranks


def make_encoding(
    ranks: Mapping[bytes, int],
    *,
    name: str = "medusa_mini",
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    pattern: str = GPT2_SPLIT_PATTERN,
) -> tiktoken.Encoding:
    """Wrap mergeable ranks as a ``tiktoken.Encoding``; special tokens get the ids after them."""
    ranks = dict(ranks)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # Without every single byte some text has no encoding at all (tiktoken would panic).
        raise ValueError(f"ranks lack {len(missing)} of the 256 single-byte tokens")
    first_special = max(ranks.values()) + 1
    specials = {token: first_special + i for i, token in enumerate(special_tokens)}
    return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def save_tokenizer(enc: tiktoken.Encoding, directory: str | os.PathLike[str]) -> pathlib.Path:
    """Save an encoding (ranks, special tokens, split pattern, name) to ``directory``; return it."""
    specials = {t: enc.encode_single_token(t) for t in sorted(enc.special_tokens_set)}
    lines = []
    for rank in sorted(set(range(enc.n_vocab)) - set(specials.values())):
        with contextlib.suppress(KeyError):  # ids need not be dense
            lines.append(f"{base64.b64encode(enc.decode_single_token_bytes(rank)).decode('ascii')} {rank}\n")
    pattern = getattr(enc, "_pat_str", GPT2_SPLIT_PATTERN)  # tiktoken has no public accessor for it
    config = {"type": "bpe", "name": enc.name, "pattern": pattern, "special_tokens": specials}
    return _write_config(directory, config, ranks_text="".join(lines))


def save_tokenizer_reference(directory: str | os.PathLike[str], name: str = "gpt2") -> pathlib.Path:
    """Save a pointer to tiktoken's named encoding ``name`` (fetched by tiktoken when loaded)."""
    return _write_config(directory, {"type": "tiktoken", "name": name})


def _write_config(directory: str | os.PathLike[str], config: dict, *, ranks_text: str | None = None) -> pathlib.Path:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if ranks_text is not None:
        atomic_write_text(directory / RANKS_FILE, ranks_text)
    atomic_write_text(directory / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


def _read_ranks(path: pathlib.Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read tokenizer ranks {path}: {e}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            encoded, rank_text = line.split()
            token = base64.b64decode(encoded, validate=True)
            rank = int(rank_text)
        except (ValueError, binascii.Error):
            raise ValueError(f"corrupt tokenizer ranks {path}: bad line {lineno}") from None
        if token in ranks or rank < 0:
            raise ValueError(f"corrupt tokenizer ranks {path}: bad token or rank at line {lineno}")
        ranks[token] = rank
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"corrupt tokenizer ranks {path}: duplicate ranks")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"corrupt tokenizer ranks {path}: some single-byte tokens are missing")
    return ranks


def load_tokenizer(directory: str | os.PathLike[str]) -> tiktoken.Encoding:
    """Load a tokenizer saved by ``save_tokenizer`` or ``save_tokenizer_reference``."""
    directory = pathlib.Path(directory)
    config_path = directory / CONFIG_FILE
    config = read_json(config_path, hint="save the tokenizer again")
    kind = config.get("type") if isinstance(config, dict) else None
    if kind == "tiktoken":
        name = config.get("name")
        if not isinstance(name, str):
            raise ValueError(f"corrupt tokenizer config {config_path}: no encoding name")
        return tiktoken.get_encoding(name)
    if kind != "bpe":
        raise ValueError(f"corrupt tokenizer config {config_path}: unknown type {kind!r}")
    pattern, specials = config.get("pattern"), config.get("special_tokens", {})
    if not isinstance(pattern, str) or not isinstance(specials, dict) or not all(
        isinstance(v, int) for v in specials.values()
    ):
        raise ValueError(f"corrupt tokenizer config {config_path}: bad pattern or special_tokens")
    ranks_path = directory / RANKS_FILE
    if not ranks_path.is_file():
        raise ValueError(f"not a tokenizer directory: {ranks_path} is missing")
    ranks = _read_ranks(ranks_path)
    if set(specials.values()) & set(ranks.values()):
        raise ValueError(f"corrupt tokenizer config {config_path}: special ids collide with ranks")
    try:
        name = str(config.get("name", "medusa_mini"))
        return tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:  # e.g. an invalid regex
        raise ValueError(f"corrupt tokenizer config {config_path}: {e}") from None
