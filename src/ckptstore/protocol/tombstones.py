"""Tombstones at a step's manifest key: claimed before files go, dropped in two phases.

A tombstone stands where a manifest would, so while it stands no commit of the step succeeds
with a create-only write. A save may still commit over a tombstone that names none of its
attempts (compare-and-swap against the version it read), so a plain read-then-delete of a
tombstone could delete a manifest committed in between. The dropper therefore first marks the
tombstone *dropping* by compare-and-swap (which fails if a commit got there first), then deletes
it, only within :data:`DROP_WINDOW` seconds of starting, on its own monotonic clock. Nobody
commits or claims over a dropping tombstone: they wait for the key to go, and only after
watching it for longer than the window (the dropper died, or gave up) swap over it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

from ckptstore import deadline
from ckptstore.backends.base import Backend, join
from ckptstore.deadline import Deadline, bounded
from ckptstore.domain import layout
from ckptstore.domain.manifest import (
    dropping_tombstone,
    encode_tombstone,
    is_tombstone,
    tombstone_dropping,
)
from ckptstore.errors import (
    DeadlineExceededError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)
from ckptstore.retry import Backoff, Pauses

log = logging.getLogger(__name__)

DROP_WINDOW = 10.0
"""Seconds after it began marking a tombstone dropping within which a dropper deletes it."""
DROP_MARGIN = 5.0
"""What a waiter adds to the window: requests in flight, clocks that tick a little apart."""
DROP_POLL = Backoff(base=0.05, cap=1.0, jitter=0.0)
"""A waiter's pauses between looks at a dropping tombstone: 50 ms, doubling to 1 s."""


class Tombstones:
    """Claims, drops and waits on the tombstones of one backend's steps, for one writer."""

    def __init__(
        self,
        backend: Backend,
        writer: str,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self.backend = backend
        self.writer = writer
        self.clock = clock
        self.monotonic = monotonic
        self.sleep = sleep

    def claim(self, step: int, attempts: Iterable[str]) -> bool:
        """Put a fresh tombstone naming ``attempts`` at an uncommitted step's manifest key
        (create-only, or by compare-and-swap over an older tombstone); False if a manifest is
        there. A committer may commit over a tombstone that names none of its attempts, by
        compare-and-swap against the version it read, so a newer claim always wins.

        Tombstones are not deleted right away: a committer that saw the key empty before a
        remover's tombstone could otherwise commit after the remover deleted both its files and
        the tombstone. ``gc`` removes a tombstone once it is a day old.
        """
        path = layout.manifest_path(step)
        tombstone = encode_tombstone(self.writer, self.clock(), attempts)
        for _ in range(3):
            try:
                self.backend.create(path, tombstone)
                return True
            except ObjectExistsError:
                pass
            try:
                held, version = self.backend.read_versioned(path)
            except NotFoundError:
                continue
            if not is_tombstone(held):
                return False
            if tombstone_dropping(held) is not None and self.outwait_drop(path, version):
                continue  # gone: create it
            try:
                self.backend.swap(path, tombstone, version)
                return True
            except PreconditionFailedError:
                continue
        return False

    def drop(self, step: int, *, gone: bool = False) -> bool:
        """Delete the step's tombstone, unless a manifest replaced it, in two phases (module
        docstring); False if it is left standing (marking or deleting took past the window:
        the next prune or gc drops it). A tombstone another remover is dropping is marked
        afresh: whoever waits on the old mark sees it change and looks again. With ``gone``,
        True means no tombstone is left there: one that a rival marked first (and may have
        died before deleting) answers False."""
        path = layout.manifest_path(step)
        try:
            held, version = self.backend.read_versioned(path)
        except NotFoundError:
            return True
        if not is_tombstone(held):
            return True
        started = self.monotonic()
        try:
            self.swap(path, dropping_tombstone(held, self.writer, self.clock()), version)
        except PreconditionFailedError:  # a commit over it, or a newer claim: not ours now
            return not gone or not self.stands(step)
        left = max(0.0, DROP_WINDOW - (self.monotonic() - started))
        try:
            with bounded(Deadline.after(left, clock=self.monotonic)):
                deadline.check(join(self.backend.uri, path), doing="delete")
                self.backend.delete([path])
        except DeadlineExceededError as e:
            log.warning(
                "%s: left the tombstone of step %d for the next gc: %s", self.backend.uri, step, e
            )
            return False
        return True

    def stands(self, step: int) -> bool:
        """Whether a tombstone stands at the step's manifest key (fresh read)."""
        try:
            return is_tombstone(self.backend.read(layout.manifest_path(step)))
        except NotFoundError:
            return False

    def outwait_drop(self, path: str, version: str) -> bool:
        """Wait for a dropping tombstone (at ``version``) to be deleted; True once the key is
        gone or holds something else (look again), False once it stood unchanged past the
        dropper's window: its dropper deletes it no more, so it may be swapped over."""
        until = self.monotonic() + DROP_WINDOW + DROP_MARGIN
        pauses = Pauses(DROP_POLL)
        while self.monotonic() < until:
            self.sleep(pauses.next())
            try:
                _, now = self.backend.read_versioned(path)
            except NotFoundError:
                return True
            if now != version:
                return True
        return False

    def swap(self, path: str, data: bytes, version: str) -> None:
        """Compare-and-swap, where a failed precondition caused by our own swap (it landed,
        its answer was lost, the retry found the object changed) counts as done."""
        try:
            self.backend.swap(path, data, version)
        except PreconditionFailedError:
            with contextlib.suppress(NotFoundError):
                if self.backend.read(path) == data:
                    return
            raise
