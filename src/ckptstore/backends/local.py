"""Local disks and NFS mounts.

Every object is written with :func:`~ckptstore.backends.fsutil.atomic_write` (temp file in its
own directory, fsync, rename, directory fsync), so a crash leaves either the old object or the
new one, never a torn one. Create-only writes link the finished temp file to its name instead
of renaming it: ``link`` fails if the name exists, so the commit marker appears whole and
exactly once, against any process on any machine that shares the filesystem. Compare-and-swap
holds an ``flock`` on a sidecar lock file (NFSv4 carries it to the server) while it checks the
version token (inode, mtime, size) and renames. ``copy`` hard-links: objects are never modified
in place, only replaced.

Temp and lock files start with ``.ckpt-``: listings hide them and ``gc`` removes stray temps.
Writes and ``read_into`` stop between chunks once the deadline in force has passed
(:mod:`ckptstore.deadline`): a disk call itself cannot be interrupted.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptstore import deadline
from ckptstore.backends.base import (
    BaseBackend,
    Capabilities,
    Chunk,
    ObjectInfo,
    PartialWrite,
)
from ckptstore.backends.fsutil import (
    HIDDEN_PREFIX,
    TMP_PREFIX,
    atomic_write,
    fsync_dir,
    move_into_place,
    temp_path,
    unlink_quietly,
    write_temp,
)
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    ConfigError,
    DeadlineExceededError,
    ErrorContext,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)

LOCK_PREFIX = ".ckpt-lock-"
READ_CHUNK = 1 << 20
"""Bytes per read call of ``read_into``: each piece is checksummed right after it is read,
while it is still in the CPU's cache. A piece well within a core's L2 (2 MiB here) keeps it
there: side by side on 256 MiB from a cold disk, 1 MiB pieces took half the CRC32C's CPU of
8 MiB ones (which spill to L3) and read 17% faster, and at the speed of raw ``preadv`` in
1 MiB pieces (which itself beat one ``preadv`` per file by 13%: the read-ahead keeps the
disk busy while each piece is copied)."""


class LocalBackend(BaseBackend):
    """A directory on a POSIX filesystem (local disk or NFS)."""

    def __init__(self, uri: str, storage_options: dict[str, Any]) -> None:
        super().__init__()
        if storage_options:
            raise ConfigError(
                f"{uri}: local stores take no storage options, got {sorted(storage_options)}",
                uri=uri,
            )
        path = uri[len("file://") :] if uri.startswith("file://") else uri
        self.root = Path(path).expanduser().absolute()
        self._uri = str(self.root)

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def capabilities(self) -> Capabilities:
        # parallel_writes: on the benchmark's disk, 8 fsyncing writers wrote 1 GiB in 32 MiB
        # files 12% faster than 4 did (the sweep in benchmarks/bench_local_limits.py)
        return Capabilities(
            atomic_create=True, atomic_swap=True, server_side_copy=True, parallel_writes=8
        )

    def _path(self, path: str) -> Path:
        return self.root / path if path else self.root

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        target = self._path(path)
        with _translated(target, "read", self._where(path)), open(target, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def read_into(self, path: str, out: memoryview) -> int:
        return self.read_into_chunks(path, out, _ignore)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        """``read_into`` in ``READ_CHUNK`` pieces, each handed to ``on_chunk`` as soon as it
        is filled, in order, while it is still in the CPU's cache: a load checksums it there
        instead of in a second pass."""
        target = self._path(path)
        with _translated(target, "read", self._where(path)):
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _advise_sequential(fd)
                filled = 0
                while filled < len(out):
                    deadline.check(str(target), doing="read", bytes_done=filled)
                    piece = out[filled : filled + READ_CHUNK]
                    n = os.preadv(fd, [piece], filled)  # releases the GIL; no temporary bytes
                    if not n:
                        break
                    on_chunk(piece[:n])
                    filled += n
                return os.fstat(fd).st_size
            finally:
                os.close(fd)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        target = self._path(path)
        with _translated(target, "read", self._where(path)), open(target, "rb") as f:
            return f.read(), _version(os.fstat(f.fileno()))

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        target = self._path(path)
        with self._writing(target, path):
            return atomic_write(target, chunks)

    def create(self, path: str, data: bytes) -> None:
        target = self._path(path)
        with self._writing(target, path):
            tmp, _ = write_temp(target, [data])
        try:
            with _translated(target, "create", self._where(path)):
                os.link(tmp, target)
        except FileExistsError as e:
            raise ObjectExistsError(f"{target} already exists", **self._where(path)) from e
        finally:
            unlink_quietly(tmp)
        fsync_dir(target.parent)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        target = self._path(path)
        with self._locked(target, path):
            try:
                current: str | None = _version(os.stat(target))
            except FileNotFoundError:
                current = None
            if current != expected:
                raise PreconditionFailedError(
                    f"{target} changed since it was read (expected version {expected}, "
                    f"found {current})",
                    **self._where(path),
                )
            with self._writing(target, path):
                atomic_write(target, [data])
                return _version(os.stat(target))

    def copy(self, src: str, dst: str) -> None:
        """Hard-link when possible: objects are never modified in place, only replaced."""
        source, target = self._path(src), self._path(dst)
        tmp = temp_path(target)
        with _translated(source, "copy", self._where(src)):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, tmp)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK):
                    raise
                with open(source, "rb") as f:
                    self.write(dst, iter(lambda: f.read(1 << 22), b""))
                return
            move_into_place(tmp, target)

    def stat(self, path: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _translate(e, self._path(path), "stat", self._where(path)) from e
        return ObjectInfo(path, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for path, st in self._walk(prefix):
            if not path.rsplit("/", 1)[-1].startswith(HIDDEN_PREFIX):
                yield ObjectInfo(path, st.st_size, st.st_mtime)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = self._path(prefix)
        try:
            with os.scandir(base) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise _translate(e, base, "list", self._where(prefix)) from e

    def delete(self, paths: Sequence[str]) -> None:
        parents = set()
        for path in paths:
            target = self._path(path)
            try:
                target.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _translate(e, target, "delete", self._where(path)) from e
            parents.add(target.parent)
        for parent in parents:
            _remove_empty_dirs(parent, stop=self.root)

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """Stray temp files, and empty directories: a process killed after a write's mkdir,
        or between a delete's unlinks and its rmdir, leaves one, which no listing shows. A
        directory holding only lock files counts as empty, as it does for delete."""
        found = [
            PartialWrite(path, upload_id=path, started=st.st_mtime)
            for path, st in self._walk(prefix)
            if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)
        ]
        for dirpath, dirs, files in os.walk(
            self._path(prefix.rsplit("/", 1)[0] if "/" in prefix else "")
        ):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            only_locks = all(name.startswith(LOCK_PREFIX) for name in files)
            if not dirs and only_locks and rel != "." and rel.startswith(prefix):
                found.append(PartialWrite(rel, upload_id=rel, started=_mtime(dirpath)))
        return found

    def abort(self, partial: PartialWrite) -> None:
        target = self._path(partial.path)
        if target.is_dir():
            _remove_empty_dirs(target, stop=self.root)  # only while it is still empty
        else:
            self.delete([partial.path])

    def _walk(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        """``(relative path, stat)`` of every file whose path starts with ``prefix``."""
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(head)
        for dirpath, _dirs, files in os.walk(start, onerror=None):
            for name in files:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if rel.startswith(prefix):
                    try:
                        yield rel, os.stat(full)
                    except FileNotFoundError:  # deleted while we walked
                        continue

    @contextlib.contextmanager
    def _writing(self, target: Path, path: str) -> Iterator[None]:
        """Create ``target`` (the object at ``path``)'s directory; errors translated, and a
        failed write leaves nothing (not even the directories it created)."""
        with _translated(target, "write", self._where(path)):
            _make_parent(target, "write", self._where(path))
            try:
                yield
            except BaseException:
                _remove_empty_dirs(target.parent, stop=self.root)
                raise

    @contextlib.contextmanager
    def _locked(self, target: Path, path: str) -> Iterator[None]:
        lock = target.parent / f"{LOCK_PREFIX}{target.name}"
        with _translated(target, "lock", self._where(path)):
            _make_parent(target, "lock", self._where(path))
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock


def _make_parent(target: Path, action: str, where: ErrorContext) -> None:
    """Create ``target``'s directory. A file in the way is a BackendError here: ``_translated``
    lets FileExistsError through, for create-only writes."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise _translate(e, target, action, where) from e


