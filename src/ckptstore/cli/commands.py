"""``ckptstore`` commands that read and manage a store: ls, show, verify, prune, pin, unpin, rm, gc.

Each is a thin face over one :class:`~ckptstore.store.CheckpointStore` method; the safety rules
(never prune latest or a pinned step, verify every byte) live in the store, not here.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ckptstore.cli.common import (
    COUNT,
    EXIT_VERIFY,
    STEP,
    common_options,
    emit,
    empty_store,
    latest_step,
    open_store,
    retention_of,
    retention_options,
    settings_of,
    step_list,
)
from ckptstore.cli.format import (
    format_pairs,
    format_table,
    format_value,
    human_size,
    iso_time,
    order_steps,
    step_record,
    steps_table,
    total_line,
)
from ckptstore.info import CheckpointInfo

# -- reading commands ------------------------------------------------------------------------


@click.command("ls")
@click.argument("uri")
@click.option(
    "--sort",
    "sort_by",
    metavar="METRIC",
    help="Order by a number in the steps' metadata, lowest first; steps without it last.",
)
@click.option("--reverse", is_flag=True, help="Highest first with --sort; newest first without.")
@click.option("--last", type=COUNT, metavar="N", help="Only the N newest steps.")
@retention_options
@common_options
@click.pass_context
def ls_command(
    ctx: click.Context, uri: str, sort_by: str | None, reverse: bool, last: int | None
) -> None:
    """List the committed steps of URI (exit 3 if there are none).

    With retention options, mark the steps that prune with the same options would delete.
    """
    retention = retention_of(ctx)
    store = open_store(ctx, uri, retention=retention)
    every = store.list()
    latest = latest_step(store) if every else None
    pins = store.pins()
    fenced = store.fenced_steps(every)
    prune = store.prune(dry_run=True) if retention and every else None
    infos = order_steps(every[-last:] if last is not None else every, sort_by, reverse=reverse)
    records = [step_record(i, latest=latest, pins=pins, fenced=fenced, prune=prune) for i in infos]
    data: dict[str, Any] = {
        "uri": store.uri,
        "latest": latest,
        "steps": records,
        "total": {"steps": len(every), "size": sum(i.size for i in every)},
    }
    if prune is not None:
        data["prune"] = prune
    if not every:
        if settings_of(ctx).as_json:
            emit(ctx, data, "")
        raise empty_store(store)
    emit(
        ctx,
        data,
        lambda: (
            steps_table(infos, latest=latest, pins=pins, fenced=fenced, prune=prune)
            + "\n"
            + total_line(infos, every, prune)
        ),
    )


@click.command("show")
@click.argument("uri")
@click.argument("step", type=STEP, required=False)
@common_options
@click.pass_context
def show_command(ctx: click.Context, uri: str, step: int | None) -> None:
    """Show one step's manifest (default: latest): files, metadata, environment."""
    store = open_store(ctx, uri)
    latest = latest_step(store)
    chosen = step if step is not None else latest
    if chosen is None:
        raise empty_store(store)
    info = store.info(chosen)
    pinned = info.step in store.pins()
    manifest = json.loads(info.manifest.encode())
    data = {"uri": info.uri, "latest": info.step == latest, "pinned": pinned, "manifest": manifest}
    emit(ctx, data, lambda: _show_text(info, latest=info.step == latest, pinned=pinned))


def _show_text(info: CheckpointInfo, *, latest: bool, pinned: bool) -> str:
    m = info.manifest
    marks = [name for name, on in (("latest", latest), ("pinned", pinned)) if on]
    summary = [
        ("step", f"{m.step}" + (f" ({', '.join(marks)})" if marks else "")),
        ("uri", info.uri),
        ("kind", m.kind),
        ("created", iso_time(m.created)),
        ("size", f"{human_size(m.size)} ({m.size} bytes) in {len(m.files)} files"),
        ("writer", m.writer),
        ("schema", m.schema_version),
    ]
    files = [[f.path, human_size(f.size), f.crc32c] for f in m.files]
    meta = [(key, format_value(value)) for key, value in sorted(m.metadata.items())]
    return "\n".join(
        [
            format_pairs(summary),
            "",
            "files:",
            format_table(["PATH", "SIZE", "CRC32C"], files, indent="  "),
            "",
            "metadata:" + ("" if meta else " (none)"),
            *([format_pairs(meta, indent="  ")] if meta else []),
            "",
            "environment:",
            format_pairs(list(vars(m.environment).items()), indent="  "),
        ]
    )


