"""A backend that delegates every member to another, for wrappers that change one or two.

Fault injection and request counting wrap a backend and override only what they change. Every
member of :class:`~.base.Backend` is delegated by name, capabilities included
(``read_into_chunks``, ``parallel_writes``, ``address``): callers never look a capability up
with ``getattr``, so a proxied backend runs the same paths as the one it wraps.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Sequence

from ckptstore.backends.base import (
    Backend,
    Capabilities,
    Chunk,
    ObjectAddress,
    ObjectInfo,
    PartialWrite,
)


class BackendProxy:
    """Every member delegated to ``inner``: subclass it and override only what you change."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def uri(self) -> str:
        return self.inner.uri

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.read(path, start, end)

    def read_into(self, path: str, out: memoryview) -> int:
        return self.inner.read_into(path, out)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        return self.inner.read_into_chunks(path, out, on_chunk)

    @property
    def parallel_writes(self) -> int:
        return self.inner.parallel_writes

    @property
    def sends_whole_up_to(self) -> int:
        return self.inner.sends_whole_up_to

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        return self.inner.read_versioned(path)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        return self.inner.write(path, chunks)

    def create(self, path: str, data: bytes) -> None:
        self.inner.create(path, data)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        return self.inner.swap(path, data, expected)

    def copy(self, src: str, dst: str) -> None:
        self.inner.copy(src, dst)

    def address(self, path: str) -> ObjectAddress | None:
        return self.inner.address(path)

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        self.inner.copy_in(source, dst, size)

    def stat(self, path: str) -> ObjectInfo | None:
        return self.inner.stat(path)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        return self.inner.list_dirs(prefix)

    def delete(self, paths: Sequence[str]) -> None:
        self.inner.delete(paths)

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        return self.inner.partial_writes(prefix)

    def abort(self, partial: PartialWrite) -> None:
        self.inner.abort(partial)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
