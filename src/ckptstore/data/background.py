"""One save in flight, in a background thread, whose errors are never lost.

``save_async`` hands the write-commit-retention sequence to a single worker thread. One save at
a time keeps memory bounded (one snapshot) and keeps steps committing in order, so ``latest``
moves forward without racing our own saves. A failure is kept until someone hears of it: the
handle's ``wait()`` raises it, and if nobody waited, the next save (or ``store.wait()``, or
closing the store) raises it instead. A save still pending when the interpreter exits is
finished first, so a training script that simply returns still commits its last step.

Waiting for that save at exit, or in ``close()`` while a Ctrl-C unwinds the script, says so on
stderr (a silent pause reads as a hang) and offers a way out: a Ctrl-C during the wait abandons
the save (the process then exits with status 130, never 0). Abandoning sets a flag the worker
checks between chunks of payload and right before the commit marker, so it stops at the next
chunk, removes its staged files and commits nothing; the process waits for that cleanup (a
further Ctrl-C stops waiting, and ``gc`` removes what is left, since an attempt nobody commits
is proven dead garbage once it is old).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar

from ckptstore.backends.base import Chunk
from ckptstore.errors import SaveAbandonedError

log = logging.getLogger(__name__)
T = TypeVar("T")
WAKE_SECONDS = 0.1
EXIT_INTERRUPTED = 130
"""The exit status of a process whose pending save was abandoned (as for SIGINT)."""
BACKGROUND_NICENESS = 10
"""How far below the caller a background save runs (nice steps; CFS then gives it about a
tenth of a core that training wants, and any core training leaves idle)."""


class Abandon:
    """The flag a background save checks between chunks and before its commit."""

    def __init__(self, step: int, uri: str) -> None:
        self.step = step
        self.uri = uri
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise SaveAbandonedError once the save was abandoned."""
        if self._event.is_set():
            raise SaveAbandonedError(
                f"the save of step {self.step} to {self.uri} was abandoned (Ctrl-C at exit); "
                "nothing was committed",
                uri=self.uri,
                step=self.step,
            )

    def checked(self, chunks: Callable[[], Iterable[Chunk]]) -> Callable[[], Iterator[Chunk]]:
        """``chunks`` that stop with SaveAbandonedError at the first chunk after abandoning."""

        def produce() -> Iterator[Chunk]:
            for chunk in chunks():
                self.check()
                yield chunk
            self.check()

        return produce


class SaveHandle(Generic[T]):
    """A save running in the background."""

    def __init__(
        self,
        step: int,
        future: Future[T],
        blocked_seconds: float,
        abandon: Abandon,
        snapshot_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.step = step
        self.blocked_seconds = blocked_seconds
        """How long the call was blocked (the snapshot, or its part not overlapped)."""
        self._future = future
        self._abandon = abandon
        self._snapshot_done = snapshot_done
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def snapshot_done(self) -> None:
        """Return once the saved tensors may change: at once, unless an overlapped copy is
        still running (then this copies what is left alongside it). Never raises."""
        self._snapshot_done()

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
        self._worker: int | None = None
        """The worker thread's id: the save it runs must not wait for itself."""

    def submit(
        self,
        step: int,
        work: Callable[[Abandon], T],
        blocked_seconds: float,
        *,
        uri: str = "",
        snapshot_done: Callable[[], None] = lambda: None,
    ) -> SaveHandle[T]:
        """Run ``work(abandon)`` in the worker; it checks ``abandon`` between chunks."""
        abandon = Abandon(step, uri)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix="ckpt-save", initializer=self._start_worker
                )
                # Runs before concurrent.futures refuses new work at shutdown (it registers the
                # same way, earlier, and these run last-registered first), so a save queued when
                # the script returns can still use thread pools to finish. Private, but no public
                # hook runs early enough: atexit.register runs after threading's shutdown (the
                # save then fails, uncommitted), and a non-daemon thread is joined after it.
                threading._register_atexit(self._flush_at_exit)  # type: ignore[attr-defined]
            future = self._executor.submit(work, abandon)
            future.add_done_callback(lambda f: _log_outcome(step, uri, f))
            self._pending = SaveHandle(step, future, blocked_seconds, abandon, snapshot_done)
            return self._pending

    def _start_worker(self) -> None:
        self._worker = threading.get_ident()
        yield_to_training()

    def drain(self) -> None:
        """Wait for the save in flight; raise its error if nobody has heard of it yet. In the
        worker itself (the save in flight waits for any other first), nothing to wait for."""
        pending = self._pending
        if pending is None or threading.get_ident() == self._worker:
            return
        try:
            _wait(pending._future)
        finally:
            error = pending._unreported_error()
        if error is not None:
            raise error

    def _flush_at_exit(self) -> None:
        interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
        try:
            self.finish(interrupted=interrupted, at_exit=True)
            if not self._abandoned():
                self.drain()
                return
        except BaseException as e:  # nobody is left to raise to: say it loudly
            if not isinstance(e, SaveAbandonedError):
                log.error("a save pending at exit failed: %s: %s", type(e).__name__, e)
            return
        _exit_interrupted()

    def finish(self, *, interrupted: bool, at_exit: bool = False) -> bool:
        """Wait for the save in flight. A wait the user did not ask for (at exit, or after a
        Ctrl-C) is announced with the way out: a Ctrl-C then abandons the save. A Ctrl-C during
        a wait not announced yet announces it. Returns whether a Ctrl-C arrived during the
        wait; errors stay for ``drain`` to raise."""
        pending = self._pending
        if pending is None or pending.done():
            return False
        announced, pressed = interrupted or at_exit, False
        if announced:
            _announce(pending, again=interrupted)
        while True:
            try:
                _wait(pending._future)
                return pressed
            except KeyboardInterrupt:
                pressed = True
                if not announced:
                    announced = True
                    _announce(pending, again=True)
                    continue
                _abandon(pending)
                return True

    def _abandoned(self) -> bool:
        """Whether the last save was abandoned (maybe still stopping: then nobody waits)."""
        pending = self._pending
        if pending is None or not pending._abandon.is_set():
            return False
        pending._unreported_error()
        return True

    def close(self) -> None:
        """Wait for the save in flight and raise its error; stop the worker thread. Inside a
        Ctrl-C (a ``with`` block unwinding), waiting is announced and may be abandoned."""
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        try:
            pressed = self.finish(interrupted=interrupted)
            if not self._abandoned():  # abandoning was the user's choice: not an error
                self.drain()
            if pressed and not interrupted:
                raise KeyboardInterrupt
        finally:
            with self._lock:
                if self._executor is not None:
                    idle = self._pending is None or self._pending.done()
                    self._executor.shutdown(wait=idle)
                    self._executor = None


