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
one that left a lock of CPython's held, is dealt with by :class:`~ckptstore.cli.interrupt.CtrlC`;
and the process then ends without waiting for threads the interrupted work left behind
(interrupt.py).

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

import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

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
from ckptstore.cli.interrupt import CTRL_C, CtrlC, ctrl_c_under, exit_interrupted
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


def main() -> None:
    """The console script ``ckptstore``."""
    CTRL_C.hard = True  # the process is ours: it may end, if it must
    try:
        code = run()
    finally:
        CTRL_C.hard = False
    if code == EXIT_INTERRUPTED:
        exit_interrupted(code)
    sys.exit(code)


__all__ = ["CTRL_C", "EXIT_CODES", "CtrlC", "cli", "ctrl_c_under", "exit_code_for", "main", "run"]
