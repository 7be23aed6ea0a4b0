"""A safetensors file of the export, produced as it is written, from ranged reads of the step.

The header comes first (every tensor's dtype, shape and place are known from the plan), then
each tensor's bytes in order. A tensor whose pieces are whole rows in order (FSDP2's shards, a
replicated tensor, a native or one-chunk DCP tensor) streams: each read's data goes out as it
arrives, converted if a dtype was asked for, so memory holds the reads in flight (the
ChunkReader's bound), not the tensor. Only a tensor that must be assembled (DCP chunks split
along another dimension) or computed (a LoRA merge) is built whole in memory, one at a time:
at most the largest such tensor, within the largest output shard. The reads of consecutive
tensors go through one ChunkReader, so the next tensor's bytes are on their way while the last
one's are written.

The library's ``safetensors.torch.save`` would need every tensor of the file in memory at once;
this writer needs at most one, so it writes the header itself (safetensors_header.build, the one
builder, shared with the checkpoint shards) and the library reads what it wrote in the tests.

Replicated copies are read too (the file check needs their bytes anyway) and must hash like
the copy that was written; a DCP item's archive header must be the one its layout implies.
"""

from __future__ import annotations

import abc
import hashlib
import warnings
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field

import torch

from ckptstore.backends.base import Chunk, chunk_size
from ckptstore.data import safetensors_header
from ckptstore.domain.checksum import Crc32c
from ckptstore.errors import CorruptCheckpointError
from ckptstore.export.plan import Merged, OutTensor, Piece, SourceTensor
from ckptstore.export.source import StepSource

Span = tuple[str, int, int]


