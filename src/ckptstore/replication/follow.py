"""Following a run from another cluster: wait until a newer step is committed.

An evaluation or rollout cluster that picks up each checkpoint of a training run polls the
store: each poll is one listing of the step directories (the catalog reads the manifests of
steps it has not seen, and the pointer, to leave out steps a fenced writer committed), and
the pause between polls grows from ``interval`` by half each time up to ``max_interval``
(:func:`poll_backoff`, a :class:`~ckptstore.retry.Backoff` with no jitter), so a follower that
waits for hours costs a few requests a minute. A step is returned only once its
manifest exists, so whatever it returns is complete and will load.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import ConfigError, WaitTimeoutError
from ckptstore.retry import Backoff, Pauses

DEFAULT_INTERVAL = 5.0
"""Seconds before the second poll."""
MAX_INTERVAL = 30.0
"""The longest pause between polls."""
GROWTH = 1.5
"""How much each idle poll's pause grows."""


class Steps(Protocol):
    """What waiting needs of a store (CheckpointStore has it)."""

    uri: str

    def list(self) -> builtins.list[CheckpointInfo]: ...

    def fenced_steps(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[int]: ...


def poll_backoff(interval: float, max_interval: float = MAX_INTERVAL) -> Backoff:
    """The pauses of a poller (for :class:`~ckptstore.retry.Pauses`): ``interval`` first
    (10 ms at least), half as long again after each idle poll, up to ``max_interval``; no
    jitter, as nobody races it. ConfigError for a negative or NaN value (a user's option)."""
    for name, value in (("interval", interval), ("max_interval", max_interval)):
        if not value >= 0:
            raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
    first = max(interval, 0.01)
    return Backoff(base=first, cap=max(max_interval, first), factor=GROWTH, jitter=0.0)


def newest_after(store: Steps, newer_than: int | None) -> CheckpointInfo | None:
    """The newest committed step after ``newer_than`` (any step, if None), fenced ones left out."""
    infos = store.list()
    fenced = set(store.fenced_steps(infos)) if infos else set()
    newer = [
        i for i in infos if i.step not in fenced and (newer_than is None or i.step > newer_than)
    ]
    return newer[-1] if newer else None


def wait_for_step(
    store: Steps,
    newer_than: int | None = None,
    *,
    timeout: float | None = None,
    interval: float = DEFAULT_INTERVAL,
    max_interval: float = MAX_INTERVAL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> CheckpointInfo:
    """The newest step committed after ``newer_than``, as soon as there is one.

    ``newer_than=None`` waits for a step newer than the store's latest now (any step, in an
    empty store). ``timeout`` (seconds, None: forever) raises WaitTimeoutError, a
    NotFoundError, naming the store and the step waited past.
    """
    for name, value in (("timeout", timeout), ("interval", interval)):
        if value is not None and not value >= 0:
            raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
    deadline = None if timeout is None else clock() + timeout
    if newer_than is None:
        current = newest_after(store, None)
        newer_than = current.step if current is not None else None
    pauses = Pauses(poll_backoff(interval, max_interval))
    while True:
        found = newest_after(store, newer_than)
        if found is not None:
            return found
        now = clock()
        if deadline is not None and now >= deadline:
            what = "step" if newer_than is None else f"step newer than {newer_than}"
            raise WaitTimeoutError(
                f"{store.uri}: no {what} was committed within {timeout:g} s; the run may be "
                "slower than that, stopped, or saving elsewhere (check the URI). Wait longer "
                "(--timeout), or not at all",
                uri=store.uri,
                step=newer_than,
            )
        delay = pauses.next()
        sleep(delay if deadline is None else min(delay, deadline - now))


__all__ = ["DEFAULT_INTERVAL", "MAX_INTERVAL", "newest_after", "poll_backoff", "wait_for_step"]
