"""A fault-injecting HTTP proxy in front of an S3 server, for testing a client under failure.

Why a proxy rather than a mocked client: the client's whole path runs against real bytes on a
socket (signing, botocore's retries and parsers, connection pooling, our error translation), so
a test sees what a flaky network or a strained server really does to it. The proxy listens on
127.0.0.1 and forwards each request to the upstream server (moto in tests) with its ``Host``
header unchanged; it assumes path-style addressing (``/bucket/key``), which boto uses for an IP
endpoint. Faults are drawn per request from a seeded RNG at ``rate``:

* ``500`` / ``503``: answered by the proxy with an S3 XML error (InternalError, SlowDown); the
  request never reaches the server.
* ``reset``: the request is forwarded (so it may take effect), then the connection is reset
  (RST) halfway through the response: the client cannot know whether it did.
* ``truncate``: forwarded, then half the body is sent under the full ``Content-Length`` and the
  connection is closed.
* ``delay``: forwarded after a random pause of up to ``max_delay`` seconds.

``throttle`` (a :class:`~ckptstore.testing.throttle.Throttle`) adds S3's request-rate limit: a
request beyond its prefix's rate is answered ``503 SlowDown`` with S3's XML error body and
never reaches the server, whatever ``rate`` draws (see throttle.py for the model).

``quirk`` emulates one way an S3-compatible server differs from S3 (see :data:`QUIRKS`), by
rewriting or refusing requests and responses. The proxy strips or rewrites some signed headers
to do so; moto does not verify signatures, a real server would refuse such requests.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from email.message import Message
from http.client import HTTPConnection, HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ckptstore.testing.throttle import Throttle

FAULTS = ("500", "503", "reset", "truncate", "delay")
QUIRKS = {
    "complete-ignores-if-none-match": "CompleteMultipartUpload ignores If-None-Match",
    "put-ignores-conditions": "PutObject ignores If-Match and If-None-Match",
    "if-match-unquoted-only": "If-Match matches only an unquoted ETag (a quoted one gets 412)",
    "complete-empty-etag": "CompleteMultipartUpload answers an empty ETag",
    "no-checksums": "x-amz-checksum-* are ignored and never returned",
    "no-upload-listing": "ListMultipartUploads and AbortMultipartUpload answer 501",
}
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "412": (412, "PreconditionFailed", "At least one of the preconditions did not hold."),
    "501": (501, "NotImplemented", "A header or operation you provided is not implemented."),
}
_HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "expect", "content-length"]
)  # fmt: skip
_CHECKSUM_XML = re.compile(rb"<Checksum\w*>[^<]*</Checksum\w*>")
_ETAG_XML = re.compile(rb"<ETag>[^<]*</ETag>")
_CHUNK = 1 << 16
_POST_OPERATIONS = (
    ("uploads", "CreateMultipartUpload"),
    ("uploadId", "CompleteMultipartUpload"),
    ("delete", "DeleteObjects"),
)


def operation(method: str, path: str, query: Mapping[str, Any], headers: Message) -> str:
    """The S3 operation a path-style request stands for (``Other`` when it is none we name)."""
    key = path.lstrip("/").partition("/")[2]
    copy = headers.get("x-amz-copy-source") is not None
    if method == "PUT" and key:
        if "partNumber" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        for marker, name in _POST_OPERATIONS:
            if marker in query:
                return name
    if method == "GET":
        if "uploads" in query:
            return "ListMultipartUploads"
        if "uploadId" in query:
            return "ListParts"
        return "GetObject" if key else "ListObjects"
    if method == "HEAD":
        return "HeadObject" if key else "HeadBucket"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    return "Other"


class FaultProxy:
    """The proxy; use as a context manager. ``rate`` may be changed while it runs."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        seed: int = 0,
        quirk: str | None = None,
        operations: frozenset[str] | None = None,
        max_delay: float = 0.3,
        throttle: Throttle | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown or not faults:
            raise ValueError(f"faults must be some of {FAULTS}, got {faults!r}")
        if quirk is not None and quirk not in QUIRKS:
            raise ValueError(f"quirk must be one of {sorted(QUIRKS)}, got {quirk!r}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be between 0 and 1, got {rate!r}")
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.rate = rate
        self.faults = faults
        self.quirk = quirk
        self.operations = operations
        """Only requests for these S3 operations get faults (None: every request)."""
        self.max_delay = max_delay
        self.throttle = throttle
        """S3's rate limit per prefix (None: no limit); its counters say what it refused."""
        self.injected: Counter[str] = Counter()
        """Faults injected so far, by kind."""
        self.seen: Counter[str] = Counter()
        """Requests seen so far, by S3 operation."""
        self.conditions: Counter[str] = Counter()
        """Conditional requests seen so far, as ``"<operation> <header>"`` (before any quirk)."""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.request_queue_size = 128
        self._server.allow_reuse_address = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FaultProxy:
        if self._thread is None:
            self._server.server_bind()
            self._server.server_activate()
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="faultproxy", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()

    def choose(self, op: str, conditions: Iterable[str] = ()) -> tuple[str | None, float]:
        """Count one request of ``op`` carrying these conditional headers; draw its fault
        (None: none) and a pause for ``delay``."""
        with self._lock:
            self.seen[op] += 1
            self.conditions.update(f"{op} {header}" for header in conditions)
            if self.operations is not None and op not in self.operations:
                return None, 0.0
            if self._rng.random() >= self.rate:
                return None, 0.0
            kind = self._rng.choice(self.faults)
            self.injected[kind] += 1
            return kind, self._rng.uniform(0.0, self.max_delay)


