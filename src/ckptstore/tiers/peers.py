"""Peer copies of a node's local tier, over torch.distributed (``replicas=1``).

A local tier (tiers/local.py) makes saves fast, but a node that is lost takes its local steps with
it; only the durable tier, which may lag by ``persist_every`` saves, is left. As Gemini and
NVIDIA's resiliency extension do, each rank of ``save_distributed`` also sends the files it
staged to the next rank (``(r + 1) % world``), which writes them into its own node's local
tier under the same keys. A job that lost one node resumes from the copies its peer holds and
reads from the bucket only what no peer holds.

Both halves are collectives: every rank calls them at the same point, whatever happened
locally (a rank with nothing to send sends an empty list), so a failure never leaves a peer
waiting. Each rank first tells its receiver which files come (keys and sizes, a small object
message; even ranks send first, so a ring of any size cannot deadlock), then every file
travels as a raw byte tensor, read straight into it, with all sends and receives posted at
once. What arrives is written as it came and checked when read: every read verifies the bytes
against the manifest (a peer's copy is never trusted for being a peer's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ckptstore.errors import CheckpointError

if TYPE_CHECKING:
    from ckptstore.backends.base import Backend
    from ckptstore.core.collectives import Collectives
    from ckptstore.domain.info import CheckpointInfo
    from ckptstore.domain.manifest import FileEntry
    from ckptstore.tiers.node_tier import NodeTier

log = logging.getLogger(__name__)

Files = list[tuple[str, torch.Tensor]]
"""Object keys in the local tier and their bytes, as uint8 tensors."""


def send_to_peer(comm: Collectives, node: NodeTier, step: int, staged: Sequence[FileEntry]) -> None:
    """Save side: send the files this rank staged for ``step`` to the next rank, and write
    those the previous rank staged into this node's local tier. Every rank calls it."""
    if comm.size == 1:
        return
    backend = node.local.catalog.backend
    mine = [(e.key(step), _read(backend, e.key(step), e.size)) for e in staged]
    for key, data in _exchange(comm, mine, to=_next(comm), source=_previous(comm)):
        backend.write(key, [_bytes(data)])


def recover_from_peer(
    comm: Collectives, node: NodeTier, info: CheckpointInfo, paths: Sequence[str]
) -> int:
    """Load side: the files of ``paths`` (this rank's part of ``info``'s step) that this
    node's local tier lacks or holds with another size (one listing) are asked of the next
    rank, whose node holds this rank's peer copies, and written into this node's local tier.
    A peer sends only copies that pass their check. Every rank calls it; returns how many
    files this rank recovered."""
    if comm.size == 1:
        return 0
    local = node.local.catalog
    step = info.step
    here = local.payload_sizes(step)
    wanted = [p for p in paths if here.get(_entry(info, p).key(step)) != _entry(info, p).size]
    asks = comm.all_gather(wanted)
    answer: Files = []
    for path in asks[_previous(comm)]:  # the previous rank's copies are on this node
        entry = _entry(info, path)
        try:
            data = local.read_verified(step, entry)
        except CheckpointError as e:
            log.warning("%s; not sent to rank %d", e, _previous(comm))
            continue
        answer.append((entry.key(step), torch.frombuffer(bytearray(data), dtype=torch.uint8)))
    received = _exchange(comm, answer, to=_previous(comm), source=_next(comm))
    for key, tensor in received:
        local.backend.write(key, [_bytes(tensor)])
    if wanted:
        log.warning("%s: %d of %d files of step %d were missing here; %d came from rank %d, "
                    "the peer holding their copies; any other is read from the durable tier",
                    local.backend.uri, len(wanted), len(paths), step, len(received),
                    _next(comm))  # fmt: skip
    return len(received)


def _entry(info: CheckpointInfo, path: str) -> FileEntry:
    return info.manifest.file(path)


def _read(backend: Backend, key: str, size: int) -> torch.Tensor:
    """A file read straight into a uint8 tensor (no second copy)."""
    out = torch.empty(size, dtype=torch.uint8)
    if size:
        backend.read_into(key, _bytes(out))
    return out


def _bytes(data: torch.Tensor) -> memoryview:
    """A uint8 tensor's memory, shared."""
    return memoryview(data.numpy())  # type: ignore[arg-type]


def _exchange(comm: Collectives, outgoing: Files, *, to: int, source: int) -> Files:
    """Send ``outgoing`` to group rank ``to`` and receive what group rank ``source`` sends:
    first the keys and sizes (even ranks send first, odd ranks receive first, so no ring
    waits on itself), then every file at once."""
    sizes = [(key, data.numel()) for key, data in outgoing]
    if comm.rank % 2 == 0:
        comm.send(sizes, to)
        incoming: list[tuple[str, int]] = comm.receive(source)
    else:
        incoming = comm.receive(source)
        comm.send(sizes, to)
    received = [(key, torch.empty(size, dtype=torch.uint8)) for key, size in incoming]
    ops = [dist.P2POp(dist.isend, data, comm.global_rank(to), comm.group)
           for _, data in outgoing if data.numel()]  # fmt: skip
    ops += [dist.P2POp(dist.irecv, data, comm.global_rank(source), comm.group)
            for _, data in received if data.numel()]  # fmt: skip
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


def _next(comm: Collectives) -> int:
    return (comm.rank + 1) % comm.size


def _previous(comm: Collectives) -> int:
    return (comm.rank - 1) % comm.size
