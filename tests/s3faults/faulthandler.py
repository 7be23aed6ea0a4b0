"""The fault proxy's per-request half: parse, fault, forward, relay (see faultproxy.py).

One handler serves one client connection (HTTP/1.1 keep-alive) and opens one fresh upstream
connection per request. Switchable faults (:mod:`.faultmodes`) act here: a stalled handler
holds its connection silent, reading nothing, and looks every :data:`_POLL` seconds whether the
client gave up, the fault was switched off or the proxy stops, so no thread outlives its test.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from email.message import Message
from http.client import HTTPConnection, HTTPResponse
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from s3faults import quirks
from s3faults.faultmodes import Fault
from s3faults.throttle import Throttle

_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "412": (412, "PreconditionFailed", "At least one of the preconditions did not hold."),
    "501": (501, "NotImplemented", "A header or operation you provided is not implemented."),
    "expired": (400, "ExpiredToken", "The provided token has expired."),
}
_HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "expect", "content-length"]
)  # fmt: skip
_CHUNK = 1 << 16
_POLL = 0.05
"""Seconds between a stalled handler's looks at its client, its fault and the proxy."""
_POST_OPERATIONS = (
    ("uploads", "CreateMultipartUpload"),
    ("uploadId", "CompleteMultipartUpload"),
    ("delete", "DeleteObjects"),
)


class Proxy(Protocol):
    """What a handler asks of the proxy it serves (:class:`~.faultproxy.FaultProxy`, which
    imports this module, so the type is spelled out here): where to forward, which fault to
    apply, and whether it is stopping."""

    upstream: tuple[str, int]
    quirk: str | None
    throttle: Throttle | None
    stopping: threading.Event

    def choose(
        self, op: str, conditions: Iterable[str] = (), key: str = "", byte_range: str = ""
    ) -> tuple[str | None, float]: ...

    def mode_for(self, op: str, key: str) -> Fault | None: ...

    def sent(self, op: str, size: int) -> None: ...

    def track(self, connection: socket.socket, alive: bool) -> None: ...

    def refuses(self, op: str, authorization: str) -> bool: ...


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


