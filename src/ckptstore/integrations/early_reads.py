"""A rank's files read while the ranks still agree on the step to load.

``load_distributed`` cannot read a byte before rank 0 has resolved the step (the durable
pointer and step index: requests to the bucket) and every rank has taken its offer (object
collectives): about 20 ms on 2 ranks on loopback, longer against a real bucket, in which the
disks sat idle. With a local tier, the step a load is offered is nearly always the one the
node's local tier's pointer names, so each rank begins reading its own files of that step at
once, from the local tier only, each verified against the local manifest's entry, and uses a
file read early only if the offered step lists the very same entry for it (path, size,
CRC32C, SHA-256 and attempt): its bytes then passed the offered manifest's checks. Any other
offer, or an early read that failed, and the file is read as without early reads, with their
fallbacks and errors; an early read nobody takes is left to finish and its buffer dropped.
Where the offer is another step (another node held a newer one, or this node's newest is a
fenced writer's), the reads not begun are cancelled at once; those under way end and free
their buffers while the offered step is read, so until then a rank holds up to twice its
share of the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ckptstore.deadline import submit
from ckptstore.domain.info import CheckpointInfo

if TYPE_CHECKING:
    from ckptstore.tiers.persister import Persister

READ_THREADS = 8


class EarlyReads:
    """Reads of ``paths`` of ``info``'s step from this node's local tier, begun at once."""

    def __init__(self, tiers: Persister, info: CheckpointInfo, paths: Sequence[str]) -> None:
        self.info = info
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read")
        self._reads: dict[str, Future[memoryview]] = {
            path: submit(self._pool, tiers.read_here, info, path) for path in paths
        }

    def take(self, offer: CheckpointInfo, path: str) -> memoryview | None:
        """``path``'s verified bytes if read early for the entry ``offer`` lists, else None
        (then read it as usual). Each file is handed out once."""
        if offer.step != self.info.step:
            self.close()  # none of them is wanted: none begins now, and their memory goes
            return None
        future = self._reads.pop(path, None)
        if future is None:
            return None
        try:
            if offer.manifest.file(path) != self.info.manifest.file(path):
                return None
            return future.result()
        except Exception:  # read again as usual, which raises what a load raises
            return None

    def close(self) -> None:
        """Drop what nobody took; reads not begun are cancelled, the others left to end."""
        self._reads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
