"""Moving bytes to and from S3: one pool, one bound on requests in flight, one retry loop.

The backend (s3.py) decides what to send and translates errors; every request it makes goes
through :meth:`Transfers.call` (or the methods here that carry bodies), so through the one retry
loop (:mod:`.s3_retry`) and under the deadline in force (:mod:`ckptstore.deadline`). GETs are in
:mod:`.s3_download`, multipart uploads and copies in :mod:`.s3_multipart`.

Parallel requests are what make S3 fast (one stream per connection is slow). The pool has
``max_concurrency`` threads, and a semaphore shared by every transfer of the backend (single
PUTs included) keeps at most ``max_concurrency`` parts in flight however many files a save
writes at once, so its memory stays near ``part_size x max_concurrency`` (at most twice that
while several large files are being cut into parts at once) whatever the objects' sizes. Jobs
run in a copy of the caller's context (:func:`ckptstore.deadline.submit`), so they see its
deadline, and whoever waits for them waits no longer than that (:meth:`Transfers.wait`).

PUTs and upload parts carry a CRC32C (option ``checksums``), computed by :func:`crc32c_base64`
here rather than by the checkpoint layer's checksum engine: backends know nothing of how
checkpoints are verified. Bodies above :data:`SMALL_BODY` go out through
:class:`~.s3_progress.ProgressBody`, which the progress watchdog counts.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import crc32c

from ckptstore.backends import s3_download
from ckptstore.backends.base import Chunk, chunk_size
from ckptstore.backends.s3_download import read_body_into
from ckptstore.backends.s3_helpers import mark_worker
from ckptstore.backends.s3_leftovers import Leftovers
from ckptstore.backends.s3_multipart import Multipart, PartJob, Upload
from ckptstore.backends.s3_options import (
    DEFAULT_RETRY_TIMEOUT,
    DEFAULT_STALL_TIMEOUT,
    MAX_SINGLE_PUT,
    S3Options,
    tail,
)
from ckptstore.backends.s3_progress import Meter, Progress, ProgressBody
from ckptstore.backends.s3_rate import SendRate, rate_for
from ckptstore.backends.s3_retry import Retrier
from ckptstore.deadline import current_deadline

__all__ = ["Transfers", "crc32c_base64", "drain", "read_body_into", "split"]

logger = logging.getLogger(__name__)

SMALL_BODY = 64 << 10
"""PUT bodies up to this size go out as plain bytes: they fit the socket buffers, so a stall
shows as a read timeout, and they skip the ``Expect: 100-continue`` round trip that botocore
adds for file-like bodies."""
_PAGING = {
    "list_objects_v2": (("NextContinuationToken", "ContinuationToken"),),
    "list_multipart_uploads": (
        ("NextKeyMarker", "KeyMarker"),
        ("NextUploadIdMarker", "UploadIdMarker"),
    ),
}
"""For each listing: the answer's field that names the next page, and the parameter it goes in."""


Body = bytes | bytearray | list[Chunk]
"""A PUT's bytes: one buffer, or chunks laid end to end (sent where they lie)."""


def body_size(body: Body) -> int:
    if not isinstance(body, list):
        return len(body)
    return sum(map(chunk_size, body))


def crc32c_base64(data: Chunk | list[Chunk], known: int | None = None) -> str:
    """The form S3's ``ChecksumCRC32C`` header takes: the CRC32C, big-endian, in base64
    (``known``: the CRC32C of ``data``, computed as it streamed in, not computed again)."""
    if known is None:
        pieces = data if isinstance(data, list) else [data]
        known = functools.reduce(lambda crc, c: crc32c.crc32c(c, crc), pieces, 0)
    return base64.b64encode(known.to_bytes(4, "big")).decode()


def operation(method: str) -> str:
    """``upload_part`` -> ``UploadPart``: the name S3 documents, for messages."""
    return "".join(word[:1].upper() + word[1:] for word in method.split("_"))


