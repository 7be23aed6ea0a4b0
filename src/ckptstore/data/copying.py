"""A committed step's files copied from one store's backend into another's: verified, in
bounded memory, under the same keys.

Each file goes one of two ways:

* **Server-side**, where both backends give addresses of one domain (the same S3 endpoint
  reached with the same credentials; backends/base.py): the source is first read through in
  ranged chunks, its CRC32C and SHA-256 checked as they pass and nothing kept, then the
  destination's server copies it (``copy_in``: CopyObject, UploadPartCopy parts above 5 GiB).
  The check comes first so that an object at a destination key only ever holds bytes that
  were checked: a kill between the two leaves nothing there, a kill after them a whole copy.
  The process reads the bytes once and uploads none of them.
* **Streamed** otherwise: ranged reads of the source (:class:`~ckptstore.data.transfer.ChunkReader`)
  feed the destination's streamed ``write`` (on S3, a parallel multipart upload). A
  :class:`~ckptstore.data.verified.StreamCheck` sees each chunk on its way and raises after the
  last one, while the write still waits for the end of its input, so a file whose bytes do
  not match the manifest never appears at the destination: the upload is aborted, the
  temporary file removed.

Memory is bounded whatever the files' sizes: at most ``read_ahead`` chunks of ``chunk_size``
bytes read ahead for the whole step, plus what the destination's write holds (on S3:
``max_concurrency`` parts in flight across the files written at once, plus the part each of
them is cutting; :func:`memory_bound` adds it up). Files of a step are copied several at a
time (the destination's ``parallel_writes``); the first failure stops the others at their next
chunk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ckptstore.backends.base import Backend, join
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import ChunkReader, PullStopped
from ckptstore.data.verified import StreamCheck, missing_file
from ckptstore.deadline import submit
from ckptstore.domain.manifest import FileEntry
from ckptstore.errors import NotFoundError

READ_CHUNK = 32 << 20
"""Bytes per ranged read of the source (one ranged GET on S3): S3's default part size here, so
a large file takes as many GETs as boto3's managed download with the same parts. Four times a
pull's chunk: servers that read a whole object to answer a ranged GET (moto does) would
otherwise spend 90 s on the 128 GETs of a 1 GiB file, against 21 s for 32 GETs."""
READ_AHEAD = 4
"""Source chunks alive at once for a whole step (read ahead, or waiting to be written): 128
MiB; four parallel GETs keep the destination's parts in flight fed."""


def memory_bound(
    *,
    part_size: int,
    parts_in_flight: int,
    files_at_once: int = 1,
    chunk_size: int = READ_CHUNK,
    read_ahead: int = READ_AHEAD,
) -> int:
    """Bytes a streamed copy holds at most, for a destination that uploads ``parts_in_flight``
    parts of ``part_size`` at once (S3's ``max_concurrency``) while each of ``files_at_once``
    files cuts one more part: the read-ahead chunks plus those parts."""
    return read_ahead * chunk_size + (parts_in_flight + files_at_once) * part_size


@dataclass
class CopyTally:
    """What a copy moved, and how; updated from several threads under ``lock``."""

    files_streamed: int = 0
    bytes_streamed: int = 0
    files_server_side: int = 0
    bytes_server_side: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def add(self, size: int, *, server_side: bool) -> None:
        with self.lock:
            if server_side:
                self.files_server_side += 1
                self.bytes_server_side += size
            else:
                self.files_streamed += 1
                self.bytes_streamed += size


class FileCopier:
    """Copies payload files of one store (``source``) into another (``target``), same keys."""

    def __init__(
        self,
        source: Backend,
        target: Backend,
        *,
        chunk_size: int = READ_CHUNK,
        read_ahead: int = READ_AHEAD,
        check_server_copies: bool = True,
    ) -> None:
        self.source = source
        self.target = target
        self.chunk_size = chunk_size
        self.read_ahead = read_ahead
        self.check_server_copies = check_server_copies
        """False: a server-side copy trusts the source's bytes (loads still verify them)."""
        self.tally = CopyTally()

    def server_side(self, key: str) -> bool:
        """Whether ``key`` can be copied by the destination's server (one domain)."""
        there, here = self.source.address(key), self.target.address(key)
        return there is not None and here is not None and there.domain == here.domain

    def copy_files(
        self, step: int, entries: Sequence[FileEntry], progress: Progress | None = None
    ) -> None:
        """Copy ``entries`` of ``step``, several at once; raises the first failure (a
        CorruptCheckpointError or IncompleteCheckpointError naming the source file when its
        bytes do not match the manifest) once the others stopped."""
        if not entries:
            return
        stop = threading.Event()
        workers = max(1, min(self.target.parallel_writes, len(entries)))
        reader = ChunkReader(
            self.source.read, chunk_size=self.chunk_size, slots=self.read_ahead, stop=stop
        )
        first: BaseException | None = None
        with reader, ThreadPoolExecutor(workers, thread_name_prefix="ckpt-replicate") as pool:
            futures = [submit(pool, self._copy_one, reader, step, e, progress) for e in entries]
            try:
                for future in as_completed(futures):
                    error = future.exception()
                    if error is not None and first is None and not isinstance(error, PullStopped):
                        first = error
                        stop.set()  # the other files stop at their next chunk
            finally:
                stop.set()  # Ctrl-C included: nothing waits for the remaining files
        if first is not None:
            raise first

    def _copy_one(
        self, reader: ChunkReader, step: int, entry: FileEntry, progress: Progress | None
    ) -> None:
        key = entry.key(step)
        check = StreamCheck(entry, where=join(self.source.uri, key), step=step)
        if self.server_side(key):
            address = self.source.address(key)
            assert address is not None  # server_side said so
            if self.check_server_copies:
                for _ in self._checked(reader, key, entry, check):
                    pass
            self.target.copy_in(address, key, entry.size)
            if progress:
                progress(entry.size)
            self.tally.add(entry.size, server_side=True)
            return
        self.target.write(key, self._checked(reader, key, entry, check, progress))
        self.tally.add(entry.size, server_side=False)

    def _checked(
        self,
        reader: ChunkReader,
        key: str,
        entry: FileEntry,
        check: StreamCheck,
        progress: Progress | None = None,
    ) -> Iterator[memoryview]:
        """The source file's chunks, each checked on its way; after the last one, raise
        unless the whole matches the manifest, before the consumer can finish its write."""
        try:
            with contextlib.closing(reader.chunks(key, entry.size)) as chunks:
                for chunk in chunks:
                    size = chunk.nbytes
                    check.update(chunk)
                    yield chunk
                    if progress:
                        progress(size)
        except NotFoundError as e:
            raise missing_file(check.where, key, check.step) from e
        check.finish()
