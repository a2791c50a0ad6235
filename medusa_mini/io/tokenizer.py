"""Byte-level BPE, GPT-2's recipe, used through tiktoken. On disk: tokenizer.tiktoken (`<base64 token bytes> <rank>` per
line) and tokenizer_config.json (`{"type": "bpe", "name", "pattern", "special_tokens"}`); tiktoken's named encodings are
saved whole too, so decoding needs no network (an older save's `{"type": "tiktoken", "name": "gpt2"}` loads by name)."""

import base64
import hashlib
import heapq
import os
import pathlib
from collections import Counter, defaultdict
from collections.abc import Mapping

import regex
import tiktoken

from .files import atomic_write_files, json_writer, read_json, text_writer

GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"  # the one special token, id right after the ranks
RANKS_FILE, CONFIG_FILE = "tokenizer.tiktoken", "tokenizer_config.json"
TOKENIZER_FILES = (RANKS_FILE, CONFIG_FILE)  # what save_tokenizer may write
Pair = str  # two adjacent tokens, each a character, chr(its id); a word, too, is a string of one character per token


class _PairCounts:
    """How often each adjacent pair occurs in the corpus, kept current merge by merge: a merge touches only the words
    holding its pair, so pairs are never recounted from scratch (quadratic on a real corpus)."""

    def __init__(self, word_counts: Counter[bytes]) -> None:
        self.words, self.freqs = [""] * len(word_counts), list(word_counts.values())
        self.counts: Counter[Pair] = Counter()
        self.holders: defaultdict[Pair, set[int]] = defaultdict(set)  # words holding a pair (or that held it)
        # Max-heap on (count, then the smallest pair): each change pushes a fresh entry; popped stale ones are skipped
        self.heap: list[tuple[int, Pair]] = []
        self._respell({wid: "".join(map(chr, word)) for wid, word in enumerate(word_counts)})  # all pairs gained

    def most_frequent(self) -> Pair | None:
        """The pair to merge next; None once no pair occurs twice."""
        while self.heap:
            neg_count, pair = heapq.heappop(self.heap)
            if self.counts[pair] == -neg_count:
                return pair if -neg_count >= 2 else None
        return None

    def merge(self, pair: Pair, new_id: int) -> None:
        """Replace `pair` by the token `new_id` in every word: str.replace goes left to right, without overlaps."""
        held = [wid for wid in self.holders.pop(pair) if pair in self.words[wid]]  # else consumed by an earlier merge
        self._respell({wid: self.words[wid].replace(pair, chr(new_id)) for wid in held})

    def _respell(self, words: dict[int, str]) -> None:
        """Give words (by id) new spellings, updating the counts of the pairs they lose or gain."""
        changed: set[Pair] = set()
        for wid, word in words.items():
            old, new = (Counter(a + b for a, b in zip(w, w[1:])) for w in (self.words[wid], word))  # adjacent pairs
            self.words[wid] = word
            for p in old.keys() | new.keys():
                if delta := (new[p] - old[p]) * self.freqs[wid]:
                    self.counts[p] += delta
                    changed.add(p)
            for p in new.keys() - old.keys():
                self.holders[p].add(wid)
        for p in changed:  # one at 0 can pop only once no pair is left: most_frequent's None either way
            heapq.heappush(self.heap, (-self.counts[p], p))


def train_bpe(text: str, *, vocab_size: int) -> dict[bytes, int]:
    """Mergeable ranks {token bytes: rank} from `text`: 0..255 the single bytes, then one per merge while fewer than
    `vocab_size` - 1 (the last id is <|endoftext|>'s) and a pair occurs twice; ties: smallest (left, right) ranks."""
    if vocab_size - 1 < 256:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for the 256 byte tokens and {EOT}")
    vocab, ranks = [bytes([b]) for b in range(256)], {bytes([b]): b for b in range(256)}
    # <|endoftext|> splits the text: learned as ordinary merges, encode_ordinary and encode would encode it differently
    words = Counter(w.encode("utf-8") for chunk in text.split(EOT) for w in regex.findall(GPT2_SPLIT_PATTERN, chunk))
    pairs = _PairCounts(words)
    while len(vocab) < vocab_size - 1 and (pair := pairs.most_frequent()) is not None:
        merged = vocab[ord(pair[0])] + vocab[ord(pair[1])]
        if merged not in ranks:  # two splits can build the same bytes; tiktoken needs one rank per bytes
            ranks[merged] = len(vocab)
            vocab.append(merged)
        pairs.merge(pair, ranks[merged])
    return ranks


