"""The ``ckptstore`` command: list, inspect, verify, prune and move checkpoints in any store.

Each command is a thin face over :class:`~ckptstore.store.CheckpointStore`; all the rules
(atomic commits, retention safety, verification) live there, so the CLI and the Python API
cannot disagree. Data goes to stdout (``--json``: one JSON document, nothing else); progress
bars, logs and errors go to stderr. Storage options (credentials) are never printed.

Exit codes, so scripts and schedulers can branch on the outcome::

    0    ok
    1    unexpected error (a bug: rerun with -v and report the traceback)
    2    usage or configuration error (bad option or URI, missing extra, refused pickle)
    3    not found (no such step, or the store holds no committed step)
    4    verification failed: a corrupt or incomplete checkpoint (also the demo's mismatch)
    5    conflict: the step exists, is latest or pinned, or another writer won a race
    6    storage error: the backend failed or denied access
    7    compatibility: written by versions this reader refuses (--compat strict)
    130  interrupted (Ctrl-C)

Ctrl-C ends every command with 130, in seconds, whatever it interrupted: an error raised while
it unwound (a cleanup that failed, CPython's own ``RuntimeError: release unlocked lock`` from a
wait it cut short) is reported as the interruption it is; a Ctrl-C that CPython swallowed, or
one that left a lock of CPython's held, is dealt with by :class:`CtrlC`; and the process then
ends without waiting for threads the interrupted work left behind (:func:`main`).

Errors print one line, ``ckptstore: error: <message>``, to stderr; ``-v`` adds the traceback.
With ``--json`` a failure also prints one JSON document on stdout, and nothing else there::

    {"error": {"type": "NotFoundError", "message": "...", "exit_code": 3,
               "uri": "s3://b/run", "step": 99, "path": null}}

(a command that found something before failing, like ``ls`` of an empty store, puts the error
into its own document). Usage errors get the same object where click lets us see ``--json``.
Shell completion is click's: ``eval "$(_CKPTSTORE_COMPLETE=bash_source ckptstore)"`` (also
``zsh_source``, ``fish_source``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import click

from ckptstore.backends.registry import scheme_of
from ckptstore.cli import (
    adopt,
    bucket,
    commands,
    diff,
    export,
    manage,
    replicate,
    reshard,
    transfer,
)
from ckptstore.cli.common import (
    COUNT,
    EXIT_BACKEND,
    EXIT_COMPAT,
    EXIT_CONFLICT,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    EXIT_VERIFY,
    global_options,
    partial_of,
    settings_of,
)
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    DeadlineExceededError,
    IncompleteCheckpointError,
    NotFoundError,
    SerializationError,
    UnsafeLoadError,
)

EXIT_CODES: tuple[tuple[type[CheckpointError], int], ...] = (
    # first match wins, so subclasses come before their bases
    (ConfigError, EXIT_USAGE),
    (SerializationError, EXIT_USAGE),
    (UnsafeLoadError, EXIT_USAGE),
    (NotFoundError, EXIT_NOT_FOUND),
    (CorruptCheckpointError, EXIT_VERIFY),
    (IncompleteCheckpointError, EXIT_VERIFY),
    (ConflictError, EXIT_CONFLICT),
    (BackendError, EXIT_BACKEND),  # AccessDeniedError included
    (DeadlineExceededError, EXIT_BACKEND),  # the storage too slow for --save-timeout
    (CompatibilityError, EXIT_COMPAT),
    (CheckpointError, EXIT_UNEXPECTED),
)

_EPILOG = """\b
Exit codes:
  0    ok
  1    unexpected error (rerun with -v for the traceback)
  2    usage or configuration error
  3    not found (no such step, or an empty store)
  4    verification failed: corrupt or incomplete checkpoint
  5    conflict (step exists, is latest or pinned, lost a race)
  6    storage error (backend failure, access denied, --save-timeout or --load-timeout passed)
  7    compatibility (versions refused under --compat strict, or a newer ckptstore's step)
  8    signed steps whose signature was not checked (no key): verify and show
  130  interrupted
"""


def exit_code_for(error: BaseException) -> int:
    """The documented exit status for an exception (see the module docstring)."""
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return EXIT_UNEXPECTED


# -- the group: error handling in one place -------------------------------------------------


def error_record(error: BaseException, code: int) -> dict[str, Any]:
    """What ``--json`` prints for a failure, inside ``{"error": ...}``."""
    if isinstance(error, click.ClickException):
        message = error.format_message()
    elif isinstance(error, CheckpointError):
        message = str(error)
    else:
        message = f"unexpected {type(error).__name__}: {error}"
    return {
        "type": type(error).__name__,
        "message": message,
        "exit_code": code,
        "uri": getattr(error, "uri", None),
        "step": getattr(error, "step", None),
        "path": getattr(error, "path", None),
    }


def _print_error_json(error: BaseException, code: int, partial: dict[str, Any]) -> None:
    click.echo(json.dumps({**partial, "error": error_record(error, code)}, indent=2))


class _Group(click.Group):
    """Turns our exceptions into one line on stderr and the documented exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt as e:
            _interrupted(ctx, e)
        except BrokenPipeError:
            # The reader went away (``| head``): not an error. Point stdout at devnull so the
            # interpreter's final flush does not raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_OK)
        except Exception as e:  # the one place that reports every error
            pressed = ctrl_c_under(e)
            if pressed is not None:  # raised while a Ctrl-C unwound: that is what happened
                if settings_of(ctx).verbose:
                    traceback.print_exc(file=sys.stderr)
                _interrupted(ctx, pressed)
            settings = settings_of(ctx)
            if settings.verbose:
                traceback.print_exc(file=sys.stderr)
            if isinstance(e, CheckpointError):
                message = str(e)
            else:
                hint = "" if settings.verbose else " (rerun with -v for the traceback)"
                message = f"unexpected {type(e).__name__}: {e}{hint}"
            code = exit_code_for(e)
            if settings.as_json:
                _print_error_json(e, code, partial_of(ctx))
            click.echo(f"ckptstore: error: {message}", err=True)
            ctx.exit(code)


def _interrupted(ctx: click.Context, e: KeyboardInterrupt) -> None:
    if settings_of(ctx).as_json:
        _print_error_json(e, EXIT_INTERRUPTED, {})
    click.echo("ckptstore: interrupted", err=True)
    ctx.exit(EXIT_INTERRUPTED)


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
        import _thread

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


@click.group(cls=_Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@global_options(loads=True)
@click.version_option(package_name="ckptstore", prog_name="ckptstore")
def cli() -> None:
    """Atomic, verified checkpoints on local disks, NFS, S3 and fsspec URLs.

    URI is a store: a local path, s3://bucket/prefix, or any fsspec URL. STEP is a number
    (100, global_step_100) or 'latest'. Options may come before or after the command.
    """


for _command in [
    *commands.COMMANDS,
    *manage.COMMANDS,
    *diff.COMMANDS,
    *reshard.COMMANDS,
    *export.COMMANDS,
    *transfer.COMMANDS,
    *replicate.COMMANDS,
    *adopt.COMMANDS,
    *bucket.COMMANDS,
]:
    cli.add_command(_command)


# -- demo ------------------------------------------------------------------------------------


@cli.command("demo")
@click.option("--uri", help="Store to use instead of a bucket on an embedded S3 server.")
@click.option("--steps", type=click.IntRange(min=2), default=60, show_default=True)
@click.option("--save-every", type=COUNT, default=10, show_default=True)
@click.option("--keep-last", type=COUNT, default=3, show_default=True)
@click.option(
    "--kill-at",
    type=COUNT,
    help="Step at which the first run is killed (default: between two saves, half-way).",
)
@global_options(loads=True, output=False)
@click.pass_context
def demo_command(
    ctx: click.Context,
    uri: str | None,
    steps: int,
    save_every: int,
    keep_last: int,
    kill_at: int | None,
) -> None:
    """Train, get killed, resume on a fresh process from S3, and prove it bit-identical."""
    from ckptstore.cli.demo import run_demo

    settings = settings_of(ctx)
    if settings.as_json:
        raise click.UsageError("demo prints a narrative; --json does not apply to it")
    options = None
    if uri is not None:
        options = {} if scheme_of(uri) == "file" else dict(settings.storage_options)
    code = run_demo(
        uri=uri,
        storage_options=options,
        steps=steps,
        save_every=save_every,
        keep_last=keep_last,
        kill_at=kill_at,
        verbose=settings.verbose,
    )
    ctx.exit(code)


# -- entry point -----------------------------------------------------------------------------


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"ckptstore: {record.levelname.lower()}: {record.getMessage()}"


def _configure_logging() -> None:
    """Warnings and errors to stderr by default; -v raises the ckptstore loggers' level."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    _configure_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with CTRL_C.watching():
            result = cli.main(args=args, prog_name="ckptstore", standalone_mode=False)
    except click.ClickException as e:
        if _asks_json(args):
            _print_error_json(e, e.exit_code, {})
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("ckptstore: interrupted", err=True)
        return EXIT_INTERRUPTED
    return result if isinstance(result, int) else EXIT_OK


def _asks_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (not after ``--``): a usage error stops
    parsing before the option's callback may have run."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


EXIT_GRACE = 10.0
"""Seconds the exit hooks of a command a Ctrl-C stopped get (a writer lease still open is
released, logs are flushed) before the process ends regardless."""


def main() -> None:
    """The console script ``ckptstore``."""
    CTRL_C.hard = True  # the process is ours: it may end, if it must
    try:
        code = run()
    finally:
        CTRL_C.hard = False
    if code == EXIT_INTERRUPTED:
        _exit_interrupted(code)
    sys.exit(code)


def _exit_interrupted(code: int) -> NoReturn:
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


__all__ = ["CTRL_C", "EXIT_CODES", "CtrlC", "cli", "ctrl_c_under", "exit_code_for", "main", "run"]
