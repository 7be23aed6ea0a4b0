"""Retries of S3 requests: budgeted by time, backed off together, never past a deadline.

The one place the S3 backend retries (botocore is set to one attempt: s3_options). Every
request the backend makes runs through :meth:`Retrier.call`.

Why by time and not by count: a thousand ranks writing one fresh prefix meet S3's ``503
SlowDown`` for as long as the prefix stays hot, minutes where S3 repartitions; five attempts
run out in seconds, and the save fails though it had minutes left. So a request retries
transient failures until ``retry_timeout`` seconds have passed, or, sooner, until the deadline
in force (:mod:`ckptstore.deadline`) leaves no time for another attempt; ``max_attempts``, if
set, bounds the count as well.

Why not for an endpoint that never answered: a request that cannot even connect to an endpoint
that has never answered this process is a configuration problem (a typo in ``endpoint_url``), so
that one gives up after :data:`UNREACHED_ATTEMPTS`; and one that gets no answer at all from it
(the connection not accepted in time, or accepted and no byte of an answer: a wrong port, a
firewall, a server that hangs) gets ``first_byte_timeout`` seconds (default 15), its retries
included, then :class:`~.s3_errors.NoAnswer` (a BackendError that is not retryable, naming the
endpoint and the option). While the endpoint has not answered, each attempt runs on a daemon
thread and is waited for no longer than that, whatever the socket timeouts (``stall_timeout``,
60 s): a mute endpoint cannot hold a command for minutes, nor its exit for a socket timeout. Once
the endpoint answered anything (any HTTP status: ``answered`` in :mod:`.s3_rate`, marked as
soon as an answer's headers arrive), the rules above apply: a server that answered before and
stalls now is a brownout, retried for ``retry_timeout``. An attempt that moves bytes (a large
upload's body) is not silent either, and is no longer held to ``first_byte_timeout``.

Why one send rate per endpoint (and bucket), shared by every thread and backend of the process:
SlowDown is about the rate the server sees, not one request's luck. If 64 threads each back off
on their own for a short jittered while, they keep hitting the limit together. Here every failed
attempt backs off by the package's policy (:mod:`ckptstore.retry`: exponential, full jitter, its
waits never past the deadline; :data:`BACKOFF`), and a throttling answer (503 SlowDown, 429)
also lowers one send rate for the endpoint's bucket (:mod:`.s3_rate`: a client-side rate limit
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
is cancelled (it stops at its next block, :mod:`.s3_progress`) and the caller raises at once
(the threads: :mod:`.s3_helpers`). Attempts already on the transfer pool (parts, ranged reads)
run in place: whoever waits for them waits with the deadline.

Why an expired key is retried: temporary credentials expire mid-save, and a server may refuse
a key before the expiry its source announced. An answer in
:data:`~ckptstore.backends.s3_errors.EXPIRED` (or a HEAD's bare 400, which carries no code)
renews the credentials (:mod:`.s3_credentials`) and retries the request at once, up to
:data:`RENEWALS` times in a row; a multipart upload is never aborted for it.

Errors are classified by type, S3 error code and HTTP status, never by message text.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

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

from ckptstore.backends.s3_credentials import Renewal
from ckptstore.backends.s3_errors import EXPIRED, NoAnswer, code_of, is_unsupported, status_of
from ckptstore.backends.s3_helpers import Helpers, in_context, on_worker
from ckptstore.backends.s3_options import DEFAULT_FIRST_BYTE_TIMEOUT
from ckptstore.backends.s3_progress import Cancelled, Progress, Stalled, cause
from ckptstore.backends.s3_rate import SendRate
from ckptstore.deadline import Deadline, current_deadline
from ckptstore.retry import Backoff, Retry, sleep_within

logger = logging.getLogger(__name__)

T = TypeVar("T")
THROTTLING = frozenset(
    [
        "SlowDown",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "503",
        "429",
    ]
)
TRANSIENT_CODES = frozenset(
    [
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "OperationAborted",
        "ServiceUnavailable",
    ]
)
"""Codes worth another attempt besides throttling and 5xx statuses (botocore's list). A
checksum mismatch (BadDigest) is not: the probe sends a wrong CRC32C on purpose, and bytes that
a part's own checksum refused are refused again."""
BACKOFF = Backoff(base=0.1, cap=5.0)
"""One request's own wait after each failure: up to 0.1 s after the first, doubling to 5 s
(botocore's cap is 20 s), full jitter."""
UNREACHED_ATTEMPTS = 3
"""Attempts for a request refused a connection by an endpoint that never answered."""
FIRST_CONTACT_WAKE = 0.25
"""Seconds between looks at an attempt on an endpoint that has not answered yet: whether it
answered meanwhile, or moves bytes (then it is no longer held to ``first_byte_timeout``)."""

RENEWALS = 3
"""Renewals of the credentials in a row for one request: a source that keeps handing out keys
the server refuses is a configuration problem (AccessDeniedError names the token)."""

HELPERS = 64
"""Helper threads per backend for attempts waited for with a timeout (made as needed)."""


class Kind(enum.Enum):
    THROTTLED = "throttled"  # SlowDown: lowers the shared rate, and this request backs off
    TRANSIENT = "transient"  # a 5xx, reset, timeout, stall, broken body: this request backs off
    UNREACHABLE = "unreachable"  # no connection at all
    EXPIRED = "expired"  # the key expired: renew the credentials, retry at once
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
        if code in EXPIRED or (status == 400 and code == "400"):  # a HEAD's 400 has no code
            return Kind.EXPIRED
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


class Retrier:
    """Runs requests with retries; one per backend, sharing its endpoint's :class:`SendRate`."""

    def __init__(
        self,
        rate: SendRate,
        *,
        retry_timeout: float,
        max_attempts: int | None = None,
        backoff: Backoff = BACKOFF,
        first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT,
        connect_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.rate = rate
        self.policy = Retry(backoff, attempts=max_attempts, budget=retry_timeout)
        """Each request's own waits, tries and time budget (``retry_timeout``)."""
        self.first_byte_timeout = first_byte_timeout
        """Seconds a request to an endpoint that never answered may go without an answer."""
        self.connect_timeout = connect_timeout
        """The client's connect timeout, if known: an attempt silent for longer got connected."""
        self.renewal: Renewal | None = None
        """The client's credentials, renewed on an expired key (None: never renewed)."""
        self._clock = clock
        self._rng = rng
        self._helpers: Helpers | None = None
        self._lock = threading.Lock()

    def heard(self, **_: Any) -> None:
        """An answer's status line and headers arrived (a botocore ``before-parse`` handler,
        which the backend registers on the client it owns): the endpoint answers."""
        self.rate.answered = True

    def close(self) -> None:
        with self._lock:
            if self._helpers is not None:
                self._helpers.close()
                self._helpers = None

    def call(self, op: str, attempt: Callable[[], T], progress: Progress) -> T:
        """``attempt()`` until it succeeds, fails for good, or time runs out.

        Raises the deadline's error (SaveTimeoutError, LoadTimeoutError) when the deadline in
        force passes first, or at once when the wait before the next attempt would reach it;
        else the last error as botocore raised it (the backend translates).
        """
        deadline = current_deadline()
        started = self._clock()
        failures = renewals = 0
        failed: Exception | None = None  # the last attempt's error
        while True:
            self._pace(deadline, progress)
            round_ = self.rate.round()
            signed = self.renewal.key() if self.renewal is not None else None
            try:
                result = self._attempt(attempt, deadline, progress, (started, failed))
            except NoAnswer:
                raise
            except Exception as e:
                kind = classify(e)
                if kind is Kind.CANCELLED:
                    if deadline is not None and deadline.expired:
                        raise progress.deadline_error(deadline) from e
                    raise
                if isinstance(e, ClientError):
                    self.rate.answered = True  # any HTTP status is an answer
                if kind is Kind.EXPIRED:
                    renewals += 1
                    renewal = self.renewal
                    if renewal is None or renewals > RENEWALS or not renewal.renew(signed):
                        raise
                    progress.last_error = describe(e, op)
                    logger.debug(
                        "%s %s: %s; retrying with new credentials",
                        op,
                        progress.target,
                        progress.last_error,
                    )
                    continue
                if kind is Kind.FATAL:
                    if isinstance(e, ClientError):
                        self.rate.succeeded()  # the server answered, and not throttling
                    raise
                failures += 1
                failed = e
                progress.last_error = describe(e, op)
                if kind is Kind.THROTTLED:
                    self.rate.throttled(round_)
                self._wait_to_retry(e, kind, failures, started, deadline, (op, progress))
                continue
            self.rate.succeeded()
            return result

    def _wait_to_retry(
        self,
        error: Exception,
        kind: Kind,
        failures: int,
        started: float,
        deadline: Deadline | None,
        request: tuple[str, Progress],
    ) -> None:
        """After failure number ``failures`` (``error``): wait before the next attempt, or
        raise when none is due: the policy's budget spent, an endpoint never reached, no
        answer yet by ``first_byte_timeout``, or the deadline reached while waiting."""
        op, progress = request
        spent = self._clock() - started
        wait = self.policy.wait(failures, spent, self._rng)
        if wait is None or self._unreached(error, kind, failures):
            raise error
        if not self.rate.answered and spent + wait >= self.first_byte_timeout:
            raise NoAnswer(
                seconds=self.first_byte_timeout,
                accepted=_accepted(error),
                last_error=progress.last_error,
            ) from error
        logger.debug(
            "%s %s failed (%s); retrying in %.2f s", op, progress.target, progress.last_error, wait
        )
        if (reached := sleep_within(wait, deadline, progress.token.sleep)) is not None:
            raise progress.deadline_error(reached) from error  # no retry could begin

    def _pace(self, deadline: Deadline | None, progress: Progress) -> None:
        """Wait for the endpoint's shared rate to let this request out; under a deadline, no
        longer than half what it leaves (the request gets its attempt)."""
        while (wait := self.rate.delay()) > 0:
            if deadline is not None and wait >= deadline.remaining() / 2:
                progress.token.sleep(deadline.remaining() / 2)
                self.rate.delay(force=True)
                return
            progress.token.sleep(wait)
        if deadline is not None and deadline.expired:
            raise progress.deadline_error(deadline)
        progress.token.sleep(0)  # raises if cancelled

    def _unreached(self, e: Exception, kind: Kind, failures: int) -> bool:
        """A connection refused :data:`UNREACHED_ATTEMPTS` times by an endpoint that never
        answered: a configuration problem, not an outage."""
        refused = kind is Kind.UNREACHABLE and not isinstance(e, ConnectTimeoutError)
        return refused and not self.rate.answered and failures >= UNREACHED_ATTEMPTS

    def _attempt(
        self,
        attempt: Callable[[], T],
        deadline: Deadline | None,
        progress: Progress,
        request: tuple[float, Exception | None],
    ) -> T:
        """One attempt; ``request``: when the request began, and its last attempt's error."""
        first = not self.rate.answered
        if not first and (deadline is None or on_worker()):
            return attempt()
        try:
            future = self._helper_pool().submit(in_context(attempt))
        except RuntimeError:  # no thread starts at interpreter shutdown: in place, then
            return attempt()
        return self._wait(future, deadline, progress, request if first else None)

    def _wait(
        self,
        future: concurrent.futures.Future[T],
        deadline: Deadline | None,
        progress: Progress,
        first: tuple[float, Exception | None] | None,
    ) -> T:
        """The result of an attempt running on a helper, waited for no longer than the
        deadline. ``first``, for an endpoint that has not answered this process: when the
        request began and its last attempt's error; then the wait ends, with
        :class:`NoAnswer`, once the request has gone ``first_byte_timeout`` seconds without an
        answer, unless the endpoint answers meanwhile or the attempt moves bytes (a large
        upload's body). An attempt given up is cancelled (it stops at its next block)."""
        begun, moved = self._clock(), progress.bytes_done
        while True:
            waits = [] if deadline is None else [deadline.remaining()]
            if first is not None:
                waits += [FIRST_CONTACT_WAKE, first[0] + self.first_byte_timeout - self._clock()]
            try:
                return future.result(timeout=max(0.0, min(waits)) if waits else None)
            except concurrent.futures.TimeoutError:
                if future.done():
                    raise  # the attempt's own TimeoutError
            if deadline is not None and deadline.expired:
                progress.token.cancel("the deadline passed")
                raise progress.deadline_error(deadline) from None
            if first is None:
                continue
            if self.rate.answered or progress.bytes_done != moved:
                first = None  # it answers, or takes our bytes: not a silent endpoint
            elif self._clock() - first[0] >= self.first_byte_timeout:
                progress.token.cancel("no answer within first_byte_timeout")
                silent = self._clock() - begun
                connected = self.connect_timeout is not None and silent > self.connect_timeout
                raise NoAnswer(  # not known to be connected: as the attempt before it, if any
                    seconds=self.first_byte_timeout,
                    accepted=True if connected else _accepted(first[1]),
                    last_error=progress.last_error,
                )

    def _helper_pool(self) -> Helpers:
        with self._lock:
            if self._helpers is None:
                self._helpers = Helpers(HELPERS, "ckptstore-s3-attempt")
            return self._helpers


def _accepted(e: BaseException | None) -> bool | None:
    """Whether a silent attempt's connection was accepted: not on a connect timeout, yes on
    a read timeout or a connection the server closed; None when the error does not tell."""
    if e is None:
        return None
    if isinstance(e, ConnectTimeoutError):
        return False
    if isinstance(e, (ReadTimeoutError, ConnectionClosedError)):
        return True
    return None
