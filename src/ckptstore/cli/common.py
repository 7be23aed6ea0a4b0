"""What every ``ckptstore`` command shares: global options, opening stores, printing results.

Global options (``--storage-option``, ``--endpoint-url``, ``--profile``, ``--region``,
``--json``, ``--compat``, ``-v``) are accepted both before and after the command name, because
``ckptstore ls s3://b/run --endpoint-url ...`` is what people type. Click callbacks merge them
into one :class:`Settings` kept in the context's ``meta`` (shared by the group and its commands,
later values win), so no command reads them from anywhere else and nothing is process-global.
``--profile`` and ``--region`` are the aws CLI's spellings of the S3 storage options
``profile`` and ``region``: they go the same way as ``-o profile=NAME`` (s3_options.py), so the
CLI has no second path to boto3. A command's ``--help`` shows only the options that act there
(``--compat`` only where a state is loaded); the others are still accepted, hidden.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click
from click.shell_completion import CompletionItem

from ckptstore.backends.registry import scheme_of
from ckptstore.domain import layout
from ckptstore.domain.compat import COMPAT_MODES
from ckptstore.domain.retention import BEST_MODES
from ckptstore.errors import ConfigError, NotFoundError
from ckptstore.options import CLI, StoreOptions
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
EXIT_UNCHECKED = 8
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


def _storage_option(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    """A callback that sets one storage option, as ``-o NAME=VALUE`` would."""

    def callback(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
        if value:
            settings_of(ctx).storage_options[name] = value

    return callback


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


STORAGE_OPTIONS = [
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
        callback=_storage_option("endpoint_url"),
        help="S3-compatible endpoint (MinIO, Ceph, R2, moto); same as -o endpoint_url=URL.",
    ),
    click.option(
        "--profile",
        metavar="NAME",
        expose_value=False,
        callback=_storage_option("profile"),
        help="S3: the AWS profile (~/.aws/config) to use; same as -o profile=NAME.",
    ),
    click.option(
        "--region",
        metavar="NAME",
        expose_value=False,
        callback=_storage_option("region"),
        help="S3: the bucket's region, e.g. eu-west-1; same as -o region=NAME.",
    ),
]
"""How to reach the storage: the options of every command."""

VERBOSE = click.option(
    "-v",
    "--verbose",
    count=True,
    expose_value=False,
    callback=_on_verbose,
    help="Log what ckptstore does (-v), in detail (-vv), with libraries (-vvv); "
    "print tracebacks on errors.",
)


def global_options(*, loads: bool = False, output: bool = True) -> Callable[[F], F]:
    """The options every command accepts, before or after its name.

    ``loads``: the command loads a state, so ``--compat`` acts and shows in its ``--help``;
    ``output``: ``--json`` applies. Options that do not apply stay accepted (scripts that
    pass them keep working) but hidden from ``--help``.
    """
    as_json = click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_on_json,
        hidden=not output,
        help="Print machine-readable JSON on stdout (on failure: an error object).",
    )
    compat = click.option(
        "--compat",
        type=click.Choice(COMPAT_MODES),
        expose_value=False,
        callback=_on_compat,
        hidden=not loads,
        help="What a version difference does on load: strict (refuse), warn (default), ignore.",
    )
    decorators = [*STORAGE_OPTIONS, as_json, compat, VERBOSE]

    def decorate(f: F) -> F:
        for option in reversed(decorators):
            f = option(f)
        return f

    return decorate


def common_options(f: F) -> F:
    """:func:`global_options` for a command that loads no state and may print JSON."""
    return global_options()(f)


def retention_of(ctx: click.Context) -> dict[str, Any]:
    """The retention options given to the command (``retention_options``), as the store's
    keyword arguments: ``{"keep_last": 3}``; empty when none was given."""
    retention: dict[str, Any] = ctx.meta.setdefault("ckptstore.domain.retention", {})
    return retention


def on_store_option(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Keep an option of the store (retention, ``--save-timeout``, ``--load-timeout``) for
    :func:`retention_of`, by its StoreOptions name."""
    if value is not None and param.name is not None:
        retention_of(ctx)[param.name] = value


def load_timeout_option(f: F) -> F:
    """``--load-timeout``: the store's ``load_timeout`` for a command that reads a step (pull,
    export); read it with ``retention_of``."""
    return click.option(
        "--load-timeout",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        expose_value=False,
        callback=on_store_option,
        help="Fail if choosing and reading the step takes longer, leaving nothing behind; "
        "default: no deadline.",
    )(f)


