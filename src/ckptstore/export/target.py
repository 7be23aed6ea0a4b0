"""Where an export goes: a local directory, or a prefix in a store, complete or absent.

Locally, files are written into a temporary directory beside the target and renamed into place
once the step's files all checked out: the directory holds a whole model or does not exist
(transfer.py's rule for pulls). An object store has no directory rename, so
``model.safetensors.index.json`` is the commit marker: every other file is written first, and
the index last, create-only, so a reader (or a second export) that finds it finds a complete
model, and an interrupted export leaves files that the next export of that prefix overwrites.
Hugging Face's loaders read the index first, so a half-written export does not load.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ckptstore.backends.base import Backend, Chunk, join
from ckptstore.backends.fsutil import atomic_write, fsync_dir, temp_name
from ckptstore.backends.registry import open_backend, scheme_of
from ckptstore.deadline import clean_up
from ckptstore.errors import ConflictError, ObjectExistsError
from ckptstore.export.plan import INDEX_NAME

log = logging.getLogger(__name__)


class Target(Protocol):
    """An export's destination; see the module docstring for how each kind commits."""

    uri: str

    def existing_index(self) -> bytes | None:
        """The index of a complete export already there, or None."""

    def check_empty(self) -> None:
        """Raise ConflictError if the destination holds anything but a previous export."""

    def write(self, path: str, chunks: Iterable[Chunk]) -> int: ...

    def commit(self, index: bytes) -> None:
        """Publish the export: it exists, whole, from here on."""

    def abort(self) -> None:
        """Remove what was written (an export that failed leaves nothing, or only files the
        next export overwrites)."""

    def close(self) -> None: ...


def open_target(out: str | os.PathLike[str], options: Mapping[str, Any] | None) -> Target:
    """A local directory for paths, a store prefix for URIs (``s3://bucket/models/step-100``)."""
    text = os.fspath(out)
    if scheme_of(text) == "file":
        return LocalTarget(Path(text.removeprefix("file://")))
    return StoreTarget(open_backend(text, options))


class LocalTarget:
    def __init__(self, out: Path) -> None:
        self.out = out.expanduser().absolute()
        self.uri = str(self.out)
        self._tmp: Path | None = None

    def existing_index(self) -> bytes | None:
        index = self.out / INDEX_NAME
        return index.read_bytes() if index.is_file() else None

    def check_empty(self) -> None:
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConflictError(
                f"{self.out} exists and is not an empty directory; an export writes a new "
                "directory. Choose another OUT, or remove it",
                path=str(self.out),
            )

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        target = self._dir() / path
        target.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write(target, chunks)

    def commit(self, index: bytes) -> None:
        tmp = self._dir()
        atomic_write(tmp / INDEX_NAME, [index])
        for folder, _, _ in os.walk(tmp):
            fsync_dir(Path(folder))
        self.check_empty()  # someone may have filled it meanwhile
        if self.out.exists():
            self.out.rmdir()
        os.replace(tmp, self.out)
        fsync_dir(self.out.parent)
        self._tmp = None

    def abort(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        self.abort()

    def _dir(self) -> Path:
        if self._tmp is None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.out.parent / temp_name(f"export-{self.out.name}")
            self._tmp.mkdir()
        return self._tmp


class StoreTarget:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.uri = backend.uri
        self._written: list[str] = []

    def existing_index(self) -> bytes | None:
        if self.backend.stat(INDEX_NAME) is None:
            return None
        return self.backend.read(INDEX_NAME)

    def check_empty(self) -> None:
        stray = [o.path for o in self.backend.list("")]
        if stray:
            log.warning(
                "%s holds %d file(s) but no %s (an interrupted export?); files of the same "
                "name are overwritten",
                self.uri,
                len(stray),
                INDEX_NAME,
            )

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        self._written.append(path)
        return self.backend.write(path, chunks)

    def commit(self, index: bytes) -> None:
        try:
            self.backend.create(INDEX_NAME, index)
        except ObjectExistsError as e:
            self._written = []  # the files are the other export's now: never delete them
            raise ConflictError(
                f"{join(self.uri, INDEX_NAME)} appeared while this export ran: another export "
                "finished first into the same OUT. Choose another OUT",
                uri=join(self.uri, INDEX_NAME),
            ) from e
        self._written = []

    def abort(self) -> None:
        if self._written:  # under a deadline of its own: the export's may have passed
            written, self._written = self._written, []
            what = f"the files of a failed export at {self.uri}"
            by_hand = "the next export to it overwrites them (gc does not look there)"
            clean_up(lambda: self.backend.delete(written), what, otherwise=by_hand)

    def close(self) -> None:
        self.abort()
        self.backend.close()


__all__ = ["LocalTarget", "StoreTarget", "Target", "open_target"]
