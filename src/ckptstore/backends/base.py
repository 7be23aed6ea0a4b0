"""The small protocol every storage backend implements.

Backends move bytes; they know nothing of steps, manifests or retention. Paths are relative to
the backend's root, ``/``-separated, never starting with ``/``. Each backend translates its own
library's errors into :mod:`ckptstore.errors` once, here at the boundary.

The protocol is deliberately small. Three writes carry the commit protocol:

* ``write``: the object appears whole or not at all (tmp+rename locally, one PUT or one
  CompleteMultipartUpload on S3); a failed write leaves nothing a reader can see.
* ``create``: create-only; it raises :class:`~ckptstore.errors.ObjectExistsError` if the object
  is already there. The commit marker (the manifest) is written with it.
* ``swap``: compare-and-swap against the version token ``read_versioned`` returned (``None``:
  the object must not exist). The ``latest`` pointer moves with it.

Where a server cannot make ``create`` or ``swap`` atomic, the backend says so in its
:class:`Capabilities`, falls back to the safest protocol it has, and warns once.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Chunk = bytes | bytearray | memoryview
"""A piece of an object's content; backends must not keep a reference after the call returns."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can guarantee; the store and the README read guarantees from here."""

    atomic_create: bool
    """``create`` is atomic against concurrent writers in other processes and machines."""
    atomic_swap: bool
    """``swap`` is a true compare-and-swap against concurrent writers."""
    server_checksums: bool = False
    """The server verifies a checksum of every uploaded part before accepting it."""
    server_side_copy: bool = False
    """``copy`` runs without moving the bytes through this process."""
    parallel_writes: int = 4
    """How many files a save writes at once: 8 on local disks (several fsyncing writers keep a
    disk busier than one), ``max_concurrency`` on S3 (a file that fits one PUT is one request)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its path under the root, size in bytes, and modification time."""

    path: str
    size: int
    mtime: float | None = None
    """Seconds since the epoch, when the backend knows it."""


@dataclass(frozen=True)
class PartialWrite:
    """A write that started and never finished: a stray temp file or multipart upload."""

    path: str
    upload_id: str
    started: float | None = None


@runtime_checkable
class Backend(Protocol):
    """Byte storage under one root URI."""

    @property
    def uri(self) -> str:
        """The root URI, for messages (never contains credentials)."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What this backend guarantees; may probe the server on first use."""
        ...

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object; raises NotFoundError if it is missing."""
        ...

    def read_into(self, path: str, out: memoryview) -> int:
        """Fill ``out`` with the object's first ``len(out)`` bytes; returns the object's size.

        Loads allocate ``out`` once at the size the manifest promises and read straight into
        it (in parallel ranges where the backend can), so a file is never copied twice.
        """
        ...

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """The whole object and a version token for ``swap``."""
        ...

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        """Store an object atomically (replacing any old one); returns its size."""
        ...

    def create(self, path: str, data: bytes) -> None:
        """Store an object only if none exists; raises ObjectExistsError otherwise."""
        ...

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        """Replace an object only if its version is still ``expected``; returns the new one."""
        ...

    def copy(self, src: str, dst: str) -> None:
        """Copy one object to another path, server-side where the backend can."""
        ...

    def stat(self, path: str) -> ObjectInfo | None:
        """The object's info, or ``None`` if (and only if) it does not exist."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose path starts with ``prefix``, recursively, in no set order."""
        ...

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate sub-directories under ``prefix`` (``""`` for the root)."""
        ...

    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; a path that is already gone is not an error."""
        ...

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """Writes under ``prefix`` that started and never finished (for ``gc``)."""
        ...

    def abort(self, partial: PartialWrite) -> None:
        """Remove a partial write's remains."""
        ...

    def close(self) -> None:
        """Release clients and threads."""
        ...


def join(root: str, *parts: str) -> str:
    """``root`` (a URI or path, kept as is) joined with relative parts by ``/``."""
    tail = [p.strip("/") for p in parts if p.strip("/")]
    return "/".join([root.rstrip("/"), *tail]) if tail else root
