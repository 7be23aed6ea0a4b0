"""Moving bytes to and from S3: one pool, one bound on requests in flight, the one multipart
skeleton that uploads and server-side copies share, the unfinished uploads it can leave, and
GETs whose body is read again when it breaks.

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

Upload parts carry a CRC32C, computed by :func:`crc32c_base64` here rather than by the
checkpoint layer's checksum engine: backends know nothing of how checkpoints are verified.
"""

from __future__ import annotations

import base64
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

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
from ckptstore.backends.s3_errors import is_not_found
from ckptstore.backends.s3_options import MAX_PART_SIZE
from ckptstore.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000
Part = dict[str, Any]
"""One entry of CompleteMultipartUpload's part list: ``PartNumber``, ``ETag``, checksums."""
PartJob = Callable[[str, int], Part]
"""Sends part ``number`` of upload ``upload_id`` (the arguments, in that order)."""
Upload = tuple[str, str, "float | None"]
"""An unfinished upload: its key, its upload id, and when it started."""
_BROKEN_BODY = (
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
)
"""A GetObject body that broke after its headers arrived: read it again."""


def crc32c_base64(data: Chunk) -> str:
    """The form S3's ``ChecksumCRC32C`` header takes: the CRC32C, big-endian, in base64."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


class Transfers:
    """The backend's pool, its bound on parts in flight, and multipart uploads on them.

    Errors come out as botocore raised them (the backend translates them) except one: an
    object that needs more than :data:`MAX_PARTS` parts is a ConfigError.
    """

    def __init__(self, client: Any, bucket: str, max_concurrency: int, max_attempts: int) -> None:
        self._client = client
        self._bucket = bucket
        self._limit = max_concurrency
        self._attempts = max_attempts
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
        for attempt in range(1, self._attempts + 1):
            try:
                resp: dict[str, Any] = self._client.get_object(
                    Bucket=self._bucket, Key=key, **extra
                )
                data: bytes = resp["Body"].read()
                return resp, data
            except _BROKEN_BODY as e:
                if attempt >= self._attempts:
                    if isinstance(e, BotoCoreError):
                        raise
                    raise ResponseStreamingError(error=e) from e  # urllib3's, untranslated
                logger.debug("body of %s broke (%s); reading it again", self._name(key), e)
                time.sleep(random.uniform(0, min(1.0, 0.05 * 2**attempt)))
        raise AssertionError("unreachable: max_attempts >= 1")

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
                        "for objects this large"
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
