"""The heartbeat that keeps a writer lease: a renewal every ``ttl / 4``, not only at saves.

An RL job that saves every half hour keeps its lease this way, and its record changes for any
contender watching it (lease_contest.py). Each renewal is bounded by a deadline of one period:
a renewal stuck in a storage that does not answer would hold the lease's lock (and with it a
release, or a persist's renewal) for as long as the storage retries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from ckptstore.deadline import Deadline, bounded


class Heartbeat:
    """A daemon thread calling ``renew`` every ``period`` seconds until it returns False or
    :meth:`stop` is called."""

    def __init__(self, renew: Callable[[], bool], period: float, uri: str, name: str) -> None:
        self.renew = renew
        self.period = period
        self.uri = uri
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No renewal after the one in progress, if any; returns at once."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Stop, and wait up to ``timeout`` seconds for a renewal in progress to end (not from
        the heartbeat's own thread, which returns at once)."""
        self.stop()
        if self._thread is threading.current_thread():
            return
        # A Ctrl-C that landed in start() may have left a thread that never started (join
        # raises), or one that did: it sees the stop at its first wait. A renewal stuck in the
        # storage is waited for by the deadline in force (close's).
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout)

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            with bounded(Deadline.after(self.period, store=self.uri)):
                if not self.renew():
                    return
