"""Any other fsspec filesystem: ``memory://``, ``gs://``, ``az://``, ``hdfs://``, ...

An object must appear whole or not at all. Object-store files (fsspec's buffered files: gcsfs,
adlfs, ...) upload as they are written and commit only on ``close``, so a failed write discards
the file instead of closing it. Other files (memory, sftp, ...) show bytes as they are written,
so they are written under a hidden temp name (``.ckpt-tmp-...``) and moved into place; a stray
temp is a partial write that ``gc`` removes.

fsspec offers no create-if-absent or compare-and-swap that holds across processes on every
filesystem, so ``create`` and ``swap`` are the base class's check-then-write fallback: atomic
within this process only. Capabilities say so, and the first create or swap warns once. Swap's
version token is a SHA-256 of the content.

A write stops between chunks, and a read does not start, once the deadline in force has passed
(:mod:`ckptstore.deadline`); the filesystem's own calls cannot be interrupted.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ckptstore import deadline
from ckptstore.backends.base import BaseBackend, Capabilities, Chunk, ObjectInfo, PartialWrite
from ckptstore.backends.fsutil import TMP_PREFIX, temp_name
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    ConfigError,
    DeadlineExceededError,
    NotFoundError,
)


class FsspecBackend(BaseBackend):
    """Objects under any fsspec URL; create and swap are atomic within one process only."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any]) -> None:
        super().__init__()
        parts = urlsplit(uri)
        netloc = parts.netloc.rpartition("@")[2]  # messages never show user:password@
        self._uri = urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")
        try:
            fs, root = fsspec.core.url_to_fs(uri, **storage_options)
        except ImportError as e:
            raise ConfigError(
                f"cannot open {self._uri}: the {parts.scheme}:// filesystem needs the missing "
                f"package {e.name!r}; install it with: pip install {e.name or parts.scheme}",
                uri=self._uri,
            ) from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"cannot open {self._uri}: {e}", uri=self._uri) from e
        self.fs: AbstractFileSystem = fs
        self._root = str(root).rstrip("/")

    def __repr__(self) -> str:
        return f"FsspecBackend({self._uri!r})"

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def root(self) -> str:
        """The store's path in the filesystem's own terms (``fs.find(root)`` lists it)."""
        return self._root

    @property
    def capabilities(self) -> Capabilities:
        native_copy = type(self.fs).cp_file is not AbstractFileSystem.cp_file
        return Capabilities(atomic_create=False, atomic_swap=False, server_side_copy=native_copy)

    def _full(self, path: str) -> str:
        return f"{self._root}/{path}" if path else self._root

    def _name(self, path: str) -> str:
        return f"{self._uri}/{path}" if path else self._uri

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with self._translated(path, "read"):
            deadline.check(self._name(path), doing="read")
            if end is not None and end <= start:
                self.fs.info(self._full(path))  # raises if missing
                return b""
            data: bytes = self.fs.cat_file(self._full(path), start=start or None, end=end)
            return data

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data = self.read(path)
        return data, _token(data)

    def _put_versioned(self, path: str, data: bytes) -> str:
        """For the fallback swap: the token is the content's hash, known without a read."""
        self.write(path, [data])
        return _token(data)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        full = self._full(path)
        parent, slash, name = full.rpartition("/")
        tmp = f"{parent}{slash}{temp_name(name)}"
        with self._translated(path, "write"):
            f = self._open_for_write(tmp)
            if isinstance(f, AbstractBufferedFile):  # commits on close: write in place
                _forget(f)  # nothing was written, so nothing was sent
                return _write_buffered(self._open_for_write(full), chunks, self._name(path))
            try:
                with f:
                    size = 0
                    for chunk in chunks:
                        deadline.check(self._name(path), doing="write", bytes_done=size)
                        size += int(f.write(chunk))
                self.fs.mv(tmp, full)
            except BaseException:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(tmp)
                raise
            return size

    def _open_for_write(self, full: str) -> Any:
        try:
            return self.fs.open(full, "wb")
        except FileNotFoundError:  # filesystems with real directories (sftp, hdfs)
            self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
            return self.fs.open(full, "wb")

    def copy(self, src: str, dst: str) -> None:
        with self._translated(src, "copy"):
            if type(self.fs).cp_file is AbstractFileSystem.cp_file:
                with self.fs.open(self._full(src), "rb") as f:
                    self.write(dst, iter(lambda: f.read(1 << 22), b""))
            else:
                self.fs.cp_file(self._full(src), self._full(dst))

    def stat(self, path: str) -> ObjectInfo | None:
        try:
            with self._translated(path, "stat"):
                info = self.fs.info(self._full(path))
        except NotFoundError:
            return None
        if info.get("type") != "file":
            return None
        return ObjectInfo(path, int(info.get("size") or 0), _mtime(info))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        head = prefix.rpartition("/")[0]
        with self._translated(prefix, "list"):
            try:
                found = self.fs.find(self._full(head), detail=True)
            except FileNotFoundError:
                return
        for name, info in sorted(found.items()):
            rel = self._relative(str(name))
            if rel.startswith(prefix) and not rel.rpartition("/")[2].startswith(TMP_PREFIX):
                yield ObjectInfo(rel, int(info.get("size") or 0), _mtime(info))

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        with self._translated(prefix, "list"):
            try:
                entries = self.fs.ls(self._full(prefix.rstrip("/")), detail=True)
            except FileNotFoundError:
                return []
        dirs = (str(e["name"]).rstrip("/") for e in entries if e.get("type") == "directory")
        return sorted(name for name in (d.rpartition("/")[2] for d in dirs) if name)

    def delete(self, paths: Sequence[str]) -> None:
        for path in paths:
            with self._translated(path, "delete"):
                try:
                    self.fs.rm_file(self._full(path))
                except FileNotFoundError:
                    continue

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """Stray temp files of writes that were killed before their move."""
        strays = []
        head = prefix.rpartition("/")[0]
        with self._translated(prefix, "list"):
            try:
                found = self.fs.find(self._full(head), detail=True)
            except FileNotFoundError:
                return []
        for info in found.values():
            rel = self._relative(str(info["name"]))
            if rel.startswith(prefix) and rel.rpartition("/")[2].startswith(TMP_PREFIX):
                strays.append(PartialWrite(rel, upload_id=rel, started=_mtime(info)))
        return strays

    def abort(self, partial: PartialWrite) -> None:
        self.delete([partial.path])

    def _relative(self, name: str) -> str:
        stripped = self.fs._strip_protocol(name)
        root = self.fs._strip_protocol(self._root) if self._root else ""
        return str(stripped)[len(root) :].lstrip("/") if root else str(stripped).lstrip("/")

    @contextlib.contextmanager
    def _translated(self, path: str, action: str) -> Iterator[None]:
        name = self._name(path)
        where = self._where(path)
        try:
            yield
        except DeadlineExceededError as e:
            e.add_context(**where)
            raise
        except (FileNotFoundError, NotADirectoryError) as e:
            raise NotFoundError(
                f"{name} does not exist (while trying to {action} it)", **where
            ) from e
        except PermissionError as e:
            raise AccessDeniedError(
                f"permission denied to {action} {name}: check the credentials and permissions "
                "this filesystem uses",
                **where,
            ) from e
        except (ConnectionError, TimeoutError) as e:
            raise BackendError(
                f"cannot reach the storage to {action} {name} ({type(e).__name__})",
                retryable=True,
                **where,
            ) from e
        except OSError as e:
            raise BackendError(f"cannot {action} {name}: {e.strerror or e}", **where) from e


def _write_buffered(f: AbstractBufferedFile, chunks: Iterable[Chunk], name: str) -> int:
    """Commit on close; on any failure (the deadline included) discard, and never close
    (closing would commit)."""
    size = 0
    try:
        for chunk in chunks:
            deadline.check(name, doing="write", bytes_done=size)
            size += f.write(chunk)
    except BaseException:
        _forget(f)
        raise
    f.close()
    return size


def _forget(f: AbstractBufferedFile) -> None:
    """Discard an unfinished file; marking it closed keeps ``__del__`` from committing it."""
    with contextlib.suppress(Exception):
        f.discard()
    f.closed = True


def _token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mtime(info: Mapping[str, Any]) -> float | None:
    for field in ("mtime", "LastModified", "updated", "last_modified", "created"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
