"""The read side of a store: the pointer, the step listing, manifests and verified payload reads.

Manifests are the truth and ``latest`` is a fast path (see commit.py). Everything here only
reads, and everything it returns has been checked: manifests strictly decoded (and their
signature checked, in a signed store), payload bytes against the size, CRC32C and, where the
manifest has one, SHA-256 it lists. A size is checked against the object itself before any
memory is allocated for it, so a manifest that promises a huge file reads as corruption, not as
an out-of-memory crash.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import time
from collections.abc import Callable

from ckptstore import layout
from ckptstore.backends.base import Backend, Chunk, join
from ckptstore.checksum import Crc32c
from ckptstore.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.manifest import FileEntry, Manifest
from ckptstore.pointer import Pointer
from ckptstore.signing import Signer

log = logging.getLogger(__name__)

STAT_BEFORE_READ = 16 << 20
"""Files above this size are stat'ed before their buffer is allocated (one HEAD on S3): the
manifest's size is a promise, the object's is a fact."""
TORN_READ_RETRIES = 3
"""Small control objects re-read after an undecodable read: some S3-compatible servers let a
reader see a PUT in progress."""


class Catalog:
    """Reads one backend's steps, manifests and pointer."""

    def __init__(
        self,
        backend: Backend,
        *,
        signer: Signer | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.backend = backend
        self.signer = signer
        self.sleep = sleep

    def uri(self, path: str) -> str:
        return join(self.backend.uri, path) if path else self.backend.uri

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
        """``(pointer, version)``; ``(None, None)`` if absent. Raises if it stays unreadable."""
        for attempt in range(TORN_READ_RETRIES + 1):
            try:
                data, version = self.backend.read_versioned(layout.LATEST_NAME)
            except NotFoundError:
                return None, None
            try:
                return Pointer.decode(data, self.uri(layout.LATEST_NAME)), version
            except CorruptCheckpointError:
                if attempt == TORN_READ_RETRIES:
                    raise
                self.sleep(0.02 * 2**attempt)  # perhaps a write in progress: look again
        raise AssertionError("unreachable")

    def step_dirs(self) -> list[int]:
        """Steps that have a directory in the store, committed or not, ascending."""
        found = (layout.parse_step_dir(name) for name in self.backend.list_dirs(""))
        return sorted(s for s in found if s is not None)

    def payload_sizes(self, step: int) -> dict[str, int]:
        """Every object's size under the step's directory, by path: one listing."""
        return {o.path: o.size for o in self.backend.list(layout.step_dir(step) + "/")}

    def read_verified(
        self, step: int, entry: FileEntry, *, actual_size: int | None = None
    ) -> memoryview:
        """A payload file's bytes after checking them against the manifest's entry.

        The buffer is allocated once at the manifest's size and filled in place, after the
        object's real size (``actual_size`` from a listing, or a stat) matched it.
        """
        path = entry.key(step)
        if actual_size is None and entry.size > STAT_BEFORE_READ:
            found = self.backend.stat(path)
            actual_size = found.size if found is not None else None
            if found is None:
                raise self._missing(path, step)
        if actual_size is not None and actual_size != entry.size:
            raise _size_mismatch(self.uri(path), actual_size, entry.size, step)
        data = _unfilled_buffer(entry.size)
        try:
            size = self.backend.read_into(path, data)
        except NotFoundError as e:
            raise self._missing(path, step) from e
        if size != entry.size:
            raise _size_mismatch(self.uri(path), size, entry.size, step)
        check_file(data, entry, where=self.uri(path), step=step)
        return data

    def _missing(self, path: str, step: int) -> IncompleteCheckpointError:
        return IncompleteCheckpointError(
            f"{self.uri(path)} is missing, but the manifest of step {step} lists it; "
            "the step is incomplete. Load an earlier step"
        )


def _size_mismatch(where: str, size: int, expected: int, step: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {size} bytes, but the manifest of step {step} says {expected}; the file is "
        "truncated or was overwritten. Load an earlier step"
    )


def _unfilled_buffer(size: int) -> memoryview:
    """Writable memory that nobody writes before the read does. ``bytearray(n)`` zero-fills
    every byte while holding the GIL: on a 1 GiB load that cost about as much as the reads."""
    if not size:
        return memoryview(bytearray())
    # MAP_PRIVATE: the default, MAP_SHARED, puts anonymous pages in shmem, slower to fault in
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def check_file(data: Chunk, entry: FileEntry, *, where: str, step: int) -> None:
    """Raise CorruptCheckpointError naming the file and step unless the bytes match the entry:
    size, CRC32C, and SHA-256 where the manifest has one (signed stores always do)."""
    if len(data) != entry.size:
        raise _size_mismatch(where, len(data), entry.size, step)
    crc = Crc32c()
    crc.update(data)
    if crc.hexdigest() != entry.crc32c:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch (crc32c {crc.hexdigest()}, manifest of step {step} "
            f"says {entry.crc32c}); the bytes are corrupt. Load an earlier step"
        )
    if entry.sha256 is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CorruptCheckpointError(
                f"{where}: SHA-256 mismatch (the CRC32C matches, so the bytes were changed on "
                f"purpose: the manifest of step {step} says sha256 {entry.sha256}, the file has "
                f"{digest}). Refusing it; load an earlier step"
            )
