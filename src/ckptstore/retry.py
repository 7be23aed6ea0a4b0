"""One retry and backoff policy for the whole package.

Every wait between tries is a :class:`Backoff`: after failed try ``n`` (0-based) a caller waits
up to ``min(cap, base * factor**n)``, of which a ``jitter`` share is drawn at random (1, "full
jitter", where rivals race for one object, so that writers that collided do not collide again in
lockstep; 0, a fixed schedule, where a poller's pauses only need to grow). A bounded loop is a
:class:`Retry`: that backoff plus at most ``attempts`` tries, or a ``budget`` of seconds after
which no try starts, or both. What is worth another try is the caller's to say, by the error's
type or code, never by its message. No wait crosses the deadline in force
(:mod:`ckptstore.deadline`): when the next wait would reach it, the loop stops at once with the
deadline's error (chained to the last failure) instead of sleeping toward a try that could not
begin in time. The clock, the sleep and the random source are arguments, so tests run a
schedule without waiting. Pollers that wait for news rather than retry a failure
(``ckptstore wait``, ``replicate --follow``, a persist waiting for other nodes' files) take
their pauses from a :class:`Pauses`. The S3 backend keeps its own decision of what to retry
(:mod:`ckptstore.backends.s3_retry`: error codes, a shared send rate, an endpoint that never
answered) and takes its waits and its budget from here.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptstore.deadline import Deadline, current_deadline

__all__ = ["Backoff", "Pauses", "Retry", "sleep_within"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """The wait after each failed try: exponential, capped, with a share of it random."""

    base: float
    """Seconds: the longest wait after the first failure."""
    cap: float
    """Seconds no wait exceeds, however many failures."""
    factor: float = 2.0
    """How much the longest wait grows per failure."""
    jitter: float = 1.0
    """The share of each wait drawn at random: 1 waits anywhere in ``(0, longest]``, 0
    exactly the longest."""

    def __post_init__(self) -> None:
        if not 0 <= self.base <= self.cap:  # also refuses NaN
            raise ValueError(f"a backoff needs 0 <= base <= cap, got {self.base!r}, {self.cap!r}")
        if not self.factor >= 1:
            raise ValueError(f"a backoff's factor must be >= 1, got {self.factor!r}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"a backoff's jitter must be within [0, 1], got {self.jitter!r}")

    def longest(self, failure: int) -> float:
        """The longest wait after failed try ``failure`` (0-based)."""
        if failure < 0:
            raise ValueError(f"tries are counted from 0, got {failure}")
        try:
            return min(self.cap, self.base * self.factor**failure)
        except OverflowError:  # a float power past 1e308: long past the cap
            return self.cap

    def delay(self, failure: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed try ``failure`` (0-based)."""
        longest = self.longest(failure)
        if not self.jitter:
            return longest
        draw = (rng or _RANDOM).random()  # [0, 1)
        return longest * (1.0 - self.jitter * draw)


_RANDOM = random.Random()


@dataclass(frozen=True)
class Retry:
    """A bounded retry loop: ``backoff`` between tries, at most ``attempts`` tries and no try
    begun past ``budget`` seconds (either may be None, not both), never past the deadline."""

    backoff: Backoff
    attempts: int | None = None
    """Tries in all, the first included."""
    budget: float | None = None
    """Seconds from the first try: a wait that would end past them is not begun."""

    def __post_init__(self) -> None:
        if self.attempts is None and self.budget is None:
            raise ValueError("a retry loop needs attempts or a budget (or both), to end")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"a retry loop needs at least 1 attempt, got {self.attempts}")
        if self.budget is not None and not self.budget >= 0:
            raise ValueError(f"a retry budget must be >= 0 seconds, got {self.budget!r}")

    def wait(self, failures: int, spent: float, rng: random.Random | None = None) -> float | None:
        """Seconds to wait before the next try, after ``failures`` (>= 1) failed tries over
        ``spent`` seconds; None once the policy gives up: the tries are used up, or the wait
        would end past the budget."""
        if self.attempts is not None and failures >= self.attempts:
            return None
        wait = self.backoff.delay(failures - 1, rng)
        if self.budget is not None and spent + wait > self.budget:
            return None
        return wait

    def run(
        self,
        call: Callable[[], T],
        *,
        retryable: Callable[[Exception], bool],
        target: str | None = None,
        doing: str = "retry",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> T:
        """``call()`` until it returns, raises an error ``retryable`` refuses (raised at once),
        or the policy gives up (the last error raised). Under a deadline, a wait that would
        reach it raises the deadline's error instead, from the last error; ``target`` (a URI)
        and ``doing`` (a verb) say in it what was being tried."""
        started = clock()
        failures = 0
        while True:
            try:
                return call()
            except Exception as e:
                if not retryable(e):
                    raise
                failures += 1
                wait = self.wait(failures, clock() - started, rng)
                if wait is None:
                    raise
                log.debug(
                    "%s %s failed (%s); try %d in %.3f s", doing, target, e, failures + 1, wait
                )
                if (reached := sleep_within(wait, current_deadline(), sleep)) is not None:
                    raise reached.error(target, doing=doing, last_error=str(e)) from e


def sleep_within(
    seconds: float, deadline: Deadline | None, sleep: Callable[[float], None] = time.sleep
) -> Deadline | None:
    """Sleep ``seconds`` and return None; or, when that would reach ``deadline``, sleep not at
    all and return the deadline, whose error the caller raises (a try after such a wait could
    not begin in time)."""
    if deadline is not None and seconds >= deadline.remaining():
        return deadline
    sleep(seconds)
    return None


class Pauses:
    """The pauses of a poller: ``backoff``'s waits one after another while polls find nothing,
    from the first again after a poll that found work."""

    def __init__(self, backoff: Backoff, rng: random.Random | None = None) -> None:
        self.backoff = backoff
        self._rng = rng
        self._idle = 0

    def next(self, *, busy: bool = False) -> float:
        """Seconds to wait before the next poll; ``busy``: the last one found work."""
        if busy:
            self._idle = 0
        delay = self.backoff.delay(self._idle, self._rng)
        self._idle += 1
        return delay
