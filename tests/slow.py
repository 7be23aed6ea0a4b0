"""A backend whose reads trickle, for the deadline tests: each read waits ``pause`` seconds
first (never past the deadline in force, as the S3 backend's requests give up at it), then
fails with the deadline's error if it has passed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from ckptstore.backends.base import Backend, Chunk
from ckptstore.backends.proxy import BackendProxy
from ckptstore.deadline import Deadline, current_deadline


class Slow(BackendProxy):
    """Writes and reads that trickle: a chunk every ``pause`` seconds. ``slows`` picks the
    reads that wait (by path; default all); ``deadlines`` records the deadline each of them
    ran under, ``unbounded`` the paths of reads (slowed or not) with no deadline in force."""

    def __init__(
        self, inner: Backend, pause: float, *, slows: Callable[[str], bool] = lambda _: True
    ) -> None:
        super().__init__(inner)
        self.pause = pause
        self.slows = slows
        self.deadlines: list[Deadline] = []
        self.unbounded: list[str] = []

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        def trickle() -> Iterator[Chunk]:
            for chunk in chunks:
                time.sleep(self.pause)
                yield chunk

        return super().write(path, trickle())

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._wait(path)
        return super().read(path, start, end)

    def read_into(self, path: str, out: memoryview) -> int:
        self._wait(path)
        return super().read_into(path, out)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        self._wait(path)
        return super().read_into_chunks(path, out, on_chunk)

    def _wait(self, path: str) -> None:
        """Pause (until the deadline at most), then give up if the deadline in force has
        passed, as the S3 backend's requests do (a local disk's read cannot be cut short)."""
        deadline = current_deadline()
        if deadline is None:
            self.unbounded.append(path)
        if not self.slows(path):
            return
        time.sleep(self.pause if deadline is None else deadline.cap(self.pause))
        if deadline is not None:
            self.deadlines.append(deadline)
            deadline.check(f"{self.uri}/{path}", doing="read")
