"""The safetensors header: written here for both our writers, judged by the library on read.

Why we write it at all: ``safetensors.torch.save`` and ``save_file`` take every tensor of the
file at once, in memory, and return (or write) the whole file. Our two writers cannot work that
way. A checkpoint shard (serialize.py) streams into storage part by part while its CRC32C is
computed, with no whole-file copy; an exported shard (export/stream.py) is produced from ranged
reads of a step, so its tensors never exist in memory together. Both need the header first,
from dtypes and shapes alone, and then the bytes of each tensor in order. :func:`build` is that
header, in one place, and tests check it against the library both ways: what we write loads
with ``safe_open``/``load_file`` tensor for tensor, and ``safetensors.torch.save`` of the same
tensors declares the same dtypes, shapes and metadata. The bytes are deterministic (compact
JSON, metadata first, tensors in the order given), so a part of a state that did not change
produces a byte-identical file, which an incremental save copies instead of uploading.

Why the library reads it: a header is trusted only once ``safetensors.safe_open`` accepts it,
so a file the library rejects (bad JSON, offsets with holes or overlaps, a size that does not
match a shape, a file not fully covered, a header too large) is rejected here too, as our
CorruptCheckpointError naming the file. The library does not look at tensor bytes to accept a
file, only at the header and the file's length; so it judges a stand-in, the header followed by
a hole up to the real length (a sparse temporary file, no data written), and the real bytes
stay where they are: a shard in memory still loads as zero-copy views, and an export still
reads only the ranges it needs. The library does not expose offsets, so they are read from the
header it accepted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ckptstore.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

LENGTH_BYTES = 8
"""The header starts with its own length, a little-endian u64."""
MAX_HEADER = 100_000_000
"""The largest header the library accepts (its ``MAX_HEADER_SIZE``)."""

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
"""The safetensors code of every dtype we write (the library's own names for them)."""
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
CODES = {code: dtype for dtype, code in DTYPES.items()}


def build(
    tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str],
) -> bytes:
    """The header of a file holding ``(name, dtype, shape)`` in this order, data packed with
    no gaps; the JSON is padded with spaces so the data section starts 8-byte aligned."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in tensors:
        end = offset + math.prod(shape) * dtype.itemsize
        entries[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: dtype, shape, and its bytes ``[begin, end)`` from the file's start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A header the library accepted: where the data starts, the metadata, the tensors."""

    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, Entry]


def header_length(first: bytes | bytearray | memoryview, size: int, where: str) -> int:
    """The length of the JSON header, from the file's first 8 bytes, checked against ``size``
    (the file's) before anything more is read."""
    if size < LENGTH_BYTES or len(first) < LENGTH_BYTES:
        raise _corrupt(where, f"{size} bytes hold no header")
    (length,) = struct.unpack_from("<Q", first, 0)
    if length > size - LENGTH_BYTES:
        raise _corrupt(where, f"a header of {length} bytes does not fit a file of {size} bytes")
    if length > MAX_HEADER:
        raise _corrupt(where, f"a header of {length} bytes, over the {MAX_HEADER} allowed")
    return int(length)


def parse(head: bytes | bytearray | memoryview, size: int, where: str) -> Header:
    """The header of a file of ``size`` bytes starting with ``head`` (its length prefix and
    JSON, see :func:`header_length`), once the library accepts it."""
    length = header_length(head, size, where)
    head = bytes(head[: LENGTH_BYTES + length])
    if len(head) < LENGTH_BYTES + length:
        raise _corrupt(where, f"{len(head)} bytes given of a {length}-byte header")
    metadata = _library_check(head, size, where)
    entries: dict[str, Any] = json.loads(head[LENGTH_BYTES:])
    tensors = {}
    start = LENGTH_BYTES + length
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        dtype = CODES.get(entry["dtype"])
        if dtype is None:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} has dtype {entry['dtype']}, which ckptstore does not "
                f"read (it reads {', '.join(sorted(CODES))}); convert it before saving"
            )
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        tensors[name] = Entry(dtype, shape, start + begin, start + end)
    return Header(start, metadata, tensors)


def _library_check(head: bytes, size: int, where: str) -> dict[str, str]:
    """Let ``safe_open`` judge ``head`` as the start of a ``size``-byte file; its metadata.

    Where no temporary file can be made (a read-only or full temporary directory), a load must
    not fail for it: the header is then read without the library's judgement, as before it."""
    try:
        fd, path = tempfile.mkstemp(prefix="ckptstore-header-", suffix=".safetensors")
    except OSError as e:
        logger.debug("no stand-in for the header of %s (%s): read unchecked", where, e)
        try:
            metadata = json.loads(head[LENGTH_BYTES:]).get("__metadata__") or {}
        except (ValueError, AttributeError) as bad:
            raise _corrupt(where, f"the header is not a JSON object: {bad}") from bad
        return {str(k): str(v) for k, v in metadata.items()}
    try:
        with os.fdopen(fd, "wb") as stand_in:
            stand_in.write(head)
            stand_in.truncate(size)  # a hole: the library reads the header, not the data
        with safe_open(path, framework="pt") as opened:
            return dict(opened.metadata() or {})
    except SafetensorError as e:
        raise _corrupt(where, str(e)) from e
    finally:
        os.unlink(path)


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: not a valid safetensors file ({why}); the file was damaged or written by "
        "something else. Load an earlier step, or re-save this one"
    )


__all__ = ["CODES", "DTYPES", "Entry", "Header", "build", "header_length", "parse"]
