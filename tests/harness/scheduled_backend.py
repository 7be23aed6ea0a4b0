"""An in-memory backend whose every call is a scheduling point of the explorer's scheduler.

:class:`ScheduledBackend` implements the whole Backend protocol over a dict, and hands each call
to :meth:`~harness.scheduler.Scheduler.call`, which parks the calling actor until it
is chosen and then runs the operation atomically, recording its effects (scheduler.py says why).

``delete`` of several paths is one atomic operation. Calls that touch no object
(``delete([])``, ``partial_writes``, ``abort``, ``close``, ``address``) are not scheduling
points: they commute with everything. A call made once the deadline in force has passed (on
its own clock: a remover's is the logical one) raises its error and does nothing, as a real
backend refuses to issue a request past it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from ckptstore.backends.base import Capabilities, Chunk, ObjectAddress, ObjectInfo, PartialWrite
from ckptstore.deadline import current_deadline
from ckptstore.errors import ConfigError, NotFoundError, ObjectExistsError, PreconditionFailedError
from harness.scheduler import Effect, Effects, Scheduler, Stored

T = TypeVar("T")


class ScheduledBackend:
    """The whole Backend protocol over a dict, each call a scheduling point of ``scheduler``."""

    def __init__(self, scheduler: Scheduler, name: str = "store") -> None:
        self.scheduler = scheduler
        self.objects: dict[str, Stored] = {}
        """The content; the checker reads it directly, never through a call."""
        self.versions = 0
        """The last version token handed out (tokens are never reused)."""
        self._uri = f"explore://{name}"

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(atomic_create=True, atomic_swap=True, parallel_writes=1)

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        return self._call("read", path, lambda: (self._get(path).data[start:end], []))

    def read_into(self, path: str, out: memoryview) -> int:
        def apply() -> tuple[int, Effects]:
            data = self._get(path).data
            out[: min(len(out), len(data))] = data[: len(out)]
            return len(data), []

        return self._call("read_into", path, apply)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        size = self.read_into(path, out)
        on_chunk(out[: min(size, len(out))])
        return size

    @property
    def parallel_writes(self) -> int:
        return 1

    @property
    def sends_whole_up_to(self) -> int:
        return 0  # a write stores as it goes: a save compares with the previous step first

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        def apply() -> tuple[tuple[bytes, str], Effects]:
            found = self._get(path)
            return (found.data, f"v{found.version}"), []

        return self._call("read_versioned", path, apply)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        data = b"".join(bytes(c) for c in chunks)  # produced before the turn: local work
        return self._call("write", path, lambda: (len(data), [self._put(path, data)]))

    def create(self, path: str, data: bytes) -> None:
        def apply() -> tuple[None, Effects]:
            if path in self.objects:
                raise ObjectExistsError(f"{self._uri}/{path} already exists")
            return None, [self._put(path, data)]

        self._call("create", path, apply)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        def apply() -> tuple[str, Effects]:
            found = self.objects.get(path)
            if (f"v{found.version}" if found is not None else None) != expected:
                raise PreconditionFailedError(f"{self._uri}/{path} is not at {expected}")
            effect = self._put(path, data)
            return f"v{self.versions}", [effect]

        return self._call("swap", path, apply)

    def copy(self, src: str, dst: str) -> None:
        self._call("copy", (src, dst), lambda: (None, [self._put(dst, self._get(src).data)]))

    def address(self, path: str) -> ObjectAddress | None:
        return None  # no server-side copy across stores: replication streams

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        raise ConfigError(f"{self.uri}: no server-side copy in (address() is None)")

    def stat(self, path: str) -> ObjectInfo | None:
        def apply() -> tuple[ObjectInfo | None, Effects]:
            found = self.objects.get(path)
            return (ObjectInfo(path, len(found.data), found.mtime) if found else None), []

        return self._call("stat", path, apply)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        def apply() -> tuple[builtins.list[ObjectInfo], Effects]:
            found = sorted((p, o) for p, o in self.objects.items() if p.startswith(prefix))
            return [ObjectInfo(p, len(o.data), o.mtime) for p, o in found], []

        return iter(self._call("list", prefix, apply))  # a snapshot taken at the call

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = prefix if not prefix or prefix.endswith("/") else prefix + "/"

        def apply() -> tuple[builtins.list[str], Effects]:
            rests = (p[len(base) :] for p in self.objects if p.startswith(base))
            return sorted({r.split("/", 1)[0] for r in rests if "/" in r}), []

        return self._call("list_dirs", prefix, apply)

    def delete(self, paths: Sequence[str]) -> None:
        doomed = tuple(dict.fromkeys(paths))
        if not doomed:
            self.scheduler.ensure_alive()
            return

        def apply() -> tuple[None, Effects]:
            gone = [p for p in doomed if p in self.objects]
            return None, [Effect(p, self.objects.pop(p), None) for p in gone]

        self._call("delete", doomed, apply)

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        self.scheduler.ensure_alive()
        return []

    def abort(self, partial: PartialWrite) -> None:
        self.scheduler.ensure_alive()

    def close(self) -> None:
        """Nothing to release; the objects stay for the checks that follow a run."""

    def _call(
        self, op: str, path: str | tuple[str, ...], apply: Callable[[], tuple[T, Effects]]
    ) -> T:
        paths = path if isinstance(path, tuple) else (path,)

        def issued() -> tuple[T, Effects]:
            deadline = current_deadline()  # a request goes out only before the deadline in force
            if deadline is not None:
                deadline.check(f"{self._uri}/{paths[0]}", doing=op)
            return apply()

        return self.scheduler.call(op, paths, issued, self._uri)

    def _get(self, path: str) -> Stored:
        found = self.objects.get(path)
        if found is None:
            raise NotFoundError(f"{self._uri}/{path} does not exist")
        return found

    def _put(self, path: str, data: bytes) -> Effect:
        self.versions += 1
        stored = Stored(bytes(data), self.versions, self.scheduler.clock())
        before, self.objects[path] = self.objects.get(path), stored
        return Effect(path, before, stored)