def _ignore(chunk: memoryview) -> None:
    """``on_chunk`` for a plain ``read_into``."""


def _advise_sequential(fd: int) -> None:
    """Tell the kernel the file is read front to back, which widens its read-ahead; a hint,
    so a filesystem or platform without it reads the same bytes, only without the hint."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def _version(st: os.stat_result) -> str:
    """A token that changes whenever the file is replaced (a rename brings a new inode)."""
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _remove_empty_dirs(start: Path, *, stop: Path) -> None:
    """Remove ``start`` and its parents up to (not including) ``stop`` while they are empty.

    Other processes may work in the same directories (the ranks of a node deleting one step
    of their node's tier, a writer creating a file): a directory already gone is passed over,
    and one that gains a file after it was seen empty stays (``rmdir``, never a recursive
    removal that would take the newcomer with it)."""
    current = start
    while current != stop and stop in current.parents:
        try:
            names = os.listdir(current)
        except FileNotFoundError:  # another process removed it
            names = []
        if any(not name.startswith(LOCK_PREFIX) for name in names):
            return
        for name in names:  # a lock file alone does not keep a directory alive
            with contextlib.suppress(FileNotFoundError):
                os.unlink(current / name)
        try:
            os.rmdir(current)
        except FileNotFoundError:
            pass
        except OSError:  # not empty (a file arrived since), or not ours to remove
            return
        current = current.parent


@contextlib.contextmanager
def _translated(path: Path, action: str, where: ErrorContext) -> Iterator[None]:
    try:
        yield
    except (FileExistsError, ObjectExistsError):
        raise
    except DeadlineExceededError as e:
        e.add_context(**where)
        raise
    except OSError as e:
        raise _translate(e, path, action, where) from e


def _translate(e: OSError, path: Path, action: str, where: ErrorContext) -> CheckpointError:
    """Our error for ``e``, raised while doing ``action`` on the file ``path``; ``where`` is
    the object's ``uri`` and store-relative ``path`` for the error's attributes."""
    if isinstance(e, FileNotFoundError):
        return NotFoundError(f"{path} does not exist (while trying to {action} it)", **where)
    if e.errno in (errno.EACCES, errno.EPERM):
        return AccessDeniedError(
            f"permission denied to {action} {path}: give this user write access to the "
            "store directory, or choose another URI",
            **where,
        )
    if e.errno == errno.EROFS:
        return AccessDeniedError(
            f"cannot {action} {path}: the filesystem is read-only; mount it read-write or "
            "choose another URI",
            **where,
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return BackendError(
            f"no space left to {action} {path}: free space on that filesystem or lower keep_last; "
            "committed steps were not touched",
            **where,
        )
    return BackendError(f"cannot {action} {path}: {e.strerror or e}", retryable=False, **where)