class Transfers:
    """The backend's pool, its bound on parts in flight, its retries, and multipart uploads.

    Errors come out as botocore raised them (the backend translates them) except two: an
    object that needs more than ``s3_multipart.MAX_PARTS`` parts is a ConfigError, and a
    deadline that passed is its SaveTimeoutError or LoadTimeoutError.
    """

    @classmethod
    def for_options(cls, client: Any, bucket: str, opts: S3Options) -> Transfers:
        """The transfers of one backend, as its storage options say."""
        return cls(
            client,
            bucket,
            opts.max_concurrency,
            opts.max_attempts,
            checksums=opts.checksums,
            stall_timeout=opts.stall_timeout,
            retry_timeout=opts.retry_timeout,
        )

    def __init__(
        self,
        client: Any,
        bucket: str,
        max_concurrency: int,
        max_attempts: int | None = None,
        *,
        checksums: bool,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        rate: SendRate | None = None,
    ) -> None:
        self._client = client
        self.bucket = bucket
        self.limit = max_concurrency
        self.checksums = checksums
        self.stall_timeout = stall_timeout
        endpoint = str(getattr(getattr(client, "meta", None), "endpoint_url", "") or "AWS S3")
        self.retrier = Retrier(
            rate or rate_for(f"{endpoint}/{bucket}"),
            retry_timeout=retry_timeout,
            max_attempts=max_attempts,
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_concurrency)
        """Hold one (:meth:`slot`) for each request that carries a part or a single PUT."""
        self.leftovers = Leftovers()
        """Uploads a failure left open that the server would not abort (s3_leftovers.py)."""

    @property
    def multiparts(self) -> Multipart:
        """Multipart uploads and copies on this pool (made per use: no reference cycle)."""
        return Multipart(self)

    def pool(self) -> ThreadPoolExecutor:
        """One pool per backend: at most ``max_concurrency`` transfers run at once."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.limit, thread_name_prefix="ckptstore-s3", initializer=mark_worker
                )
            return self._pool

    def close(self) -> None:
        """Abort what is recorded (:meth:`settle`), then stop the pool and the helpers."""
        self.settle()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        self.retrier.close()

    def name(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- requests -------------------------------------------------------------------------

    def request(self, method: str, **params: Any) -> dict[str, Any]:
        """One attempt of a client method on this bucket (no retries: use :meth:`call`)."""
        resp: dict[str, Any] = getattr(self._client, method)(Bucket=self.bucket, **params)
        return resp

    def call(self, method: str, key: str, doing: str, **params: Any) -> dict[str, Any]:
        """A request, retried (:mod:`.s3_retry`); ``key`` and ``doing`` (a verb) are for the
        errors: the object or prefix it is about, and what was being done to it."""
        progress = Progress(self.name(key), doing)
        return self.retrier.call(
            operation(method), functools.partial(self.request, method, **params), progress
        )

    def pages(self, method: str, key: str, doing: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every page of a listing (``list_objects_v2``, ``list_multipart_uploads``), each
        page's request retried on its own."""
        while True:
            page = self.call(method, key, doing, **params)
            yield page
            following = {name: page[field] for field, name in _PAGING[method] if page.get(field)}
            if not page.get("IsTruncated") or not following:
                return
            params.update(following)

    def acquire(self, progress: Progress) -> None:
        """Take one of the ``max_concurrency`` slots, waiting no longer than the deadline."""
        deadline = current_deadline()
        if not self.slots.acquire(timeout=None if deadline is None else deadline.remaining()):
            raise progress.deadline_error(deadline) if deadline else AssertionError

    @contextlib.contextmanager
    def slot(self, progress: Progress) -> Iterator[None]:
        """Hold a slot (:meth:`acquire`) for the block."""
        self.acquire(progress)
        try:
            yield
        finally:
            self.slots.release()

    def wait(
        self, futures: set[Future[Any]], progress: Progress, return_when: str
    ) -> tuple[set[Future[Any]], set[Future[Any]]]:
        """``concurrent.futures.wait`` no longer than the deadline (then its error), raising
        the first failure among the finished."""
        deadline = current_deadline()
        timeout = None if deadline is None else deadline.remaining()
        done, pending = wait(futures, timeout=timeout, return_when=return_when)
        for future in done:
            if future.exception() is not None:
                future.result()
        met = not pending or (return_when == FIRST_COMPLETED and done)
        if not met and deadline is not None and deadline.expired:
            raise progress.deadline_error(deadline)
        return done, pending

    # -- reads (s3_download) --------------------------------------------------------------

    def get(self, key: str, **extra: str) -> tuple[dict[str, Any], bytes]:
        return s3_download.get(self, key, extra)

    def get_into(self, key: str, out: memoryview, **extra: str) -> tuple[dict[str, Any], int]:
        return s3_download.get_into(self, key, out, extra)

    def read_into(self, key: str, out: memoryview, part_size: int) -> int:
        return s3_download.read_into(self, key, out, part_size)

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: str, body: Body, **extra: str) -> dict[str, Any]:
        """One PutObject (``extra``: its conditions, and its ``ChecksumCRC32C`` where the
        caller has it: :meth:`part_checksum`), carrying a CRC32C if checksums are on, retried.
        ``body``: bytes, or a list of chunks sent one after another where they lie. The
        caller holds a slot where the PUT carries a part's worth of bytes."""
        if self.checksums:
            extra = {"ChecksumAlgorithm": "CRC32C", **extra}
            if "ChecksumCRC32C" not in extra:
                extra |= self.part_checksum(body)
        progress = Progress(self.name(key), "write")

        def attempt() -> dict[str, Any]:
            progress.bytes_done = 0
            return self.request("put_object", Key=key, Body=self._body(body, progress), **extra)

        return self.retrier.call("PutObject", attempt, progress)

    def _body(self, data: Body, progress: Progress) -> Any:
        size = body_size(data)
        if size <= SMALL_BODY:
            return data if not isinstance(data, list) else b"".join(data)
        return ProgressBody(
            data, Meter(self.stall_timeout, size, progress.token, on_bytes=progress.add)
        )

    def part_checksum(self, data: Body, known: int | None = None) -> dict[str, str]:
        """``ChecksumCRC32C`` of a part or PUT body (``known``: its CRC32C, if computed
        already), if checksums are on."""
        return {"ChecksumCRC32C": crc32c_base64(data, known)} if self.checksums else {}

    # -- multipart (s3_multipart) ---------------------------------------------------------

    def upload(self, key: str, parts: Iterator[bytearray], *, part_size: int) -> int:
        return self.multiparts.upload(key, parts, part_size=part_size)

    def copy(
        self, source: str, target: str, size: int, *, part_size: int, bucket: str | None = None
    ) -> None:
        """Server-side copy of ``source`` in ``bucket`` (default: this one) to ``target`` here:
        one CopyObject (holding a slot, like a PUT), or parallel UploadPartCopy parts above
        5 GiB, where CopyObject stops. The copy gets a CRC32C if checksums are on."""
        origin = {"Bucket": bucket or self.bucket, "Key": source}
        if size > MAX_SINGLE_PUT:
            self.multiparts.copy(origin, target, size, part_size=part_size)
            return
        extra = {"ChecksumAlgorithm": "CRC32C"} if self.checksums else {}
        with self.slot(Progress(self.name(target), "copy")):
            self.call("copy_object", target, "copy", Key=target, CopySource=origin, **extra)

    def multipart(self, key: str, jobs: Iterable[PartJob], *, part_size: int, **start: str) -> int:
        return self.multiparts.run(key, jobs, part_size=part_size, start=start)

    def unfinished(self, prefix: str) -> list[Upload]:
        return self.multiparts.unfinished(prefix)

    def settle(self) -> None:
        """Abort the uploads recorded when the server did not answer (cheap when none is)."""
        if self.leftovers:
            self.multiparts.settle()

    def abort(self, key: str, upload_id: str) -> None:
        self.multiparts.abort(key, upload_id)


def split(chunks: Iterable[Chunk], part_size: int) -> Iterator[bytearray]:
    """Re-cut chunks into ``part_size`` pieces, copying each byte once; the last piece may be
    shorter, or longer by up to ``s3_options.tail`` bytes (a shard's header goes up with its
    tensors, not as a part of its own). Bytes past a part are kept until more arrive, then
    moved into the next piece (a second copy of at most ``tail`` bytes per part)."""
    limit = part_size + tail(part_size)
    buf = bytearray()
    for chunk in chunks:
        view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        offset, total = 0, view.nbytes
        while offset < total:
            if len(buf) == limit:  # a part and its tail, and more follows: cut the part
                rest = buf[part_size:]
                del buf[part_size:]  # shrinks in place
                yield buf
                buf = rest
            take = min(limit - len(buf), total - offset)
            buf += view[offset : offset + take]
            offset += take
    if buf:
        yield buf


def drain(queue: deque[bytearray]) -> Iterator[bytearray]:
    """Yield and forget: the caller's deque must not keep uploaded parts alive."""
    while queue:
        yield queue.popleft()
