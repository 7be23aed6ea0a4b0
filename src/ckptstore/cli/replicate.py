"""``ckptstore cp`` and ``ckptstore replicate``: committed steps from one store into another.

Both are faces of replication/replicator.py: ``cp SRC DST [STEP...]`` is one pass, ``replicate SRC
DST [STEP...]`` the same pass, and ``replicate SRC DST --follow`` passes again and again as SRC
commits new steps, with pauses from ``--interval`` growing to ``--max-interval`` while nothing is
new, until Ctrl-C (exit 130) or an error. Global options (``--endpoint-url``, ``-o``, ``--profile``,
``--region``) set the source's storage; ``--dst-*`` options the destination's, over them (another
endpoint, account or region). The destination is written under its own writer lease (``--takeover``
displaces a holder known to be dead) and retention.

Output: one pass prints what it copied, what the destination already held, what it left out and
why; ``--json`` one document (``replicate --follow --json``: one line per pass that copied or
refused something). A step whose source bytes fail their check is reported and the others are
copied; the command then exits 4 (a follower logs it and goes on).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from ckptstore.cli.common import (
    STEP,
    StepRef,
    common_options,
    emit,
    empty_store,
    open_store,
    parse_pair,
    resolve_step,
    retention_of,
    set_partial,
    settings_of,
)
from ckptstore.cli.format import human_size, plural
from ckptstore.cli.transfer import progress_bar, progress_option, steps_text, writer_options
from ckptstore.replication.follow import DEFAULT_INTERVAL, MAX_INTERVAL
from ckptstore.replication.replicator import ReplicationReport, follow, replicate
from ckptstore.store import CheckpointStore

SECONDS = click.FloatRange(min=0)
F = TypeVar("F", bound=Callable[..., Any])


DST_KEY = "ckptstore.dst_options"


def destination_options(f: F) -> F:
    """Settings for a command's destination store only, over the global ones (``cp``,
    ``replicate``: another endpoint, account or region on the other side); read them with
    ``destination_storage_options``."""

    def setting(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
        def callback(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
            if value:
                ctx.meta.setdefault(DST_KEY, {})[name] = value

        return callback

    def pairs(ctx: click.Context, _: click.Parameter, values: Sequence[str]) -> None:
        for text in values:
            key, value = parse_pair(text, "--dst-storage-option")
            ctx.meta.setdefault(DST_KEY, {})[key] = value

    specs: list[tuple[str, str, Callable[..., None], str, bool]] = [
        (
            "--dst-storage-option",
            "KEY=VALUE",
            pairs,
            "Backend option for the destination only, over the global ones (repeatable).",
            True,
        ),
        (
            "--dst-endpoint-url",
            "URL",
            setting("endpoint_url"),
            "S3-compatible endpoint of the destination only.",
            False,
        ),
        (
            "--dst-profile",
            "NAME",
            setting("profile"),
            "AWS profile of the destination only.",
            False,
        ),
        ("--dst-region", "NAME", setting("region"), "Region of the destination only.", False),
    ]
    for name, metavar, callback, text, multiple in reversed(specs):
        f = click.option(
            name,
            metavar=metavar,
            multiple=multiple,
            expose_value=False,
            callback=callback,
            help=text,
        )(f)
    return f


def destination_storage_options(ctx: click.Context) -> dict[str, Any]:
    """The destination's storage options: the global ones, then ``destination_options``'."""
    merged = dict(settings_of(ctx).storage_options)
    merged.update(ctx.meta.get(DST_KEY, {}))
    return merged


def _open_pair(
    ctx: click.Context, src_uri: str, dst_uri: str, takeover: bool
) -> tuple[CheckpointStore, CheckpointStore]:
    src = open_store(ctx, src_uri)
    dst = open_store(
        ctx,
        dst_uri,
        retention=retention_of(ctx),
        options=destination_storage_options(ctx),
        takeover=takeover,
    )
    return src, dst


def _one_pass(
    ctx: click.Context,
    src: CheckpointStore,
    dst: CheckpointStore,
    refs: Sequence[StepRef],
    progress: bool | None,
    trust_server_copies: bool,
) -> None:
    """One pass, printed; a step that failed its check makes the command exit 4 after it."""
    numbers = sorted({resolve_step(src, s) for s in refs}) or None
    chosen = [src.info(s) for s in numbers] if numbers is not None else src.list()
    if not chosen:
        raise empty_store(src)
    held = {i.step for i in dst.list()}
    total = sum(i.size for i in chosen if i.step not in held)
    with progress_bar(total, "replicate", progress) as update:
        report = replicate(
            src, dst, numbers, progress=update, check_server_copies=not trust_server_copies
        )
    if report.failed:
        if not settings_of(ctx).as_json:
            click.echo(report_text(report))
        set_partial(ctx, report.as_dict())
        report.raise_failures()
    emit(ctx, report.as_dict(), lambda: report_text(report))


def report_text(report: ReplicationReport) -> str:
    """A pass as lines of text: copied, already there, left out, failed."""
    done = [i.step for i in report.copied]
    lines = [f"copied nothing to {report.dst}"]
    if done:
        files = sum(len(i.files) for i in report.copied)
        size = sum(i.size for i in report.copied)
        how = [
            f"{human_size(n)} {what}"
            for n, what in (
                (report.bytes_streamed, "streamed"),
                (report.bytes_server_side, "copied server-side"),
                (report.bytes_resumed, "found from an interrupted copy"),
            )
            if n
        ]
        detail = f" ({', '.join(how)})" if how else ""
        lines = [
            f"copied {steps_text(done)} to {report.dst}: {plural(files, 'file')}, "
            f"{human_size(size)} in {report.seconds:.2f} s{detail}"
        ]
    if report.present:
        lines.append(
            f"skipped {steps_text(report.present)}: already in {report.dst} with the same files"
        )
    for step, why in sorted(report.excluded.items()):
        lines.append(f"left out step {step}: {why}")
    for step, error in sorted(report.failed.items()):
        lines.append(f"failed step {step}: {error}")
    if report.latest is not None:
        lines.append(f"latest of {report.dst} is now step {report.latest}")
    return "\n".join(lines)


@click.command("cp")
@click.argument("src_uri")
@click.argument("dst_uri")
@click.argument("step", type=STEP, nargs=-1)
@click.option("--step", "step_options", type=STEP, multiple=True, help="Same as STEP (repeatable).")
@destination_options
@writer_options
@progress_option
@common_options
@click.pass_context
def cp_command(
    ctx: click.Context,
    src_uri: str,
    dst_uri: str,
    step: Sequence[StepRef],
    step_options: Sequence[StepRef],
    takeover: bool,
    progress: bool | None,
) -> None:
    """Replicate committed steps (STEPs, default all; 'latest' is SRC_URI's) from SRC_URI
    to DST_URI, verified. Steps DST_URI holds with the same files are skipped. The same as
    `ckptstore replicate` without --follow."""
    src, dst = _open_pair(ctx, src_uri, dst_uri, takeover)
    _one_pass(ctx, src, dst, [*step, *step_options], progress, trust_server_copies=False)


@click.command("replicate")
@click.argument("src_uri")
@click.argument("dst_uri")
@click.argument("step", type=STEP, nargs=-1)
@click.option(
    "--follow",
    "following",
    is_flag=True,
    help="Keep replicating new steps as SRC_URI commits them, until Ctrl-C (exit 130).",
)
@click.option(
    "--interval",
    type=SECONDS,
    default=DEFAULT_INTERVAL,
    show_default=True,
    metavar="S",
    help="--follow: seconds between polls while steps keep coming; it grows while none do.",
)
@click.option(
    "--max-interval",
    type=SECONDS,
    default=MAX_INTERVAL,
    show_default=True,
    metavar="S",
    help="--follow: the longest pause between two polls.",
)
@click.option(
    "--trust-server-copies",
    is_flag=True,
    help="Same endpoint and credentials on both sides: let the server copy each file without "
    "reading it through first (a load from DST_URI still verifies every byte).",
)
@destination_options
@writer_options
@progress_option
@common_options
@click.pass_context
def replicate_command(
    ctx: click.Context,
    src_uri: str,
    dst_uri: str,
    step: Sequence[StepRef],
    following: bool,
    interval: float,
    max_interval: float,
    trust_server_copies: bool,
    takeover: bool,
    progress: bool | None,
) -> None:
    """Mirror committed steps of SRC_URI into DST_URI (another bucket, region, account or
    endpoint: --dst-endpoint-url, --dst-profile, --dst-storage-option).

    Files land before their manifest, which is SRC_URI's (signature included); DST_URI's
    latest only moves forward, to steps whose copy is complete. A killed replication resumes
    where it stopped, without copying finished files again. Steps a fenced writer committed
    in SRC_URI, and steps DST_URI's retention would delete at once, are left out. STEPs
    (default: all; 'latest' is SRC_URI's) limit a one-time pass; --follow takes every new step.
    """
    if following and step:
        raise click.UsageError("--follow replicates every new step; give no STEP with it")
    src, dst = _open_pair(ctx, src_uri, dst_uri, takeover)
    if not following:
        _one_pass(ctx, src, dst, step, progress, trust_server_copies)
        return
    as_json = settings_of(ctx).as_json
    told: set[int] = set()  # steps left out, said once

    def show(report: ReplicationReport) -> None:
        news = set(report.excluded) - told
        told.update(news)
        if not (report.busy or news or report.latest is not None):
            return
        if as_json:
            click.echo(json.dumps(report.as_dict()))
        else:
            click.echo(f"{time.strftime('%H:%M:%S')} {report_text(report)}")

    with progress_bar(None, "replicate", progress) as update:
        follow(
            src,
            dst,
            interval=interval,
            max_interval=max_interval,
            on_pass=show,
            progress=update,
            check_server_copies=not trust_server_copies,
        )


COMMANDS = [cp_command, replicate_command]
