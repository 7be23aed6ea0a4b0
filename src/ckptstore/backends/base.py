"""The backend protocol, and the base class that implements most of it.

Backends move bytes; they know nothing of steps, manifests or retention. Paths are relative to
the backend's root, ``/``-separated, never starting with ``/``. Each backend translates its own
library's errors into :mod:`ckptstore.errors` once, at its boundary.

Three writes carry the commit protocol:

* ``write``: the object appears whole or not at all (tmp+rename locally, one PUT or one
  CompleteMultipartUpload on S3); a failed write leaves nothing a reader can see.
* ``create``: create-only; it raises :class:`~ckptstore.errors.ObjectExistsError` if the object
  is already there. The commit marker (the manifest) is written with it.
* ``swap``: compare-and-swap against the version token ``read_versioned`` returned (``None``:
  the object must not exist). The ``latest`` pointer moves with it.

:class:`Backend` is the protocol callers type against. :class:`BaseBackend` is what a backend
subclasses: a new backend implements ``uri``, ``capabilities``, ``read``, ``read_versioned``,
``write``, ``stat``, ``list`` and ``delete``, plus ``create`` and ``swap`` where its server has
conditional writes. Without them the base gives the one check-then-write fallback (atomic
against writers in this process only; the :class:`Capabilities` say so, the first such write
warns once). Every capability is a declared member (``read_into_chunks``, ``parallel_writes``,
``address``), never looked up by ``getattr``, so a wrapper built on
:class:`~.proxy.BackendProxy` (fault injection, request counting) runs the same paths as the
backend it wraps.

Copies between two backends (replication/replicator.py) go server-side where one server can
do them: ``address`` says where an object lives for such a copy and in which *domain* (for S3:
one endpoint with one set of credentials), and ``copy_in`` copies an address of its own domain
in. The caller compares domains: each backend decides "same server, same credentials" once.
"""

from __future__ import annotations

import abc
import builtins
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ckptstore.errors import (
    ConfigError,
    ErrorContext,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)

logger = logging.getLogger(__name__)
_WARN_LOCK = threading.Lock()

Chunk = bytes | bytearray | memoryview
"""A piece of an object's content; backends must not keep a reference after the call returns."""


def chunk_size(chunk: Chunk) -> int:
    """The bytes ``chunk`` holds (a memoryview of wider items counts bytes, not items)."""
    return chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)


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
class ObjectAddress:
    """Where a server finds an object for a server-side copy into another backend.

    Two backends whose addresses have equal ``domain`` values can copy between each other
    without the bytes passing through this process (``copy_in``). The domain is opaque: for
    S3 a digest of the endpoint and the credentials' settings, so a bucket on another endpoint
    or under other credentials never compares equal (its bytes are streamed instead).
    """

    domain: str
    bucket: str
    """The container the server knows the object by (an S3 bucket)."""
    key: str
    """The object's full key in ``bucket`` (not relative to a store's root)."""

    def __repr__(self) -> str:
        return f"ObjectAddress(bucket={self.bucket!r}, key={self.key!r})"


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
    abandoned: bool = False
    """Given up by its own writer in this process (an abort the server did not answer): gc
    removes it however young it is."""


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
        """Fill ``out`` with the object's first ``len(out)`` bytes (in parallel ranges where
        the backend can, so a file is never copied twice); returns the object's size."""
        ...

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        """``read_into``, handing each filled piece of ``out`` to ``on_chunk`` in order, so a
        load checksums a piece while it is still in the CPU's cache (the local backend), or,
        where pieces land in any order (parallel ranges), the whole buffer once it is full."""
        ...

    @property
    def parallel_writes(self) -> int:
        """How many files a save writes at once, known without probing the server: a rank
        that only stages payload never writes conditionally and must not pay for a probe."""
        ...

    @property
    def sends_whole_up_to(self) -> int:
        """Files up to this size are taken whole by ``write`` before any byte is stored or
        sent (one request); 0 where ``write`` streams them out at once. An error raised by
        the chunks of such a file, even as the last was taken, then leaves nothing behind: a
        save checks whether a file equals the previous step's as its bytes pass, instead of
        reading them once more for that alone (commit.py)."""
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

    def address(self, path: str) -> ObjectAddress | None:
        """Where a server-side copy into another backend finds the object at ``path``;
        ``None`` where this backend copies nothing server-side across backends."""
        ...

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        """Copy the ``size``-byte object at ``source`` (an address of this backend's own
        domain, as ``address`` gives it) to ``dst``, server-side, whole or not at all."""
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


