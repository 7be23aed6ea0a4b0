"""A backend view that counts calls by kind, for the tests that pin request costs down."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from ckptstore.backends.base import Backend, Chunk, ObjectInfo
from ckptstore.backends.proxy import BackendProxy
from ckptstore.domain import layout
from ckptstore.domain.step_index import INDEX_DIR


class CountingBackend(BackendProxy):
    """Counts reads by what they read (``manifest GET``, ``pointer GET``, ``other GET``) and
    listings (``LIST``, ``LIST dirs``); ``heads=True`` counts ``stat`` calls as ``HEAD`` too,
    ``writes=True`` every write by what it writes (``lease write``, ``pointer write``,
    ``manifest write``, ``marker write``, ``payload write``, ``copy``, ``DELETE``)."""

    def __init__(self, inner: Backend, *, heads: bool = False, writes: bool = False) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self._heads = heads
        self._writes = writes

    def _count_write(self, path: str) -> None:
        if not self._writes:
            return
        if path == layout.LEASE_NAME:
            self.calls["lease write"] += 1
        elif path == layout.LATEST_NAME:
            self.calls["pointer write"] += 1
        elif path.endswith("/" + layout.MANIFEST_NAME):
            self.calls["manifest write"] += 1
        elif path.endswith("/" + layout.ATTEMPT_MARKER):
            self.calls["marker write"] += 1
        elif path.startswith(INDEX_DIR + "/"):
            self.calls["index write"] += 1
        else:
            self.calls["payload write"] += 1

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        self._count_write(path)
        return super().write(path, chunks)

    def create(self, path: str, data: bytes) -> None:
        self._count_write(path)
        super().create(path, data)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        self._count_write(path)
        return super().swap(path, data, expected)

    def copy(self, src: str, dst: str) -> None:
        if self._writes:
            self.calls["copy"] += 1
        super().copy(src, dst)

    def delete(self, paths: Sequence[str]) -> None:
        if self._writes:
            self.calls["DELETE"] += len(paths)
        super().delete(paths)

    def _count_read(self, path: str) -> None:
        if path.endswith("/" + layout.MANIFEST_NAME):
            self.calls["manifest GET"] += 1
        elif path == layout.LATEST_NAME:
            self.calls["pointer GET"] += 1
        elif path.startswith(INDEX_DIR + "/"):
            self.calls["index GET"] += 1
        else:
            self.calls["other GET"] += 1

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._count_read(path)
        return super().read(path, start, end)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        self._count_read(path)
        return super().read_versioned(path)

    def read_into(self, path: str, out: memoryview) -> int:
        self._count_read(path)
        return super().read_into(path, out)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        self._count_read(path)
        return super().read_into_chunks(path, out, on_chunk)

    def stat(self, path: str) -> ObjectInfo | None:
        if self._heads:
            self.calls["HEAD"] += 1
        return super().stat(path)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.calls["LIST"] += 1
        return super().list(prefix)

    def list_dirs(self, prefix: str) -> list[str]:
        self.calls["LIST dirs"] += 1
        return super().list_dirs(prefix)

    def take(self) -> Counter[str]:
        """The counts so far; counting starts again from zero."""
        calls, self.calls = self.calls, Counter()
        return calls
