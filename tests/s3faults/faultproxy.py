"""A fault-injecting HTTP proxy in front of an S3 server, for testing a client under failure.

Why a proxy rather than a mocked client: the client's whole path runs against real bytes on a
socket (signing, botocore's parsers, connection pooling, our retries, watchdog and error
translation), so a test sees what a flaky network or a strained server really does to it. The
proxy listens on 127.0.0.1 and forwards each request to the upstream server (moto in tests)
with its ``Host`` header unchanged; it assumes path-style addressing (``/bucket/key``), which
boto uses for an IP endpoint. Faults come three ways.

Drawn per request from a seeded RNG at ``rate`` (``faults``):

* ``500`` / ``503``: answered by the proxy with an S3 XML error (InternalError, SlowDown); the
  request never reaches the server.
* ``reset``: the request is forwarded (so it may take effect), then the connection is reset
  (RST) halfway through the response: the client cannot know whether it did.
* ``truncate``: forwarded, then half the body is sent under the full ``Content-Length`` and the
  connection is closed.
* ``delay``: forwarded after a random pause of up to ``max_delay`` seconds.

Switched on and off by the test (:mod:`s3faults.faultmodes`, ``add_fault``): a stall
(no answer, or silence after N bytes of either body), a trickle, a reset after N bytes, a
brownout of 503s or 500s for T seconds, refused connections for T seconds; each for chosen
operations and keys, each counting how often it fired. These take precedence over the rest.

``throttle`` (a :class:`~s3faults.throttle.Throttle`) adds S3's request-rate limit: a
request beyond its prefix's rate is answered ``503 SlowDown`` with S3's XML error body and
never reaches the server, whatever ``rate`` draws (see throttle.py for the model).

``key_lifetime`` makes it a server whose credentials expire: a request signed with a rotating
key (:mod:`.rotation`) more than that many seconds after the key was issued is answered
``400 ExpiredToken`` and never reaches the server; other keys pass.

``quirk`` emulates one way an S3-compatible server differs from S3 (:mod:`.quirks`).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from s3faults.faulthandler import Handler, Proxy, operation
from s3faults.faultmodes import Fault
from s3faults.quirks import QUIRKS
from s3faults.rotation import issued_at, key_of
from s3faults.throttle import Throttle

__all__ = ["FAULTS", "QUIRKS", "Fault", "FaultProxy", "operation"]

FAULTS = ("500", "503", "reset", "truncate", "delay")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    allow_reuse_address = True
    proxy: Proxy
    """The :class:`FaultProxy` its handlers serve (set before it starts)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: clients that give up on a stalled or reset connection are the point."""


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
        record: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        key_lifetime: float | None = None,
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
        """Only requests for these S3 operations get random faults (None: every request)."""
        self.max_delay = max_delay
        self.throttle = throttle
        """S3's rate limit per prefix (None: no limit); its counters say what it refused."""
        self.modes: list[Fault] = []
        """The switchable faults added so far (:meth:`add_fault`), first match wins."""
        self.injected: Counter[str] = Counter()
        """Random faults injected so far, by kind."""
        self.seen: Counter[str] = Counter()
        """Requests seen so far, by S3 operation."""
        self.body_bytes: Counter[str] = Counter()
        """Response body bytes sent to clients so far, by S3 operation (what a client
        downloaded: ``body_bytes["GetObject"]``)."""
        self.conditions: Counter[str] = Counter()
        """Conditional requests seen so far, as ``"<operation> <header>"`` (before any quirk)."""
        self.requests: list[tuple[str, str, str]] | None = [] if record else None
        """With ``record=True``: every request as ``(operation, key, Range header or "")``."""
        self.key_lifetime = key_lifetime
        """Seconds a rotating key is accepted after its issue (None: keys never expire)."""
        self.keys: Counter[str] = Counter()
        """Requests seen so far, by rotating access key (with ``key_lifetime``)."""
        self.expired: Counter[str] = Counter()
        """Requests answered ExpiredToken so far, by S3 operation."""
        self.revoked: set[str] = set()
        """Rotating keys refused whatever their age (:meth:`expire_keys`)."""
        self.connections = 0
        """Client connections accepted so far (a client that reuses its connections opens
        one per request in flight, not one per request)."""
        self.stopping = threading.Event()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._listen_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server = _Server((host, port), Handler, bind_and_activate=False)
        self._server.proxy = self
        self._thread: threading.Thread | None = None
        self._bound = False

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FaultProxy:
        self._listen()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for fault in self.modes:
            fault.off()
        self._stop_listening(count=None)
        self._server.server_close()

    def add_fault(self, fault: Fault) -> Fault:
        """Switch ``fault`` on (it applies to requests from now on); returns it."""
        fault.listen(self._switched)
        with self._lock:
            self.modes.append(fault)
        return fault.on()

    def clear_faults(self) -> None:
        """Switch every added fault off and forget them."""
        with self._lock:
            modes, self.modes = self.modes, []
        for fault in modes:
            fault.off()

    def mode_for(self, op: str, key: str) -> Fault | None:
        """The first live switchable fault for a request of ``op`` on ``key`` (counted)."""
        with self._lock:
            modes = list(self.modes)
        return next((fault for fault in modes if fault.take(op, key)), None)

    def choose(
        self, op: str, conditions: Iterable[str] = (), key: str = "", byte_range: str = ""
    ) -> tuple[str | None, float]:
        """Count one request of ``op`` carrying these conditional headers; draw its fault
        (None: none) and a pause for ``delay``."""
        with self._lock:
            self.seen[op] += 1
            if self.requests is not None:
                self.requests.append((op, key, byte_range))
            self.conditions.update(f"{op} {header}" for header in conditions)
            if self.operations is not None and op not in self.operations:
                return None, 0.0
            if self._rng.random() >= self.rate:
                return None, 0.0
            kind = self._rng.choice(self.faults)
            self.injected[kind] += 1
            return kind, self._rng.uniform(0.0, self.max_delay)

    def sent(self, op: str, size: int) -> None:
        """A handler sent ``size`` body bytes of an ``op`` response (:attr:`body_bytes`)."""
        with self._lock:
            self.body_bytes[op] += size

    def expire_keys(self) -> None:
        """Every rotating key seen so far expires now, whatever ``key_lifetime`` says: an
        expiry at a point of the test's choosing, which a slow machine cannot move. Keys
        issued later are judged by their age as before."""
        with self._lock:
            self.revoked.update(self.keys)

    def refuses(self, op: str, authorization: str) -> bool:
        """Whether a request of ``op`` signed as ``authorization`` says is refused as expired
        (``key_lifetime``, :meth:`expire_keys`); counted."""
        if self.key_lifetime is None:
            return False
        key = key_of(authorization)
        issued = issued_at(key) if key is not None else None
        if key is None or issued is None:
            return False
        with self._lock:
            self.keys[key] += 1
            if key not in self.revoked and time.time() - issued <= self.key_lifetime:
                return False
            self.expired[op] += 1
            return True

    def track(self, connection: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._connections.add if alive else self._connections.discard)(connection)
            self.connections += alive

    # -- refused connections: stop listening, drop what is open, listen again -------------

    def _switched(self, fault: Fault) -> None:
        if fault.kind != "refuse" or self.stopping.is_set():
            return
        if fault.active:
            self._stop_listening(count=fault)
            timer = threading.Timer(fault.seconds or 0.0, fault.off)
            timer.daemon = True
            timer.start()
        else:
            self._listen()

    def _listen(self) -> None:
        with self._listen_lock:
            if self._thread is not None:
                return
            if self._bound:  # after a refusal: a fresh socket on the same port
                self._server.socket = socket.socket(
                    self._server.address_family, self._server.socket_type
                )
            self._server.server_bind()
            self._server.server_activate()
            self._bound = True
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                args=(0.05,),  # a quick shutdown: refusals and stop wait for the loop
                name="faultproxy",
                daemon=True,
            )
            self._thread.start()

    def _stop_listening(self, count: Fault | None) -> None:
        with self._listen_lock:
            if self._thread is not None:
                self._server.shutdown()
                self._thread.join(10)
                self._thread = None
                self._server.socket.close()
                if count is not None:
                    count.count()
        with self._lock:
            open_now = list(self._connections)
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
