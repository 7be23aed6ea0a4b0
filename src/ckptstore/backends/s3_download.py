"""GETs: whole objects, or ranges read in parallel straight into one buffer, resumed when
their body breaks or stalls.

botocore reads a GET's body after its retry loop, and a body can break after its headers (a
reset, a truncation) or stall (the watchdog, :mod:`.s3_progress`). Such a read is resumed,
not restarted: the next attempt asks for the bytes from the last one received on (``Range``),
with ``If-Match`` on the first answer's ETag, so the pieces are of one version of the object
(an object replaced in between is read again from the start). Attempts run through the
backend's retry loop (:mod:`.s3_retry`), under its time budget and the deadline in force.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from typing import Any, Protocol

import urllib3
from botocore.exceptions import ClientError, IncompleteReadError

from ckptstore.backends.s3_errors import code_of, is_refused
from ckptstore.backends.s3_options import tail
from ckptstore.backends.s3_progress import Meter, Progress
from ckptstore.backends.s3_retry import Retrier
from ckptstore.deadline import submit

READ_PIECE = 4 << 20
"""Bytes per ``readinto`` call on a GET's body, at most (:func:`read_body_into`): small
enough that urllib3's temporary copy of each piece stays in the CPU's cache."""
FIRST_PIECE = 64 << 10
MIN_PIECE = 16 << 10


class GetRequests(Protocol):
    """What a GET needs of the backend's :class:`~.s3_transfer.Transfers` (which calls this
    module, so the type is spelled out here): single attempts, the retry loop around them, the
    pool for ranges and a wait bounded by the deadline."""

    retrier: Retrier
    stall_timeout: float

    def name(self, key: str) -> str: ...

    def request(self, method: str, **params: Any) -> dict[str, Any]: ...

    def pool(self) -> ThreadPoolExecutor: ...

    def wait(
        self, futures: set[Future[Any]], progress: Progress, return_when: str
    ) -> tuple[set[Future[Any]], set[Future[Any]]]: ...


def read_body_into(
    body: Any, out: memoryview, meter: Meter | None = None, length: int | None = None
) -> int:
    """Read a GetObject body into ``out``; returns the body's size (more than ``len(out)``
    if the server sent more: those bytes are read and dropped, for the caller to reject).

    ``StreamingBody.readinto`` (botocore >= 1.35) keeps botocore's content-length and
    checksum checks. Through urllib3 2.x it reads each call into a temporary ``bytes`` and
    copies that into place, so calls ask for at most :data:`READ_PIECE` bytes: the temporary
    then stays in the CPU's cache and reuses memory just freed, where ``read()`` allocated
    (and faulted in) a fresh buffer the size of the whole range. Bodies without ``readinto``
    are read whole and copied.

    With a ``meter`` (the watchdog), a piece must not hide a trickle: ``readinto`` returns
    only when its piece is full, so a server that slows from fast to a few bytes a second
    would keep a 4 MiB piece, and the watchdog, waiting for hours. So a body botocore does not
    checksum is read one socket read at a time: large pieces while data flows, every byte
    counted when it trickles; ``length`` (the answer's Content-Length) is then checked here,
    as botocore would. Where the response allows it, the socket reads land straight in
    ``out`` (:func:`_recv_into`); otherwise through urllib3's ``read1`` (:func:`_read1_into`),
    which hands over a new ``bytes`` per read, copied into place. A body botocore checksums
    (a whole object with a stored checksum: small JSON, in practice) keeps ``readinto``, in
    pieces sized to what arrives in an eighth of ``stall_timeout``.
    """
    raw = _raw_stream(body) if meter is not None else None
    if raw is not None and meter is not None:
        if _direct(raw):
            return _recv_into(raw, out, meter, length)
        return _read1_into(raw.read1, out, meter, length)
    readinto = getattr(body, "readinto", None)
    if readinto is None:
        data = body.read()
        out[: len(data)] = data[: len(out)]
        if meter is not None:
            meter.moved(min(len(data), len(out)))
        return len(data)
    filled = 0
    piece = READ_PIECE if meter is None else min(READ_PIECE, FIRST_PIECE)
    while filled < len(out):
        started = time.monotonic()
        n = readinto(out[filled : filled + piece])
        if not n:
            return filled  # a short body: botocore checked its length on this empty read
        filled += n
        if meter is not None:
            meter.moved(n)
            rate = n / max(time.monotonic() - started, 1e-6)
            piece = int(min(READ_PIECE, max(MIN_PIECE, rate * meter.stall_timeout / 8)))
    rest: bytes = body.read()  # empty, normally; the whole-body read runs botocore's checks
    return filled + len(rest)


def _raw_stream(body: Any) -> Any:
    """urllib3's response under a botocore body that checks no checksum and has ``read1``,
    else None. (``_raw_stream`` is botocore's, as its own ``set_socket_timeout`` uses it.)"""
    raw = getattr(body, "_raw_stream", None)
    if getattr(body, "_checksum", None) is not None or not callable(getattr(raw, "read1", None)):
        return None
    return raw


def _direct(raw: Any) -> bool:
    """Whether :func:`_recv_into` can read ``raw``: urllib3's response over http.client's
    (``_fp``), with a Content-Length, not chunked, not read from yet."""
    resp = getattr(raw, "_fp", None)
    return (
        isinstance(resp, http.client.HTTPResponse)
        and isinstance(resp.length, int)
        and not resp.chunked
        and callable(getattr(resp.fp, "readinto1", None))
        and getattr(raw, "_fp_bytes_read", None) == 0
        and callable(getattr(raw, "release_conn", None))
    )


def _recv_into(raw: Any, out: memoryview, meter: Meter, length: int | None) -> int:
    """:func:`read_body_into` with each socket read landing in ``out`` itself.

    urllib3 reads a body into a new ``bytes`` per call, which a caller then copies into
    place: a sixth of a load's CPU on loopback, and memory faulted in for every piece. So
    the body is read from http.client's buffered socket file with ``readinto1`` (one socket
    read, straight into ``out`` past the few bytes buffered with the headers), keeping
    http.client's count of what is left as its own reads do. At the end the response is
    closed and its connection given back to urllib3's pool for the next request; on any
    error the connection is closed instead, and a socket error is raised as urllib3 would
    raise it (the retry loop knows those: a timeout, a broken body)."""
    resp = raw._fp
    filled = extra = 0
    try:
        while resp.length:
            if filled < len(out):
                n = resp.fp.readinto1(out[filled : filled + min(READ_PIECE, resp.length)])
            else:  # more than asked for: read, counted and dropped, for the caller
                n = len(resp.fp.read1(min(READ_PIECE, resp.length)))
            if not n:
                break  # the connection closed early: cut short, below
            resp.length -= n
            if filled < len(out):
                filled += n
                meter.moved(n)
            else:
                extra += n
    except (OSError, http.client.HTTPException) as e:
        raw.close()
        if isinstance(e, TimeoutError):
            raise urllib3.exceptions.ReadTimeoutError(raw._pool, None, "Read timed out.") from e
        raise urllib3.exceptions.ProtocolError(f"Connection broken: {e!r}", e) from e
    except BaseException:
        raw.close()
        raise
    if resp.length:
        raw.close()
    else:
        resp.close()  # http.client's response ends; its socket stays with the connection
        raw.release_conn()
    if length is not None and filled + extra != length:
        raise IncompleteReadError(actual_bytes=filled + extra, expected_bytes=length)
    return filled + extra


def _read1_into(
    read1: Callable[[int], bytes], out: memoryview, meter: Meter, length: int | None
) -> int:
    """:func:`read_body_into` through ``read1``. botocore has urllib3 leave the length to it,
    so a body cut short is caught here (IncompleteReadError, which the retry loop resumes)."""
    filled = extra = 0
    while filled < len(out):
        data = read1(min(READ_PIECE, len(out) - filled))
        if not data:
            break
        out[filled : filled + len(data)] = data
        filled += len(data)
        meter.moved(len(data))
    else:
        while data := read1(READ_PIECE):  # more than asked for: counted, for the caller
            extra += len(data)
    if length is not None and filled + extra != length:
        raise IncompleteReadError(actual_bytes=filled + extra, expected_bytes=length)
    return filled + extra


class _Resumable:
    """One GET, possibly over several attempts: each asks for what the last one missed."""

    def __init__(
        self,
        moves: GetRequests,
        key: str,
        progress: Progress,
        buffer: Callable[[dict[str, Any]], memoryview],
        extra: dict[str, str],
    ) -> None:
        self.moves, self.key, self.progress = moves, key, progress
        self.buffer = buffer
        self.extra = extra
        first, _, last = extra.get("Range", "bytes=0-").removeprefix("bytes=").partition("-")
        self.first, self.last = int(first or 0), last
        self.response: dict[str, Any] | None = None
        self.out: memoryview | None = None
        self.got = 0

    def attempt(self) -> tuple[dict[str, Any], int]:
        """One GET from the first byte not yet received; returns the first answer and the
        body's total size."""
        if self.response is not None and self.out is not None and self.got >= len(self.out) > 0:
            return self.response, self.got  # all in: what broke was the check after the end
        params = dict(self.extra)
        if self.response is not None:  # a resumed read: the rest, of the same version
            params["Range"] = f"bytes={self.first + self.got}-{self.last}"
            params["IfMatch"] = str(self.response["ETag"])
        try:
            resp = self.moves.request("get_object", Key=self.key, **params)
        except ClientError as e:
            if self.response is None or not is_refused(e):
                raise
            self.response, self.out, self.got = None, None, 0  # replaced: from the start
            return self.attempt()
        if self.response is None or self.out is None:
            self.response, self.out = resp, self.buffer(resp)
        meter = Meter(
            self.moves.stall_timeout,
            len(self.out) - self.got,
            self.progress.token,
            on_bytes=self.progress.add,
        )
        length = resp.get("ContentLength")
        try:
            body = resp["Body"]
            size = self.got + read_body_into(body, self.out[self.got :], meter, length)
        finally:
            self.got += meter.total
        return self.response, size


def get(moves: GetRequests, key: str, extra: dict[str, str]) -> tuple[dict[str, Any], bytes]:
    """GetObject (``extra``: a ``Range``) and its whole body."""
    buffers: list[bytearray] = []

    def allocate(resp: dict[str, Any]) -> memoryview:
        buffers[:] = [bytearray(int(resp.get("ContentLength", 0) or 0))]
        return memoryview(buffers[0])

    read = _Resumable(moves, key, Progress(moves.name(key), "read"), allocate, extra)
    resp, size = moves.retrier.call("GetObject", read.attempt, read.progress)
    data = buffers[0] if buffers else bytearray()
    return resp, bytes(data) if size == len(data) else bytes(memoryview(data)[:size])


def get_into(
    moves: GetRequests,
    key: str,
    out: memoryview,
    extra: dict[str, str],
    progress: Progress | None = None,
) -> tuple[dict[str, Any], int]:
    """GetObject with its body read straight into ``out`` (:func:`read_body_into`); returns
    the (first) response and the body's size. ``progress``: shared by the ranges of a file."""
    progress = progress or Progress(moves.name(key), "read")
    read = _Resumable(moves, key, progress, lambda _: out, extra)
    return moves.retrier.call("GetObject", read.attempt, progress)


def ranges_of(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[first, end)`` ranges of ``part_size`` bytes covering ``size``; a last range of at
    most ``s3_options.tail`` bytes rides with the one before it (a shard's header)."""
    ranges = [(a, min(a + part_size, size)) for a in range(0, size, part_size)] or [(0, 0)]
    if len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] <= tail(part_size):
        (first, _), (_, end) = ranges[-2], ranges.pop()
        ranges[-1] = (first, end)
    return ranges


def read_into(moves: GetRequests, key: str, out: memoryview, part_size: int) -> int:
    """Ranged GETs of ``part_size`` bytes, ``max_concurrency`` at a time, straight into
    ``out``: a large file downloads over many connections, like the upload. Returns the
    object's size, which may differ from ``len(out)``."""
    ranges = ranges_of(len(out), part_size)
    progress = Progress(moves.name(key), "read")

    def fetch(first: int, end: int) -> int:
        extra = {"Range": f"bytes={first}-{end - 1}"} if end > first else {}
        try:
            resp, size = get_into(moves, key, out[first:end], extra, progress)
        except ClientError as e:
            if code_of(e) == "InvalidRange":  # object shorter than expected
                return int(e.response.get("Error", {}).get("ActualObjectSize", 0) or 0)
            raise
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        return int(total) if total.isdigit() else int(resp.get("ContentLength", size))

    if len(ranges) == 1:
        return fetch(*ranges[0])
    pool = moves.pool()
    futures = {submit(pool, fetch, *r) for r in ranges}
    try:
        moves.wait(futures, progress, FIRST_EXCEPTION)  # raises the first failure
        return max(f.result() for f in futures)
    except BaseException:
        progress.token.cancel("another range of the file failed")
        for future in futures:
            future.cancel()
        raise
