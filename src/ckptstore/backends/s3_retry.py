"""Retries of S3 requests: budgeted by time, backed off together, never past a deadline.

The one place the S3 backend retries (botocore is set to one attempt: s3_options). Every
request the backend makes runs through :meth:`Retrier.call`.

Why by time and not by count: a thousand ranks writing one fresh prefix meet S3's ``503
SlowDown`` for as long as the prefix stays hot, minutes where S3 repartitions; five attempts
run out in seconds, and the save fails though it had minutes left. So a request retries
transient failures until ``retry_timeout`` seconds have passed, or, sooner, until the deadline
in force (:mod:`ckptstore.deadline`) leaves no time for another attempt; ``max_attempts``, if
set, bounds the count as well. A request that cannot even connect to an endpoint that has never
answered this process is a configuration problem (a typo in ``endpoint_url``), so that one gives
up after :data:`UNREACHED_ATTEMPTS`.

Why one backoff per endpoint (and bucket), shared by every thread and backend of the process:
SlowDown is about the rate the server sees, not one request's luck. If 64 threads each back off
on their own for a short jittered while, they keep hitting the limit together. Here every failed
attempt backs off, exponentially with full jitter, and a throttling answer (503 SlowDown, 429)
also lowers one send rate for the endpoint's bucket (:mod:`.s3_backoff`: a client-side rate limit
like botocore's ``adaptive`` mode, but shared by every client of the process and bounded by the
deadline). It halves once per round of throttling, however many threads were answered SlowDown;
requests go out no faster than that rate, spaced rather than in bursts; successes raise it
fourfold per second until the limit is lifted. Other 5xx answers, resets, timeouts and stalls
may be one request's or one connection's trouble: they do not lower the shared rate, so one
broken key cannot slow every thread. A request never waits for its turn longer than half the
time its deadline leaves: it gets its attempt.

Why a helper thread per attempt under a deadline: a request blocked in a socket call ends only
when that call times out (``stall_timeout``). With a deadline in force, a caller's attempt runs
on a helper thread and the caller waits no longer than the deadline; if it passes, the attempt
is cancelled (it stops at its next block, :mod:`.s3_progress`) and the caller raises at once.
Attempts already on the transfer pool (parts, ranged reads) run in place: whoever waits for
them waits with the deadline.

Errors are classified by type, S3 error code and HTTP status, never by message text.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import urllib3
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectionError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from ckptstore.backends.s3_backoff import Backoff
from ckptstore.backends.s3_errors import code_of, is_unsupported, status_of
from ckptstore.backends.s3_progress import Cancelled, Progress, Stalled, cause
from ckptstore.deadline import Deadline, current_deadline

logger = logging.getLogger(__name__)

T = TypeVar("T")
THROTTLING = frozenset(
    ["SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "TooManyRequests",
     "RequestLimitExceeded", "RequestThrottled", "503", "429"]
)  # fmt: skip
TRANSIENT_CODES = frozenset(
    ["InternalError", "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
     "OperationAborted", "ServiceUnavailable"]
)  # fmt: skip
"""Codes worth another attempt besides throttling and 5xx statuses (botocore's list). A
checksum mismatch (BadDigest) is not: the probe sends a wrong CRC32C on purpose, and bytes that
a part's own checksum refused are refused again."""
UNREACHED_ATTEMPTS = 3
"""Attempts for a request that cannot connect to an endpoint that never answered."""

HELPERS = 64
"""Helper threads per backend for attempts run under a deadline (made as needed)."""


class Kind(enum.Enum):
    THROTTLED = "throttled"  # SlowDown: lowers the shared rate, and this request backs off
    TRANSIENT = "transient"  # a 5xx, reset, timeout, stall, broken body: this request backs off
    UNREACHABLE = "unreachable"  # no connection at all
    CANCELLED = "cancelled"
    FATAL = "fatal"


_BROKEN = (
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, and what urllib3 raised
    ResponseStreamingError,
    IncompleteReadError,
    FlexibleChecksumError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    Stalled,
)


_MEANINGS: tuple[tuple[type[BaseException], str], ...] = (
    (ConnectTimeoutError, "could not connect in time"),
    (EndpointConnectionError, "could not connect"),
    (ConnectionClosedError, "connection closed mid-request"),
    (ResponseStreamingError, "the body broke off"),
    (IncompleteReadError, "the body was cut short"),
    (urllib3.exceptions.ProtocolError, "the body broke off"),
)


def classify(e: BaseException) -> Kind:
    """What a failed attempt calls for."""
    inner = cause(e)
    if isinstance(inner, Cancelled):
        return Kind.CANCELLED
    if isinstance(e, ClientError):
        code, status = code_of(e), status_of(e)
        if is_unsupported(e):  # 501 NotImplemented: no time heals that
            return Kind.FATAL
        if code in THROTTLING or status in (429, 503):
            return Kind.THROTTLED
        return Kind.TRANSIENT if code in TRANSIENT_CODES or status >= 500 else Kind.FATAL
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError)):
        return Kind.UNREACHABLE
    return Kind.TRANSIENT if isinstance(e, _BROKEN) else Kind.FATAL