class BaseBackend(abc.ABC):
    """What a backend subclasses: the essential members are abstract, the rest have defaults.

    Subclasses call ``super().__init__()``. See the module docstring for what to implement.
    """

    def __init__(self) -> None:
        self._fallback_lock = threading.Lock()
        self._warned: set[str] = set()

    # -- to implement -----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The root URI, for messages (never contains credentials)."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend guarantees; may probe the server on first use."""

    @abc.abstractmethod
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of an object; raises NotFoundError if it is missing."""

    @abc.abstractmethod
    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """The whole object and a version token for ``swap``."""

    @abc.abstractmethod
    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        """Store an object atomically (replacing any old one); returns its size."""

    @abc.abstractmethod
    def stat(self, path: str) -> ObjectInfo | None:
        """The object's info, or ``None`` if (and only if) it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose path starts with ``prefix``, recursively, in no set order."""

    @abc.abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Delete objects; a path that is already gone is not an error."""

    # -- conditional writes: override where the server has them -------------------------------

    def create(self, path: str, data: bytes) -> None:
        """Check-then-write (atomic within this process only); warns once."""
        self._warn_not_atomic()
        self._fallback_create(path, data)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        """Check-then-write (atomic within this process only); warns once."""
        self._warn_not_atomic()
        return self._fallback_swap(path, data, expected)

    # -- defaults -----------------------------------------------------------------------------

    def read_into(self, path: str, out: memoryview) -> int:
        """``stat``, then one ``read`` of ``len(out)`` bytes copied into ``out``."""
        info = self.stat(path)
        if info is None:
            raise NotFoundError(
                f"{join(self.uri, path)} does not exist (while trying to read it)",
                **self._where(path),
            )
        if len(out):
            data = self.read(path, 0, len(out))
            out[: len(data)] = data
        return info.size

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        """``read_into``, then the whole filled buffer to ``on_chunk``: override where the
        backend reads in order and can hand over pieces as they land."""
        size = self.read_into(path, out)
        on_chunk(out[: min(size, len(out))])
        return size

    @property
    def parallel_writes(self) -> int:
        """``capabilities.parallel_writes``: override where asking that would probe."""
        return self.capabilities.parallel_writes

    @property
    def sends_whole_up_to(self) -> int:
        """None by default: ``write`` may store the first chunk before the last is taken."""
        return 0

    def copy(self, src: str, dst: str) -> None:
        """Read the whole object, write it again: override where objects are large."""
        self.write(dst, [self.read(src)])

    def address(self, path: str) -> ObjectAddress | None:
        """None: no server-side copy across backends; override together with ``copy_in``."""
        return None

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        """Only reached when a caller ignored ``address``: this backend has no domain."""
        raise ConfigError(
            f"{join(self.uri, dst)}: this storage cannot copy objects in server-side (it gives "
            "no address); stream the bytes instead",
            **self._where(dst),
        )

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """From ``list``: one pass over everything below ``prefix``; override where the server
        can list one level (a delimiter, a directory listing)."""
        base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        names: set[str] = set()
        for info in self.list(base):
            head, slash, _ = info.path[len(base) :].partition("/")
            if slash and head:
                names.add(head)
        return sorted(names)

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """None: a backend whose writes can leave remains overrides this and ``abort``."""
        return []

    def abort(self, partial: PartialWrite) -> None:
        """Nothing to remove."""
        return None

    def close(self) -> None:
        """Nothing to release."""
        return None

    # -- the shared check-then-write fallback -------------------------------------------------

    def _fallback_create(self, path: str, data: bytes) -> None:
        """Check absent, write, read back: a writer in another process that writes between our
        check and our write makes one of us fail on the read-back, but one whose read-back ran
        before the other's write may believe it won."""
        with self._fallback_lock:
            if self.stat(path) is not None:
                raise self._exists_error(path)
            self.write(path, [data])
            if self.read(path) != data:
                raise ObjectExistsError(
                    f"{join(self.uri, path)} was written concurrently by another writer, whose "
                    "version won; this one was not committed",
                    **self._where(path),
                )

    def _fallback_swap(self, path: str, data: bytes, expected: str | None) -> str:
        """Check the version, write: a swap by another process in between is lost."""
        with self._fallback_lock:
            if not self._is_current(path, expected):
                raise self._changed_error(path, expected)
            return self._put_versioned(path, data)

    def _is_current(self, path: str, expected: str | None) -> bool:
        """Whether the object is still at version ``expected`` (``None``: absent)."""
        try:
            current: str | None = self.read_versioned(path)[1]
        except NotFoundError:
            current = None
        return current == expected

    def _put_versioned(self, path: str, data: bytes) -> str:
        """Write ``data`` and return its version token: here by reading it back."""
        self.write(path, [data])
        back, version = self.read_versioned(path)
        if back != data:
            raise PreconditionFailedError(
                f"{join(self.uri, path)} was written concurrently by another writer, whose "
                "version won; read it again and retry",
                **self._where(path),
            )
        return version

    def _exists_error(self, path: str) -> ObjectExistsError:
        return ObjectExistsError(
            f"{join(self.uri, path)} already exists: another writer created it first; it was "
            "not overwritten",
            **self._where(path),
        )

    def _changed_error(self, path: str, expected: str | None) -> PreconditionFailedError:
        want = "to be absent" if expected is None else f"at version {expected}"
        return PreconditionFailedError(
            f"{join(self.uri, path)} changed since it was read (expected it {want}); another "
            "writer moved it: read it again and retry",
            **self._where(path),
        )

    def _where(self, path: str) -> ErrorContext:
        """The ``uri`` and ``path`` of an error about the object at ``path``
        (:func:`error_context`)."""
        return error_context(self.uri, path)

    def _warn_not_atomic(self) -> None:
        self._warn_once(
            "conditional-writes",
            f"{self.uri}: this storage has no create-if-absent or compare-and-swap across "
            "processes, so committing steps and moving `latest` are safe against writers in "
            "this process only; use one writing process per store.",
        )

    def _warn_once(self, topic: str, message: str) -> None:
        """Log and warn about a lost guarantee once per backend instance and topic."""
        with _WARN_LOCK:
            if topic in self._warned:
                return
            self._warned.add(topic)
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def error_context(root: str, path: str) -> ErrorContext:
    """``uri=`` and ``path=`` for an error about the object at ``path`` under the store at
    ``root``: the object's full URI and its store-relative key, as :mod:`ckptstore.errors`
    defines them. Use as ``raise NotFoundError(message, **error_context(backend.uri, path))``."""
    return {"uri": join(root, path), "path": path}


def join(root: str, *parts: str) -> str:
    """``root`` (a URI or path, kept as is) joined with relative parts by ``/``."""
    tail = [p.strip("/") for p in parts if p.strip("/")]
    return "/".join([root.rstrip("/"), *tail]) if tail else root
