"""What every ``ckptstore`` command shares: global options, opening stores, printing results.

Global options (``--storage-option``, ``--endpoint-url``, ``--json``, ``--compat``, ``-v``) are
accepted both before and after the command name, because ``ckptstore ls s3://b/run
--endpoint-url ...`` is what people type. Click callbacks merge them into one
:class:`Settings` kept in the context's ``meta`` (shared by the group and its commands, later
values win), so no command reads them from anywhere else and nothing is process-global.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from ckptstore.backends.registry import scheme_of
from ckptstore.compat import COMPAT_MODES
from ckptstore.errors import NotFoundError
from ckptstore.retention import BEST_MODES
from ckptstore.store import CheckpointStore

F = TypeVar("F", bound=Callable[..., Any])

# The documented exit statuses (the table is in main.py's docstring and --help).
EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_VERIFY = 4
EXIT_CONFLICT = 5
EXIT_BACKEND = 6
EXIT_COMPAT = 7
EXIT_INTERRUPTED = 130


@dataclass
class Settings:
    """Options that may be given before or after the command name (merged, later wins)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    as_json: bool = False
    verbose: int = 0
    compat: str = "warn"


def settings_of(ctx: click.Context) -> Settings:
    settings: Settings = ctx.meta.setdefault("ckptstore.settings", Settings())
    return settings


def parse_pair(text: str, what: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, value)``; the value is JSON when it parses, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}", param_hint=what)
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def _on_storage_option(ctx: click.Context, _: click.Parameter, values: Sequence[str]) -> None:
    for text in values:
        key, value = parse_pair(text, "--storage-option")
        settings_of(ctx).storage_options[key] = value


def _on_endpoint(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value:
        settings_of(ctx).storage_options["endpoint_url"] = value


def _on_json(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value:
        settings_of(ctx).as_json = True


def _on_compat(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value:
        settings_of(ctx).compat = value


def _on_verbose(ctx: click.Context, _: click.Parameter, value: int) -> None:
    if value:
        settings = settings_of(ctx)
        settings.verbose += value
        level = logging.INFO if settings.verbose == 1 else logging.DEBUG
        logging.getLogger("ckptstore").setLevel(level)
        if settings.verbose >= 3:  # boto, fsspec, urllib3 too
            logging.getLogger().setLevel(logging.DEBUG)


def common_options(f: F) -> F:
    """The options every command accepts, before or after its name."""
    decorators = [
        click.option(
            "--storage-option",
            "-o",
            multiple=True,
            metavar="KEY=VALUE",
            expose_value=False,
            callback=_on_storage_option,
            help="Backend option (repeatable); VALUE is parsed as JSON when it parses. "
            "Applies to remote URIs; local paths take none.",
        ),
        click.option(
            "--endpoint-url",
            metavar="URL",
            expose_value=False,
            callback=_on_endpoint,
            help="S3-compatible endpoint (MinIO, Ceph, R2, moto); same as -o endpoint_url=URL.",
        ),
        click.option(
            "--json",
            "as_json",
            is_flag=True,
            expose_value=False,
            callback=_on_json,
            help="Print machine-readable JSON on stdout.",
        ),
        click.option(
            "--compat",
            type=click.Choice(COMPAT_MODES),
            expose_value=False,
            callback=_on_compat,
            help="What a version difference does on load: strict (refuse), warn (default), ignore.",
        ),
        click.option(
            "-v",
            "--verbose",
            count=True,
            expose_value=False,
            callback=_on_verbose,
            help="Log what ckptstore does (-v), in detail (-vv), with libraries (-vvv); "
            "print tracebacks on errors.",
        ),
    ]
    for decorate in reversed(decorators):
        f = decorate(f)
    return f


def retention_of(ctx: click.Context) -> dict[str, Any]:
    """The retention options given to the command (``retention_options``), as the store's
    keyword arguments: ``{"keep_last": 3}``; empty when none was given."""
    retention: dict[str, Any] = ctx.meta.setdefault("ckptstore.retention", {})
    return retention


def _on_retention(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is not None and param.name is not None:
        retention_of(ctx)[param.name] = value


def retention_options(f: F) -> F:
    """The retention rules, for the commands that apply them (prune, push, cp) or show what
    they would delete (ls); read them with ``retention_of``. The store checks them
    (--keep-best needs --best-metric and --best-mode) and answers a ConfigError (exit 2)."""
    specs: list[tuple[str, Any, str | None, str]] = [
        ("--keep-last", COUNT, "N", "keep the N newest steps."),
        ("--keep-every", COUNT, "K", "keep every step that is a multiple of K."),
        (
            "--keep-best",
            COUNT,
            "K",
            "keep the K best steps by --best-metric (steps without a number for it are kept).",
        ),
        ("--best-metric", str, "NAME", "the metadata key that ranks steps, e.g. val_loss."),
        (
            "--best-mode",
            click.Choice(BEST_MODES),
            None,
            "min if lower is better (a loss), max if higher is (an accuracy).",
        ),
        (
            "--keep-every-seconds",
            click.FloatRange(min=0, min_open=True),
            "T",
            "keep one step per T seconds of commit time.",
        ),
    ]
    for name, kind, metavar, text in reversed(specs):
        f = click.option(
            name,
            type=kind,
            metavar=metavar,
            expose_value=False,
            callback=_on_retention,
            help=f"Retention: {text}",
        )(f)
    return f


def open_store(
    ctx: click.Context,
    uri: str,
    *,
    retention: Mapping[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    takeover: bool = False,
) -> CheckpointStore:
    """A store closed when the command ends; local paths get no storage options."""
    settings = settings_of(ctx)
    if options is None:
        options = settings.storage_options
    if scheme_of(uri) == "file":
        options = {}
    store = CheckpointStore(
        uri,
        **(retention or {}),
        storage_options=options,
        compat=settings.compat,
        takeover=takeover,
    )
    return ctx.with_resource(store)


def emit(ctx: click.Context, data: Any, human: str | Callable[[], str]) -> None:
    """``data`` as JSON with --json, else the human text."""
    if settings_of(ctx).as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(human if isinstance(human, str) else human())


def step_list(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


STEP = click.IntRange(min=0)
COUNT = click.IntRange(min=1)


def latest_step(store: CheckpointStore) -> int | None:
    latest = store.latest()
    return latest.step if latest is not None else None


def empty_store(store: CheckpointStore) -> NotFoundError:
    return NotFoundError(
        f"{store.uri} holds no committed step; check the URI (and --endpoint-url), or save a "
        "step first"
    )
