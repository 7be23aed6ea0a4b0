"""The send rate one endpoint (and bucket) gets from this process, shared by its threads.

S3 throttles by request rate (per prefix of a bucket): when it answers 503 SlowDown, the
threads of a process must slow down together, not each on its own (see :mod:`.s3_retry` for
why). This is a client-side rate limit like botocore's ``adaptive`` mode, but one per endpoint
and bucket for the whole process (every client and backend on it), and one whose waits the
retry loop bounds by the deadline. It also remembers whether the endpoint ever answered, which
tells a typo in ``endpoint_url`` from an outage. One request's own wait after a failure is not
shared: it is the package's retry policy (:mod:`ckptstore.retry`), applied by :mod:`.s3_retry`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["SendRate", "rate_for"]

MIN_RATE = 5.0
"""Requests per second the shared rate never falls below: a brownout (every answer SlowDown
for a while) takes it there, and it must climb back fast once the endpoint recovers."""
GROWTH = 4.0
"""How much the shared rate grows per second of successes."""


class SendRate:
    """The send rate one endpoint's requests share, across the threads of this process.

    Unlimited until the endpoint throttles. A throttling answer to a request sent since the
    rate last fell halves it (the first time: half the rate requests were sent at over the last
    second); answers to requests sent before do not lower it again, so 64 threads answered
    SlowDown at once lower it once. A request goes out once ``1 / rate`` has passed since the
    last one did (:meth:`delay`), so the threads go out spaced, not in bursts. Successes
    raise the rate, fourfold per second of them, and once it is four times what is being
    sent the limit is lifted. ``answered`` says whether the endpoint ever answered;
    ``lowered`` counts how often the rate fell (for tests and logs).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.answered = False
        self.lowered = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._rate: float | None = None
        self._last = float("-inf")
        self._grown = 0.0
        self._round = 0
        self._second = 0  # the whole second the counts below are for
        self._this_second = 0  # requests sent in it
        self._last_second = 0  # requests sent in the one before

    @property
    def rate(self) -> float | None:
        """Requests per second the endpoint is sent at most (None: no limit)."""
        return self._rate

    def round(self) -> int:
        """The current round (rises each time the rate falls): pass it to :meth:`throttled`."""
        return self._round

    def delay(self, *, force: bool = False) -> float:
        """0 if a request may go out now (it is counted as sent), else how long until it may
        (then ask again: the rate may have changed). ``force``: it goes out regardless."""
        with self._lock:
            now = self._clock()
            if self._rate is not None and not force:
                due = self._last + 1.0 / self._rate
                if due > now:
                    return due - now
            self._last = now
            self._count(now)
            return 0.0

    def throttled(self, round_: int) -> None:
        """A throttling answer to a request sent in ``round_``."""
        with self._lock:
            self.answered = True
            if round_ != self._round:  # sent before the rate last fell: no news
                return
            now = self._clock()
            current = self._rate if self._rate is not None else self._sent_rate(now)
            self._rate = max(MIN_RATE, current / 2)
            self._grown = now
            self._round += 1
            self.lowered += 1

    def succeeded(self) -> None:
        """An answer that was no throttling: the rate grows (:data:`GROWTH` per second)."""
        with self._lock:
            self.answered = True
            if self._rate is None:
                return
            now = self._clock()
            self._rate *= GROWTH ** min(now - self._grown, 8.0)
            self._grown = now
            if self._rate > 4 * max(self._sent_rate(now), MIN_RATE):
                self._rate = None  # far above what is sent: no limit

    def _count(self, now: float) -> None:
        self._roll(now)
        self._this_second += 1

    def _roll(self, now: float) -> None:
        second = int(now)
        if second != self._second:
            self._last_second = self._this_second if second == self._second + 1 else 0
            self._this_second, self._second = 0, second

    def _sent_rate(self, now: float) -> float:
        """Requests sent over about the last second (this second's, and the share of the
        previous one's that the last second still covers)."""
        self._roll(now)
        return self._this_second + self._last_second * (1.0 - (now - self._second))


_SHARED: weakref.WeakValueDictionary[str, SendRate] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def rate_for(endpoint: str) -> SendRate:
    """The process's send rate for ``endpoint`` (a URL, and the bucket: S3 limits each bucket's
    prefixes on their own): shared while any backend holds it."""
    with _SHARED_LOCK:
        found = _SHARED.get(endpoint)
        if found is None:
            found = _SHARED[endpoint] = SendRate()
        return found