def make_encoding(ranks: Mapping[bytes, int]) -> tiktoken.Encoding:
    """Mergeable ranks as a `tiktoken.Encoding` with GPT-2's split pattern; <|endoftext|> gets the next id."""
    if any(bytes([b]) not in ranks for b in range(256)):  # some text would have no encoding at all
        raise ValueError("the ranks lack some of the 256 single-byte tokens")
    return tiktoken.Encoding("medusa_mini", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=dict(ranks),
                             special_tokens={EOT: max(ranks.values()) + 1})


def save_tokenizer(enc: tiktoken.Encoding, directory: str | os.PathLike) -> pathlib.Path:
    """Save `enc` to `directory` (returned), whole: tiktoken's named ones too, which loading by name would fetch."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specials = {t: enc.encode_single_token(t) for t in sorted(enc.special_tokens_set)}
    ranks = sorted((enc.encode_single_token(t), t) for t in enc.token_byte_values())  # ranks need not be dense
    lines = [f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in ranks]
    config = {"type": "bpe", "name": enc.name, "pattern": enc._pat_str, "special_tokens": specials}  # no public getter
    atomic_write_files(directory, {RANKS_FILE: text_writer("".join(lines)), CONFIG_FILE: json_writer(config)})
    return directory


def tokenizer_digest(enc: tiktoken.Encoding) -> str:
    """sha256 of enc's tokens and their ids: a resumed run's tokenizer must be the one the run began with."""
    return hashlib.sha256(repr(sorted(enc._mergeable_ranks.items())).encode()).hexdigest()  # no public getter


def load_tokenizer(directory: str | os.PathLike) -> tiktoken.Encoding:
    """The tokenizer save_tokenizer wrote to `directory`; a one-line ValueError names a missing or corrupt file."""
    config_path, path = pathlib.Path(directory) / CONFIG_FILE, pathlib.Path(directory) / RANKS_FILE
    config = obj if isinstance(obj := read_json(config_path, hint="save the tokenizer again"), dict) else {}
    if config.get("type") == "tiktoken" and isinstance(config.get("name"), str):
        return tiktoken.get_encoding(config["name"])
    pattern, specials = config.get("pattern"), config.get("special_tokens")
    if config.get("type") != "bpe" or not isinstance(pattern, str) or not isinstance(specials, dict) or not all(
            isinstance(v, int) for v in specials.values()):
        raise ValueError(f"corrupt tokenizer config {config_path}: unknown type, or bad pattern or special_tokens")
    if not path.is_file():
        raise ValueError(f"{path} is missing; save the tokenizer again")
    try:
        pairs = [line.split() for line in path.read_text(encoding="ascii").splitlines() if line.strip()]
        ranks = {base64.b64decode(token, validate=True): int(rank) for token, rank in pairs}
    except (OSError, ValueError) as e:  # UnicodeDecodeError and binascii.Error are ValueErrors
        raise ValueError(f"corrupt tokenizer ranks {path}: {e}") from None
    ids = set(ranks.values()) | set(specials.values())  # fewer than lines and specials: a token or an id twice
    if any(bytes([b]) not in ranks for b in range(256)) or len(ids) < len(pairs) + len(specials) or min(ids) < 0:
        raise ValueError(f"corrupt tokenizer ranks {path}: a single-byte token is missing, or a token or a rank "
                         "appears twice or is negative (special ids count as ranks)")
    try:
        return tiktoken.Encoding(str(config.get("name", "medusa_mini")), pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=specials)
    except Exception as e:  # e.g. an invalid regex
        raise ValueError(f"corrupt tokenizer config {config_path}: {e}") from None
