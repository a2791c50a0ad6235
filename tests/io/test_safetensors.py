"""The safetensors format: written byte for byte as documented, read back bit-exact, hostile files rejected
with one clear line before any allocation, and a failed write never damages the old file."""

import json
import os
import re
import stat
import struct
import tracemalloc

import pytest
import torch

from medusa_mini.io.files import atomic_write
from medusa_mini.io.safetensors import read_safetensors, write_safetensors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool], ids=str)
def test_a_round_trip_keeps_dtype_shape_and_every_bit(tmp_path, dtype):
    def sample(*shape: int) -> torch.Tensor:
        ints = torch.randint(-100 if dtype.is_signed else 0, 2 if dtype is torch.bool else 100, shape)
        return (torch.randn(shape) if dtype.is_floating_point else ints).to(dtype)

    tensors = {"matrix": sample(3, 5), "scalar": sample(), "empty": sample(0, 4), "view": sample(4, 3).t()}
    atomic_write(tmp_path / "t.safetensors", lambda f: write_safetensors(f, tensors))
    assert (back := read_safetensors(tmp_path / "t.safetensors")).keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape and torch.equal(back[name], t)


def test_the_written_file_has_the_documented_byte_layout_and_each_formats_raw_bits(tmp_path):
    """F16 is IEEE half, BF16 bfloat16: a swapped pair would round-trip yet misread every real file."""
    tensors = {"a": torch.randn(2, 3), "b": torch.arange(5), "c": torch.tensor([1, 2, 255]).to(torch.uint8),
               "h": torch.tensor([1.5, -2.0, 65504.0], dtype=torch.float16),
               "bf": torch.tensor([1.5, -2.0, 3.0e38], dtype=torch.bfloat16)}
    want = {"a": ("F32", tensors["a"].numpy().astype("<f4").tobytes()), "c": ("U8", bytes([1, 2, 255])),
            "b": ("I64", struct.pack("<5q", *range(5))), "h": ("F16", struct.pack("<3H", 0x3E00, 0xC000, 0x7BFF)),
            "bf": ("BF16", struct.pack("<3H", 0x3FC0, 0xC000, 0x7F62))}
    atomic_write(tmp_path / "t.safetensors", lambda f: write_safetensors(f, tensors, {"note": "hi"}))
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header padded so the data starts 8-byte aligned"
    header, data, covered = json.loads(raw[8 : 8 + n].decode("utf-8")), raw[8 + n :], 0
    assert header.pop("__metadata__") == {"note": "hi"}
    for (begin, end), name in sorted((e["data_offsets"], k) for k, e in header.items()):
        assert (header[name]["dtype"], data[begin:end]) == want[name]
        assert (header[name]["shape"], begin) == (list(tensors[name].shape), covered)
        covered = end
    assert covered == len(data), "tensors tile the buffer in order"


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    path, synced = tmp_path / "t.safetensors", []
    monkeypatch.setattr(os, "fsync", lambda fd, real=os.fsync: synced.append(os.fstat(fd).st_mode) or real(fd))
    atomic_write(path, lambda f: write_safetensors(f, {"x": torch.ones(3)}))
    assert [stat.S_ISREG(m) for m in synced] == [True, False]  # the bytes on disk, then the rename in the folder
    complex_last = {"y": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)}
    pytest.raises(ValueError, atomic_write, path, lambda f: write_safetensors(f, complex_last)).match("cannot be")
    assert torch.equal(read_safetensors(path)["x"], torch.ones(3)) and os.listdir(tmp_path) == ["t.safetensors"]


def st_file(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = {"shorter than 8 bytes": (b"\x10\x00\x00", "too short"),
    "header length beyond the file": (st_file(b"{}", length=3), "runs past the end"),
    "invalid JSON": (st_file(b'{"a": '), "not valid JSON"), "too deep": (st_file(b"[" * 10**5), "not valid JSON"),
    "invalid UTF-8": (st_file(b"\xff\xfe\xfd"), "not valid JSON"),
    "JSON but not an object": (st_file(b"[1, 2]"), "not an object"),
    "duplicate tensor name": (st_file(b'{"a": 1, "a": 2}'), "duplicate key 'a'"),
    "entry without fields": (st_file({"a": {"dtype": "F32"}}), "needs dtype, shape and data_offsets"),
    "entry not an object": (st_file({"a": 5}), "needs dtype, shape and data_offsets"),
    "unknown dtype": (st_file({"a": entry("F128", [1], 0, 16)}, bytes(16)), "unknown dtype 'F128'"),
    "negative shape": (st_file({"a": entry("F32", [-1, 2], 0, 8)}, bytes(8)), "non-negative integers"),
    "float in shape": (st_file({"a": entry("F32", [2.0], 0, 8)}, bytes(8)), "non-negative integers"),
    "offsets not a pair": (st_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, b"x"), "begin, end"),
    "float in offsets": (st_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}}, b"x"), "begin, end"),
    "shape disagrees with bytes": (st_file({"a": entry("F32", [3], 0, 8)}, bytes(8)), "needs 12 bytes"),
    "offsets beyond the buffer": (st_file({"a": entry("F32", [4], 0, 16)}, bytes(8)), "outside"),
    "offsets reversed": (st_file({"a": entry("U8", [0], 8, 4)}, bytes(8)), "outside"),
    "overlapping tensors": (st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
                            "overlaps"),
    "gap between tensors": (st_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)), "gap"),
    "bytes nobody owns": (st_file({"a": entry("F32", [1], 0, 4)}, bytes(8)), "cover 4 bytes"),
    "metadata not strings": (st_file({"__metadata__": {"a": 1}}), "__metadata__"),
    "BOOL byte other than 0/1": (st_file({"a": entry("BOOL", [2], 0, 2)}, b"\x01\x02"), "BOOL"),
    "bool in shape": (st_file({"a": entry("F32", [True], 0, 4)}, bytes(4)), "non-negative integers")}


@pytest.mark.parametrize("content, match", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_broken_or_hostile_file_gives_one_line_naming_it(tmp_path, content, match):
    (path := tmp_path / "bad.safetensors").write_bytes(content)
    err = pytest.raises(ValueError, read_safetensors, path)
    assert err.match(match) and str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_huge_header_length_is_rejected_before_any_allocation(tmp_path):
    (path := tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 150 * 2**20))
    os.truncate(path, 8 + 200 * 2**20)  # sparse: the file really is long enough for a 150 MB header
    tracemalloc.start()
    pytest.raises(ValueError, read_safetensors, path).match(f"^{re.escape(str(path))}: header length .* exceeds")
    assert tracemalloc.get_traced_memory()[1] < 2**20
    tracemalloc.stop()
