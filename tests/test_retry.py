"""The package's retry policy (ckptstore/retry.py) as tables of cases, with no I/O: a fake
clock that only the fake sleep moves, a random source that draws what a case says."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from ckptstore.deadline import Deadline, Operation, bounded
from ckptstore.errors import (
    BackendError,
    ConflictError,
    LoadTimeoutError,
    PreconditionFailedError,
    SaveTimeoutError,
)
from ckptstore.retry import Backoff, Pauses, Retry, sleep_within


class Draw(random.Random):
    """A random source whose every draw is ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


class Time:
    """A clock that moves only when slept on; records the sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def script(*outcomes: Exception | str) -> tuple[Callable[[], str], list[int]]:
    """A call that raises or returns each outcome in turn; and the count of calls made."""
    calls = [0]

    def call() -> str:
        outcome = outcomes[calls[0]]
        calls[0] += 1
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return call, calls


def raced(e: Exception) -> bool:
    return isinstance(e, PreconditionFailedError)


LOST = PreconditionFailedError("s3://b/run/latest.json changed since it was read")
"""A retryable failure (by type)."""
FATAL = ConflictError("s3://b/run/step 3 is already committed")
"""The parent type of LOST: not retryable, though its message reads alike."""
FIXED = Backoff(base=0.5, cap=4.0, jitter=0.0)


# -- Backoff ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backoff", "failures", "longest"),
    [
        (Backoff(0.1, 5.0), [0, 1, 2, 5], [0.1, 0.2, 0.4, 3.2]),  # doubles
        (Backoff(0.1, 5.0), [6, 7, 60], [5.0, 5.0, 5.0]),  # capped
        (Backoff(0.1, 5.0), [5000], [5.0]),  # 2.0**5000 overflows a float: the cap
        (Backoff(1.0, 30.0, factor=1.5), [0, 1, 2, 9], [1.0, 1.5, 2.25, 30.0]),
        (Backoff(0.2, 0.2, factor=1.0), [0, 3], [0.2, 0.2]),  # a fixed pause
        (Backoff(0.0, 1.0), [0, 9], [0.0, 0.0]),  # no wait at all
    ],
)
def test_the_longest_wait_grows_by_factor_and_is_capped(
    backoff: Backoff, failures: list[int], longest: list[float]
) -> None:
    assert [backoff.longest(n) for n in failures] == pytest.approx(longest)


@pytest.mark.parametrize(
    ("jitter", "draw", "wait"),
    [
        (1.0, 0.0, 0.8),  # full jitter: anywhere in (0, longest]
        (1.0, 0.999999, 0.0000008),
        (1.0, 0.5, 0.4),
        (0.5, 0.999999, 0.4000004),  # half: never below half the longest
        (0.5, 0.0, 0.8),
        (0.0, 0.999999, 0.8),  # none: exactly the longest, whatever the draw
    ],
)
def test_jitter_takes_its_share_of_the_wait_at_random(
    jitter: float, draw: float, wait: float
) -> None:
    backoff = Backoff(0.2, 5.0, jitter=jitter)
    assert backoff.delay(2, Draw(draw)) == pytest.approx(wait)  # longest: 0.8


@pytest.mark.parametrize("jitter", [0.0, 0.3, 1.0])
def test_jittered_waits_stay_within_their_bounds(jitter: float) -> None:
    backoff, rng = Backoff(0.05, 2.0, jitter=jitter), random.Random(7)
    for n in range(12):
        longest = backoff.longest(n)
        waits = [backoff.delay(n, rng) for _ in range(200)]
        assert all(longest * (1 - jitter) <= w <= longest for w in waits)
        assert (max(waits) - min(waits) > 0) == (jitter > 0)  # drawn, or fixed


@pytest.mark.parametrize(
    "make",
    [
        lambda: Backoff(-0.1, 1.0),
        lambda: Backoff(2.0, 1.0),  # base above the cap
        lambda: Backoff(float("nan"), 1.0),
        lambda: Backoff(0.1, 1.0, factor=0.5),  # waits that shrink
        lambda: Backoff(0.1, 1.0, jitter=1.5),
        lambda: Retry(FIXED),  # no bound: it would never end
        lambda: Retry(FIXED, attempts=0),
        lambda: Retry(FIXED, budget=-1.0),
        lambda: FIXED.longest(-1),
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


# -- Retry.wait: when the policy gives up ----------------------------------------------------------


@pytest.mark.parametrize(
    ("retry", "failures", "spent", "wait"),
    [
        (Retry(FIXED, attempts=3), 1, 0.0, 0.5),
        (Retry(FIXED, attempts=3), 2, 0.0, 1.0),
        (Retry(FIXED, attempts=3), 3, 0.0, None),  # the third try failed: no fourth
        (Retry(FIXED, attempts=1), 1, 0.0, None),  # one try, no retry
        (Retry(FIXED, budget=10.0), 3, 7.0, 2.0),  # ends at 9 s: within the budget
        (Retry(FIXED, budget=10.0), 3, 8.5, None),  # would end past it
        (Retry(FIXED, budget=10.0), 9, 0.0, 4.0),  # capped, and no count
        (Retry(FIXED, attempts=5, budget=1.0), 2, 0.0, 1.0),
        (Retry(FIXED, attempts=5, budget=1.0), 2, 0.1, None),  # the budget comes first
    ],
)
def test_the_policy_gives_up_on_attempts_or_on_its_budget(
    retry: Retry, failures: int, spent: float, wait: float | None
) -> None:
    assert retry.wait(failures, spent) == wait


# -- Retry.run: the loop -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retry", "outcomes", "calls", "slept", "raises"),
    [
        (Retry(FIXED, attempts=5), ["done"], 1, [], None),
        (Retry(FIXED, attempts=5), [LOST, LOST, "done"], 3, [0.5, 1.0], None),
        (Retry(FIXED, attempts=3), [LOST, LOST, LOST, "done"], 3, [0.5, 1.0], LOST),
        (Retry(FIXED, attempts=5), [LOST, FATAL, "done"], 2, [0.5], FATAL),  # at once
        (Retry(FIXED, attempts=5), [FATAL], 1, [], FATAL),
        (Retry(FIXED, budget=3.0), [LOST] * 9, 3, [0.5, 1.0], LOST),  # 1.5 + 2 > 3
        (
            Retry(FIXED, attempts=9, budget=60),
            [LOST] * 8 + ["done"],
            9,
            [0.5, 1, 2] + [4] * 5,
            None,
        ),
    ],
)
def test_the_loop_retries_what_is_retryable_and_counts_its_attempts(
    retry: Retry,
    outcomes: Sequence[Exception | str],
    calls: int,
    slept: list[float],
    raises: Exception | None,
) -> None:
    time = Time()
    call, made = script(*outcomes)
    if raises is None:
        assert retry.run(call, retryable=raced, sleep=time.sleep, clock=time.clock) == "done"
    else:
        with pytest.raises(type(raises)) as caught:
            retry.run(call, retryable=raced, sleep=time.sleep, clock=time.clock)
        assert caught.value is raises  # the error itself, not a wrapper
    assert made[0] == calls and time.slept == slept


@pytest.mark.parametrize(
    ("seconds", "operation", "error", "calls", "slept"),
    [
        (1.2, "save", SaveTimeoutError, 2, [0.5]),  # 0.5 slept; 1.0 would cross 1.2
        (1.5, "load", LoadTimeoutError, 2, [0.5]),  # 1.0 would end at the deadline exactly
        (1.51, "save", None, 3, [0.5, 1.0]),  # room for both waits
    ],
)
def test_a_deadline_stops_the_loop_before_the_wait_that_would_cross_it(
    seconds: float,
    operation: Operation,
    error: type[Exception] | None,
    calls: int,
    slept: list[float],
) -> None:
    time = Time()
    call, made = script(LOST, LOST, "done")
    deadline = Deadline.after(seconds, operation=operation, rank=4, clock=time.clock)
    with bounded(deadline):
        if error is None:
            assert Retry(FIXED, attempts=5).run(call, retryable=raced, sleep=time.sleep) == "done"
        else:
            with pytest.raises(error) as caught:
                Retry(FIXED, attempts=5).run(
                    call,
                    retryable=raced,
                    target="s3://b/run/latest.json",
                    doing="move latest to step 3",
                    sleep=time.sleep,
                )
            assert caught.value.__cause__ is LOST  # the failure that would have been retried
            message = str(caught.value)
            assert (
                "rank 4's" in message and "move latest to step 3 s3://b/run/latest.json" in message
            )
    assert made[0] == calls and time.slept == slept
    assert time.now < deadline.expires  # never slept up to the deadline


# -- sleep_within and Pauses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "left", "slept", "stopped"),
    [
        (0.5, None, [0.5], False),  # no deadline
        (0.5, 2.0, [0.5], False),
        (2.0, 2.0, [], True),  # would reach it: no sleep at all
        (3.0, 2.0, [], True),
        (0.0, 0.0, [], True),  # passed already
    ],
)
def test_a_wait_never_reaches_the_deadline(
    seconds: float, left: float | None, slept: list[float], stopped: bool
) -> None:
    time = Time()
    deadline = None if left is None else Deadline.after(left, clock=time.clock)
    reached = sleep_within(seconds, deadline, time.sleep)
    assert reached is (deadline if stopped else None)
    assert time.slept == slept


def test_a_pollers_pauses_grow_while_idle_and_start_again_after_work() -> None:
    pauses = Pauses(Backoff(1.0, 3.0, factor=1.5, jitter=0.0))
    idle = [pauses.next() for _ in range(5)]
    assert idle == pytest.approx([1.0, 1.5, 2.25, 3.0, 3.0])
    assert pauses.next(busy=True) == 1.0 and pauses.next() == 1.5


def test_a_caller_turns_the_last_lost_race_into_its_own_error() -> None:
    """What cas.swap_loop does: the policy raises the last error, the caller names the object."""
    time = Time()
    call, made = script(*[LOST] * 4)

    def swap() -> str:
        try:
            return Retry(Backoff(0.02, 1.0), attempts=4).run(
                call, retryable=raced, sleep=time.sleep
            )
        except PreconditionFailedError as e:
            raise BackendError("could not move latest after 4 attempts", retryable=True) from e

    with pytest.raises(BackendError, match="after 4 attempts") as caught:
        swap()
    assert caught.value.__cause__ is LOST and made[0] == 4 and len(time.slept) == 3
    assert all(0 < s <= min(1.0, 0.02 * 2**n) for n, s in enumerate(time.slept))
