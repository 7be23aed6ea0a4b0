"""Peer copies of a node's local tier, over torch.distributed (``replicas=1``).

A local tier (tiers.py) makes saves fast, but a node that is lost takes its local steps with
it; only the durable tier, which may lag by ``persist_every`` saves, is left. As Gemini and
NVIDIA's resiliency extension do, each rank of ``save_distributed`` also sends the files it
staged to the next rank (``(r + 1) % world``), which writes them into its own node's local
tier under the same keys. A job that lost one node resumes from the copies its peer holds and
reads from the bucket only what no peer holds.

Both halves are collectives: every rank calls them at the same point, whatever happened
locally (a rank with nothing to send sends an empty list), so a failure never leaves a peer
waiting. Files travel as pickled bytes over the save's process group, one rank's share at a
time; the ranks alternate sending and receiving (even ranks send first) so that a ring of any
size cannot deadlock. What arrives is written as it came and checked when read: every read
verifies the bytes against the manifest (a peer's copy is never trusted for being a peer's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptstore.errors import CheckpointError

if TYPE_CHECKING:
    from ckptstore.distributed import Collectives
    from ckptstore.info import CheckpointInfo
    from ckptstore.manifest import FileEntry
    from ckptstore.tiers import Persister

log = logging.getLogger(__name__)

Files = list[tuple[str, bytes]]
"""Object keys in the local tier and their bytes."""


def send_to_peer(
    comm: Collectives, tiers: Persister, step: int, staged: Sequence[FileEntry]
) -> None:
    """Save side: send the files this rank staged for ``step`` to the next rank, and write
    those the previous rank staged into this node's local tier. Every rank calls it."""
    if comm.size == 1:
        return
    backend = tiers.local.catalog.backend
    mine: Files = [(e.key(step), bytes(backend.read(e.key(step)))) for e in staged]
    received = _ring(comm, mine, to=_next(comm), source=_previous(comm))
    for key, data in received:
        backend.write(key, [data])


def recover_from_peer(
    comm: Collectives, tiers: Persister, info: CheckpointInfo, paths: Sequence[str]
) -> int:
    """Load side: the files of ``paths`` (this rank's part of ``info``'s step) that this
    node's local tier lacks, or holds with bytes that fail their check, are asked of the next
    rank, whose node holds this rank's peer copies, and written into this node's local tier.
    Every rank calls it; returns how many files this rank recovered."""
    if comm.size == 1:
        return 0
    local = tiers.local.catalog
    step = info.step
    wanted = [p for p in paths if not _good(tiers, info, p)]
    asks = comm.all_gather(wanted)
    asked_of_me = asks[_previous(comm)]  # the previous rank's copies are here
    answer: Files = []
    for path in asked_of_me:
        entry = info.manifest.file(path)
        if _good(tiers, info, path):
            answer.append((entry.key(step), bytes(local.backend.read(entry.key(step)))))
    received = _ring(
        comm, answer, to=(comm.rank - 1) % comm.size, source=(comm.rank + 1) % comm.size
    )
    for key, data in received:
        local.backend.write(key, [data])
    if wanted:
        log.warning("%s: %d of %d files of step %d were missing here; %d came from rank %d, "
                    "the peer holding their copies; any other is read from the durable tier",
                    local.backend.uri, len(wanted), len(paths), step, len(received),
                    _next(comm))  # fmt: skip
    return len(received)


def _good(tiers: Persister, info: CheckpointInfo, path: str) -> bool:
    """Whether this node's local tier holds ``path`` of ``info``'s step with the right bytes."""
    try:
        tiers.local.catalog.read_verified(info.step, info.manifest.file(path))
    except CheckpointError:
        return False
    return True


def _ring(comm: Collectives, outgoing: Files, *, to: int, source: int) -> Files:
    """Send ``outgoing`` to rank ``to`` and receive from rank ``source`` (group ranks); even
    ranks send first, odd ranks receive first, so no ring waits on itself."""
    if comm.rank % 2 == 0:
        comm.send(outgoing, to)
        return comm.receive(source)  # type: ignore[no-any-return]
    received = comm.receive(source)
    comm.send(outgoing, to)
    return received  # type: ignore[no-any-return]


def _next(comm: Collectives) -> int:
    return (comm.rank + 1) % comm.size


def _previous(comm: Collectives) -> int:
    return (comm.rank - 1) % comm.size