def _exit_interrupted() -> None:
    """End a process whose pending save was abandoned at exit with status 130 (interrupted),
    not the 0 of a script that returned: a scheduler must not take the run for a success.
    The status of a returning script is fixed before this hook runs, so the exit hooks
    (writer lease releases) run now, then the process exits."""
    try:
        atexit._run_exitfuncs()  # private, as threading._register_atexit: no public way
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)


def yield_to_training() -> None:
    """Lower this thread's scheduling priority by :data:`BACKGROUND_NICENESS` (Linux: nice
    is per thread, and threads it starts inherit it). A background save then takes the CPU
    that training leaves idle instead of slowing its steps; on a busy host it finishes later,
    never wrongly. Elsewhere (where the call would name a process, not this thread), or
    where refused, a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, niceness + BACKGROUND_NICENESS))
    except (AttributeError, OSError) as e:  # not Linux, or a sandbox that refuses
        log.debug("background save keeps its priority: %s", e)


def _wait(future: Future[Any]) -> BaseException | None:
    """``future.exception()``, waking every WAKE_SECONDS: Linux may deliver a Ctrl-C to any
    thread, and Python runs its handler in the main thread only between bytecodes, so a
    main thread blocked in one long wait would never see it."""
    while True:
        try:
            return future.exception(WAKE_SECONDS)
        except FutureTimeout:
            continue


def _announce(pending: SaveHandle[Any], *, again: bool) -> None:
    log.warning(
        "finishing the save of step %d to %s; press Ctrl-C %sto abandon it",
        pending.step,
        pending._abandon.uri,
        "again " if again else "",
    )


def _abandon(pending: SaveHandle[Any]) -> None:
    """Tell the worker to stop and wait for it to remove the staged files."""
    pending._abandon.set()
    log.warning(
        "abandoning the save of step %d to %s: removing its staged files (Ctrl-C again to "
        "stop waiting; `ckptstore gc` removes what is left)",
        pending.step,
        pending._abandon.uri,
    )
    try:
        error = _wait(pending._future)
    except KeyboardInterrupt:
        log.warning(
            "left the staged files of step %d in %s; `ckptstore gc` removes them once they are "
            "an hour old (nothing was committed)",
            pending.step,
            pending._abandon.uri,
        )
        return
    if error is None:
        log.warning(
            "step %d was committed to %s before the save could be abandoned",
            pending.step,
            pending._abandon.uri,
        )


def _log_outcome(step: int, uri: str, future: Future[Any]) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if isinstance(error, SaveAbandonedError):
        log.warning(
            "abandoned the save of step %d to %s: nothing was committed, its staged files were "
            "removed (any left over are garbage that `ckptstore gc` removes)",
            step,
            uri,
        )
    elif error is not None:
        log.error("background save of step %d failed: %s", step, error)
