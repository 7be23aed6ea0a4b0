"""What only the fsspec backend does; the shared contract (create and swap atomic between
threads included) runs in test_backend_contract.py."""

from __future__ import annotations

import gc
import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from fsspec.spec import AbstractBufferedFile

from ckptstore.backends.fsspec import TMP_PREFIX, FsspecBackend
from ckptstore.backends.registry import open_backend
from ckptstore.errors import ConfigError


@pytest.fixture
def backend(memory_uri: str) -> Iterator[FsspecBackend]:
    b = open_backend(memory_uri)
    assert isinstance(b, FsspecBackend)
    yield b
    b.close()


def test_first_create_or_swap_warns_once(backend: FsspecBackend) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.create("a", b"1")
        backend.swap("b", b"1", None)
        backend.create("c", b"1")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert backend.uri in message
    assert "this process only" in message


def test_nothing_is_visible_while_a_write_streams(backend: FsspecBackend) -> None:
    backend.write("x", [b"old"])

    def chunks() -> Iterator[bytes]:
        yield b"new "
        assert backend.read("x") == b"old"
        assert [i.path for i in backend.list("")] == ["x"]
        yield b"content"

    backend.write("x", chunks())
    assert backend.read("x") == b"new content"
    assert not [k for k in backend.fs.find(backend.root) if TMP_PREFIX in k]


def test_stray_temp_files_are_partial_writes(backend: FsspecBackend) -> None:
    backend.fs.pipe_file(f"{backend.root}/step/{TMP_PREFIX}abc-model.pt", b"half")
    assert list(backend.list("")) == []
    (stray,) = backend.partial_writes("")
    assert stray.path == f"step/{TMP_PREFIX}abc-model.pt"
    assert backend.partial_writes("other/") == []
    backend.abort(stray)
    assert backend.partial_writes("") == []


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_missing_filesystem_package_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match="pip install"):
        open_backend("gs://bucket/run")


def test_uri_never_shows_credentials() -> None:
    b = FsspecBackend("memory://user:hunter2@host/run", {})
    assert "hunter2" not in b.uri
    assert "hunter2" not in repr(b)


# -- filesystems whose files commit on close (gcsfs, adlfs, ...) ----------------------------------


class _CommitOnCloseFile(AbstractBufferedFile):  # type: ignore[misc]
    """Uploads as it is written; the object appears only at ``close`` (like gcsfs)."""

    def _initiate_upload(self) -> None:
        self.parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        self.parts.append(self.buffer.getvalue())
        if final:
            self.fs.store[self.path] = MemoryFile(self.fs, self.path, b"".join(self.parts))
        return True

    def discard(self) -> None:
        self.parts = []


class CommitOnCloseFileSystem(MemoryFileSystem):  # type: ignore[misc]
    protocol = "commitonclose"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(super()._strip_protocol(path.removeprefix("commitonclose://")))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode:
            return _CommitOnCloseFile(self, self._strip_protocol(path), mode, block_size=1024)
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def commit_on_close() -> Iterator[FsspecBackend]:
    fsspec.register_implementation("commitonclose", CommitOnCloseFileSystem, clobber=True)
    b = open_backend("commitonclose://bucket/run")
    assert isinstance(b, FsspecBackend)
    yield b
    CommitOnCloseFileSystem.store.clear()


def test_commit_on_close_files_are_written_in_place(commit_on_close: FsspecBackend) -> None:
    data = bytes(range(256)) * 40
    assert commit_on_close.write("a/b", (data[i : i + 999] for i in range(0, len(data), 999)))
    assert commit_on_close.read("a/b") == data
    assert list(CommitOnCloseFileSystem.store) == ["/bucket/run/a/b"]  # no temp, no move


def test_commit_on_close_failed_write_is_discarded(commit_on_close: FsspecBackend) -> None:
    def failing() -> Iterator[bytes]:
        yield b"x" * 5000  # more than a block: parts were already uploaded
        raise RuntimeError("serializer broke")

    with pytest.raises(RuntimeError, match="serializer broke"):
        commit_on_close.write("a/b", failing())
    gc.collect()  # a file that was only dropped would commit in __del__
    assert commit_on_close.stat("a/b") is None
    assert CommitOnCloseFileSystem.store == {}
