"""A backend wrapper that fails on purpose, for the commit-protocol tests.

It sits on top of a real backend (local, memory or S3) and fails the Nth mutating operation:
once (``mode="error"``: the operation raises and later ones work, like a transient fault), or for
good (``mode="crash"``: that operation and every one after it raises, like a process that died
at that moment and left whatever it had written).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from ckptstore.backends.base import Backend, Capabilities, Chunk, ObjectInfo, PartialWrite
from ckptstore.errors import BackendError

MUTATING = ("write", "create", "swap", "copy", "delete", "abort")


class InjectedFault(BackendError):
    """The failure this wrapper injects."""


class FaultyBackend:
    def __init__(self, inner: Backend, *, fail_at: int | None, mode: str = "error") -> None:
        assert mode in ("error", "crash")
        self.inner = inner
        self.fail_at = fail_at
        self.mode = mode
        self.count = 0
        self.fired = False

    def _tick(self, op: str, path: str) -> None:
        if self.fired and self.mode == "crash":
            raise InjectedFault(f"process is dead (crashed before {op} {path})")
        self.count += 1
        if self.count == self.fail_at:
            self.fired = True
            raise InjectedFault(f"injected failure of {op} #{self.count} on {path}")

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

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        return self.inner.read_versioned(path)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        self._tick("write", path)
        return self.inner.write(path, chunks)

    def create(self, path: str, data: bytes) -> None:
        self._tick("create", path)
        self.inner.create(path, data)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        self._tick("swap", path)
        return self.inner.swap(path, data, expected)

    def copy(self, src: str, dst: str) -> None:
        self._tick("copy", dst)
        self.inner.copy(src, dst)

    def stat(self, path: str) -> ObjectInfo | None:
        return self.inner.stat(path)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> list[str]:
        return self.inner.list_dirs(prefix)

    def delete(self, paths: Sequence[str]) -> None:
        for path in paths:  # one fault point per object, as a crash can strike between them
            self._tick("delete", path)
            self.inner.delete([path])

    def partial_writes(self, prefix: str) -> list[PartialWrite]:
        return self.inner.partial_writes(prefix)

    def abort(self, partial: PartialWrite) -> None:
        self._tick("abort", partial.path)
        self.inner.abort(partial)

    def close(self) -> None:
        self.inner.close()
