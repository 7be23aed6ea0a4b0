"""The commit protocol, over any backend.

1. Payload files are written first, each atomically, with a CRC32C computed as bytes stream
   past. Before committing, one listing of the step directory confirms each is present with
   its size (a concurrent ``gc`` cannot leave a manifest pointing at nothing).
2. The manifest, the commit marker, is written last with a create-only write: a step exists
   if and only if its manifest does, and it can be committed once.
3. ``latest`` then moves by compare-and-swap, only forward: on a lost race the pointer is
   re-read and the move retried only while our step is still newer.
4. Uncommitting (retention, ``rm``) deletes the manifest first, then the payload, so an
   interrupted delete leaves garbage that ``gc`` finds, never a half-deleted committed step.

Readers treat manifests as the truth and ``latest`` as a fast path: a missing, broken or
dangling pointer makes them fall back to listing (see store.py).
"""

from __future__ import annotations

import json
import logging
import mmap
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore import layout
from ckptstore.backends.base import Backend, Chunk, join
from ckptstore.checksum import Crc32c, checksummed
from ckptstore.errors import (
    BackendError,
    ConflictError,
    CorruptCheckpointError,
    FencedError,
    IncompleteCheckpointError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)
from ckptstore.manifest import FileEntry, Manifest
from ckptstore.signing import Signer

log = logging.getLogger(__name__)

POINTER_SCHEMA = 1
Progress = Callable[[int], None]
"""Called with a number of bytes just transferred (CLI progress bars)."""
MAX_SWAP_ATTEMPTS = 20


@dataclass(frozen=True)
class Pointer:
    """The decoded ``latest.json``: which step, who moved it there and when."""

    step: int
    writer: str
    time: float
    epoch: int = 0
    """The writer lease epoch of whoever moved it (lease.py); 0 without leases."""

    def encode(self) -> bytes:
        body = {
            "schema_version": POINTER_SCHEMA,
            "epoch": self.epoch,
            "step": self.step,
            "manifest": layout.manifest_path(self.step),
            "writer": self.writer,
            "time": self.time,
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Pointer:
        try:
            body = json.loads(data)
            if body["schema_version"] != POINTER_SCHEMA:
                raise ValueError(f"schema_version {body['schema_version']!r}")
            step = layout.check_step(body["step"], where="latest step")
            if body["manifest"] != layout.manifest_path(step):
                raise ValueError("manifest path does not match the step")
            epoch = body["epoch"]
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"epoch {epoch!r}")
            return cls(step, str(body["writer"]), float(body["time"]), epoch)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: unreadable latest pointer ({e})") from e


@dataclass(frozen=True)
class SourceFile:
    """A payload file to write: path in the step, a producer of its bytes, its size if known."""

    path: str
    chunks: Callable[[], Iterable[Chunk]]
    size: int | None = None