@click.command("verify")
@click.argument("uri")
@click.argument("step", type=STEP, required=False)
@click.option("--all", "all_steps", is_flag=True, help="Verify every committed step.")
@common_options
@click.pass_context
def verify_command(ctx: click.Context, uri: str, step: int | None, all_steps: bool) -> None:
    """Check every byte of a step (default: latest) against its manifest; exit 4 on problems."""
    if all_steps and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    store = open_store(ctx, uri)
    reports = store.verify_all() if all_steps else [store.verify(step)]
    if not reports:
        raise empty_store(store)
    ok = all(r.ok for r in reports)
    data = {
        "uri": store.uri,
        "ok": ok,
        "steps": [{"step": r.step, "ok": r.ok, "problems": list(r.problems)} for r in reports],
    }
    lines = []
    for r in reports:
        lines.append(f"step {r.step}: {'OK' if r.ok else 'FAILED'}")
        lines += [f"  {problem}" for problem in r.problems]
    emit(ctx, data, "\n".join(lines))
    if not ok:
        ctx.exit(EXIT_VERIFY)


# -- managing commands -----------------------------------------------------------------------


@click.command("prune")
@click.argument("uri")
@retention_options
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@common_options
@click.pass_context
def prune_command(ctx: click.Context, uri: str, dry_run: bool) -> None:
    """Delete the steps no retention option keeps (a step is kept if any option keeps it;
    never latest, pinned, or newer than latest)."""
    store = open_store(ctx, uri, retention=retention_of(ctx))
    doomed = store.prune(dry_run=dry_run)
    kept = [i.step for i in store.list() if i.step not in doomed]
    data = {"uri": store.uri, "dry_run": dry_run, "deleted": doomed, "kept": kept}
    verb = "would delete" if dry_run else "deleted"
    emit(ctx, data, f"{verb} steps: {step_list(doomed)}\nkept steps: {step_list(kept)}")


@click.command("pin")
@click.argument("uri")
@click.argument("step", type=STEP)
@common_options
@click.pass_context
def pin_command(ctx: click.Context, uri: str, step: int) -> None:
    """Protect STEP from retention (prune, keep_last) until unpinned."""
    store = open_store(ctx, uri)
    changed = step not in store.pins()
    store.pin(step)
    data = {"uri": store.uri, "step": step, "pinned": True, "changed": changed}
    emit(ctx, data, f"pinned step {step}" if changed else f"step {step} was already pinned")


@click.command("unpin")
@click.argument("uri")
@click.argument("step", type=STEP)
@common_options
@click.pass_context
def unpin_command(ctx: click.Context, uri: str, step: int) -> None:
    """Let retention delete STEP again."""
    store = open_store(ctx, uri)
    changed = store.unpin(step)
    data = {"uri": store.uri, "step": step, "pinned": False, "changed": changed}
    emit(ctx, data, f"unpinned step {step}" if changed else f"step {step} was not pinned")


@click.command("rm")
@click.argument("uri")
@click.argument("step", type=STEP)
@click.option("--force", is_flag=True, help="Also delete the latest or a pinned step.")
@common_options
@click.pass_context
def rm_command(ctx: click.Context, uri: str, step: int, force: bool) -> None:
    """Delete a committed step (latest moves back to the newest step left)."""
    store = open_store(ctx, uri)
    store.delete(step, force=force)
    latest = latest_step(store)
    data = {"uri": store.uri, "step": step, "deleted": True, "latest": latest}
    emit(ctx, data, f"deleted step {step}; latest is now {latest if latest is not None else '-'}")


@click.command("gc")
@click.argument("uri")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    metavar="SECONDS",
    help="Leave younger objects alone: they may belong to a save in flight.",
)
@common_options
@click.pass_context
def gc_command(ctx: click.Context, uri: str, dry_run: bool, older_than: float) -> None:
    """Remove garbage: uncommitted step files, stray temp files and uploads, stale pins."""
    store = open_store(ctx, uri)
    report = store.gc(dry_run=dry_run, older_than=older_than)
    data = {
        "uri": store.uri,
        "dry_run": dry_run,
        "deleted": list(report.deleted),
        "aborted_uploads": list(report.aborted_uploads),
    }
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {len(report.deleted)} objects and {len(report.aborted_uploads)} uploads"]
    lines += [f"  {path}" for path in (*report.deleted, *report.aborted_uploads)]
    emit(ctx, data, "\n".join(lines))


COMMANDS = [
    ls_command,
    show_command,
    verify_command,
    prune_command,
    pin_command,
    unpin_command,
    rm_command,
    gc_command,
]
