"""Giving writer leases up when nobody calls ``close()``: at interpreter exit, when a store is
collected, and in a hurry while a Ctrl-C unwinds (lease.py holds and renews them).

A script run twice must just work, so a lease its store did not release is released anyway:
by one exit hook for every lease this process holds (nothing piles up per store), and, for a
store that was garbage-collected, by a releaser thread. Not by the finalizer itself: the
collector runs in whichever thread allocates, maybe one that the release's own request waits
on (an in-process server) or one holding a lock it needs. And a release at exit, or while a
Ctrl-C unwinds, waits :data:`HURRIED_RELEASE` seconds at most: a storage that does not answer
must not keep the process from ending; the record then expires after one TTL, as after a kill.
"""

from __future__ import annotations

import atexit
import contextvars
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from ckptstore.backends.base import Backend
from ckptstore.deadline import Deadline, bounded
from ckptstore.errors import BackendError, ErrorContext


class Releasable(Protocol):
    """What this module uses of a lease (lease.py's WriterLease)."""

    backend: Backend
    writer: str
    epoch: int | None
    lost: str | None
    abandoned: bool

    def release(self, *, hurry: bool | None = None) -> None: ...


HURRIED_RELEASE = 5.0
"""Seconds giving the lease up may take while a Ctrl-C unwinds or the interpreter exits: the
write runs on a daemon thread under a deadline of its own, and is left behind after that."""

_HOLDERS: weakref.WeakValueDictionary[tuple[str, str], Releasable] = weakref.WeakValueDictionary()
"""The leases this process holds, by store URI and writer id (a tiered store's two tiers share
one writer id): for a contender in this process, which need not guess, and for the release at
exit (one hook for all, so nothing piles up)."""
_ABANDONED: queue.SimpleQueue[Releasable] = queue.SimpleQueue()
"""Leases whose store was collected, for the releaser thread (SimpleQueue.put is safe in a
finalizer, which may run in any thread at any allocation)."""
_releaser: list[threading.Thread] = []


def holding(lease: Releasable) -> None:
    """``lease`` was taken: known to contenders in this process, released at exit."""
    _HOLDERS[lease.backend.uri, lease.writer] = lease
    _start_releaser()


def held_here(uri: str, writer: str) -> Releasable | None:
    """The lease ``writer`` holds on the store at ``uri`` in this process, if any."""
    return _HOLDERS.get((uri, writer))


def let_go(lease: Releasable) -> None:
    """``lease`` was released (or given up trying): nothing left to do at exit."""
    _HOLDERS.pop((lease.backend.uri, lease.writer), None)


def release_when_collected(owner: object, lease: Releasable) -> None:
    """Have the releaser thread release ``lease`` once ``owner`` (its store) is collected,
    holding no reference to ``owner``."""
    weakref.finalize(owner, _abandon, lease).atexit = False  # _release_all does exit


def _abandon(lease: Releasable) -> None:
    lease.abandoned = True
    _ABANDONED.put(lease)


def hurried(write: Callable[[], None], uri: str, context: ErrorContext) -> None:
    """Run ``write`` (the release's), waiting :data:`HURRIED_RELEASE` seconds at most: on a
    daemon thread (a request blocked in a socket, or on a lock, must not hold the process at
    exit), under a deadline of its own (retries stop by then). Raises what it raised, or a
    retryable BackendError naming ``uri`` when the storage did not answer in time."""
    seconds = HURRIED_RELEASE
    done = threading.Event()
    failed: list[Exception] = []

    def run() -> None:
        try:
            with bounded(Deadline.after(seconds)):
                write()
        except Exception as e:
            failed.append(e)
        finally:
            done.set()

    copied = contextvars.copy_context()
    try:
        threading.Thread(
            target=copied.run, args=(run,), name="ckpt-lease-release", daemon=True
        ).start()
    except RuntimeError:  # no thread starts at interpreter shutdown (3.12+): here, then
        run()
    if not done.wait(seconds + 1.0):
        raise BackendError(
            f"{uri}: the storage did not answer within {seconds:g} s", retryable=True, **context
        )
    if failed:
        raise failed[0]


def _start_releaser() -> None:
    """The thread that releases abandoned leases (started again in a forked child)."""
    if not any(thread.is_alive() for thread in _releaser):
        _releaser[:] = [threading.Thread(target=_release_abandoned, name="ckpt-lease-releaser")]
        _releaser[0].daemon = True
        _releaser[0].start()


def _release_abandoned() -> None:
    while True:
        _ABANDONED.get().release()


@atexit.register
def _release_all() -> None:
    """At interpreter exit, after threading's exit hooks (a pending async save commits first);
    each release waits :data:`HURRIED_RELEASE` seconds at most."""
    for lease in list(_HOLDERS.values()):
        lease.release(hurry=True)