class Committer:
    """Writes steps into one backend following the protocol above."""

    def __init__(
        self,
        backend: Backend,
        *,
        writer: str,
        clock: Callable[[], float] = time.time,
        signer: Signer | None = None,
    ) -> None:
        self.backend = backend
        self.signer = signer
        self.writer = writer
        self.clock = clock

    def uri(self, path: str) -> str:
        return join(self.backend.uri, path) if path else self.backend.uri

    # -- reading -------------------------------------------------------------------------

    def read_manifest(self, step: int) -> Manifest:
        """The step's manifest; NotFoundError if the step is not committed."""
        path = layout.manifest_path(step)
        try:
            data = self.backend.read(path)
        except NotFoundError as e:
            raise NotFoundError(
                f"step {step} is not committed in {self.backend.uri} (no {path})"
            ) from e
        manifest = Manifest.decode(data, where=self.uri(path))
        if self.signer is not None:
            self.signer.check(manifest, self.uri(path))
        if manifest.step != step:
            raise CorruptCheckpointError(
                f"{self.uri(path)}: manifest says step {manifest.step}, expected {step}"
            )
        return manifest

    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        """``(pointer, version)``; ``(None, None)`` if absent. Raises if unreadable."""
        try:
            data, version = self.backend.read_versioned(layout.LATEST_NAME)
        except NotFoundError:
            return None, None
        return Pointer.decode(data, self.uri(layout.LATEST_NAME)), version

    def step_dirs(self) -> list[int]:
        """Steps that have a directory in the store, committed or not, ascending."""
        found = (layout.parse_step_dir(name) for name in self.backend.list_dirs(""))
        return sorted(s for s in found if s is not None)

    def read_verified(self, step: int, entry: FileEntry) -> memoryview:
        """A payload file's bytes after checking its size and CRC32C against the manifest.

        The buffer is allocated once at the manifest's size and filled in place.
        """
        path = layout.payload_path(step, entry.path)
        data = _unfilled_buffer(entry.size)
        try:
            size = self.backend.read_into(path, data)
        except NotFoundError as e:
            raise IncompleteCheckpointError(
                f"{self.uri(path)} is missing, but the manifest of step {step} lists it; "
                "the step is incomplete. Load an earlier step"
            ) from e
        if size != entry.size:
            raise CorruptCheckpointError(
                f"{self.uri(path)}: {size} bytes, but the manifest of step {step} says "
                f"{entry.size}; the file is truncated or was overwritten. Load an earlier step"
            )
        check_file(data, entry, where=self.uri(path), step=step)
        return data

    # -- writing -------------------------------------------------------------------------

    def write_payload(
        self,
        step: int,
        files: Iterable[SourceFile],
        progress: Progress | None = None,
        *,
        previous: Manifest | None = None,
    ) -> list[FileEntry]:
        """Write every payload file (several at once); returns their manifest entries.

        A file whose size and CRC32C equal those of the same path in ``previous`` is copied
        from there (server-side on S3, a hard link locally) instead of uploaded. ``progress``
        is called with each chunk's size as it is handed to the backend.
        """
        sources = list(files)
        if len({f.path for f in sources}) != len(sources):
            raise ConflictError(f"step {step}: two payload files share a path")
        for source in sources:
            layout.check_relpath(source.path, where=f"step {step}")
        earlier = {f.path: f for f in previous.files} if previous is not None else {}

        def write_one(source: SourceFile) -> FileEntry:
            path = layout.payload_path(step, source.path)
            old = earlier.get(source.path)
            if previous is not None and old is not None and old.size == source.size:
                crc = Crc32c()
                for chunk in source.chunks():
                    crc.update(chunk)
                if crc.hexdigest() == old.crc32c:
                    self.backend.copy(layout.payload_path(previous.step, old.path), path)
                    if progress:
                        progress(old.size)
                    return FileEntry(source.path, old.size, old.crc32c, previous.step)
            crc = Crc32c()
            chunks = checksummed(source.chunks(), crc)
            size = self.backend.write(path, _reporting(chunks, progress) if progress else chunks)
            return FileEntry(source.path, size, crc.hexdigest())

        workers = max(1, min(self.backend.capabilities.parallel_writes, len(sources)))
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-write") as pool:
            return list(pool.map(write_one, sources))

    def confirm_payload(self, step: int, entries: Iterable[FileEntry]) -> None:
        """One listing proves every file is in place before the commit marker is written."""
        present = {o.path: o.size for o in self.backend.list(layout.step_dir(step) + "/")}
        for entry in entries:
            path = layout.payload_path(step, entry.path)
            if present.get(path) != entry.size:
                raise IncompleteCheckpointError(
                    f"{self.uri(path)} vanished or changed size before step {step} was "
                    "committed (a concurrent gc or rm?); nothing was committed, save again"
                )

    def commit(self, manifest: Manifest) -> Manifest:
        """Write the commit marker, create-only: the step exists from this moment.

        Returns the manifest as written (signed, when there is a signer).
        """
        path = layout.manifest_path(manifest.step)
        if self.signer is not None:
            manifest = self.signer.sign(manifest)
        data = manifest.encode()
        try:
            self.backend.create(path, data)
        except ObjectExistsError as e:
            if manifest.writer == self.writer and self._holds(path, data):
                return manifest  # a retry found our own first attempt, whose answer was lost
            raise ConflictError(
                f"step {manifest.step} is already committed in {self.backend.uri}; committed "
                "steps are immutable. Save under a new step, or `ckptstore rm` it first"
            ) from e
        return manifest

    def _holds(self, path: str, data: bytes) -> bool:
        """Whether ``path`` holds exactly ``data`` (a manifest of ours: writer id and time)."""
        try:
            return self.backend.read(path) == data
        except NotFoundError:
            return False

    def advance_latest(self, step: int, *, epoch: int = 0, rollback: bool = False) -> bool:
        """Move ``latest`` to ``step`` by compare-and-swap; returns False if it was ahead.

        Without ``rollback`` the pointer only moves forward: if another writer already moved
        it past ``step`` it stays there. Lost races are retried against the fresh pointer.
        A pointer stamped with a newer lease ``epoch`` than ours means we were fenced.
        """
        for attempt in range(MAX_SWAP_ATTEMPTS):
            try:
                current, version = self.read_pointer()
            except CorruptCheckpointError as e:
                log.warning("%s; overwriting it with step %d", e, step)
                current, version = None, self._version_of_broken_pointer()
            if current is not None and rollback:
                epoch = max(epoch, current.epoch)
            elif current is not None and current.epoch > epoch:
                raise FencedError(
                    f"{self.uri(layout.LATEST_NAME)} was moved by {current.writer} holding a "
                    f"newer writer lease (epoch {current.epoch} > {epoch}); step {step} is "
                    "committed but this writer may no longer move latest. Stop this job"
                )
            elif current is not None and current.step >= step:
                return current.step == step
            pointer = Pointer(step, self.writer, self.clock(), epoch)
            try:
                self.backend.swap(layout.LATEST_NAME, pointer.encode(), version)
                return True
            except PreconditionFailedError:
                log.debug("latest moved under us (attempt %d); re-reading", attempt + 1)
                time.sleep(min(0.05 * 2**attempt, 1.0))
        raise BackendError(
            f"step {step} is committed in {self.backend.uri}, but {layout.LATEST_NAME} could not "
            f"be moved to it after {MAX_SWAP_ATTEMPTS} attempts (too many concurrent writers); "
            "readers fall back to listing, and the next save moves it",
            retryable=True,
        )

    def stamp_latest(self, epoch: int) -> None:
        """Re-write ``latest`` (same step) with a new lease epoch, fencing older writers."""
        for _ in range(MAX_SWAP_ATTEMPTS):
            try:
                current, version = self.read_pointer()
            except CorruptCheckpointError:
                return  # the next save replaces it
            if current is None or current.epoch >= epoch:
                return
            stamped = Pointer(current.step, self.writer, self.clock(), epoch)
            try:
                self.backend.swap(layout.LATEST_NAME, stamped.encode(), version)
                return
            except PreconditionFailedError:
                continue

    def _version_of_broken_pointer(self) -> str | None:
        try:
            return self.backend.read_versioned(layout.LATEST_NAME)[1]
        except NotFoundError:
            return None

    # -- deleting ------------------------------------------------------------------------

    def uncommit(self, step: int) -> None:
        """Delete a step: manifest first, then the payload (see the module docstring)."""
        self.backend.delete([layout.manifest_path(step)])
        self.delete_prefix(layout.step_dir(step) + "/")

    def delete_prefix(self, prefix: str) -> list[str]:
        paths = [o.path for o in self.backend.list(prefix)]
        self.backend.delete(paths)
        return paths


