"""One save in flight, in a background thread, whose errors are never lost.

``save_async`` hands the write-commit-retention sequence to a single worker thread. One save at
a time keeps memory bounded (one snapshot) and keeps steps committing in order, so ``latest``
moves forward without racing our own saves. A failure is kept until someone hears of it: the
handle's ``wait()`` raises it, and if nobody waited, the next save (or ``store.wait()``, or
closing the store) raises it instead. A save still pending when the interpreter exits is
finished first, so a training script that simply returns still commits its last step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class SaveHandle(Generic[T]):
    """A save running in the background."""

    def __init__(self, step: int, future: Future[T], blocked_seconds: float) -> None:
        self.step = step
        self.blocked_seconds = blocked_seconds
        """How long the caller was blocked (the snapshot), in seconds."""
        self._future = future
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """The committed step's info; raises what the background save raised."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done():
                self._reported = True
            raise

    def _unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        error = self._future.exception()
        self._reported = True
        return error

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle(step={self.step}, {state}, blocked={self.blocked_seconds:.3f}s)"


class BackgroundSaver(Generic[T]):
    """A single worker thread and the handle of the save it runs."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: SaveHandle[T] | None = None
        self._lock = threading.Lock()

    def submit(self, step: int, work: Callable[[], T], blocked_seconds: float) -> SaveHandle[T]:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
                # Runs before concurrent.futures refuses new work at shutdown (it registers the
                # same way, earlier, and these run last-registered first), so a save queued when
                # the script returns can still use thread pools to finish. Private, but no public
                # hook runs early enough: atexit.register runs after threading's shutdown (the
                # save then fails, uncommitted), and a non-daemon thread is joined after it.
                threading._register_atexit(self._flush_at_exit)  # type: ignore[attr-defined]
            future = self._executor.submit(work)
            future.add_done_callback(lambda f: _log_failure(step, f))
            self._pending = SaveHandle(step, future, blocked_seconds)
            return self._pending

    def drain(self) -> None:
        """Wait for the save in flight; raise its error if nobody has heard of it yet."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending._future.exception()  # waits without raising
        finally:
            error = pending._unreported_error()
        if error is not None:
            raise error

    def _flush_at_exit(self) -> None:
        try:
            self.drain()
        except BaseException as e:  # nobody is left to raise to: say it loudly
            log.error("a save pending at exit failed: %s", e)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            with self._lock:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None


def _log_failure(step: int, future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("background save of step %d failed: %s", step, future.exception())
