"""A rank's DCP ``.distcp`` file, produced as chunks instead of built in memory.

The file must stay byte for byte what ``FileSystemWriter`` writes, so that a pulled step loads
with plain ``dcp.load``: the bytes items first, as they are, then each tensor item as
``torch.save`` of the tensor, moved to the CPU and cloned when its storage is larger than the
tensor. Tensors come in the plan's order, or smallest first where an accelerator is available
(FileSystemWriter's default single thread then loads them through its overlapping loader,
which sorts them so). Each ``torch.save`` runs into a sink that copies the archive's small
records (a few hundred bytes) and, for the record of the tensor's data, keeps a view of the
tensor's own memory instead of a copy. So no tensor's bytes are copied, a rank holds at most
one item's clone (of a strided view) at a time, and the backend uploads the views as it does
the tensors of ``CheckpointStore.save``.

DCP's ``WriteResult`` needs every item's offset, and the incremental comparison the file's
size, before the first byte is produced. The lengths come from ``torch.save`` under
``skip_data``, which writes the same archive with the data skipped (not read, no CRC): a
``torch.save`` archive's length depends on the tensor's layout, never on its values. Every
item's length is checked against the plan as it is produced.

``chunks()`` may run twice (an incremental save reads the file to compare it with the previous
step's before writing it): the archive records of each tensor are kept from the first pass, so
the second neither runs ``torch.save`` nor computes its CRC32 again.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptstore.backends.base import Chunk
from ckptstore.data.payload import SourceFile
from ckptstore.errors import SerializationError

ZERO_COPY_MIN = 4096
"""Writes of ``torch.save`` at least this long are looked up in the tensor's memory; shorter
ones (the archive's records) are copied."""


@dataclass(frozen=True)
class _Span:
    """Bytes ``[start, end)`` of the saved tensor's storage."""

    start: int
    end: int


_Piece = bytes | _Span


class _Sink:
    """A write-only file for ``torch.save``: small writes are copied, writes from the storage
    at ``[base, base + nbytes)`` are recorded as spans of it. ``seek`` is how ``skip_data``
    skips the data."""

    def __init__(self, base: int = 0, nbytes: int = 0) -> None:
        self.base, self.end = base, base + nbytes
        self.size = 0
        self.pieces: list[_Piece] = []
        self._pending = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.size += n
        if n >= ZERO_COPY_MIN and self.end > self.base:
            address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
            if self.base <= address and address + n <= self.end:
                self._flush()
                self.pieces.append(_Span(address - self.base, address - self.base + n))
                return n
        self._pending += view
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR:
            raise io.UnsupportedOperation("torch.save may only skip ahead")
        self.size += offset
        return self.size

    def flush(self) -> None:
        pass

    def finish(self) -> list[_Piece]:
        self._flush()
        return self.pieces

    def _flush(self) -> None:
        if self._pending:
            self.pieces.append(bytes(self._pending))
            self._pending = bytearray()


def stored_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor FileSystemWriter passes to ``torch.save``: on the CPU, with no storage
    beyond its own bytes (a view is cloned, keeping its memory format)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def _layout_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as ``stored_tensor(tensor)`` without copying (or reading) its data."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.untyped_storage().size() == tensor.nbytes:
        return tensor
    return torch.empty_like(tensor, device="cpu")  # preserves strides as .cpu() and .clone()


def tensors_by_size() -> bool:
    """Whether FileSystemWriter writes tensors smallest first here: it does where an
    accelerator is available (CUDA or a PrivateUse1 backend)."""
    custom = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
    return torch.cuda.is_available() or bool(custom is not None and custom.is_available())


def _item_size(item: WriteItem) -> int:
    """The tensor bytes of a write item, the key of FileSystemWriter's (stable) sort."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's whole storage as bytes, without a copy (the view keeps it alive)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(flat.numpy())  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Item:
    write_item: WriteItem
    offset: int
    length: int

    @property
    def fqn(self) -> str:
        return self.write_item.index.fqn


class RankFile:
    """One rank's ``__<rank>_0.distcp`` laid out as FileSystemWriter lays it out.

    ``results`` are the WriteResults DCP records in ``.metadata``; ``source`` hands the file
    to ``stage_files``. Items are resolved through the planner again as they are produced
    (DCP asks ``resolve_data`` to be idempotent), so none is held between the passes.
    """

    def __init__(self, name: str, plan: SavePlan, planner: SavePlanner, *, where: str) -> None:
        self.name = name
        self.where = where
        self._planner = planner
        ordered = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        ordered += sorted(tensors, key=_item_size) if tensors_by_size() else tensors
        self._items: list[_Item] = []
        offset = 0
        for write_item in ordered:
            length = self._planned_length(write_item)
            self._items.append(_Item(write_item, offset, length))
            offset += length
        self.size = offset
        self._records: dict[int, tuple[int, list[_Piece]]] = {}
        """Item position -> (storage size, the pieces of its archive), from the first pass."""

    @property
    def results(self) -> list[WriteResult]:
        return [
            WriteResult(i.write_item.index, i.length, _StorageInfo(self.name, i.offset, i.length))
            for i in self._items
        ]

    def source(self) -> SourceFile:
        return SourceFile(self.name, self.chunks, self.size)

    def chunks(self) -> Iterator[Chunk]:
        """The file's bytes: each bytes item's buffer, each tensor's archive records and a
        view of its memory."""
        for position, item in enumerate(self._items):
            data = self._resolve(item.write_item)
            if isinstance(data, io.BytesIO):
                view = data.getbuffer()
                self._check(item, view.nbytes)
                yield view
            else:
                yield from self._tensor_chunks(position, item, data)

    def _planned_length(self, write_item: WriteItem) -> int:
        data = self._resolve(write_item)
        if isinstance(data, io.BytesIO):
            return data.getbuffer().nbytes
        sink = _Sink()
        with torch.serialization.skip_data():
            torch.save(_layout_twin(data), cast(IO[bytes], sink))
        return sink.size

    def _tensor_chunks(self, position: int, item: _Item, data: torch.Tensor) -> Iterator[Chunk]:
        tensor = stored_tensor(data)
        memory = _storage_bytes(tensor)
        record = self._records.get(position)
        if record is None or record[0] != memory.nbytes:
            sink = _Sink(tensor.untyped_storage().data_ptr(), memory.nbytes)
            torch.save(tensor, cast(IO[bytes], sink))
            self._check(item, sink.size)
            record = self._records[position] = (memory.nbytes, sink.finish())
        for piece in record[1]:
            yield piece if isinstance(piece, bytes) else memory[piece.start : piece.end]

    def _resolve(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self._planner.resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise SerializationError(
                    f"{self.where}: {write_item.index.fqn}: DCP's planner resolved a bytes item "
                    f"to {type(data).__name__}, expected io.BytesIO (check the SavePlanner)"
                )
        elif not isinstance(data, torch.Tensor):
            raise SerializationError(
                f"{self.where}: {write_item.index.fqn}: DCP's planner resolved a tensor item "
                f"to {type(data).__name__}, expected a torch.Tensor (check the SavePlanner)"
            )
        return data

    def _check(self, item: _Item, length: int) -> None:
        if length != item.length:
            raise SerializationError(
                f"{self.where}: {item.fqn} came out {length} bytes long, its planned length "
                f"is {item.length}: the SavePlanner's resolve_data returned something else "
                "on a second call, or torch.save lays this tensor out differently than "
                "planned; save this state with FileSystemWriter and report it"
            )
