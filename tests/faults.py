"""A backend wrapper that fails on purpose, for the commit-protocol tests.

It sits on top of a real backend (local, memory or S3) and fails the Nth mutating operation:
once (``mode="error"``: the operation raises and later ones work, like a transient fault), or for
good (``mode="crash"``: that operation and every one after it raises, like a process that died
at that moment and left whatever it had written). Reads pass through untouched
(:class:`~ckptstore.backends.proxy.BackendProxy` delegates everything not overridden here).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ckptstore.backends.base import Backend, Chunk, ObjectAddress, PartialWrite
from ckptstore.backends.proxy import BackendProxy
from ckptstore.errors import BackendError

MUTATING = ("write", "create", "swap", "copy", "copy_in", "delete", "abort")


class InjectedFault(BackendError):
    """The failure this wrapper injects."""


class FaultyBackend(BackendProxy):
    def __init__(self, inner: Backend, *, fail_at: int | None, mode: str = "error") -> None:
        assert mode in ("error", "crash")
        super().__init__(inner)
        self.fail_at = fail_at
        self.mode = mode
        self.count = 0
        self.fired = False
        self.log: list[tuple[str, str]] = []
        """(operation, path) of every operation counted, in order."""

    def _tick(self, op: str, path: str) -> None:
        if self.fired and self.mode == "crash":
            raise InjectedFault(f"process is dead (crashed before {op} {path})")
        self.count += 1
        self.log.append((op, path))
        if self.count == self.fail_at:
            self.fired = True
            raise InjectedFault(f"injected failure of {op} #{self.count} on {path}")

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        self._tick("write", path)
        return super().write(path, chunks)

    def create(self, path: str, data: bytes) -> None:
        self._tick("create", path)
        super().create(path, data)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        self._tick("swap", path)
        return super().swap(path, data, expected)

    def copy(self, src: str, dst: str) -> None:
        self._tick("copy", dst)
        super().copy(src, dst)

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        self._tick("copy_in", dst)
        super().copy_in(source, dst, size)

    def delete(self, paths: Sequence[str]) -> None:
        for path in paths:  # one fault point per object, as a crash can strike between them
            self._tick("delete", path)
            super().delete([path])

    def abort(self, partial: PartialWrite) -> None:
        self._tick("abort", partial.path)
        super().abort(partial)


class Gate(BackendProxy):
    """Holds every write until opened: copies to a tier behind it lag behind the saves, as
    they do when the bucket is slower than the local disk."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.open = threading.Event()

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        assert self.open.wait(30), "the gate was never opened"
        return super().write(path, chunks)


class FailsManifestOf(BackendProxy):
    """Every commit of ``step`` through it fails for good (a non-retryable storage error at
    its manifest), after its files landed: a tiered store's copy of the step fails, and the
    step stays pinned in the local tier, due and not durable. Paths are the store's (the
    wrapped backend is rooted at the store)."""

    def __init__(self, inner: Backend, step: int) -> None:
        super().__init__(inner)
        self.folder = f"global_step_{step}/"
        self.failures = 0

    def _check(self, path: str) -> None:
        if path.startswith(self.folder) and path.endswith("manifest.json"):
            self.failures += 1
            raise BackendError(f"injected: the bucket refused {path}", retryable=False)

    def create(self, path: str, data: bytes) -> None:
        self._check(path)
        super().create(path, data)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        self._check(path)
        return super().write(path, chunks)
