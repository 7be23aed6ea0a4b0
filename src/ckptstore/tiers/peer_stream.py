"""Files streamed between ranks in chunks, read from and written to disk as they travel.

Peer copies (peers.py) move whole shards between nodes in a background thread while the job
trains, and again when a lost node resumes. Holding a shard in memory to send it, or
allocating every incoming buffer at once, would cost as much memory as the shards themselves
(8 ranks x 10 GB per node is 160 GB). Here a file travels in chunks of :data:`CHUNK` bytes: per
destination a reader thread reads ahead at most :data:`DEPTH` chunks, per source a writer
thread writes what arrived through the backend's atomic write (temp file, then rename), and the
calling thread moves one chunk per pair and round over point-to-point sends. A rank therefore
holds ``(DEPTH + 1) x CHUNK`` bytes per peer it sends to or receives from, whatever the size of
the shards, and disk and network work at the same time.

An exchange is a collective: every rank of the group calls :func:`exchange` at the same point,
whatever it holds, and the shape of the transfer is agreed before a byte moves (one
``all_gather`` of what each rank offers to whom), so both ends count the same chunks. A file
that fails on the way (the sender cannot read it, or its bytes fail the manifest's checksums)
still travels as filler, so no rank ever skips a transfer its peer waits for; a second
``all_gather`` at the end names such files, and their receivers remove them. A receiver also
checks each file against its manifest entry (which the offer carries) as its chunks pass, so
filler never appears under the file's key, not even until that second ``all_gather``: a
node's persist may be reading the step's files at that moment.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ckptstore.backends.base import join
from ckptstore.data.verified import StreamCheck

if TYPE_CHECKING:
    from ckptstore.backends.base import Backend
    from ckptstore.core.collectives import Collectives
    from ckptstore.domain.manifest import FileEntry

log = logging.getLogger(__name__)

CHUNK = 8 << 20
"""Bytes per chunk on the wire (and per read and write)."""
DEPTH = 2
"""Chunks read ahead per destination, and waiting for the disk per source."""
_POLL = 0.2
"""Seconds a worker waits on its queue before it looks whether the exchange was abandoned."""
Q = TypeVar("Q")


@dataclass(frozen=True)
class Outgoing:
    """One file a rank sends: its manifest entry, checked as it is read and as it arrives
    (the offer carries it whole)."""

    step: int
    entry: FileEntry

    @property
    def key(self) -> str:
        return self.entry.key(self.step)


@dataclass(frozen=True)
class Received:
    """What one rank got from the others in one exchange."""

    keys: dict[int, list[str]]
    """By source rank, the keys that arrived whole and were written."""
    missed: dict[int, list[str]]
    """By source rank, the keys offered that did not (the sender's read or check failed, or
    this rank could not write them): nothing is left of them here."""

    def count(self) -> int:
        return sum(len(k) for k in self.keys.values())


def exchange(
    comm: Collectives,
    backend: Backend,
    outgoing: Mapping[int, Sequence[Outgoing]],
    *,
    chunk: int = CHUNK,
) -> Received:
    """Send each destination rank its files (read from ``backend``) and write what the other
    ranks send into ``backend`` under the same keys, in pieces of ``chunk`` bytes (a sender's
    own: its offer says which). Every rank of ``comm`` calls it."""
    offer = {dst: list(files) for dst, files in outgoing.items()}
    offers: list[tuple[int, dict[int, list[Outgoing]]]] = comm.all_gather((chunk, offer))
    incoming = {src: o[comm.rank] for src, (_, o) in enumerate(offers) if o.get(comm.rank)}
    stop = threading.Event()
    readers = {
        dst: _Reader(backend, files, chunk, stop) for dst, files in outgoing.items() if files
    }
    writers = {
        src: _Writer(backend, files, offers[src][0], stop) for src, files in incoming.items()
    }
    workers: list[_Worker] = [*readers.values(), *writers.values()]
    for worker in workers:
        worker.start()
    try:
        _transfer(comm, readers, writers)
    except BaseException:
        stop.set()  # the workers end; the error (a peer that never came) goes up
        raise
    finally:
        for worker in workers:
            worker.join()
    failed_sends = {dst: sorted(r.failed) for dst, r in readers.items() if r.failed}
    told: list[dict[int, list[str]]] = comm.all_gather(failed_sends)
    keys: dict[int, list[str]] = {}
    missed: dict[int, list[str]] = {}
    for src, writer in writers.items():
        bad = set(told[src].get(comm.rank, ())) | writer.failed
        if bad:
            backend.delete(sorted(bad & writer.written))
            missed[src] = sorted(bad)
        keys[src] = [o.key for o in incoming[src] if o.key not in bad]
    return Received(keys, missed)


def _transfer(comm: Collectives, readers: dict[int, _Reader], writers: dict[int, _Writer]) -> None:
    """Round k moves the k-th chunk of every pair: the sends and receives of a round are
    posted together, so no ring of ranks waits on itself."""
    rounds = max((w.count for w in [*readers.values(), *writers.values()]), default=0)
    for k in range(rounds):
        works, sent, landed = [], [], []
        for dst, reader in readers.items():
            if k < reader.count:
                buffer, length = reader.next_chunk()
                if length:
                    works.append(dist.isend(buffer[:length], comm.global_rank(dst), comm.group))
                sent.append((reader, buffer))
        for src, writer in writers.items():
            if k < writer.count:
                buffer, length = writer.free_buffer(), writer.lengths[k]
                if length:
                    works.append(dist.irecv(buffer[:length], comm.global_rank(src), comm.group))
                landed.append((writer, buffer, length))
        for work in works:
            if work is not None:  # None only on a rank outside the group: never here
                work.wait()
        for reader, buffer in sent:
            reader.pool.put(buffer)
        for writer, buffer, length in landed:
            writer.ready.put((buffer, length))


def _chunks(files: Sequence[Outgoing], chunk: int) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every chunk, in order; an empty file is one empty
    chunk (so its receiver creates it)."""
    out = []
    for i, size in enumerate(o.entry.size for o in files):
        out += [(i, at, min(chunk, size - at)) for at in range(0, size, chunk)] or [(i, 0, 0)]
    return out


