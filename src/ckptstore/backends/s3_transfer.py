"""Moving bytes to and from S3: one pool, one bound on requests in flight, the one multipart
skeleton that uploads and server-side copies share, the unfinished uploads it can leave, and
GETs (ranged, in parallel, into one buffer) whose body is read again when it breaks. The
backend (s3.py) decides what to send and translates errors; requests that carry an object's
bytes are made here.

Parallel requests are what make S3 fast (one stream per connection is slow). The pool has
``max_concurrency`` threads, and a semaphore shared by every transfer of the backend (single
PUTs included) keeps at most ``max_concurrency`` parts in flight however many files a save
writes at once, so its memory stays near ``part_size x max_concurrency`` (at most twice that
while several large files are being cut into parts at once) whatever the objects' sizes.

A multipart operation starts an upload, sends its parts, and completes the upload with the
parts in order. On any exception (Ctrl-C included) it lets the running parts finish (a part
landing after the abort would revive the upload) and then aborts, because S3 never shows a
partial object but bills and keeps the parts of an unfinished upload until someone aborts it;
``gc`` finds the strays a killed process left behind (:meth:`Transfers.unfinished`).

botocore retries a request that fails, but reads a GET's body (the object, or an error's XML)
after its retry loop: :meth:`Transfers.get` reads a body that breaks after the headers (reset,
truncated) again, under the same ``max_attempts`` bound.

PUTs and upload parts carry a CRC32C (option ``checksums``), computed by :func:`crc32c_base64`
here rather than by the checkpoint layer's checksum engine: backends know nothing of how
checkpoints are verified.
"""

from __future__ import annotations

import base64
import functools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import crc32c
import urllib3
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from ckptstore.backends.base import Chunk
from ckptstore.backends.s3_errors import code_of, is_not_found
from ckptstore.backends.s3_options import MAX_PART_SIZE, MAX_SINGLE_PUT
from ckptstore.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000
Part = dict[str, Any]
"""One entry of CompleteMultipartUpload's part list: ``PartNumber``, ``ETag``, checksums."""
PartJob = Callable[[str, int], Part]
"""Sends part ``number`` of upload ``upload_id`` (the arguments, in that order)."""
Upload = tuple[str, str, "float | None"]
"""An unfinished upload: its key, its upload id, and when it started."""
T = TypeVar("T")
READ_PIECE = 4 << 20
"""Bytes per ``readinto`` call on a GET's body (:func:`read_body_into`): small enough that
urllib3's temporary copy of each piece stays in the CPU's cache."""
_BROKEN_BODY = (
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
)
"""A GetObject body that broke after its headers arrived: read it again."""


def read_body_into(body: Any, out: memoryview) -> int:
    """Read a GetObject body into ``out``; returns the body's size (more than ``len(out)``
    if the server sent more: those bytes are read and dropped, for the caller to reject).

    ``StreamingBody.readinto`` (botocore >= 1.35) keeps botocore's content-length and
    checksum checks. Through urllib3 2.x it still reads each call into a temporary ``bytes``
    and copies that into place, so the calls ask for :data:`READ_PIECE` bytes: the temporary
    then stays in the CPU's cache for the copy and reuses memory just freed, where
    ``read()`` allocated (and faulted in) a fresh buffer the size of the whole range.
    Bodies without ``readinto`` are read whole and copied.
    """
    readinto = getattr(body, "readinto", None)
    if readinto is None:
        data = body.read()
        out[: len(data)] = data[: len(out)]
        return len(data)
    filled = 0
    while filled < len(out):
        n = readinto(out[filled : filled + READ_PIECE])
        if not n:
            return filled  # a short body: botocore checked its length on this empty read
        filled += n
    rest: bytes = body.read()  # empty, normally; the whole-body read runs botocore's checks
    return filled + len(rest)