def _unfilled_buffer(size: int) -> memoryview:
    """Writable memory that nobody writes before the read does. ``bytearray(n)`` zero-fills
    every byte while holding the GIL: on a 1 GiB load that cost about as much as the reads."""
    if not size:
        return memoryview(bytearray())
    # MAP_PRIVATE: the default, MAP_SHARED, puts anonymous pages in shmem, slower to fault in
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def check_file(data: Chunk, entry: FileEntry, *, where: str, step: int) -> None:
    """Raise CorruptCheckpointError naming the file and step unless size and CRC32C match."""
    if len(data) != entry.size:
        raise CorruptCheckpointError(
            f"{where}: {len(data)} bytes, but the manifest of step {step} says {entry.size}; "
            "the file is truncated or was overwritten. Load an earlier step"
        )
    crc = Crc32c()
    crc.update(data)
    if crc.hexdigest() != entry.crc32c:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch (crc32c {crc.hexdigest()}, manifest of step {step} "
            f"says {entry.crc32c}); the bytes are corrupt. Load an earlier step"
        )


def _reporting(chunks: Iterable[Chunk], progress: Progress) -> Iterator[Chunk]:
    for chunk in chunks:
        yield chunk
        progress(len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes)


def iter_file(read: Callable[[int], bytes], chunk_size: int = 1 << 22) -> Iterator[bytes]:
    """Chunks from a ``read(n)`` callable until it returns nothing."""
    while chunk := read(chunk_size):
        yield chunk
