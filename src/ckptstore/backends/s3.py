"""Amazon S3 and S3-compatible servers (MinIO, Ceph RGW, R2, moto), through boto3.

Large objects go up as multipart uploads, small ones in one PutObject, with at most
``max_concurrency`` parts or PUTs in flight across all the files of a save: parallel requests are
what make S3 fast (one stream per connection is slow), and the bound keeps a save's memory near
``part_size x max_concurrency`` (at most twice that while several large files are being cut into
parts at once) whatever the objects' sizes. Each part carries a CRC32C,
which the server checks before it accepts the part where it can (the probe below asks). An
upload either completes into a whole object or is aborted (on any exception, Ctrl-C included),
because S3 never shows a partial object but bills and keeps the parts of an unfinished upload
until someone aborts it; ``gc`` finds the strays a killed process left behind.

The commit marker (the manifest) is written with ``If-None-Match: *``, so of two writers
committing the same step exactly one wins and the other gets ObjectExistsError; the ``latest``
pointer moves with ``If-Match: <etag>``, a compare-and-swap. S3-compatible servers differ: the
first create or swap of a backend instance runs a small probe under ``<prefix>/.ckptstore/``
(put a new object with ``If-None-Match: *``, put it again and expect 412, put with a wrong
``If-Match`` and expect 412, put with the right one quoted, then unquoted, put with a wrong
CRC32C and expect 400; the probe object is deleted). Where the server ignores a header, the
capability is reported False, a warning says which guarantee is lost, and the backend falls
back: create becomes HEAD, PUT, read back and compare (two writers racing inside that window
can both pass the HEAD; the loser of the PUTs sees foreign bytes and fails, but one whose
read-back ran before the winner's PUT may believe it won); swap becomes HEAD, compare ETag, PUT
(a concurrent swap between HEAD and PUT is lost). Within one process both fallbacks hold a
lock, so only writers in other processes can race. A server that does not verify checksums
loses no guarantee (loads verify CRC32C), so that is only logged. Readers never probe.

Retries live in one place, botocore's ``standard`` retry mode, bounded by the ``max_attempts``
option; the one thing it cannot retry, a GetObject body that breaks after its headers arrived,
is read again by ``_get`` under the same bound. Errors are translated once, at this boundary
(:mod:`.s3_errors`), by error code and HTTP status, never by message text.
Options and URIs are validated in :mod:`.s3_options`, the probe lives in :mod:`.s3_probe`.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import logging
import random
import re
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import boto3
import urllib3
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    IncompleteReadError,
    ProfileNotFound,
    ReadTimeoutError,
    ResponseStreamingError,
)

from ckptstore.backends import s3_errors
from ckptstore.backends.base import Capabilities, Chunk, ObjectInfo, PartialWrite
from ckptstore.backends.s3_errors import is_not_found, is_unsupported
from ckptstore.backends.s3_options import MAX_PART_SIZE, S3Options, parse_s3_uri
from ckptstore.backends.s3_probe import bare, lost_guarantees, probe
from ckptstore.checksum import crc32c_base64
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)

__all__ = ["S3Backend", "S3Options", "parse_s3_uri"]

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000
MAX_SINGLE_PUT = 5 << 30
"""The largest object one PutObject or CopyObject may create."""
DELETE_BATCH = 1000
PROBE_DIR = ".ckptstore"
_BROKEN_BODY = (
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
)
"""A GetObject body that broke after its headers arrived: read it again."""


class S3Backend:
    """Objects under ``s3://bucket/prefix``, on AWS S3 or any S3-compatible server."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any], *, client: Any = None) -> None:
        self._bucket, self._root = parse_s3_uri(uri)
        self._base = f"{self._root}/" if self._root else ""
        self._uri = f"s3://{self._bucket}/{self._root}".rstrip("/")
        self._opts = S3Options.parse(self._uri, storage_options)
        self._owns_client = client is None
        self._client = client if client is not None else self._build_client()
        endpoint = getattr(getattr(self._client, "meta", None), "endpoint_url", None) or "AWS S3"
        self._endpoint = re.sub(r"//[^/@]*@", "//", str(endpoint))  # no user:password@
        self._probe_lock = threading.Lock()
        self._fallback_lock = threading.Lock()
        self._caps: Capabilities | None = None
        self._unquoted_if_match = False
        self._bucket_checked = False
        self._warned: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._part_slots = threading.BoundedSemaphore(self._opts.max_concurrency)
        """Parts and single PUTs in flight across all concurrent uploads: requests stay within
        ``max_concurrency`` however many files a save writes at once."""

    def _build_client(self) -> Any:
        """boto3 resolves whatever we do not pass (env vars, profiles, roles) as usual."""
        try:
            session = boto3.session.Session(**self._opts.session_kwargs)
            return session.client("s3", config=self._opts.config, **self._opts.client_kwargs)
        except ProfileNotFound as e:
            raise ConfigError(
                f"{self._uri}: AWS profile {self._opts.session_kwargs.get('profile_name')!r} "
                "is not in ~/.aws/config or ~/.aws/credentials"
            ) from e
        except (BotoCoreError, TypeError, ValueError) as e:
            raise ConfigError(f"{self._uri}: cannot create an S3 client: {e}") from e

    def __repr__(self) -> str:
        return f"S3Backend({self._uri!r}, endpoint={self._endpoint!r}, options={self._opts!r})"

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def capabilities(self) -> Capabilities:
        """Probes the server on first use (it writes): ask on write paths only."""
        return self._probe()

    # -- reads ------------------------------------------------------------------------------

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        key = self._key(path)
        if end is not None and end <= start:
            if self.stat(path) is None:
                raise NotFoundError(f"{self._obj(key)} does not exist (while trying to read it)")
            return b""
        extra: dict[str, str] = {}
        if start > 0 or end is not None:
            extra["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        with self._translated(key, "read"):
            try:
                return self._get(key, **extra)[1]
            except ClientError as e:
                if s3_errors.code_of(e) == "InvalidRange":  # start past the end, like EOF
                    return b""
                raise

    def read_into(self, path: str, out: memoryview) -> int:
        """Ranged GETs of ``part_size`` bytes, ``max_concurrency`` at a time, straight into
        ``out``: a large file downloads over many connections, like the upload."""
        key, step = self._key(path), self._opts.part_size
        ranges = [(a, min(a + step, len(out))) for a in range(0, len(out), step)] or [(0, 0)]

        def fetch(first: int, end: int) -> int:
            extra = {"Range": f"bytes={first}-{end - 1}"} if end > first else {}
            with self._translated(key, "read"):
                try:
                    resp, data = self._get(key, **extra)
                except ClientError as e:
                    if s3_errors.code_of(e) == "InvalidRange":  # object shorter than expected
                        return int(e.response.get("Error", {}).get("ActualObjectSize", 0) or 0)
                    raise
            out[first : first + len(data)] = data
            total = str(resp.get("ContentRange", "")).rpartition("/")[2]
            return int(total) if total.isdigit() else int(resp.get("ContentLength", len(data)))

        if len(ranges) == 1:
            return fetch(*ranges[0])
        sizes = list(self._executor().map(lambda r: fetch(*r), ranges))
        return max(sizes)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        key = self._key(path)
        with self._translated(key, "read"):
            resp, data = self._get(key)
            return data, str(resp["ETag"])

    def stat(self, path: str) -> ObjectInfo | None:
        key = self._key(path)
        with self._translated(key, "stat"):
            try:
                resp = self._client.head_object(Bucket=self._bucket, Key=key)
            except ClientError as e:
                if not is_not_found(e):
                    raise  # a 403 is AccessDeniedError, never "missing"
                self._check_bucket()  # HEAD gives a bare 404 for a missing bucket too
                return None
        return ObjectInfo(path, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = self._base + prefix
        paginator = self._client.get_paginator("list_objects_v2")
        with self._translated(full, "list"):
            for page in paginator.paginate(Bucket=self._bucket, Prefix=full):
                for obj in page.get("Contents", ()):
                    rel = str(obj["Key"])[len(self._base) :]
                    if rel.endswith("/") or rel.startswith(f"{PROBE_DIR}/probe-"):
                        continue  # console "folder" markers and in-flight probes
                    yield ObjectInfo(rel, int(obj["Size"]), obj["LastModified"].timestamp())

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        full = self._base + prefix
        if prefix and not full.endswith("/"):
            full += "/"
        paginator = self._client.get_paginator("list_objects_v2")
        names = []
        with self._translated(full, "list"):
            for page in paginator.paginate(Bucket=self._bucket, Prefix=full, Delimiter="/"):
                for common in page.get("CommonPrefixes", ()):
                    names.append(str(common["Prefix"])[len(full) :].rstrip("/"))
        return sorted(name for name in names if name)

    # -- writes -----------------------------------------------------------------------------

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        """One PutObject below ``multipart_threshold``, else a parallel multipart upload."""
        key = self._key(path)
        parts = _split(chunks, self._opts.part_size)
        head: deque[bytearray] = deque()
        size = 0
        for part in parts:
            head.append(part)
            size += len(part)
            if size >= self._opts.multipart_threshold:
                break
        else:
            body = head[0] if len(head) == 1 else b"".join(head)
            with self._translated(key, "write"), self._part_slots:  # a PUT is a part in flight
                self._put(key, body)
            return size
        return self._write_multipart(key, itertools.chain(_drain(head), parts))

    def _write_multipart(self, key: str, parts: Iterator[bytearray]) -> int:
        extra = {"ChecksumAlgorithm": "CRC32C"} if self._opts.checksums else {}
        with self._translated(key, "start a multipart upload of"):
            resp = self._client.create_multipart_upload(Bucket=self._bucket, Key=key, **extra)
        upload_id = str(resp["UploadId"])
        logger.debug("multipart upload %s of %s started", upload_id, self._obj(key))
        pool, limit = self._executor(), self._opts.max_concurrency
        inflight: set[Future[dict[str, Any]]] = set()
        done: builtins.list[dict[str, Any]] = []
        size = 0
        try:
            with self._translated(key, "write"):
                for number, part in enumerate(parts, start=1):
                    if number > MAX_PARTS:
                        raise ConfigError(
                            f"{self._obj(key)} needs more than {MAX_PARTS} parts of "
                            f"{self._opts.part_size} bytes; raise the storage option part_size "
                            f"(up to {MAX_PART_SIZE}) for objects this large"
                        )
                    while len(inflight) >= limit:  # bounded memory: wait for a free slot
                        finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                        done.extend(f.result() for f in finished)
                    size += len(part)
                    self._part_slots.acquire()  # shared with the other files being written
                    future = pool.submit(self._upload_part, key, upload_id, number, part)
                    future.add_done_callback(lambda _: self._part_slots.release())
                    inflight.add(future)
                    del part
                finished, inflight = wait(inflight)
                done.extend(f.result() for f in finished)
                done.sort(key=lambda p: int(p["PartNumber"]))
                self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                )
        except BaseException:
            self._abort_after_failure(key, upload_id, inflight)
            raise
        logger.debug("multipart upload of %s done: %d parts", self._obj(key), len(done))
        return size

    def _upload_part(
        self, key: str, upload_id: str, number: int, data: bytearray
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {"PartNumber": number}
        extra: dict[str, str] = {}
        if self._opts.checksums:
            entry["ChecksumCRC32C"] = crc32c_base64(data)
            extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": entry["ChecksumCRC32C"]}
        resp = self._client.upload_part(
            Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data, **extra
        )
        entry["ETag"] = resp["ETag"]
        return entry

    def create(self, path: str, data: bytes) -> None:
        key = self._key(path)
        if not self._probe().atomic_create:
            self._create_fallback(key, data)
            return
        try:
            with self._translated(key, "create"):
                self._put(key, data, IfNoneMatch="*")
        except PreconditionFailedError as e:  # 412, or 409 for a concurrent create
            raise self._exists(key) from e

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        key = self._key(path)
        if not self._probe().atomic_swap:
            return self._swap_fallback(key, data, expected)
        if expected is None:
            condition = {"IfNoneMatch": "*"}
        else:
            tag = bare(expected) if self._unquoted_if_match else f'"{bare(expected)}"'
            condition = {"IfMatch": tag}
        try:
            with self._translated(key, "swap"):
                resp = self._put(key, data, **condition)
        except (PreconditionFailedError, NotFoundError) as e:  # NotFound: If-Match, no object
            raise self._changed(key, expected) from e
        return self._etag(key, resp)

    def copy(self, src: str, dst: str) -> None:
        source, target = self._key(src), self._key(dst)
        info = self.stat(src)
        if info is None:
            raise NotFoundError(f"{self._obj(source)} does not exist (while trying to copy it)")
        if info.size > MAX_SINGLE_PUT:
            self._copy_multipart(source, target, info.size)
            return
        extra = {"ChecksumAlgorithm": "CRC32C"} if self._opts.checksums else {}
        with self._translated(source, "copy"):
            self._client.copy_object(
                Bucket=self._bucket,
                Key=target,
                CopySource={"Bucket": self._bucket, "Key": source},
                **extra,
            )

    def _copy_multipart(self, source: str, target: str, size: int) -> None:
        """UploadPartCopy in parallel, server-side: CopyObject stops at 5 GiB."""
        part = max(self._opts.part_size, -(-size // MAX_PARTS))
        with self._translated(target, "start a multipart copy to"):
            resp = self._client.create_multipart_upload(Bucket=self._bucket, Key=target)
        upload_id = str(resp["UploadId"])

        def copy_part(number: int, first: int) -> dict[str, Any]:
            out = self._client.upload_part_copy(
                Bucket=self._bucket,
                Key=target,
                UploadId=upload_id,
                PartNumber=number,
                CopySource={"Bucket": self._bucket, "Key": source},
                CopySourceRange=f"bytes={first}-{min(first + part, size) - 1}",
            )
            return {"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]}

        pool = self._executor()
        futures = {pool.submit(copy_part, n, s) for n, s in enumerate(range(0, size, part), 1)}
        try:
            with self._translated(source, "copy"):
                parts = sorted((f.result() for f in futures), key=lambda p: int(p["PartNumber"]))
                self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=target,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self._abort_after_failure(target, upload_id, futures)
            raise

    def delete(self, paths: Sequence[str]) -> None:
        keys = [self._key(p) for p in paths]
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            with self._translated(batch[0], "delete"):
                resp = self._client.delete_objects(
                    Bucket=self._bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in s3_errors.NOT_FOUND]
            if errors:  # DeleteObjects answers 200 and reports failures per key
                failed = ", ".join(
                    f"{self._obj(str(e.get('Key', '?')))} ({e.get('Code')})" for e in errors[:5]
                )
                raise s3_errors.error_for(
                    str(errors[0].get("Code", "")),
                    0,
                    bucket=self._bucket,
                    endpoint=self._endpoint,
                    target=f"{len(errors)} object(s) under {self._uri}",
                    action="delete",
                    message=f"failed: {failed}",
                )

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """Unfinished multipart uploads, and probe objects a process killed mid-probe left."""
        return self._unfinished_uploads(prefix) + self._leftover_probes(prefix)

    def _leftover_probes(self, prefix: str) -> builtins.list[PartialWrite]:
        probes = f"{PROBE_DIR}/probe-"
        if not probes.startswith(prefix):
            return []
        paginator = self._client.get_paginator("list_objects_v2")
        found = []
        with self._translated(self._base + probes, "list"):
            for page in paginator.paginate(Bucket=self._bucket, Prefix=self._base + probes):
                for obj in page.get("Contents", ()):
                    rel = str(obj["Key"])[len(self._base) :]
                    found.append(PartialWrite(rel, "", obj["LastModified"].timestamp()))
        return found

    def _unfinished_uploads(self, prefix: str) -> builtins.list[PartialWrite]:
        full = self._base + prefix
        paginator = self._client.get_paginator("list_multipart_uploads")
        found = []
        with self._translated(full, "list unfinished uploads under"):
            try:
                for page in paginator.paginate(Bucket=self._bucket, Prefix=full):
                    for up in page.get("Uploads", ()):
                        started = up.get("Initiated")
                        found.append(
                            PartialWrite(
                                str(up["Key"])[len(self._base) :],
                                upload_id=str(up["UploadId"]),
                                started=started.timestamp() if started else None,
                            )
                        )
            except ClientError as e:
                if not is_unsupported(e):
                    raise
                self._warn_once(
                    "list-uploads",
                    f"{self._endpoint} does not implement ListMultipartUploads: gc cannot find "
                    f"unfinished uploads under {self._uri}; add an AbortIncompleteMultipartUpload "
                    "lifecycle rule to the bucket instead",
                )
                return []
        return found

    def abort(self, partial: PartialWrite) -> None:
        if partial.path.startswith(f"{PROBE_DIR}/probe-"):  # a probe object, not an upload
            self.delete([partial.path])
            return
        key = self._key(partial.path)
        with self._translated(key, "abort the upload of"):
            try:
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=key, UploadId=partial.upload_id
                )
            except ClientError as e:
                if not is_not_found(e):  # NoSuchUpload: already gone
                    raise

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if self._owns_client:
            self._client.close()

    # -- helpers ----------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return self._base + path

    def _obj(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"

    def _get(self, key: str, **extra: str) -> tuple[dict[str, Any], bytes]:
        """GetObject and its body. botocore retries a request that fails, but reads a GET's
        body (the object, or an error's XML) after its retry loop: a body that breaks after
        the headers (reset, truncated) is read again here, up to ``max_attempts`` times."""
        for attempt in range(1, self._opts.max_attempts + 1):
            try:
                resp: dict[str, Any] = self._client.get_object(
                    Bucket=self._bucket, Key=key, **extra
                )
                data: bytes = resp["Body"].read()
                return resp, data
            except _BROKEN_BODY as e:
                if attempt >= self._opts.max_attempts:
                    if isinstance(e, BotoCoreError):
                        raise
                    raise ResponseStreamingError(error=e) from e  # urllib3's, untranslated
                logger.debug("body of %s broke (%s); reading it again", self._obj(key), e)
                time.sleep(random.uniform(0, min(1.0, 0.05 * 2**attempt)))
        raise AssertionError("unreachable: max_attempts >= 1")

    def _put(self, key: str, body: bytes | bytearray, **extra: str) -> dict[str, Any]:
        if self._opts.checksums:
            extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": crc32c_base64(body), **extra}
        resp: dict[str, Any] = self._client.put_object(
            Bucket=self._bucket, Key=key, Body=body, **extra
        )
        return resp

    def _head_etag(self, key: str) -> str | None:
        with self._translated(key, "stat"):
            try:
                return str(self._client.head_object(Bucket=self._bucket, Key=key)["ETag"])
            except ClientError as e:
                if is_not_found(e):
                    return None
                raise

    def _etag(self, key: str, resp: Mapping[str, Any]) -> str:
        """The ETag a PUT returned; some servers leave it out, then ask for it."""
        etag = resp.get("ETag")
        return str(etag) if etag else (self._head_etag(key) or "")

    def _exists(self, key: str) -> ObjectExistsError:
        return ObjectExistsError(
            f"{self._obj(key)} already exists: another writer created it first; it was not "
            "overwritten"
        )

    def _changed(self, key: str, expected: str | None) -> PreconditionFailedError:
        want = "to be absent" if expected is None else f"at version {expected}"
        return PreconditionFailedError(
            f"{self._obj(key)} changed since it was read (expected it {want}); another writer "
            "moved it: read it again and retry"
        )

    def _executor(self) -> ThreadPoolExecutor:
        """One pool per backend: at most ``max_concurrency`` transfers run at once."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._opts.max_concurrency, thread_name_prefix="ckptstore-s3"
                )
            return self._pool

    def _abort_after_failure(
        self, key: str, upload_id: str, inflight: Iterable[Future[dict[str, Any]]]
    ) -> None:
        """Let running parts finish (a part landing after the abort would revive the upload),
        then abort. The caller re-raises the original error, so a failed abort is logged."""
        for future in inflight:
            future.cancel()
        wait(list(inflight))
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
            logger.debug("aborted multipart upload %s of %s", upload_id, self._obj(key))
        except Exception as e:
            logger.warning(
                "could not abort multipart upload %s of %s (%s); `ckptstore gc` or an "
                "AbortIncompleteMultipartUpload lifecycle rule removes it",
                upload_id,
                self._obj(key),
                type(e).__name__,
            )

    def _check_bucket(self) -> None:
        """Tell a missing bucket from a missing object, once per instance."""
        if self._bucket_checked:
            return
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except ClientError as e:
            if s3_errors.status_of(e) == 404 or s3_errors.code_of(e) in ("NoSuchBucket", "404"):
                raise self._translate_code("NoSuchBucket", "stat") from e
            if s3_errors.status_of(e) != 403:  # 403: may read objects without ListBucket
                raise
        self._bucket_checked = True

    def _translate_code(self, code: str, action: str) -> CheckpointError:
        return s3_errors.error_for(
            code, 0, bucket=self._bucket, endpoint=self._endpoint, target=self._uri, action=action
        )

    def _warn_once(self, topic: str, message: str) -> None:
        if topic in self._warned:
            return
        self._warned.add(topic)
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    @contextlib.contextmanager
    def _translated(self, key: str, action: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as e:
            raise s3_errors.translate(
                e,
                bucket=self._bucket,
                endpoint=self._endpoint,
                target=self._obj(key),
                action=action,
            ) from e

    # -- capability probe and fallbacks -------------------------------------------------------

    def _probe(self) -> Capabilities:
        with self._probe_lock:
            if self._caps is None:
                self._caps = self._run_probe()
            return self._caps

    def _run_probe(self) -> Capabilities:
        path = f"{PROBE_DIR}/probe-{uuid.uuid4().hex}"
        key, body = self._key(path), b"ckptstore capability probe; safe to delete\n"
        try:
            with self._translated(key, "probe conditional writes with"):
                result = probe(
                    lambda **condition: self._put(key, body, **condition),
                    lambda resp: self._etag(key, resp),
                    wrong_crc32c=crc32c_base64(body + b"!") if self._opts.checksums else None,
                )
        finally:
            try:
                self.delete([path])
            except CheckpointError as e:
                logger.warning("could not delete the probe object %s: %s", self._obj(key), e)
        self._unquoted_if_match = result.unquoted_if_match
        where = f"{self._endpoint} ({self._uri})"
        if result.unquoted_if_match:
            logger.info("%s accepts only unquoted ETags in If-Match; using those", where)
        for topic, message in lost_guarantees(result, where, self._opts.checksums):
            if topic == "checksums":  # no guarantee is lost: loads verify CRC32C anyway
                logger.warning("%s", message)
            else:
                self._warn_once(topic, message)
        return Capabilities(
            atomic_create=result.atomic_create,
            atomic_swap=result.atomic_swap,
            server_checksums=self._opts.checksums and result.server_checksums,
            server_side_copy=True,
            parallel_writes=self._opts.max_concurrency,
        )

    def _create_fallback(self, key: str, data: bytes) -> None:
        """HEAD, PUT, read back: see the module docstring for the race this leaves."""
        with self._fallback_lock:
            if self._head_etag(key) is not None:
                raise self._exists(key)
            with self._translated(key, "create"):
                self._put(key, data)
                back = self._get(key)[1]
            if back != data:
                raise ObjectExistsError(
                    f"{self._obj(key)} was written concurrently by another writer, whose "
                    "version won; this one was not committed"
                )

    def _swap_fallback(self, key: str, data: bytes, expected: str | None) -> str:
        """HEAD, compare ETags, PUT: see the module docstring for the race this leaves."""
        with self._fallback_lock:
            current = self._head_etag(key)
            same = current == expected or (
                current is not None and expected is not None and bare(current) == bare(expected)
            )
            if not same:
                raise self._changed(key, expected)
            with self._translated(key, "swap"):
                return self._etag(key, self._put(key, data))


def _split(chunks: Iterable[Chunk], part_size: int) -> Iterator[bytearray]:
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


def _drain(queue: deque[bytearray]) -> Iterator[bytearray]:
    """Yield and forget: the caller's deque must not keep uploaded parts alive."""
    while queue:
        yield queue.popleft()