class _Stopped(Exception):
    """The exchange was abandoned (a transfer failed): the worker ends."""


class _Worker(threading.Thread):
    """A reader or writer thread with its pool of chunk buffers."""

    def __init__(
        self, backend: Backend, files: Sequence[Outgoing], chunk: int, stop: threading.Event
    ) -> None:
        super().__init__(name="ckpt-peer-io", daemon=True)
        self.backend, self.files, self.stop = backend, files, stop
        self.plan = _chunks(files, chunk)
        self.count = len(self.plan)
        self.lengths = [length for _, _, length in self.plan]
        size = max(self.lengths, default=0)
        self.pool: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(min(DEPTH + 1, self.count)):
            self.pool.put(torch.empty(size, dtype=torch.uint8))
        self.ready: queue.Queue[tuple[torch.Tensor, int]] = queue.Queue()
        self.failed: set[str] = set()

    def _get(self, q: queue.Queue[Q]) -> Q:
        while True:
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def run(self) -> None:
        try:
            self.work()
        except _Stopped:
            pass
        except Exception:  # a bug: end the exchange here rather than hang it
            log.exception("%s: a peer copy's worker failed", self.backend.uri)
            self.stop.set()

    def work(self) -> None:
        raise NotImplementedError  # pragma: no cover (both subclasses define it)


class _Reader(_Worker):
    """Reads a destination's files chunk by chunk into the pool's buffers, checking each file
    against its manifest entry; a file that fails is sent on as filler and named in
    :attr:`failed`."""

    def next_chunk(self) -> tuple[torch.Tensor, int]:
        return self._get(self.ready)

    def work(self) -> None:
        check: StreamCheck | None = None
        for i, at, length in self.plan:
            buffer = self._get(self.pool)
            file = self.files[i]
            if at == 0:
                where = join(self.backend.uri, file.key)
                check = StreamCheck(file.entry, where=where, step=file.step)
            if file.key not in self.failed:
                try:
                    data = self.backend.read(file.key, at, at + length)
                    if len(data) != length:
                        raise OSError(f"{where}: {len(data)} bytes at {at}, expected {length}")
                    buffer[:length].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
                    assert check is not None
                    check.update(data)
                    if at + length == file.entry.size:
                        check.finish()
                except Exception as e:  # whatever it is, the peer still gets its chunks
                    log.warning("%s: not copied to a peer: %s", where, e)
                    self.failed.add(file.key)
            self.ready.put((buffer, length))


class _Writer(_Worker):
    """Writes a source's files as their chunks arrive, one atomic write per file; a file that
    cannot be written, or whose bytes fail its manifest entry (the sender's filler), is
    drained (its chunks still arrive), never put in place, and named in :attr:`failed`."""

    def __init__(
        self, backend: Backend, files: Sequence[Outgoing], chunk: int, stop: threading.Event
    ) -> None:
        super().__init__(backend, files, chunk, stop)
        self.written: set[str] = set()
        self.lengths_of: list[list[int]] = [[] for _ in files]
        """The lengths of each file's chunks."""
        for i, _, length in self.plan:
            self.lengths_of[i].append(length)

    def free_buffer(self) -> torch.Tensor:
        return self._get(self.pool)

    def work(self) -> None:
        for i, file in enumerate(self.files):
            key, pieces = file.key, self._pieces(i)
            try:
                self.backend.write(key, pieces)
                self.written.add(key)
            except _Stopped:
                raise
            except Exception as e:
                log.warning(
                    "%s: a peer's copy could not be written: %s", join(self.backend.uri, key), e
                )
                self.failed.add(key)
            for _ in pieces:  # what the write did not take still arrives
                pass

    def _pieces(self, index: int) -> Iterator[memoryview]:
        """The chunks of file ``index`` as they arrive; each buffer goes back to the pool once
        the write asks for the next one (it has been written). Past the last, bytes that fail
        the file's manifest entry fail the write before the file is put in place."""
        file = self.files[index]
        check = StreamCheck(file.entry, where=join(self.backend.uri, file.key), step=file.step)
        for length in self.lengths_of[index]:
            buffer, got = self._get(self.ready)
            try:
                if length:
                    piece = memoryview(buffer[:got].numpy())  # type: ignore[arg-type]
                    check.update(piece)
                    yield piece
            finally:
                self.pool.put(buffer)
        check.finish()