class _Handler(BaseHTTPRequestHandler):
    """One client connection (HTTP/1.1 keep-alive); one fresh upstream connection per request."""

    protocol_version = "HTTP/1.1"
    timeout = 120

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests count faults through ``FaultProxy.injected`` instead."""

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # the connection was reset on purpose
            super().finish()

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        split = urlsplit(self.path)
        query = parse_qs(split.query, keep_blank_values=True)
        op = operation(self.command, split.path, query, self.headers)
        conditions = [h for h in ("If-Match", "If-None-Match") if self.headers.get(h) is not None]
        fault, delay = proxy.choose(op, conditions)
        throttle = proxy.throttle
        if throttle is not None and not throttle.admit(op, _partition_path(split.path, query)):
            self._send_error("503", split.path)
            return
        if fault in ("500", "503"):
            self._send_error(fault, split.path)
            return
        if fault == "delay":
            time.sleep(delay)
        quirk = proxy.quirk
        refusal = _refusal(quirk, op, self.headers)
        if refusal is not None:
            self._send_error(refusal, split.path)
            return
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        headers = _quirk_request(quirk, op, headers)
        if quirk == "no-checksums" and op == "CompleteMultipartUpload":
            body = _CHECKSUM_XML.sub(b"", body)
        upstream = HTTPConnection(*proxy.upstream, timeout=self.timeout)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.putheader("Connection", "close")
            upstream.endheaders(body or None)
            self._relay(upstream.getresponse(), op, quirk, fault)
        finally:
            upstream.close()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            pieces = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(pieces)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self, resp: HTTPResponse, op: str, quirk: str | None, fault: str | None) -> None:
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        declared = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304)
        rewrite = quirk in ("no-checksums", "complete-empty-etag") and op != "GetObject"
        chunks: Iterator[bytes]
        if no_body:
            length, chunks = int(declared or 0), iter(())
        elif declared is not None and not rewrite:
            length, chunks = int(declared), _stream(resp)
        else:
            data = _quirk_body(quirk, op, resp.status, resp.read())
            length, chunks = len(data), iter([data] if data else [])
        headers = _quirk_response(quirk, op, headers)
        headers.append(("Content-Length", str(length)))
        if self.close_connection or fault in ("reset", "truncate"):
            headers.append(("Connection", "close"))
            self.close_connection = True
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"] + [f"{k}: {v}" for k, v in headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        body_length = 0 if no_body else length
        if fault == "reset" and body_length == 0:
            self.wfile.write(head[: len(head) // 2])
            self._reset()
            return
        self.wfile.write(head)
        limit = body_length // 2 if fault in ("reset", "truncate") else body_length
        sent = 0
        for chunk in chunks:
            piece = chunk[: max(0, limit - sent)]
            self.wfile.write(piece)
            sent += len(piece)
            if sent >= limit:
                break
        if fault == "reset":
            self._reset()

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0), as a crashed server or a middlebox would."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _send_error(self, kind: str, resource: str) -> None:
        status, code, message = _ERRORS[kind]
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
            f"{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
        ).encode()
        body = b"" if self.command == "HEAD" else xml
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def _partition_path(path: str, query: Mapping[str, list[str]]) -> str:
    """``/bucket/key`` for an object; a listing's partition is the one of its ``prefix``."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not key and query.get("prefix"):
        key = query["prefix"][0]
    return f"/{bucket}/{key}"


def _stream(resp: HTTPResponse) -> Iterator[bytes]:
    while chunk := resp.read(_CHUNK):
        yield chunk


def _refusal(quirk: str | None, op: str, headers: Message) -> str | None:
    """The error the emulated server answers instead of forwarding, if any."""
    if quirk == "no-upload-listing" and op in ("ListMultipartUploads", "AbortMultipartUpload"):
        return "501"
    if quirk == "if-match-unquoted-only":
        tag = (headers.get("If-Match") or "").strip()
        if tag.startswith(('"', "W/")):  # compared literally with the stored, unquoted ETag
            return "412"
    return None


def _quirk_request(
    quirk: str | None, op: str, headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    ignores = {"complete-ignores-if-none-match": "CompleteMultipartUpload"}
    ignores["put-ignores-conditions"] = "PutObject"
    drop: tuple[str, ...] = ()
    if quirk in ignores and op == ignores[quirk]:
        drop = ("if-none-match", "if-match")
    elif quirk == "no-checksums":
        drop = ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm")
    return [(k, v) for k, v in headers if not k.lower().startswith(drop)] if drop else headers


def _quirk_response(
    quirk: str | None, op: str, headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    if quirk == "no-checksums":
        return [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum-")]
    if quirk == "complete-empty-etag" and op == "CompleteMultipartUpload":
        return [(k, v) for k, v in headers if k.lower() != "etag"]
    return headers


def _quirk_body(quirk: str | None, op: str, status: int, data: bytes) -> bytes:
    if quirk == "no-checksums":
        return _CHECKSUM_XML.sub(b"", data)
    if quirk == "complete-empty-etag" and op == "CompleteMultipartUpload" and status == 200:
        return _ETAG_XML.sub(b"<ETag></ETag>", data)
    return data
