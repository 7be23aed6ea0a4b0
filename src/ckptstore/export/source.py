"""A committed step's files as an export reads them: in ranges, checked afterwards.

An export never downloads a step. It reads each file's archive directory, then each tensor's
bytes where the file holds them, in ranged reads (one ranged GET each on S3) of at most
:data:`~ckptstore.data.transfer.CHUNK_SIZE`, at most a few in flight
(:class:`~ckptstore.data.transfer.ChunkReader`, the bound a pull keeps). Every read is noted in its
file's :class:`~ckptstore.export.ledger.Ledger`; :meth:`StepSource.verify` then reads what no
tensor needed and checks every touched file against the manifest's CRC32C. An export is
published only after that check, so a corrupt byte fails the export, never ships in a model.

A signed store's manifests hold SHA-256 digests, which cannot be checked on ranges; the export
pulls the files it needs first (every byte SHA-256 verified) and reads that local copy the same
way (hf.py).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Generator, Iterable, Iterator, Mapping
from contextlib import closing
from types import TracebackType

from ckptstore.backends.base import Backend, join
from ckptstore.data.transfer import CHUNK_SIZE, PULL_CONCURRENCY, ChunkReader
from ckptstore.data.verified import missing_file, size_mismatch
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import FileEntry
from ckptstore.errors import NotFoundError
from ckptstore.export.ledger import Ledger


class StepSource:
    """The files of one committed step, read in ranges, every read noted for :meth:`verify`.

    ``keys`` maps a file's path in the step to its object path in ``backend`` (default: the
    manifest's key, inside its attempt directory).
    """

    def __init__(
        self,
        backend: Backend,
        info: CheckpointInfo,
        *,
        keys: Mapping[str, str] | None = None,
        chunk_size: int = CHUNK_SIZE,
        slots: int = PULL_CONCURRENCY,
    ) -> None:
        self.backend, self.info, self.step = backend, info, info.step
        self.entries: dict[str, FileEntry] = {e.path: e for e in info.files}
        self._keys = dict(keys) if keys is not None else None
        self.chunk_size = chunk_size
        self._stop = threading.Event()
        self._ledgers: dict[str, Ledger] = {}
        self._lock = threading.Lock()
        self._reader = ChunkReader(self.read, chunk_size=chunk_size, slots=slots, stop=self._stop)
        self._checker = ChunkReader(
            self._fetch, chunk_size=chunk_size, slots=slots, stop=self._stop
        )
        self.bytes_read = 0

    def __enter__(self) -> StepSource:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._reader.__exit__(None, None, None)
        self._checker.__exit__(None, None, None)

    def where(self, path: str) -> str:
        return join(self.info.uri, path)

    def entry(self, path: str) -> FileEntry:
        try:
            return self.entries[path]
        except KeyError:
            raise NotFoundError(
                f"{self.info.uri} has no file {path!r}; the export needs it. Check the step "
                "(ckptstore show URI STEP lists its files)",
                uri=self.info.uri,
                step=self.step,
                path=path,
            ) from None

    def size(self, path: str) -> int:
        return self.entry(path).size

    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the step's file ``path``, noted in its ledger."""
        data = self._fetch(self._key(path), start, end)
        self._ledger(path).record(start, data)
        return data

    def whole(self, path: str) -> bytes:
        """A small file (a config, an index), read in one piece."""
        return self.read(path, 0, self.size(path))

    def open(self, path: str, base: int = 0, length: int | None = None) -> RangeFile:
        """A read-only file object over bytes ``[base, base + length)`` of ``path``, for
        readers that seek (``torch.load``): each read is one ranged read."""
        size = self.size(path) - base if length is None else length
        return RangeFile(self, path, base, size)

    def ranges(self, spans: Iterable[tuple[str, int, int]]) -> Generator[memoryview, None, None]:
        """Each ``(path, start, end)`` read in order, a few ahead (ChunkReader's bound)."""
        return self._reader.ranges(spans)

    def verify(self) -> int:
        """Read what was not read of every touched file and check each file against its
        manifest entry; returns the bytes read for that."""
        extra = 0
        with self._lock:
            ledgers = list(self._ledgers.items())
        for path, ledger in ledgers:
            key = self._key(path)

            def read(start: int, end: int, key: str = key) -> Iterator[memoryview]:
                step = self.chunk_size
                spans = ((key, a, min(a + step, end)) for a in range(start, end, step))
                with closing(self._checker.ranges(spans)) as pieces:
                    yield from pieces

            extra += ledger.finish(read)
        return extra

    def touched(self) -> list[str]:
        with self._lock:
            return sorted(self._ledgers)

    def _ledger(self, path: str) -> Ledger:
        with self._lock:
            ledger = self._ledgers.get(path)
            if ledger is None:
                entry = self.entry(path)
                ledger = self._ledgers[path] = Ledger(
                    entry.size,
                    entry.crc32c,
                    where=self.where(path),
                    step=self.step,
                    path=entry.key(self.step),
                )
            return ledger

    def _key(self, path: str) -> str:
        entry = self.entry(path)
        if self._keys is None:
            return entry.key(self.step)
        if path not in self._keys:
            raise NotFoundError(
                f"{self.where(path)} was not copied for the export; it needs the file",
                uri=self.where(path),
                step=self.step,
            )
        return self._keys[path]

    def _fetch(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object ``key``; a short read is a truncated file."""
        where = join(self.backend.uri, key)
        try:
            data = self.backend.read(key, start, end)
        except NotFoundError as e:
            raise missing_file(where, key, self.step) from e
        if len(data) != end - start:
            raise size_mismatch(where, start + len(data), end, self.step, key)
        with self._lock:
            self.bytes_read += len(data)
        return data


class RangeFile(io.RawIOBase):
    """A seekable, read-only window of a step's file; each read is one ranged read, except
    that the last piece read is kept (torch reads an archive's headers twice)."""

    def __init__(self, source: StepSource, path: str, base: int, size: int) -> None:
        super().__init__()
        self._source, self._path, self._base, self._size = source, path, base, size
        self._pos = 0
        self._last: tuple[int, bytes] = (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, origin + offset)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        end = min(self._pos + view.nbytes, self._size)
        if end <= self._pos:
            return 0
        start, data = self._last
        if not (start <= self._pos and end <= start + len(data)):
            data = self._source.read(self._path, self._base + self._pos, self._base + end)
            start = self._pos
            self._last = (start, data)
        n = end - self._pos
        view[:n] = data[self._pos - start : end - start]
        self._pos = end
        return n


__all__ = ["RangeFile", "StepSource"]