def crc32c_base64(data: Chunk) -> str:
    """The form S3's ``ChecksumCRC32C`` header takes: the CRC32C, big-endian, in base64."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


class Transfers:
    """The backend's pool, its bound on parts in flight, and multipart uploads on them.

    Errors come out as botocore raised them (the backend translates them) except one: an
    object that needs more than :data:`MAX_PARTS` parts is a ConfigError.
    """

    def __init__(
        self, client: Any, bucket: str, max_concurrency: int, max_attempts: int, *, checksums: bool
    ) -> None:
        self._client = client
        self._bucket = bucket
        self._limit = max_concurrency
        self._attempts = max_attempts
        self._checksums = checksums
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_concurrency)
        """Hold one for each request that carries a part or a single PUT's body."""

    def pool(self) -> ThreadPoolExecutor:
        """One pool per backend: at most ``max_concurrency`` transfers run at once."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._limit, thread_name_prefix="ckptstore-s3")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def get(self, key: str, **extra: str) -> tuple[dict[str, Any], bytes]:
        """GetObject and its whole body; a body that breaks is read again."""

        def body(resp: dict[str, Any]) -> bytes:
            data: bytes = resp["Body"].read()
            return data

        return self._retrying_body(key, body, **extra)

    def get_into(self, key: str, out: memoryview, **extra: str) -> tuple[dict[str, Any], int]:
        """GetObject with its body read straight into ``out`` (:func:`read_body_into`); returns
        the response and the body's size. A body that breaks is read again, over the same
        bytes of ``out``."""
        return self._retrying_body(key, lambda resp: read_body_into(resp["Body"], out), **extra)

    def _retrying_body(
        self, key: str, body: Callable[[dict[str, Any]], T], **extra: str
    ) -> tuple[dict[str, Any], T]:
        """GetObject and ``body(response)``, again while the body breaks after the headers."""
        for attempt in range(1, self._attempts + 1):
            try:
                resp: dict[str, Any] = self._client.get_object(
                    Bucket=self._bucket, Key=key, **extra
                )
                return resp, body(resp)
            except _BROKEN_BODY as e:
                if attempt >= self._attempts:
                    if isinstance(e, BotoCoreError):
                        raise
                    raise ResponseStreamingError(error=e) from e  # urllib3's, untranslated
                logger.debug("body of %s broke (%s); reading it again", self._name(key), e)
                time.sleep(random.uniform(0, min(1.0, 0.05 * 2**attempt)))
        raise AssertionError("unreachable: max_attempts >= 1")

    def read_into(self, key: str, out: memoryview, part_size: int) -> int:
        """Ranged GETs of ``part_size`` bytes, ``max_concurrency`` at a time, straight into
        ``out``: a large file downloads over many connections, like the upload. Returns the
        object's size, which may differ from ``len(out)``."""
        step = part_size
        ranges = [(a, min(a + step, len(out))) for a in range(0, len(out), step)] or [(0, 0)]

        def fetch(first: int, end: int) -> int:
            extra = {"Range": f"bytes={first}-{end - 1}"} if end > first else {}
            try:
                resp, size = self.get_into(key, out[first:end], **extra)
            except ClientError as e:
                if code_of(e) == "InvalidRange":  # object shorter than expected
                    return int(e.response.get("Error", {}).get("ActualObjectSize", 0) or 0)
                raise
            total = str(resp.get("ContentRange", "")).rpartition("/")[2]
            return int(total) if total.isdigit() else int(resp.get("ContentLength", size))

        if len(ranges) == 1:
            return fetch(*ranges[0])
        sizes = list(self.pool().map(lambda r: fetch(*r), ranges))
        return max(sizes)

    def put(self, key: str, body: bytes | bytearray, **extra: str) -> dict[str, Any]:
        """One PutObject (``extra``: its conditions), carrying a CRC32C if checksums are on.
        The caller holds a slot where the PUT carries a part's worth of bytes."""
        if self._checksums:
            extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": crc32c_base64(body), **extra}
        resp: dict[str, Any] = self._client.put_object(
            Bucket=self._bucket, Key=key, Body=body, **extra
        )
        return resp

    def upload(self, key: str, parts: Iterator[bytearray], *, part_size: int) -> int:
        """A multipart upload of ``parts``, each with its CRC32C if checksums are on; returns
        the bytes uploaded."""
        size = 0

        def jobs() -> Iterator[functools.partial[Part]]:
            nonlocal size
            for part in parts:
                size += len(part)
                job = functools.partial(self._upload_part, key, part)
                del part  # only the job holds the part, and only until it is uploaded
                yield job
                del job

        extra = {"ChecksumAlgorithm": "CRC32C"} if self._checksums else {}
        self.multipart(key, jobs(), part_size=part_size, **extra)
        return size

    def copy(
        self, source: str, target: str, size: int, *, part_size: int, bucket: str | None = None
    ) -> None:
        """Server-side copy of ``source`` in ``bucket`` (default: this one) to ``target`` here:
        one CopyObject (holding a slot, like a PUT), or parallel UploadPartCopy parts above
        5 GiB, where CopyObject stops. The copy gets a CRC32C if checksums are on."""
        origin = {"Bucket": bucket or self._bucket, "Key": source}
        if size <= MAX_SINGLE_PUT:
            extra = {"ChecksumAlgorithm": "CRC32C"} if self._checksums else {}
            with self.slots:
                self._client.copy_object(
                    Bucket=self._bucket, Key=target, CopySource=origin, **extra
                )
            return
        step = max(part_size, -(-size // MAX_PARTS))
        jobs = (
            functools.partial(
                self._copy_part, origin, target, f"bytes={a}-{min(a + step, size) - 1}"
            )
            for a in range(0, size, step)
        )
        self.multipart(target, jobs, part_size=step)

    def multipart(self, key: str, jobs: Iterable[PartJob], *, part_size: int, **start: str) -> int:
        """Start an upload of ``key`` (``start``: extra CreateMultipartUpload parameters), run
        ``jobs`` as parts 1, 2, ... on the pool, complete it; returns the number of parts.

        ``jobs`` is consumed lazily, one job per free slot, so a job may hold its part's bytes.
        """
        resp = self._client.create_multipart_upload(Bucket=self._bucket, Key=key, **start)
        upload_id = str(resp["UploadId"])
        logger.debug("multipart upload %s of %s started", upload_id, self._name(key))
        pool = self.pool()
        inflight: set[Future[Part]] = set()
        done: list[Part] = []
        try:
            for number, job in enumerate(jobs, start=1):
                if number > MAX_PARTS:
                    raise ConfigError(
                        f"{self._name(key)} needs more than {MAX_PARTS} parts of {part_size} "
                        f"bytes; raise the storage option part_size (up to {MAX_PART_SIZE}) "
                        "for objects this large",
                        uri=self._name(key),
                    )
                while len(inflight) >= self._limit:  # bounded memory: wait for a free slot
                    finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                    done.extend(f.result() for f in finished)
                self.slots.acquire()  # shared with the other files being written
                try:
                    future = pool.submit(job, upload_id, number)
                except BaseException:
                    self.slots.release()
                    raise
                future.add_done_callback(lambda _: self.slots.release())
                inflight.add(future)
                del job  # the future holds the part now, and only while it runs
            finished, inflight = wait(inflight)
            done.extend(f.result() for f in finished)
            done.sort(key=lambda p: int(p["PartNumber"]))
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
            )
        except BaseException:
            self._abort_after_failure(key, upload_id, inflight)
            raise
        logger.debug("multipart upload of %s done: %d parts", self._name(key), len(done))
        return len(done)

    def unfinished(self, prefix: str) -> list[Upload]:
        """Every unfinished multipart upload whose key starts with ``prefix``."""
        found: list[Upload] = []
        paginator = self._client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self._bucket, Prefix=prefix):
            for up in page.get("Uploads", ()):
                started = up.get("Initiated")
                found.append(
                    (str(up["Key"]), str(up["UploadId"]), started.timestamp() if started else None)
                )
        return found

    def abort(self, key: str, upload_id: str) -> None:
        """Abort an unfinished upload; one that is already gone is not an error."""
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
        except ClientError as e:
            if not is_not_found(e):  # NoSuchUpload
                raise

    def _upload_part(self, key: str, data: bytearray, upload_id: str, number: int) -> Part:
        entry: Part = {"PartNumber": number}
        extra: dict[str, str] = {}
        if self._checksums:
            entry["ChecksumCRC32C"] = crc32c_base64(data)
            extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": entry["ChecksumCRC32C"]}
        resp = self._client.upload_part(
            Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, **extra
        )
        entry["ETag"] = resp["ETag"]
        return entry

    def _copy_part(
        self, origin: dict[str, str], target: str, byte_range: str, upload_id: str, n: int
    ) -> Part:
        out = self._client.upload_part_copy(
            Bucket=self._bucket,
            Key=target,
            UploadId=upload_id,
            PartNumber=n,
            CopySource=origin,
            CopySourceRange=byte_range,
        )
        return {"PartNumber": n, "ETag": out["CopyPartResult"]["ETag"]}

    def _abort_after_failure(self, key: str, upload_id: str, inflight: set[Future[Part]]) -> None:
        """Let running parts finish, then abort. The caller re-raises the original error, so a
        failed abort is only logged."""
        for future in inflight:
            future.cancel()
        wait(inflight)
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
            logger.debug("aborted multipart upload %s of %s", upload_id, self._name(key))
        except Exception as e:
            logger.warning(
                "could not abort multipart upload %s of %s (%s); `ckptstore gc` or an "
                "AbortIncompleteMultipartUpload lifecycle rule removes it",
                upload_id,
                self._name(key),
                type(e).__name__,
            )

    def _name(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"


def split(chunks: Iterable[Chunk], part_size: int) -> Iterator[bytearray]:
    """Re-cut chunks into ``part_size`` pieces (the last may be shorter), copying each byte once."""
    buf = bytearray()
    for chunk in chunks:
        view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        offset, total = 0, view.nbytes
        while offset < total:
            take = min(part_size - len(buf), total - offset)
            buf += view[offset : offset + take]
            offset += take
            if len(buf) == part_size:
                yield buf
                buf = bytearray()
    if buf:
        yield buf


def drain(queue: deque[bytearray]) -> Iterator[bytearray]:
    """Yield and forget: the caller's deque must not keep uploaded parts alive."""
    while queue:
        yield queue.popleft()