class Handler(BaseHTTPRequestHandler):
    """One client connection (HTTP/1.1 keep-alive); one fresh upstream connection per request."""

    protocol_version = "HTTP/1.1"
    timeout = 120

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests count faults through ``FaultProxy.injected`` and ``Fault.fired``."""

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    @property
    def proxy(self) -> Proxy:
        return self.server.proxy  # type: ignore[attr-defined,no-any-return]

    def setup(self) -> None:
        super().setup()
        self.proxy.track(self.connection, True)

    def finish(self) -> None:
        self.proxy.track(self.connection, False)
        with contextlib.suppress(OSError):  # the connection was reset on purpose
            super().finish()

    def _handle(self) -> None:
        proxy = self.proxy
        split = urlsplit(self.path)
        query = parse_qs(split.query, keep_blank_values=True)
        op = operation(self.command, split.path, query, self.headers)
        conditions = [h for h in ("If-Match", "If-None-Match") if self.headers.get(h) is not None]
        key = _key(split.path, query)
        fault, delay = proxy.choose(op, conditions, key, self.headers.get("Range") or "")
        mode = proxy.mode_for(op, key)
        if mode is not None and mode.direction == "request":
            body = self._read_body_under(mode)
            if body is None:
                return
        else:
            body = self._read_body()
        if proxy.refuses(op, self.headers.get("Authorization") or ""):
            self._send_error("expired", split.path)
            return
        if mode is not None and mode.kind == "brownout":
            self._send_error(str(mode.status), split.path)
            return
        if mode is not None and mode.kind == "stall" and mode.after is None:
            self._hold(mode)  # read it all, answer nothing
            return
        throttle = proxy.throttle
        if throttle is not None and not throttle.admit(op, partition_path(split.path, query)):
            self._send_error("503", split.path)
            return
        if mode is not None:
            fault = None  # one fault per request
        if fault in ("500", "503"):
            self._send_error(fault, split.path)
            return
        if fault == "delay":
            time.sleep(delay)
        quirk = proxy.quirk
        refusal = quirks.refusal(quirk, op, self.headers)
        if refusal is not None:
            self._send_error(refusal, split.path)
            return
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        headers = quirks.request_headers(quirk, op, headers)
        body = quirks.request_body(quirk, op, body)
        upstream = HTTPConnection(*proxy.upstream, timeout=self.timeout)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.putheader("Connection", "close")
            upstream.endheaders(body or None)
            self._relay(upstream.getresponse(), op, quirk, fault, mode)
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

    def _read_body_under(self, mode: Fault) -> bytes | None:
        """The request body under a request-direction fault; None if the fault ended the
        connection (a stall or a reset)."""
        length = int(self.headers.get("Content-Length") or 0)
        head = self.rfile.read(min(length, mode.after or 0))
        if mode.kind == "stall":
            self._hold(mode)
            return None
        if mode.kind == "reset":
            self._reset()
            return None
        pieces = [head]
        received = len(head)
        while received < length:
            piece = self.rfile.read(min(length - received, _pace(mode)))
            if not piece:
                return None  # the client gave up: forward nothing
            pieces.append(piece)
            received += len(piece)
            if mode.active:
                time.sleep(len(piece) / mode.rate)
        return None if self._client_gone() else b"".join(pieces)

    def _client_gone(self) -> bool:
        """Whether the client closed its end (it gave up on a slow request)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True

    def _relay(
        self, resp: HTTPResponse, op: str, quirk: str | None, fault: str | None, mode: Fault | None
    ) -> None:
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        declared = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304)
        chunks: Iterator[bytes]
        if no_body:
            length, chunks = int(declared or 0), iter(())
        elif declared is not None and not quirks.rewrites_body(quirk, op):
            length, chunks = int(declared), _stream(resp)
        else:
            data = quirks.response_body(quirk, op, resp.status, resp.read())
            length, chunks = len(data), iter([data] if data else [])
        headers = quirks.response_headers(quirk, op, headers)
        headers.append(("Content-Length", str(length)))
        cut = fault in ("reset", "truncate") or (mode is not None and mode.kind != "trickle")
        if self.close_connection or cut:
            headers.append(("Connection", "close"))
            self.close_connection = True
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"] + [f"{k}: {v}" for k, v in headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        body_length = 0 if no_body else length
        cuts = mode is not None and mode.kind in ("stall", "reset")
        if (fault == "reset" and body_length == 0) or (
            cuts and mode is not None and body_length == 0 and not mode.after
        ):  # no body to cut after its first 0 bytes: cut the head
            self.wfile.write(head[: len(head) // 2])
            self._hold(mode) if mode is not None and mode.kind == "stall" else self._reset()
            return
        self.wfile.write(head)
        limit = body_length // 2 if fault in ("reset", "truncate") else body_length
        if mode is not None and mode.kind in ("stall", "reset"):
            limit = min(limit, mode.after or 0)
        self.proxy.sent(op, self._send_body(chunks, limit, mode))
        if fault == "reset" or (mode is not None and mode.kind == "reset"):
            self._reset()
        elif mode is not None and mode.kind == "stall":
            self._hold(mode)

    def _send_body(self, chunks: Iterator[bytes], limit: int, mode: Fault | None) -> int:
        """Up to ``limit`` bytes of the body; under a trickle, past its ``after`` at its rate.
        Returns how many it sent."""
        sent = 0
        fast = limit if mode is None or mode.kind != "trickle" else (mode.after or 0)
        for chunk in chunks:
            view = memoryview(chunk)[: max(0, limit - sent)]
            while len(view):
                step = len(view) if sent >= fast or mode is None else fast - sent
                if sent >= fast and mode is not None and mode.active:
                    step = _pace(mode)
                    time.sleep(min(step, len(view)) / mode.rate)
                piece = view[:step]
                self.wfile.write(piece)
                self.wfile.flush()
                sent += len(piece)
                view = view[len(piece) :]
            if sent >= limit:
                break
        return sent

    def _hold(self, mode: Fault) -> None:
        """Stay silent, reading nothing, until the client gives up (closes), the fault is
        switched off or the proxy stops; then close."""
        self.close_connection = True
        self.wfile.flush()
        proxy = self.proxy
        while mode.active and not proxy.stopping.is_set() and not self._client_gone():
            time.sleep(_POLL)
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _reset(self) -> None:
        """Close with RST (SO_LINGER 0), as a crashed server or a middlebox would."""
        self.close_connection = True
        try:
            self.wfile.flush()
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


def _pace(mode: Fault) -> int:
    """Bytes per step of a trickle: a twentieth of a second's worth, at least one."""
    return max(1, int(mode.rate * _POLL))


def _key(path: str, query: Mapping[str, list[str]]) -> str:
    """The key a request is about, without the bucket; a listing's is its ``prefix``."""
    key = path.lstrip("/").partition("/")[2]
    if not key and query.get("prefix"):
        key = query["prefix"][0]
    return key


def partition_path(path: str, query: Mapping[str, list[str]]) -> str:
    """``/bucket/key`` for an object; a listing's partition is the one of its ``prefix``."""
    bucket = path.lstrip("/").partition("/")[0]
    return f"/{bucket}/{_key(path, query)}"


def _stream(resp: HTTPResponse) -> Iterator[bytes]:
    while chunk := resp.read(_CHUNK):
        yield chunk