def describe(e: BaseException, op: str) -> str:
    """A short account of a failed attempt, for ``last_error``."""
    inner = cause(e)
    if isinstance(inner, Stalled):
        return f"{op} {inner}"
    if isinstance(e, ClientError):
        return f"{op}: {code_of(e) or 'error'} (HTTP {status_of(e)})"
    unreachable = isinstance(e, (ConnectTimeoutError, EndpointConnectionError))
    if not unreachable and _timed_out(e):  # a socket call past its timeout, however wrapped
        return f"{op}: no bytes moved within stall_timeout ({type(e).__name__})"
    for kind, meaning in _MEANINGS:
        if isinstance(e, kind):
            return f"{op}: {meaning} ({type(e).__name__})"
    return f"{op}: {type(e).__name__}: {e}"


def _timed_out(e: BaseException, depth: int = 0) -> bool:
    """Whether a TimeoutError lies under ``e`` (urllib3 reports a send that timed out as a
    ProtocolError, botocore as ConnectionClosedError)."""
    if isinstance(e, (TimeoutError, ReadTimeoutError, urllib3.exceptions.TimeoutError)):
        return True
    if depth > 4:
        return False
    kwargs = getattr(e, "kwargs", None)
    inner = [kwargs.get("error")] if isinstance(kwargs, dict) else []
    inner += [a for a in e.args if isinstance(a, BaseException)]
    inner += [e.__cause__, e.__context__]
    return any(i is not None and _timed_out(i, depth + 1) for i in inner)


_LOCAL = threading.local()


def mark_worker() -> None:
    """Thread initializer of the transfer and helper pools: attempts there run in place."""
    _LOCAL.worker = True


def on_worker() -> bool:
    return bool(getattr(_LOCAL, "worker", False))


class Retrier:
    """Runs requests with retries; one per backend, sharing its endpoint's :class:`Backoff`."""

    def __init__(
        self,
        backoff: Backoff,
        *,
        retry_timeout: float,
        max_attempts: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff = backoff
        self.retry_timeout = retry_timeout
        self.max_attempts = max_attempts
        self._clock = clock
        self._helpers: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._helpers is not None:
                self._helpers.shutdown(wait=False, cancel_futures=True)
                self._helpers = None

    def call(self, op: str, attempt: Callable[[], T], progress: Progress) -> T:
        """``attempt()`` until it succeeds, fails for good, or time runs out.

        Raises the deadline's error (SaveTimeoutError, LoadTimeoutError) when the deadline in
        force passes first, else the last error as botocore raised it (the backend translates).
        """
        deadline = current_deadline()
        started = self._clock()
        failures = 0
        while True:
            self._pace(deadline, progress)
            round_ = self.backoff.round()
            try:
                result = self._attempt(attempt, deadline, progress)
            except Exception as e:
                kind = classify(e)
                if kind is Kind.CANCELLED:
                    if deadline is not None and deadline.expired:
                        raise progress.deadline_error(deadline) from e
                    raise
                if kind is Kind.FATAL:
                    if isinstance(e, ClientError):
                        self.backoff.succeeded()  # the server answered, and not throttling
                    raise
                failures += 1
                progress.last_error = describe(e, op)
                if kind is Kind.THROTTLED:
                    self.backoff.throttled(round_)
                wait = self.backoff.alone(failures)
                if self._exhausted(kind, failures, self._clock() - started + wait):
                    raise
                logger.debug(
                    "%s %s failed (%s); retrying in %.2f s",
                    op,
                    progress.target,
                    progress.last_error,
                    wait,
                )
                self._sleep(wait, deadline, progress)
                continue
            self.backoff.succeeded()
            return result

    def _pace(self, deadline: Deadline | None, progress: Progress) -> None:
        """Wait for the endpoint's shared rate to let this request out; under a deadline, no
        longer than half what it leaves (the request gets its attempt)."""
        while (wait := self.backoff.delay()) > 0:
            if deadline is not None and wait >= deadline.remaining() / 2:
                self._sleep(deadline.remaining() / 2, deadline, progress)
                self.backoff.delay(force=True)
                return
            self._sleep(wait, deadline, progress)
        if deadline is not None and deadline.expired:
            raise progress.deadline_error(deadline)
        progress.token.sleep(0)  # raises if cancelled

    def _exhausted(self, kind: Kind, failures: int, spent: float) -> bool:
        if self.max_attempts is not None and failures >= self.max_attempts:
            return True
        if kind is Kind.UNREACHABLE and not self.backoff.answered:
            return failures >= UNREACHED_ATTEMPTS
        return spent > self.retry_timeout

    def _sleep(self, seconds: float, deadline: Deadline | None, progress: Progress) -> None:
        """Sleep, but not past the deadline (raising its error then) nor past a cancel."""
        if deadline is not None and seconds >= deadline.remaining():
            progress.token.sleep(deadline.remaining())
            raise progress.deadline_error(deadline)
        progress.token.sleep(seconds)

    def _attempt(
        self, attempt: Callable[[], T], deadline: Deadline | None, progress: Progress
    ) -> T:
        if deadline is None or on_worker():
            return attempt()
        future = self._helper_pool().submit(contextvars.copy_context().run, attempt)
        try:
            return future.result(timeout=deadline.remaining())
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the attempt's own TimeoutError
            progress.token.cancel("the deadline passed")
            raise progress.deadline_error(deadline) from None

    def _helper_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._helpers is None:
                self._helpers = concurrent.futures.ThreadPoolExecutor(
                    HELPERS, thread_name_prefix="ckptstore-s3-attempt", initializer=mark_worker
                )
            return self._helpers
