"""Daemon threads for S3 attempts that somebody waits for with a timeout.

The retry loop (:mod:`.s3_retry`) runs an attempt on one of these when it must not wait for it
longer than a deadline or ``first_byte_timeout``: a request blocked in a socket call ends only
when that call times out (``stall_timeout``), and the caller must not. Threads of the transfer
pool and of these helpers are marked (:func:`mark_worker`): an attempt already on one runs in
place, since whoever waits for it waits with the deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Helpers", "in_context", "mark_worker", "on_worker"]

T = TypeVar("T")

_LOCAL = threading.local()


def mark_worker() -> None:
    """Thread initializer of the transfer and helper pools: attempts there run in place."""
    _LOCAL.worker = True


def on_worker() -> bool:
    return bool(getattr(_LOCAL, "worker", False))


class Helpers:
    """At most ``limit`` daemon threads that run attempts somebody waits for with a timeout
    (a deadline, ``first_byte_timeout``); attempts beyond that wait their turn. Daemon threads,
    unlike a ThreadPoolExecutor's (which the interpreter joins at exit): an attempt given up
    while blocked in a socket call, until its socket timeout, keeps neither its caller nor the
    process's exit (a Ctrl-C, a failed command) waiting."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit, self.name = limit, name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a job that no submit counted on yet
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on a helper; RuntimeError once closed, or where no thread can start (at
        interpreter shutdown)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the helpers are closed")
            if self._idle:
                self._idle -= 1
            elif self._threads < self.limit:
                thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                thread.start()  # RuntimeError at interpreter shutdown: nothing queued yet
                self._threads += 1
            self._queue.put(_Job(future, fn))
        return future

    def close(self) -> None:
        """Stop the threads once their attempt ends; attempts not started are cancelled."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.future.cancel()
            for _ in range(self._threads):
                self._queue.put(None)

    def _work(self) -> None:
        mark_worker()
        while (job := self._queue.get()) is not None:
            job.run()
            del job
            with self._lock:
                self._idle += 1


def in_context(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` to run in a copy of this context (its deadline) on another thread."""
    context = contextvars.copy_context()
    return lambda: context.run(fn)


class _Job:
    def __init__(self, future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
        self.future, self.fn = future, fn

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as e:  # the caller raises it, or nobody waits for it any more
            self.future.set_exception(e)
        else:
            self.future.set_result(result)
