"""Safetensors: an 8-byte little-endian header length N; N bytes of JSON `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`, space-padded to 8-byte alignment; then the raw little-endian tensor bytes,
offsets counted from the header's end. Every file is hostile: a bad header is refused before any allocation."""

import itertools
import json
import math
import os
import struct
import sys
from collections import Counter
from typing import IO

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # a real header takes a few hundred bytes per tensor
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # tensor bytes are copied as they are between the file and torch storage
        raise RuntimeError("safetensors I/O here assumes a little-endian machine")


def write_safetensors(f: IO[bytes], tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write `tensors` (in dict order; views are fine) to a binary file as safetensors; `metadata`: str -> str."""
    _require_little_endian()
    header: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
    for (name, t), end in zip(tensors.items(), itertools.accumulate(v.nbytes for v in tensors.values())):
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors here")
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [end - t.nbytes, end]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)) + raw)
    for t in tensors.values():
        # One tensor at a time, made contiguous on the host: no GPU copy of the whole model, nor of a transposed view
        f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    if twice := [k for k, n in Counter(k for k, _ in pairs).items() if n > 1]:
        raise ValueError(f"duplicate key {twice[0]!r}")
    return dict(pairs)


def _check_entry(name: str, info: object, buffer_size: int) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"entry for tensor {name!r} needs dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r}; expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_size:
        raise ValueError(f"tensor {name!r} has data_offsets {offsets} outside the {buffer_size}-byte buffer")
    if end - begin != (nbytes := math.prod(shape) * _DTYPES[dtype].itemsize):
        raise ValueError(f"tensor {name!r}: {dtype} {shape} needs {nbytes} bytes, data_offsets span {end - begin}")
    return _DTYPES[dtype], shape, (begin, end)


def _read_header(f: IO[bytes]) -> tuple[dict[str, tuple], int]:
    """The checked header: ({name: (dtype, shape, (begin, end))}, where the data starts)."""
    if (size := os.fstat(f.fileno()).st_size) < 8:
        raise ValueError(f"only {size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:  # this check and the next come before reading: a hostile length allocates nothing
        raise ValueError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)")
    if 8 + n > size:
        raise ValueError(f"header length {n} runs past the end of the {size}-byte file")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, duplicate keys, absurd nesting
        raise ValueError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is JSON but not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must be an object of strings")
    entries = {name: _check_entry(name, info, size - 8 - n) for name, info in header.items()}
    covered = 0  # the tensors must tile the buffer exactly: no overlaps (aliasing), no gaps (hidden bytes)
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda kv: kv[1][2]):
        if begin != covered:
            what = "overlaps the previous tensor" if begin < covered else f"leaves a gap at byte {covered}"
            raise ValueError(f"tensor {name!r} at data_offsets [{begin}, {end}] {what}")
        covered = end
    if covered != size - 8 - n:
        raise ValueError(f"tensors cover {covered} bytes, the data buffer holds {size - 8 - n}")
    return entries, 8 + n


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a one-line ValueError naming the file if it is broken or hostile.
    Each tensor's bytes are read straight into its own storage, so peak memory is the tensors once."""
    _require_little_endian()
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        try:
            entries, start = _read_header(f)
            for name, (dtype, shape, (begin, _)) in entries.items():
                t = torch.empty(math.prod(shape), dtype=dtype)
                f.seek(start + begin)
                if f.readinto(t.view(torch.uint8).numpy()) != t.nbytes:  # short only at the end of the file (buffered)
                    raise ValueError(f"file ended inside tensor {name!r}")
                if dtype is torch.bool and t.view(torch.uint8).gt(1).any():
                    raise ValueError(f"tensor {name!r} holds BOOL bytes other than 0 and 1")
                out[name] = t.reshape(shape)
        except ValueError as e:  # every error names the file, once
            raise ValueError(f"{os.fspath(path)}: {e}") from None
    return out