def header(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of an export file: tensors laid out in order."""
    specs = ((t.name, t.dtype, t.shape) for t in tensors)
    return safetensors_header.build(specs, {"format": "pt", **(metadata or {})})


@dataclass
class Written:
    """What one file's bytes came to: its size and CRC32C, for the export's record."""

    size: int = 0
    crc: Crc32c = field(default_factory=Crc32c)


class ShardStream:
    """The bytes of one safetensors file of ``tensors``, read from ``source``."""

    def __init__(self, source: StepSource, tensors: list[OutTensor]) -> None:
        self.source, self.tensors = source, tensors
        self.written = Written()
        self.peak_tensor = 0
        """Bytes of the largest tensor built whole in memory."""

    def chunks(self) -> Iterator[Chunk]:
        for chunk in self._chunks():
            self.written.crc.update(chunk)
            self.written.size += chunk_size(chunk)
            yield chunk

    def _chunks(self) -> Iterator[Chunk]:
        yield header(self.tensors)
        jobs = [_job(t, self.source.chunk_size) for t in self.tensors]
        reads = self.source.ranges(span for job in jobs for span in job.spans)
        with closing(reads):
            for job in jobs:
                yield from job.run(reads)
                self.peak_tensor = max(self.peak_tensor, job.held)


def _job(tensor: OutTensor, chunk: int) -> _Job:
    source = tensor.source
    if isinstance(source, SourceTensor) and source.rows_in_order():
        return _Streamed(tensor, source, chunk)
    return _Built(tensor, chunk)


class _Job(abc.ABC):
    """One tensor: the reads it needs (``spans``, in order) and what it makes of them."""

    held = 0

    def __init__(self, tensor: OutTensor, chunk: int) -> None:
        self.tensor = tensor
        self.chunk = chunk
        self.spans: list[Span] = []

    @abc.abstractmethod
    def run(self, reads: Iterator[memoryview]) -> Iterator[Chunk]:
        """The tensor's bytes, taking exactly its ``spans`` from ``reads``."""

    def _plan(self, piece: Piece) -> int:
        """Queue the reads of a piece: its lead in the first read, then chunks; returns how
        many reads it takes."""
        count = 0
        position = piece.start
        first_end = piece.data_start + self.chunk
        while position < piece.stop:
            end = min(piece.stop, first_end if count == 0 else position + self.chunk)
            self.spans.append((piece.path, position, end))
            position = end
            count += 1
        return count

    def _data(self, piece: Piece, reads: Iterator[memoryview], count: int) -> Iterator[memoryview]:
        """The piece's data bytes from its ``count`` reads, its lead checked."""
        position = piece.start
        for _ in range(count):
            view = next(reads)
            a, b = position, position + view.nbytes
            if a == piece.start and piece.expect is not None:
                self._expect(piece, view[: piece.lead])
            lo, hi = max(a, piece.data_start), min(b, piece.data_start + piece.nbytes)
            if lo < hi:
                yield view[lo - a : hi - a]
            position = b

    def _expect(self, piece: Piece, got: memoryview) -> None:
        if bytes(got) != piece.expect:
            raise CorruptCheckpointError(
                f"{self.tensor.source.name}: the archive at byte {piece.start} of "
                f"{piece.path} does not start as torch.save of a {self.tensor.source.dtype} "
                f"tensor of {piece.shape} does (another torch version's layout, or not a "
                "tensor); re-save the step or export it with the torch that wrote it"
            )


class _Streamed(_Job):
    """Whole rows in order: data goes out as it is read, converted chunk by chunk."""

    def __init__(self, tensor: OutTensor, source: SourceTensor, chunk: int) -> None:
        super().__init__(tensor, chunk)
        self.source = source
        self.counts = [self._plan(p) for p in source.pieces]
        self.replica_counts = [self._plan(p) for p in source.replicas]

    def run(self, reads: Iterator[memoryview]) -> Iterator[Chunk]:
        convert = _Converter(self.source.dtype, self.tensor.dtype)
        digest = hashlib.blake2b() if self.source.replicas else None
        for piece, count in zip(self.source.pieces, self.counts, strict=True):
            for data in self._data(piece, reads, count):
                if digest is not None:
                    digest.update(data)
                yield from convert(data)
        yield from convert.finish()
        for piece, count in zip(self.source.replicas, self.replica_counts, strict=True):
            copy = hashlib.blake2b()
            for data in self._data(piece, reads, count):
                copy.update(data)
            if digest is not None and copy.digest() != digest.digest():
                raise CorruptCheckpointError(
                    f"{self.source.where}: {self.source.name} is a plain (replicated) tensor "
                    f"whose copy in {piece.path} differs from the one in "
                    f"{self.source.pieces[0].path}; in a verl FSDP2 step only DTensor shards "
                    "differ between ranks, so these files do not belong to one step"
                )


class _Built(_Job):
    """Assembled (or computed) in memory, then written."""

    def __init__(self, tensor: OutTensor, chunk: int) -> None:
        super().__init__(tensor, chunk)
        source = tensor.source
        self.parts = (
            [source] if isinstance(source, SourceTensor) else [source.base, source.a, source.b]
        )
        self.counts = [[self._plan(p) for p in (*s.pieces, *s.replicas)] for s in self.parts]

    def run(self, reads: Iterator[memoryview]) -> Iterator[Chunk]:
        built = [self._assemble(s, reads, c) for s, c in zip(self.parts, self.counts, strict=True)]
        source = self.tensor.source
        if isinstance(source, Merged):
            base, a, b = built
            merged = base.float() + (b.float() @ a.float()) * source.scale
            result = merged.to(base.dtype)
        else:
            result = built[0]
        self.held = sum(t.nbytes for t in built) + result.nbytes
        out = result.to(self.tensor.dtype).contiguous()
        if out.numel():
            yield memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]

    def _assemble(
        self, source: SourceTensor, reads: Iterator[memoryview], counts: list[int]
    ) -> torch.Tensor:
        full = torch.empty(source.shape, dtype=source.dtype)
        pieces = (*source.pieces, *source.replicas)
        first: bytes | None = None
        for index, (piece, count) in enumerate(zip(pieces, counts, strict=True)):
            data = b"".join(bytes(d) for d in self._data(piece, reads, count))
            if index >= len(source.pieces):
                if data != first:
                    raise CorruptCheckpointError(
                        f"{source.where}: {source.name}: the copy in {piece.path} differs from "
                        f"the one in {source.pieces[0].path}; the files do not belong to one step"
                    )
                continue
            first = data if index == 0 else first
            block = _frombuffer(data, source.dtype).view(piece.shape)
            box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape, strict=True))
            full[box] = block
        return full


class _Converter:
    """Bytes of ``source`` dtype in, bytes of ``target`` dtype out, element-aligned: a chunk
    that ends inside an element carries its tail to the next."""

    def __init__(self, source: torch.dtype, target: torch.dtype) -> None:
        self.source, self.target = source, target
        self.size = source.itemsize
        self.carry = b""

    def __call__(self, data: memoryview) -> Iterator[Chunk]:
        if self.source == self.target:
            yield data
            return
        if self.carry:
            data = memoryview(self.carry + bytes(data))
            self.carry = b""
        usable = data.nbytes - data.nbytes % self.size
        if usable < data.nbytes:
            self.carry = bytes(data[usable:])
        if usable:
            converted = _frombuffer(data[:usable], self.source).to(self.target)
            yield memoryview(converted.view(torch.uint8).numpy())  # type: ignore[arg-type]

    def finish(self) -> Iterator[Chunk]:
        if self.carry:
            raise CorruptCheckpointError(
                f"{len(self.carry)} bytes left over converting {self.source} to {self.target}"
            )
        return iter(())


def _frombuffer(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor viewing ``data`` (read-only bytes: torch warns, and nothing writes to it)."""
    if not len(data):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


__all__ = ["ShardStream", "Written", "header"]
