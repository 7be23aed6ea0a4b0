"""Ctrl-C ends every command with 130, in seconds, whatever it interrupted.

An error raised while a Ctrl-C unwound (a cleanup that failed, CPython's own ``RuntimeError:
release unlocked lock`` from a wait it cut short) is the interruption it is
(:func:`ctrl_c_under`); a Ctrl-C that CPython swallowed, or one that left a lock of CPython's
held, is dealt with by :class:`CtrlC`; and the process then ends without waiting for threads
the interrupted work left behind (:func:`exit_interrupted`). The command line (main.py) uses
them; nothing here knows a command.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from ckptstore.cli.common import EXIT_INTERRUPTED


def ctrl_c_under(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt ``error`` was raised while handling (its ``__context__`` or
    ``__cause__``, however deep), if any."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        todo += [e.__context__, e.__cause__]
    return None


class CtrlC:
    """What makes one Ctrl-C end a command, while it runs (:meth:`watching`), wherever it lands.

    Python raises KeyboardInterrupt wherever the main thread next checks for signals, and two
    kinds of places there are CPython's own:

    * a weakref callback or a ``__del__`` (a thread pool's or a WeakSet's bookkeeping runs them
      all the time): there the exception is "ignored", printed and dropped, and the Ctrl-C is
      lost; a ``replicate --follow`` would poll on forever. ``sys.unraisablehook`` sees such a
      KeyboardInterrupt: it is not printed, and SIGINT is sent to the main thread again (from
      this class's thread: sent from the hook, it would land in the hook and be dropped again);
    * a ``Condition.__enter__`` (``Thread.start``, a thread pool's semaphore): its lock taken,
      the ``with`` not entered, so the lock stays held, and a thread that needs it next never
      ends; the command, unwinding, may wait for that thread (a pool's ``__exit__`` joins its
      workers). So a command still running :data:`SECOND_CTRL_C` seconds after a Ctrl-C gets
      SIGINT again, as from a second Ctrl-C (which ends any wait), and again each such while;
      with ``hard`` (the installed command, not an in-process ``run``), one still running that
      long after the second ends at once with status 130.

    A KeyboardInterrupt is only seen here where Python's own handler raised it (a SIGINT
    ignored, or handled by the program, is left alone). The thread hears of events through a
    SimpleQueue, which is safe to use from a signal handler and a finalizer.
    """

    def __init__(self) -> None:
        self.hard = False
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        previous_hook = sys.unraisablehook
        events = self._events

        def hook(unraisable: Any) -> None:
            if isinstance(unraisable.exc_value, KeyboardInterrupt) and (
                threading.current_thread() is threading.main_thread()
            ):
                events.put("lost")
                return
            previous_hook(unraisable)

        def pressed(signum: int, frame: Any) -> None:
            events.put("pressed")
            raise KeyboardInterrupt

        ours = threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        self._start()
        sys.unraisablehook = hook
        if ours:
            signal.signal(signal.SIGINT, pressed)
        try:
            yield
        finally:
            events.put("done")
            if ours and signal.getsignal(signal.SIGINT) is pressed:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if sys.unraisablehook is hook:
                sys.unraisablehook = previous_hook

    def _start(self) -> None:
        with self._lock:  # one thread per process (again in a forked child)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._watch, name="ckptstore-ctrl-c", daemon=True
                )
                self._thread.start()

    def _watch(self) -> None:
        due: float | None = None  # when a command a Ctrl-C stops must have ended
        again = False  # SIGINT was sent again already
        while True:
            try:
                event = self._events.get(timeout=None if due is None else due - time.monotonic())
            except (queue.Empty, ValueError):  # ValueError: a negative timeout, overdue
                if again and self.hard:
                    _end(EXIT_INTERRUPTED)
                again, due = True, time.monotonic() + SECOND_CTRL_C
                _interrupt_main()
                continue
            if event == "lost":
                _interrupt_main()
            elif event == "pressed" and due is None:
                again, due = False, time.monotonic() + SECOND_CTRL_C
            elif event == "done":
                due = None


def _interrupt_main() -> None:
    """SIGINT to the main thread: it ends a sleep or a wait there, as a real Ctrl-C does."""
    main = threading.main_thread().ident
    kill = getattr(signal, "pthread_kill", None)
    if kill is not None and main is not None:
        kill(main, signal.SIGINT)
    else:  # pragma: no cover - Windows
        _thread.interrupt_main()


def _end(code: int) -> NoReturn:
    """End the process now, its output flushed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


SECOND_CTRL_C = 10.0
"""Seconds a command may take to stop in order after a Ctrl-C (give its writer lease up, abort
its uploads) before it is interrupted again, as a second Ctrl-C would (:class:`CtrlC`)."""
CTRL_C = CtrlC()
"""The process's one watcher: its thread is started once (again in a forked child)."""


EXIT_GRACE = 10.0
"""Seconds the exit hooks of a command a Ctrl-C stopped get (a writer lease still open is
released, logs are flushed) before the process ends regardless."""


def exit_interrupted(code: int) -> NoReturn:
    """End a command a Ctrl-C stopped now, without waiting for the threads it left behind.

    The interpreter's exit joins every non-daemon thread (the thread pools' workers), and a
    Ctrl-C may have left one that never ends: it can land in CPython's own bookkeeping of a
    thread being started (``Condition.__enter__`` in ``Thread.start``'s wait, where it leaves
    the new thread's start lock held), so that the new thread can never finish starting, and
    the exit would wait for it forever. So the exit hooks run (writer leases not released yet,
    logging), :data:`EXIT_GRACE` seconds at most, the output is flushed, and the process ends.
    """

    def end_later() -> None:
        time.sleep(EXIT_GRACE)
        _end(code)

    with contextlib.suppress(RuntimeError):  # no thread: the hooks run unbounded, as usual
        threading.Thread(target=end_later, name="ckptstore-exit", daemon=True).start()
    try:
        atexit._run_exitfuncs()  # private, as background.py's: there is no public way
    finally:
        _end(code)


__all__ = [
    "CTRL_C",
    "EXIT_GRACE",
    "SECOND_CTRL_C",
    "CtrlC",
    "ctrl_c_under",
    "exit_interrupted",
]