def tier_options(f: F) -> F:
    """``--local PATH`` and ``--tier``: a tool that acts on a store's steps (rm, pin, unpin,
    prune, verify, gc) acts on both tiers of a tiered store given its local tier, or on the
    one ``--tier`` names (core/maintenance.py)."""
    f = click.option(
        "--tier",
        type=click.Choice(["local", "durable"]),
        help="Act on this tier only (with --local); default: both.",
    )(f)
    return click.option(
        "--local",
        metavar="PATH",
        help="The local tier in front of URI (a tiered store): act on both tiers, as its "
        "reads see them.",
    )(f)


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
            callback=on_store_option,
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
    local: str | None = None,
) -> CheckpointStore:
    """A store closed when the command ends; local paths get no storage options.

    A URI that is a committed step's directory (``s3://b/run/global_step_100``) is refused
    with the store and the command to run instead, at the cost of one request for such URIs.
    """
    settings = settings_of(ctx)
    if options is None:
        options = settings.storage_options
    if scheme_of(uri) == "file":
        options = {}
    try:
        store = CheckpointStore(
            uri,
            options=StoreOptions(
                **(retention or {}),
                storage_options=options,
                compat=settings.compat,
                takeover=takeover,
                local=local,
                spelling=CLI,
            ),
        )
    except ConfigError as e:
        inside = split_step_uri(uri)
        if inside is None or e.step != inside[1]:
            raise
        raise ConfigError(
            f"{uri} is the directory of step {inside[1]}, not a store: {step_dir_hint(uri)}",
            uri=uri,
            step=inside[1],
        ) from e
    ctx.with_resource(store)
    return store


split_step_uri = layout.split_step_uri


def step_dir_hint(uri: str) -> str:
    """What to type instead of a step directory's URI: the store and the step apart, in the
    command the user typed where it takes a step (``pull URI DEST STEP``), else ``show``."""
    split = split_step_uri(uri)
    if split is None:
        return ""
    store, step = split
    ctx = click.get_current_context(silent=True)
    command = ctx.info_name if ctx is not None and ctx.parent is not None else None
    if command == "pull" and ctx is not None:
        dest = ctx.params.get("local_dir") or "DEST"
        return f"its store is {store}; run: ckptstore pull {store} {dest} {step}"
    if command not in STEP_COMMANDS:
        command = "show"
    return f"its store is {store}; run: ckptstore {command} {store} {step}"


STEP_COMMANDS = frozenset({"show", "verify", "pin", "unpin", "rm"})
"""Commands whose arguments are ``URI STEP``: the step-directory hint names them as typed."""


def emit(ctx: click.Context, data: Any, human: str | Callable[[], str]) -> None:
    """``data`` as JSON with --json, else the human text."""
    if settings_of(ctx).as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(human if isinstance(human, str) else human())


def step_list(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


LATEST = "latest"
"""What a STEP argument may say instead of a number: the store's latest committed step."""

StepRef = int | str
"""A parsed STEP: a step number, or :data:`LATEST` (resolve it with :func:`resolve_step`)."""


class _StepType(click.ParamType):  # type: ignore[type-arg]
    """A step number (``100``, ``global_step_100``) or ``latest``."""

    name = "step"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if text.lower() == LATEST:
            return LATEST
        number = layout.parse_step_dir(text) if text.startswith(layout.STEP_PREFIX) else None
        if number is not None:
            return number
        if text.isdigit():
            return int(text)
        self.fail(
            f"{value!r} is not a step: give a non-negative number (100), global_step_100, "
            "or 'latest'",
            param,
            ctx,
        )

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        return [CompletionItem(LATEST)] if LATEST.startswith(incomplete.lower()) else []


STEP = _StepType()
COUNT = click.IntRange(min=1)


def resolve_step(store: CheckpointStore, step: StepRef) -> int:
    """The number a parsed STEP stands for; ``latest`` needs a store with a committed step."""
    if step != LATEST:
        return int(step)
    latest = latest_step(store)
    if latest is None:
        raise empty_store(store)
    return latest


def latest_step(store: CheckpointStore) -> int | None:
    latest = store.latest()
    return latest.step if latest is not None else None


def empty_store(store: CheckpointStore) -> NotFoundError:
    hint = step_dir_hint(store.uri)
    if hint:
        hint = f"; if this is a step directory, {hint}"
    return NotFoundError(
        f"{store.uri} holds no committed step; check the URI (and --endpoint-url), or save a "
        f"step first{hint}",
        uri=store.uri,
    )


PARTIAL_KEY = "ckptstore.partial"


def set_partial(ctx: click.Context, data: Mapping[str, Any]) -> None:
    """What a failing command found before it failed (``ls`` of an empty store: no steps):
    under ``--json`` the error object is added to it, so stdout stays one document."""
    ctx.meta[PARTIAL_KEY] = dict(data)


def partial_of(ctx: click.Context) -> dict[str, Any]:
    partial: dict[str, Any] = ctx.meta.get(PARTIAL_KEY, {})
    return partial
