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

Why one backoff per endpoint, shared by every thread and backend of the process: SlowDown is
about the rate the server sees, not one request's luck. If 64 threads each back off on their own
for a short jittered while, they keep hitting the limit together. Here a throttling answer
(503 SlowDown, 429) raises one pause for the endpoint; every request to it waits the pause out
and then starts at a jittered moment within the next pause length, so the threads come back
spread out. The pause doubles for each round of throttling (answers to requests sent before it
was last raised do not raise it again) and halves for each pause length since it was last
raised. Other 5xx answers, resets, timeouts and stalls may be one request's or one
connection's trouble: that request alone backs off, exponentially with full jitter, so one
broken key cannot slow every thread. A request never waits out a shared pause longer than half
the time its deadline leaves: it gets its attempt.

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
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import urllib3
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,
)

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
BASE_DELAY = 0.05
MAX_PAUSE = 20.0
"""The longest shared pause (botocore's own cap on a backoff)."""
MAX_DELAY = 5.0
"""The longest backoff of one request after a reset, timeout or stall."""
HELPERS = 64
"""Helper threads per backend for attempts run under a deadline (made as needed)."""


class Kind(enum.Enum):
    THROTTLED = "throttled"  # SlowDown: the endpoint's shared pause
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
    return f"{op}: {type(e).__name__}: {e}"


class Backoff:
    """The pause one endpoint's requests share, across the threads of this process.

    ``answered`` says whether the endpoint ever answered; ``raised`` counts how often the
    pause was raised (for tests and logs).
    """

    def __init__(
        self,
        *,
        base: float = BASE_DELAY,
        cap: float = MAX_PAUSE,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.base, self.cap = base, cap
        self.answered = False
        self.raised = 0
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._pause = 0.0
        self._until = 0.0
        self._changed = 0.0
        self._round = 0

    @property
    def pause(self) -> float:
        return self._pause

    def round(self) -> int:
        """The current round: pass it back with the attempt's outcome."""
        return self._round

    def delay(self) -> float:
        """How long a request about to start waits: the rest of the pause, then a jittered
        moment within one pause length; 0 when calm."""
        with self._lock:
            now = self._clock()
            if now >= self._until:
                return 0.0
            return self._until - now + self._rng.uniform(0.0, self._pause)

    def throttled(self, round_: int) -> float:
        """A throttling answer to a request sent in ``round_``; returns how long it waits."""
        with self._lock:
            now = self._clock()
            self.answered = True
            self._decay(now)
            if round_ == self._round:  # news: raise the pause, once per round
                self._pause = min(self.cap, max(self.base, 2 * self._pause))
                self._until = now + self._pause
                self._changed = now
                self._round += 1
                self.raised += 1
            return max(0.0, self._until - now) + self._rng.uniform(0.0, self._pause)

    def succeeded(self) -> None:
        """An answer that was no throttling."""
        self.answered = True

    def _decay(self, now: float) -> None:
        """Halve the pause for each pause length since it was last raised."""
        while self._pause > 0.0 and now - self._changed >= self._pause:
            self._changed += self._pause
            self._pause = 0.0 if self._pause / 2 < self.base else self._pause / 2

    def alone(self, failures: int) -> float:
        """One request's own backoff after ``failures`` resets, timeouts or stalls."""
        return self._rng.uniform(0.0, min(MAX_DELAY, self.base * 2**failures))


_SHARED: weakref.WeakValueDictionary[str, Backoff] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def backoff_for(endpoint: str) -> Backoff:
    """The process's backoff for ``endpoint``: shared while any backend holds it."""
    with _SHARED_LOCK:
        found = _SHARED.get(endpoint)
        if found is None:
            found = _SHARED[endpoint] = Backoff()
        return found


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
            pause = self.backoff.delay()
            if deadline is not None:  # a shared pause never costs a request its attempt
                pause = min(pause, deadline.remaining() / 2)
            self._sleep(pause, deadline, progress)
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
                    wait = self.backoff.throttled(round_)
                else:
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
