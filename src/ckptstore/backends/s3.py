"""Amazon S3 and S3-compatible servers (MinIO, Ceph RGW, R2, moto), through boto3.

Large objects go up as multipart uploads, small ones in one PutObject (which of the two is
decided as a file streams, in :mod:`.s3_write`), with at most ``max_concurrency`` parts or PUTs
in flight across all the files of a save; the pool, that bound, the multipart skeleton (abort
on any failure) and the requests that carry a file's bytes (PUTs, parts, part copies, ranged
GETs) live in :mod:`.s3_transfer`. Each part and PUT carries a CRC32C, which the server checks
before it accepts it where it can (the probe asks).

The commit marker (the manifest) is written with ``If-None-Match: *``, so of two writers
committing the same step exactly one wins and the other gets ObjectExistsError; the ``latest``
pointer moves with ``If-Match: <etag>``, a compare-and-swap. S3-compatible servers differ: the
first create or swap of a backend instance runs a small probe under ``<prefix>/.ckptstore/``
(:mod:`.s3_probe`). Where the server ignores a header, the capability is reported False, a
warning says which guarantee is lost, and the backend falls back to the base class's
check-then-write, atomic within this process only: create becomes HEAD, PUT, read back and
compare; swap becomes HEAD, compare ETags, PUT. A server that does not verify checksums loses no
guarantee (loads verify CRC32C), so that is only logged. Readers never probe.

Every request goes through one retry loop (:mod:`.s3_retry`; botocore itself makes one
attempt): transient failures are retried for ``retry_timeout`` seconds rather than a count of
attempts, with jittered backoff and one send rate per endpoint and bucket that the threads of
the process share (SlowDown lowers it), so a thousand ranks writing one fresh prefix slow down
together and keep going under SlowDown (README "Bounded saves"). A request that moves no bytes
for ``stall_timeout`` seconds, or trickles, is given up and retried (:mod:`.s3_progress`); a
broken or stalled GET resumes from its last byte (:mod:`.s3_download`). No request, retry or
wait outlives the deadline in force (:mod:`ckptstore.deadline`): then a multipart upload is
aborted and SaveTimeoutError (or LoadTimeoutError) names the file, the upload, the bytes done
and the last error. An abort the server does not answer is recorded, and the next write (the
lease renewal that begins the next save, or its first file), ``close()`` or ``gc`` aborts the
upload (:mod:`.s3_leftovers`). An endpoint that never answered this process gets
``first_byte_timeout`` seconds to answer a request, its retries included (a mute endpoint fails
in seconds). Errors are translated once, at this boundary (:mod:`.s3_errors`), by error code
and HTTP status, never by message text. Options and URIs are validated in :mod:`.s3_options`.
The requests about many keys at once (listings, batched deletes, the remains of unfinished
writes) are in :mod:`.s3_namespace`.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from botocore.exceptions import ClientError

from ckptstore.backends import s3_errors
from ckptstore.backends.base import (
    BaseBackend,
    Capabilities,
    Chunk,
    ObjectAddress,
    ObjectInfo,
    PartialWrite,
    error_context,
)
from ckptstore.backends.s3_credentials import Renewal
from ckptstore.backends.s3_errors import is_not_found
from ckptstore.backends.s3_leftovers import Leftovers
from ckptstore.backends.s3_namespace import Namespace
from ckptstore.backends.s3_options import S3Options, parse_s3_uri
from ckptstore.backends.s3_probe import PROBE_PREFIX, bare, capabilities, probe
from ckptstore.backends.s3_retry import Retrier
from ckptstore.backends.s3_transfer import Transfers, crc32c_base64
from ckptstore.backends.s3_write import FileWrites
from ckptstore.errors import CheckpointError, ConfigError, NotFoundError, PreconditionFailedError

__all__ = ["S3Backend", "S3Options", "parse_s3_uri"]

logger = logging.getLogger(__name__)


class S3Backend(BaseBackend):
    """Objects under ``s3://bucket/prefix``, on AWS S3 or any S3-compatible server."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any], *, client: Any = None) -> None:
        super().__init__()
        self._bucket, self._root = parse_s3_uri(uri)
        self._base = f"{self._root}/" if self._root else ""
        self._uri = f"s3://{self._bucket}/{self._root}".rstrip("/")
        self._opts = S3Options.parse(self._uri, storage_options)
        self._owns_client = client is None
        self._client = client if client is not None else self._opts.client(self._uri)
        endpoint = getattr(getattr(self._client, "meta", None), "endpoint_url", None) or "AWS S3"
        self._endpoint = re.sub(r"//[^/@]*@", "//", str(endpoint))  # no user:password@
        self._errors = s3_errors.Translator(self._bucket, self._endpoint, self._uri)
        self._domain = self._opts.copy_domain(str(endpoint))
        self._probe_lock = threading.Lock()
        self._caps: Capabilities | None = None
        self._unquoted_if_match = False
        self._bucket_checked = False
        self._transfers = Transfers.for_options(self._client, self._bucket, self._opts)
        self._writes = FileWrites(self._transfers, self._opts, self._errors)
        self._namespace = Namespace(
            self._uri, self._base, self._transfers, self._errors, self._warn_once
        )
        retrier = self._transfers.retrier  # a mute endpoint fails in first_byte_timeout
        retrier.first_byte_timeout = self._opts.first_byte_timeout
        retrier.renewal = Renewal(self._client)  # an expired key is renewed, then retried
        if self._owns_client:  # an answer counts from its headers; injected clients: from its end
            retrier.connect_timeout = self._client.meta.config.connect_timeout
            self._client.meta.events.register("before-parse.s3", retrier.heard)

    def __repr__(self) -> str:
        return f"S3Backend({self._uri!r}, endpoint={self._endpoint!r}, options={self._opts!r})"

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def capabilities(self) -> Capabilities:
        """Probes the server on first use (it writes): ask on write paths only."""
        return self._probe()

    @property
    def parallel_writes(self) -> int:
        """``capabilities.parallel_writes`` without the probe: what staging asks (commit.py)."""
        return self._opts.max_concurrency

    @property
    def sends_whole_up_to(self) -> int:
        return self._writes.held_whole_up_to

    @property
    def client(self) -> Any:
        """The boto3 client this backend sends with: ``meta`` shows its region, endpoint and
        retry config, ``meta.events`` takes botocore hooks (a request counter, say)."""
        return self._client

    @property
    def retrier(self) -> Retrier:
        """How this backend's requests are retried and timed out (s3_retry.py)."""
        return self._transfers.retrier

    @property
    def leftovers(self) -> Leftovers:
        """The uploads this process could not abort yet (s3_leftovers.py), which the next
        write, ``close()`` or ``gc`` aborts."""
        return self._transfers.leftovers

    # -- reads ------------------------------------------------------------------------------

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        key = self._key(path)
        if end is not None and end <= start:
            if self.stat(path) is None:
                raise NotFoundError(
                    f"{self._obj(key)} does not exist (while trying to read it)",
                    **error_context(self._uri, path),
                )
            return b""
        extra: dict[str, str] = {}
        if start > 0 or end is not None:
            extra["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        with self._translated(key, "read"):
            try:
                return self._transfers.get(key, **extra)[1]
            except ClientError as e:
                if s3_errors.code_of(e) == "InvalidRange":  # start past the end, like EOF
                    return b""
                raise

    def read_into(self, path: str, out: memoryview) -> int:
        """Parallel ranged GETs straight into ``out`` (:meth:`.s3_transfer.Transfers.read_into`)."""
        key = self._key(path)
        with self._translated(key, "read"):
            return self._transfers.read_into(key, out, self._opts.part_size)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        key = self._key(path)
        with self._translated(key, "read"):
            resp, data = self._transfers.get(key)
            return data, str(resp["ETag"])

    def stat(self, path: str) -> ObjectInfo | None:
        key = self._key(path)
        with self._translated(key, "stat"):
            try:
                resp = self._transfers.call("head_object", key, "stat", Key=key)
            except ClientError as e:
                if not is_not_found(e):
                    raise  # a 403 is AccessDeniedError, never "missing"
                self._check_bucket()  # HEAD gives a bare 404 for a missing bucket too
                return None
        return ObjectInfo(path, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Leaves out console "folder" markers and in-flight probes (:mod:`.s3_namespace`)."""
        return self._namespace.objects(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """One delimited listing (:meth:`.s3_namespace.Namespace.dirs`)."""
        return self._namespace.dirs(prefix)

    # -- writes -----------------------------------------------------------------------------

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        """One PutObject below ``multipart_threshold``, else a parallel multipart upload
        (:mod:`.s3_write`)."""
        self._transfers.settle()
        return self._writes.write(self._key(path), chunks)

    def create(self, path: str, data: bytes) -> None:
        self._transfers.settle()
        if not self._probe().atomic_create:  # the probe warned
            self._fallback_create(path, data)
            return
        key = self._key(path)
        try:
            with self._translated(key, "create"):
                self._transfers.put(key, data, IfNoneMatch="*")
        except PreconditionFailedError as e:  # 412, or 409 for a concurrent create
            raise self._exists_error(path) from e

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        self._transfers.settle()
        if not self._probe().atomic_swap:  # the probe warned
            return self._fallback_swap(path, data, expected)
        key = self._key(path)
        if expected is None:
            condition = {"IfNoneMatch": "*"}
        else:
            tag = bare(expected) if self._unquoted_if_match else f'"{bare(expected)}"'
            condition = {"IfMatch": tag}
        try:
            with self._translated(key, "swap"):
                resp = self._transfers.put(key, data, **condition)
        except (PreconditionFailedError, NotFoundError) as e:  # NotFound: If-Match, no object
            raise self._changed_error(path, expected) from e
        return self._etag(key, resp)

    def _is_current(self, path: str, expected: str | None) -> bool:
        """For the fallback swap: HEAD, and ETags compared without quotes."""
        current = self._head_etag(self._key(path))
        return current == expected or (
            current is not None and expected is not None and bare(current) == bare(expected)
        )

    def _put_versioned(self, path: str, data: bytes) -> str:
        """For the fallback swap: the new version is the ETag the PUT returns."""
        key = self._key(path)
        with self._translated(key, "swap"):
            return self._etag(key, self._transfers.put(key, data))

    def copy(self, src: str, dst: str) -> None:
        source = self._key(src)
        info = self.stat(src)
        if info is None:
            raise NotFoundError(
                f"{self._obj(source)} does not exist (while trying to copy it)",
                **error_context(self._uri, src),
            )
        with self._translated(source, "copy"):
            self._transfers.copy(source, self._key(dst), info.size, part_size=self._opts.part_size)

    def address(self, path: str) -> ObjectAddress:
        """This bucket and key, in the domain of this endpoint and these credentials."""
        return ObjectAddress(self._domain, self._bucket, self._key(path))

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        """A server-side copy from another bucket (or prefix) of this domain."""
        origin = f"s3://{source.bucket}/{source.key}"
        if source.domain != self._domain:
            raise ConfigError(
                f"{self._obj(self._key(dst))}: {origin} is on another endpoint or under other "
                "credentials; it cannot be copied server-side: stream the bytes instead",
                **error_context(self._uri, dst),
            )
        with self._errors.translated(origin, "copy"):
            part_size = self._opts.part_size
            self._transfers.copy(
                source.key, self._key(dst), size, part_size=part_size, bucket=source.bucket
            )

    def delete(self, paths: Sequence[str]) -> None:
        """DeleteObjects in batches, failures reported per key (:mod:`.s3_namespace`)."""
        self._namespace.delete(paths)

    def partial_writes(self, prefix: str) -> builtins.list[PartialWrite]:
        """Unfinished multipart uploads, and probe objects a process killed mid-probe left."""
        return self._namespace.partial_writes(prefix)

    def abort(self, partial: PartialWrite) -> None:
        self._namespace.abort(partial)

    def close(self) -> None:
        self._transfers.close()
        if self._owns_client:
            self._client.close()

    # -- helpers ----------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        return self._base + path

    def _obj(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"

    def _head_etag(self, key: str) -> str | None:
        with self._translated(key, "stat"):
            try:
                return str(self._transfers.call("head_object", key, "stat", Key=key)["ETag"])
            except ClientError as e:
                if is_not_found(e):
                    return None
                raise

    def _etag(self, key: str, resp: Mapping[str, Any]) -> str:
        """The ETag a PUT returned; some servers leave it out, then ask for it."""
        etag = resp.get("ETag")
        return str(etag) if etag else (self._head_etag(key) or "")

    def _check_bucket(self) -> None:
        """Tell a missing bucket from a missing object, once per instance."""
        if self._bucket_checked:
            return
        try:
            self._transfers.call("head_bucket", "", "stat")
        except ClientError as e:
            if s3_errors.status_of(e) == 404 or s3_errors.code_of(e) in ("NoSuchBucket", "404"):
                raise self._errors.error("NoSuchBucket", self._uri, "stat") from e
            if s3_errors.status_of(e) != 403:  # 403: may read objects without ListBucket
                raise
        self._bucket_checked = True

    def _translated(self, key: str, action: str) -> contextlib.AbstractContextManager[None]:
        return self._errors.translated(self._obj(key), action)

    # -- capability probe ---------------------------------------------------------------------

    def _probe(self) -> Capabilities:
        with self._probe_lock:
            if self._caps is None:
                self._caps = self._run_probe()
            return self._caps

    def _run_probe(self) -> Capabilities:
        path = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        key, body = self._key(path), b"ckptstore capability probe; safe to delete\n"
        try:
            with self._translated(key, "probe conditional writes with"):
                result = probe(
                    lambda **condition: self._transfers.put(key, body, **condition),
                    lambda resp: self._etag(key, resp),
                    wrong_crc32c=crc32c_base64(body + b"!") if self._opts.checksums else None,
                )
        finally:
            try:
                self.delete([path])
            except CheckpointError as e:
                logger.warning("could not delete the probe object %s: %s", self._obj(key), e)
        self._unquoted_if_match = result.unquoted_if_match
        return capabilities(
            result,
            f"{self._endpoint} ({self._uri})",
            checksums=self._opts.checksums,
            parallel_writes=self._opts.max_concurrency,
            warn=self._warn_once,
        )
