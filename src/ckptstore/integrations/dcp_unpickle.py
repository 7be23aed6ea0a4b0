"""Reading DCP's pickled files without running pickle from the store unless told to.

DCP's format uses pickle: ``.metadata`` is pickled, and tensors and non-tensor values are
written with ``torch.save``; DCP's planner unpickles the latter in full. So a reader that trusts
the format trusts every writer of the store. Here ``.metadata`` is unpickled admitting only
DCP's metadata classes and torch dtypes, tensors load with ``torch.load(weights_only=True)`` (as
DCP does), and a non-tensor value reaches the planner only after ``torch.load(weights_only=True)``
accepted it; ``allow_pickle=True`` lifts these checks for writers you trust. Kept apart from
dcp.py, which moves the bytes, so that what may be unpickled is reviewed in one place.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptstore.errors import CorruptCheckpointError, UnsafeLoadError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: no class outside the list is built."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def load_metadata(data: bytes, where: str, allow_pickle: bool) -> Metadata:
    """DCP's ``.metadata``, ``where`` naming the file: only DCP's classes, or any with
    ``allow_pickle``."""
    try:
        if allow_pickle:
            metadata = pickle.loads(data)
        else:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(
            f"{where}: not plain DCP metadata ({e}); load with "
            "CkptStoreReader(..., allow_pickle=True) only if you trust every writer"
        ) from e
    except (EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: unreadable ({e!r})") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(metadata)}")
    return metadata


def check_weights_only(piece: io.BytesIO, where: str) -> None:
    """Raise UnsafeLoadError unless ``torch.load(weights_only=True)`` accepts the value."""
    try:
        torch.load(piece, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(
            f"{where}: loading this value would run pickle from the store ({_reason(e)}). "
            "Pass CkptStoreReader(..., allow_pickle=True) only if you trust every writer"
        ) from e


def load_tensor(piece: io.BytesIO, where: str, allow_pickle: bool) -> torch.Tensor:
    """One tensor, loaded as DCP loads it: ``weights_only`` unless ``allow_pickle``."""
    try:
        tensor = torch.load(piece, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(f"{where}: not a plain tensor ({_reason(e)})") from e
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: holds a {type(tensor).__name__}, not a tensor")
    return tensor


def _reason(error: Exception) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    found = [line for line in lines if line.startswith("WeightsUnpickler error")]
    return (found or lines or ["unpickling refused"])[0]
