"""The tensor half of resharding verl FSDP2 checkpoints: read W rank files safely, build the
state one new rank would have saved on W' ranks, write it without holding the model.

verl's FSDP2 rank files are ``torch.save`` pickles of ``model.state_dict()`` and
``optimizer.state_dict()``: every parameter (and every Adam moment) is a DTensor on a 1-D
mesh of all W ranks with placement ``Shard(0)``, its local tensor the rows ``torch.chunk``
gives that rank (``ceil(n / W)`` rows each, the last ranks fewer or none). Everything else in
those files (optimizer step counters, ``param_groups``, buffers) is the same on every rank.

Three choices make this safe and small:

* **No code from the bucket.** A file is first scanned for the globals its pickle names
  (nothing is executed); any outside :data:`SAFE_GLOBALS` is refused, then the file is loaded
  with ``weights_only=True``, allowing exactly those classes.
* **No whole model in memory.** Inputs are loaded with ``mmap=True``: their bytes stay in the
  page cache, read slice by slice. Each output tensor is allocated in a scratch file
  (:class:`Scratch`, unlinked at creation) and filled by copying rows from the inputs, so the
  process's own (anonymous) memory stays about the size of one tensor's metadata while
  ``torch.save`` streams the file-backed storages out.
* **The new mesh is built, not patched.** A ``DeviceMesh`` over ``range(W')`` is constructed
  without a process group (``_init_backend=False``) for the new rank, and keeps the old mesh's
  device type, dimension names and process-group names, so verl's load on W' ranks sees the
  same mesh its own save would have written.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

from ckptstore.errors import CompatibilityError, CorruptCheckpointError, UnsafeLoadError

SAFE_GLOBALS: tuple[Any, ...] = (
    DTensor,
    DTensorSpec,
    TensorMeta,
    ShardOrderEntry,
    DeviceMesh,
    Shard,
)
"""What an FSDP2 model or optimizer rank file may name besides plain tensors and containers."""

_SAFE_NAMES = frozenset(f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS)
EXTRA_STATE_GLOBALS = frozenset(
    {
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
    }
)
"""What ``extra_state`` (lr scheduler and the RNG states: numpy's is an array) may name; those
files are copied byte for byte, never unpickled here."""

_ALIGN = 64


def chunk_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` that ``torch.chunk(rows, world)[rank]`` holds (FSDP2's split):
    chunks of ``ceil(rows / world)``, the last ranks shorter or empty."""
    size = math.ceil(rows / world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def check_globals(path: Path, allowed: frozenset[str]) -> None:
    """Refuse a pickle that names a global outside ``allowed``, without executing it."""
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save file ({e}); pull the step again", path=str(path)
        ) from e
    unsafe = sorted(set(named) - allowed - _SAFE_NAMES)
    if unsafe:
        raise UnsafeLoadError(
            f"{path} names {', '.join(unsafe)}, which an FSDP2 checkpoint of verl never holds; "
            "refusing to unpickle it (a writer to the bucket could run code through it). Reshard "
            "only checkpoints verl wrote, or inspect the file",
            path=str(path),
        )


def load_rank_file(path: Path) -> Any:
    """A model or optimizer rank file, memory-mapped, with only :data:`SAFE_GLOBALS` allowed."""
    check_globals(path, frozenset())
    try:
        with quiet_meshes(), torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(
            f"{path}: refused by the weights-only loader ({e})", path=str(path)
        ) from e
    except (RuntimeError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save file ({e}); pull the step again", path=str(path)
        ) from e


@contextmanager
def quiet_meshes() -> Iterator[None]:
    """Unpickling a DeviceMesh where no process group exists warns once per mesh; here that
    is the point (the meshes are only read), so the warning is held back while loading."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_shard(node: DTensor, world: int, rank: int, shape: tuple[int, ...], name: str) -> None:
    """Raise unless ``node`` is what FSDP2 on ``world`` ranks saves on ``rank`` for a tensor of
    ``shape``: ``Shard(0)`` on a 1-D mesh of all ranks, holding ``torch.chunk``'s rows. A mesh
    loaded on the meta device (its ranks unread) is checked by its size only."""
    mesh = node.device_mesh
    if node.placements != (Shard(0),) or mesh.ndim != 1:
        raise CompatibilityError(
            f"{name}: placements {node.placements} on a {mesh.ndim}-D mesh; only FSDP2's "
            "Shard(0) over one mesh of all ranks is supported (tensor parallel and HSDP meshes "
            "are not)"
        )
    ranks = list(range(mesh.mesh.numel())) if mesh.mesh.is_meta else mesh.mesh.flatten().tolist()
    if ranks != list(range(world)):
        raise CompatibilityError(
            f"{name}: the mesh covers ranks {ranks}, not all {world} ranks of the checkpoint; "
            "its shards cannot be put together"
        )
    lo, hi = chunk_range(shape[0] if shape else 0, world, rank)
    local = node._local_tensor
    if tuple(node.shape) != shape or tuple(local.shape) != (hi - lo, *shape[1:]):
        raise CorruptCheckpointError(
            f"{name}: rank {rank} holds a shard of shape {tuple(local.shape)} of "
            f"{tuple(node.shape)}; FSDP2 on {world} ranks would hold {(hi - lo, *shape[1:])} "
            f"of {shape}"
        )


class Scratch:
    """Tensors whose storage lives in one anonymous scratch file: filling them does not grow
    the process's own memory, and ``torch.save`` writes each storage as it is (compact: one
    storage per tensor, like verl's own files)."""

    def __init__(self, folder: Path) -> None:
        self._file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115 (closed by close())
            dir=folder, prefix=".ckpt-tmp-scratch-"
        )
        self._end = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        offset = -(-self._end // _ALIGN) * _ALIGN
        self._end = offset + nbytes
        os.ftruncate(self._file.fileno(), self._end)
        raw = np.memmap(self._file, dtype=np.uint8, mode="r+", offset=offset, shape=(nbytes,))
        return torch.from_numpy(raw).view(dtype).view(tuple(shape))

    def close(self) -> None:
        self._file.close()


class RankBuilder:
    """Builds what new rank ``rank`` of ``world`` ranks holds, from the W old ranks' trees."""

    def __init__(self, name: str, old_world: int, world: int, rank: int, scratch: Scratch) -> None:
        self.name, self.old_world, self.world, self.rank = name, old_world, world, rank
        self.scratch = scratch
        self._meshes: dict[int, DeviceMesh] = {}

    def build(self, nodes: Sequence[Any], where: str = "") -> Any:
        first = nodes[0]
        if isinstance(first, DTensor):
            return self._dtensor(nodes, where)
        for node in nodes[1:]:
            if type(node) is not type(first):
                self._differs(where, "holds values of different types")
        if isinstance(first, torch.Tensor):
            return self._replicated(nodes, where)
        if isinstance(first, dict):
            keys = list(first)
            if any(list(n) != keys for n in nodes[1:]):
                self._differs(where, "holds different keys")
            out = OrderedDict() if isinstance(first, OrderedDict) else {}
            for key in keys:
                out[key] = self.build([n[key] for n in nodes], f"{where}[{key!r}]")
            return out
        if isinstance(first, (list, tuple)):
            if any(len(n) != len(first) for n in nodes[1:]):
                self._differs(where, "holds sequences of different lengths")
            items = [self.build([n[i] for n in nodes], f"{where}[{i}]") for i in range(len(first))]
            return items if isinstance(first, list) else type(first)(items)
        if any(not _same(first, n) for n in nodes[1:]):
            self._differs(where, f"holds {first!r} on rank 0 but not on every rank")
        return first

    def _replicated(self, nodes: Sequence[torch.Tensor], where: str) -> torch.Tensor:
        first = nodes[0]
        if any(not torch.equal(first, n) or n.dtype != first.dtype for n in nodes[1:]):
            self._differs(where, "is a plain tensor that differs between ranks")
        out = self.scratch.empty(first.shape, first.dtype)
        out.copy_(first)
        return out

    def _dtensor(self, nodes: Sequence[Any], where: str) -> DTensor:
        first: DTensor = nodes[0]
        shape, rows = tuple(first.shape), first.shape[0] if first.dim() else 0
        for old_rank, node in enumerate(nodes):
            self._check_sharding(node, old_rank, shape, where)
        start, end = chunk_range(rows, self.world, self.rank)
        local = self.scratch.empty((end - start, *shape[1:]), first.dtype)
        for old_rank, node in enumerate(nodes):
            lo, hi = chunk_range(rows, self.old_world, old_rank)
            a, b = max(lo, start), min(hi, end)
            if a < b:
                local[a - start : b - start].copy_(node._local_tensor[a - lo : b - lo])
        return DTensor.from_local(
            local,
            self._mesh(first.device_mesh),
            [Shard(0)],
            run_check=False,
            shape=first.shape,
            stride=first.stride(),
        )

    def _check_sharding(self, node: Any, old_rank: int, shape: tuple[int, ...], where: str) -> None:
        if not isinstance(node, DTensor):
            self._differs(where, "is a DTensor on some ranks only")
        check_shard(node, self.old_world, old_rank, shape, f"{self.name}{where}")

    def _mesh(self, old: DeviceMesh) -> DeviceMesh:
        mesh = self._meshes.get(id(old))
        if mesh is None:
            mesh = DeviceMesh(
                old.device_type,
                torch.arange(self.world, dtype=torch.int),
                mesh_dim_names=old.mesh_dim_names,
                _init_backend=False,
                _rank=self.rank,
            )
            names = getattr(old, "_dim_group_names", None)
            if names is not None:
                mesh._dim_group_names = list(names)
            self._meshes[id(old)] = mesh
        return mesh

    def _differs(self, where: str, what: str) -> None:
        raise CorruptCheckpointError(
            f"{self.name}{where} {what}; in a verl FSDP2 checkpoint only DTensor shards differ "
            "between ranks, so these files do not belong to one step"
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


__all__ = [
    "EXTRA_STATE_GLOBALS",
    "SAFE_GLOBALS",
    "RankBuilder",
    "Scratch",
    "check_globals",
    "check_shard",
    "chunk_range",
    "load_rank_file",
    "quiet_meshes",
]
