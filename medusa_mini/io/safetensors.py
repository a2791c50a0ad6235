"""The safetensors format, read and written with our own code, and atomic file writes.

Layout: 8-byte little-endian header length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}` (space-padded so the data is 8-byte aligned), then the raw
little-endian tensor bytes, offsets counted from the end of the header. The reader treats every file as
hostile: a malformed header gives one SafetensorsError naming the file, before anything is allocated.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections import Counter
from typing import IO, Callable

import torch

# A real header is a few hundred bytes per tensor; anything near this is not a safetensors file.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message names the file and its first problem."""


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # tensor bytes are copied as they are into and out of torch storage
        raise RuntimeError("safetensors I/O here assumes a little-endian machine")


def write_safetensors_to(f: IO[bytes], tensors: dict[str, torch.Tensor], metadata: dict | None) -> None:
    """Write the safetensors bytes of `tensors` (in dict order) to a binary file; views are fine."""
    _require_little_endian()
    header: dict[str, dict] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors here")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # keeps the data buffer 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors.values():
        # One tensor at a time, so a model on a GPU is never copied to the host all at once; a view (a
        # transposed weight) is copied as it is and made contiguous on the host, not on the device.
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        f.write(flat.view(torch.uint8).numpy())


def remove_file(path: str) -> None:
    """Remove `path` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def fsync_dir(folder: str) -> None:
    """Make renames inside `folder` durable (a no-op where a directory cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_files(files: dict[str, Callable[[IO[bytes]], object]]) -> None:
    """Call each writer on a temporary sibling of its path, then rename them all into place in order; if
    anything fails, the files already replaced are restored, so readers see the old set or the new one."""
    staged: list[tuple[str, str]] = []
    done: list[tuple[str, str | None]] = []  # (final, hard link to its previous version or None)
    try:
        for path, write in files.items():
            folder, base = os.path.split(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=".tmp")
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes files private; a checkpoint is meant to be shared
        for tmp, final in staged:
            if len(staged) > 1:  # one file needs no undo: os.replace happens entirely or not at all
                backup = f"{final}.{os.getpid()}.bak" if os.path.exists(final) else None
                if backup is not None:
                    remove_file(backup)
                    try:
                        os.link(final, backup)  # keeps the old bytes without copying them
                    except OSError:
                        shutil.copyfile(final, backup)
                done.append((final, backup))
            os.replace(tmp, final)
    except BaseException:
        for final, backup in reversed(done):
            if backup is None:
                remove_file(final)
            else:
                os.replace(backup, final)
        raise
    finally:  # a temporary file is gone once renamed, a backup once restored
        for leftover in [tmp for tmp, _ in staged] + [backup for _, backup in done if backup is not None]:
            remove_file(leftover)
    for folder in {os.path.dirname(os.path.abspath(path)) for path in files}:
        fsync_dir(folder)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Call `write` on a temporary sibling of `path`, then rename it over `path`: readers see the old
    file or the new one, and a failure leaves the old file in place."""
    atomic_write_files({os.fspath(path): write})


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` as UTF-8, atomically."""
    # Bytes, not a text-mode file: newlines stay "\n" on every platform.
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def read_json(path: str | os.PathLike, *, hint: str) -> object:
    """The JSON value in `path`, or a one-line ValueError that names the file and says `hint` (the fix)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; {hint}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); {hint}") from None


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` as a safetensors file, atomically: readers see the old file or the new one."""
    atomic_write(path, lambda f: write_safetensors_to(f, tensors, metadata))


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"duplicate key {next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)!r}")
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(name: str, info: object, buffer_size: int) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    """Validate one header entry; a ValueError here becomes a SafetensorsError naming the file."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"entry for tensor {name!r} needs dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r}; expected a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= buffer_size:
        raise ValueError(f"tensor {name!r} has data_offsets {offsets} outside the {buffer_size}-byte buffer")
    nbytes = math.prod(shape) * torch.empty(0, dtype=_DTYPES[dtype]).element_size()
    if end - begin != nbytes:
        raise ValueError(
            f"tensor {name!r}: shape {shape} of {dtype} needs {nbytes} bytes, data_offsets span {end - begin}"
        )
    return _DTYPES[dtype], shape, (begin, end)


def _read_header(f: IO[bytes], path: str) -> tuple[dict[str, tuple], dict[str, str], int]:
    """Validate the header; return ({name: (dtype, shape, (begin, end))}, metadata, data start)."""
    _require_little_endian()
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise SafetensorsError(f"{path}: only {size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    # Both checks come before reading, so a hostile length never turns into a huge allocation.
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
        )
    if 8 + n > size:
        raise SafetensorsError(f"{path}: header length {n} runs past the end of the {size}-byte file")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, duplicate keys, absurd nesting
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is JSON but not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings")
    buffer_size = size - 8 - n
    try:
        entries = {name: _check_entry(name, info, buffer_size) for name, info in header.items()}
    except ValueError as e:
        raise SafetensorsError(f"{path}: {e}") from None
    # The tensors must tile the buffer exactly: no overlaps (aliasing), no gaps (hidden bytes).
    covered = 0
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda kv: kv[1][2]):
        if begin != covered:
            what = "overlaps the previous tensor" if begin < covered else f"leaves a gap at byte {covered}"
            raise SafetensorsError(f"{path}: tensor {name!r} at data_offsets [{begin}, {end}] {what}")
        covered = end
    if covered != buffer_size:
        raise SafetensorsError(f"{path}: tensors cover {covered} bytes, the data buffer holds {buffer_size}")
    return entries, metadata, 8 + n


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file; raise SafetensorsError for a broken or hostile file.
    Each tensor's bytes are read straight into its own storage, so peak memory is the model once."""
    path = os.fspath(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        entries, _, start = _read_header(f, path)
        for name, (dtype, shape, (begin, end)) in entries.items():
            t = torch.empty(math.prod(shape), dtype=dtype)
            raw = memoryview(t.view(torch.uint8).numpy())
            f.seek(start + begin)
            if f.readinto(raw) != len(raw):  # a buffered readinto stops short only at the end of the file
                raise SafetensorsError(f"{path}: file ended inside tensor {name!r}")
            if dtype is torch.bool and t.numel() and int(t.view(torch.uint8).max()) > 1:
                raise SafetensorsError(f"{path}: tensor {name!r} holds BOOL bytes other than 0 and 1")
            out[name] = t.reshape(shape)
    return out


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The header's __metadata__ (e.g. {"format": "pt"}), without reading any tensor."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        return _read_header(f, path)[1]
