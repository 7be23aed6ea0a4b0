"""Where a ``torch.save`` archive keeps each tensor's bytes, found without reading them.

``torch.load(f, map_location="meta", weights_only=True)`` builds the whole object tree (DTensor
placements and meshes included) with storages on the meta device, and records on each storage
the offset of its bytes in the archive (``_checkpoint_offset``): torch reads the archive's
directory and its pickle, and computes the offsets from the directory as its zip writer lays
records out. Given a file object that turns each read into a ranged read (source.py), that is
a handful of small requests per rank file, whatever the size of the model; the tensors' bytes
are then read where they lie. Only weights-only globals, plus the DTensor classes the elastic
resume admits (verl_reshard_tensors), are unpickled: nothing from the bucket runs.

A DCP item is a ``torch.save`` of one tensor, so its layout is a function of the tensor's dtype
and shape alone (dcp_write.py relies on the same): :func:`item_layout` saves a data-less twin
to learn the header that precedes the bytes, which the export then checks as it reads it.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch

from ckptstore.deadline import map_in_context
from ckptstore.errors import CompatibilityError, CorruptCheckpointError, UnsafeLoadError
from ckptstore.export.source import StepSource
from ckptstore.integrations.verl_reshard_tensors import SAFE_GLOBALS, quiet_meshes

LOAD_THREADS = 8
"""Archives whose directories are read at once (a few small requests each)."""


def load_metas(source: StepSource, paths: Sequence[str]) -> list[Any]:
    """The objects of each ``torch.save`` file of ``paths``, every tensor on the meta device,
    the files read in parallel (each a few small requests)."""
    # torch's allowlist and the mesh logger are process-wide: set once around every thread
    with (
        quiet_meshes(),
        torch.serialization.safe_globals(list(SAFE_GLOBALS)),
        ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="ckpt-export") as pool,
    ):
        return map_in_context(pool, lambda path: _load_meta(source, path), paths)  # deadline too


def _load_meta(source: StepSource, path: str) -> Any:
    where = source.where(path)
    try:
        return torch.load(
            cast(IO[bytes], source.open(path)), map_location="meta", weights_only=True
        )
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(
            f"{where}: refused by the weights-only loader ({_first_line(e)}); an export "
            "unpickles only tensors, containers and FSDP2's DTensor classes, so that a writer to "
            "the bucket cannot run code through it",
            uri=where,
            step=source.step,
        ) from e
    except (RuntimeError, ValueError, EOFError, KeyError) as e:
        raise CorruptCheckpointError(
            f"{where}: not a readable torch.save file ({_first_line(e)})",
            uri=where,
            step=source.step,
        ) from e


def tensor_span(tensor: torch.Tensor, *, name: str) -> tuple[int, int]:
    """``(offset, nbytes)`` of a meta tensor's bytes in its archive, as :func:`load_meta` left
    it; refuses a tensor whose elements are not one contiguous run there."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0, 0
    if not tensor.is_contiguous():
        raise CompatibilityError(
            f"{name} is saved with strides {tensor.stride()} for shape {tuple(tensor.shape)} "
            "(a transposed or sliced view); an export reads contiguous tensors only. Save "
            ".contiguous() tensors"
        )
    storage = tensor.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    start = int(tensor.storage_offset()) * tensor.element_size()
    if not isinstance(offset, int) or start + nbytes > storage.nbytes():
        raise CorruptCheckpointError(
            f"{name}: its bytes do not lie inside its storage in the archive (offset "
            f"{offset!r}, {start}+{nbytes} of {storage.nbytes()} bytes)"
        )
    return offset + start, nbytes


@functools.lru_cache(maxsize=1024)
def item_layout(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """``(head, size)`` of ``torch.save`` of a contiguous tensor: the bytes before its data
    (the pickle and record headers, the same for any values) and the archive's length. The
    twin's memory is allocated, never touched (so never resident)."""
    sink = io.BytesIO()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), sink)
    data = sink.getvalue()
    twin = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    offset = getattr(twin.untyped_storage(), "_checkpoint_offset", None)
    if not isinstance(offset, int):  # an empty tensor: no record for its bytes
        offset = len(data)
    return data[:offset], len(data)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    found = [line for line in lines if line.startswith("WeightsUnpickler error")]
    return (found or lines or [type(error).__name__])[0]


__all__ = ["item_layout", "load_metas", "tensor_span"]
