"""The progress watchdog: a request that stops moving bytes is given up and retried.

botocore's socket timeouts (connect and read, both at most ``stall_timeout``: s3_options) bound
one blocking socket call, so a server that accepts a connection and never answers, or stops
reading a body, makes that call fail within ``stall_timeout``. They cannot see a trickle: a
server that sends or reads a few bytes a second keeps every call short and a request alive for
hours. So the bytes a request moves are counted where they pass through our code (an upload
body, which urllib3 reads in 16 KiB blocks as it sends them; a download body, which we read in
pieces), and a request that moves fewer than :data:`MIN_PROGRESS` bytes (or what is left of
it) in a window of ``stall_timeout`` seconds raises :class:`Stalled`, a transient error the
retry loop (:mod:`.s3_retry`) retries; a download resumes where it stopped.

The counting points are also where a request learns that it was given up from outside (its
upload was aborted, its deadline passed while its caller stopped waiting): it raises
:class:`Cancelled` at the next block, so an abandoned request stops within one block or one
socket timeout instead of running on. Both exceptions reach botocore from inside urllib3, which
wraps them (``HTTPClientError(error=...)``); :func:`cause` unwraps them.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Sequence

from ckptstore.backends.base import Chunk
from ckptstore.deadline import Deadline, current_deadline

MIN_PROGRESS = 64 << 10
"""Bytes a request must move per ``stall_timeout`` window (or all it has left): with the default
60 s, about 1 KiB/s, below any working link; a trickle under it is a stall."""


class Stalled(Exception):
    """A request moved fewer than its due bytes in one ``stall_timeout`` window."""

    def __init__(self, moved: int, need: int, window: float) -> None:
        super().__init__(
            f"stalled: {moved} bytes moved in {window:g} s, fewer than the {need} due "
            "(stall_timeout)"
        )
        self.moved, self.need, self.window = moved, need, window


class Cancelled(Exception):
    """The request was given up from outside: its upload aborted, or its deadline passed."""


class CancelToken:
    """Shared by the requests of one file's transfer: cancelling it stops every one of them at
    its next block, and wakes any of them sleeping in a backoff."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def cancel(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` unless cancelled first (then raise :class:`Cancelled`)."""
        if (seconds > 0 and self._event.wait(seconds)) or self._event.is_set():
            raise Cancelled(self.reason)


class Progress:
    """What one file's transfer has done so far, for the errors that end it: its URI, the
    verb, the multipart upload's id (and what became of it), the bytes done, the last
    retryable error, and the token that cancels its requests. Updated by several threads
    (parts); each field is one store."""

    def __init__(self, target: str, doing: str) -> None:
        self.target = target
        self.doing = doing
        self.upload_id: str | None = None
        self.upload_left: str | None = None
        """What became of the upload, when it could not be aborted (s3_multipart.py)."""
        self.bytes_done = 0
        self.last_error: str | None = None
        self.token = CancelToken()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_done += n

    def deadline_error(self, deadline: Deadline) -> Exception:
        return deadline.error(
            self.target,
            doing=self.doing,
            upload_id=self.upload_id,
            bytes_done=self.bytes_done,
            last_error=self.last_error,
            upload_left=self.upload_left,
        )


class Meter:
    """Counts one attempt's bytes in windows of ``stall_timeout`` seconds (the watchdog).

    ``size`` is what the attempt has to move in the direction counted; ``on_bytes`` hears
    every count (the transfer's ``bytes_done``).
    """

    def __init__(
        self,
        stall_timeout: float,
        size: int,
        token: CancelToken,
        *,
        on_bytes: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_timeout = stall_timeout
        self.size = size
        self.total = 0
        self._token = token
        self._deadline = current_deadline()
        self._on_bytes = on_bytes
        self._clock = clock
        self._window_start = clock()
        self._window_bytes = 0
        self._left_at_start = size

    def moved(self, n: int) -> None:
        """``n`` more bytes moved; raises Cancelled or Stalled when the attempt must end."""
        if self._token.cancelled:
            raise Cancelled(self._token.reason)
        if self._deadline is not None and self._deadline.expired:
            raise Cancelled("the deadline passed")
        self.total += n
        self._window_bytes += n
        if self._on_bytes is not None and n:
            self._on_bytes(n)
        now = self._clock()
        window = now - self._window_start
        if window >= self.stall_timeout:
            need = min(MIN_PROGRESS, self._left_at_start)
            if self._window_bytes < need:
                raise Stalled(self._window_bytes, need, round(window, 2))
            self._window_start, self._window_bytes = now, 0
            self._left_at_start = max(0, self.size - self.total)


class ProgressBody:
    """An upload body botocore and urllib3 read as a file, counting every block they send.

    urllib3 reads the next block only once the previous one was handed to the socket, so the
    count (one block behind) is what the server accepted, give or take the socket buffers.
    Reads return at most the size asked, as files do, but as read-only views of the body, not
    copies: botocore reads it in 128 KiB blocks (to hash it for the signature over plain HTTP,
    then to send it), and a copy per block was a second copy of every byte a save uploads.
    The body may be one buffer or several laid end to end (a shard's header and its tensors,
    where they lie: ``s3_write``); a read then stops at the end of a segment.
    """

    def __init__(self, data: Chunk | Sequence[Chunk], meter: Meter) -> None:
        pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        self._segments = [memoryview(p).cast("B").toreadonly() for p in pieces]
        self._starts = list(itertools.accumulate((len(s) for s in self._segments), initial=0))
        self._meter = meter
        self._pos = 0
        self._pending = 0

    def __len__(self) -> int:
        return self._starts[-1]

    def read(self, size: int = -1) -> memoryview:
        self._meter.moved(self._pending)  # the previous block was sent
        index = bisect.bisect_right(self._starts, self._pos) - 1
        if index >= len(self._segments):
            self._pending = 0
            return memoryview(b"")
        segment, offset = self._segments[index], self._pos - self._starts[index]
        if size is None or size < 0:  # the rest, whole (a copy only where it spans segments)
            rest = [segment[offset:], *self._segments[index + 1 :]]
            block = rest[0] if len(rest) == 1 else memoryview(b"".join(rest))
        else:
            block = segment[offset : min(len(segment), offset + size)]
        self._pending = len(block)
        self._pos += len(block)
        return block

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self)}[whence]
        self._pos = max(0, min(len(self), base + offset))
        self._pending = 0
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def cause(e: BaseException) -> BaseException:
    """The Stalled or Cancelled that botocore wrapped (``HTTPClientError(error=...)``), or
    ``e`` itself."""
    kwargs = getattr(e, "kwargs", None)
    inner = kwargs.get("error") if isinstance(kwargs, dict) else None
    for candidate in (inner, e.__context__):
        if isinstance(candidate, (Stalled, Cancelled)):
            return candidate
    return e
