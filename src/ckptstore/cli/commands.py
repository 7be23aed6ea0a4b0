"""``ckptstore`` commands that read and manage a store: ls, show, verify, prune, pin, unpin, rm, gc.

Each is a thin face over one :class:`~ckptstore.store.CheckpointStore` method; the safety rules
(never prune latest or a pinned step, verify every byte) live in the store, not here.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click

from ckptstore.backends.base import join
from ckptstore.cli import discover
from ckptstore.cli.common import (
    COUNT,
    EXIT_UNCHECKED,
    EXIT_VERIFY,
    STEP,
    StepRef,
    common_options,
    emit,
    empty_store,
    latest_step,
    open_store,
    resolve_step,
    retention_of,
    retention_options,
    set_partial,
    step_list,
)
from ckptstore.cli.format import (
    format_pairs,
    format_table,
    format_value,
    human_size,
    iso_time,
    order_steps,
    plural,
    step_record,
    steps_table,
    total_line,
)
from ckptstore.config import SIGNING_KEY, SIGNING_KEY_FILE
from ckptstore.errors import ConflictError, NotFoundError
from ckptstore.export.records import ExportRecord, by_step, list_records
from ckptstore.info import SIGNATURE_NOT_CHECKED, CheckpointInfo, signature_status
from ckptstore.retention import metric_value
from ckptstore.store import CheckpointStore

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
@click.option(
    "--local",
    metavar="PATH",
    help="The local tier in front of URI (a tiered store): a TIER column says where each step "
    "is (local, durable, or both).",
)
@retention_options
@common_options
@click.pass_context
def ls_command(
    ctx: click.Context,
    uri: str,
    sort_by: str | None,
    reverse: bool,
    last: int | None,
    local: str | None,
) -> None:
    """List the committed steps of URI.

    With retention options, mark the steps that prune with the same options would delete.
    A URI that is not a store (a bucket, a parent directory) lists the stores below it,
    searched 3 levels down; exit 3 if there are none.
    """
    retention = retention_of(ctx)
    store = open_store(ctx, uri, retention=retention, local=local)
    every = store.list()
    latest = latest_step(store) if every else None
    pins = store.pins()
    fenced = store.fenced_steps(every)
    prune = store.prune(dry_run=True) if retention and every else None
    infos = order_steps(every[-last:] if last is not None else every, sort_by, reverse=reverse)
    unscored = all(metric_value(i.metadata, sort_by or "") is None for i in every)
    if sort_by is not None and every and unscored:
        known = sorted({k for i in every for k in i.metadata})
        click.echo(
            f"warning: no step has a number for {sort_by!r} in its metadata, so --sort "
            f"changed nothing; metadata keys found: {', '.join(known) or 'none'}",
            err=True,
        )
    records = [step_record(i, latest=latest, pins=pins, fenced=fenced, prune=prune) for i in infos]
    exported = by_step(list_records(store.backend)) if every else {}
    for record in records:
        if record["step"] in exported:
            record["exports"] = [e.out for e in exported[record["step"]]]
    data: dict[str, Any] = {
        "uri": store.uri,
        "latest": latest,
        "steps": records,
        "total": {"steps": len(every), "size": sum(i.size for i in every)},
    }
    if prune is not None:
        data["prune"] = prune
    if not every:
        _ls_stores_below(ctx, store, data)
        return
    emit(
        ctx,
        data,
        lambda: (
            steps_table(infos, latest=latest, pins=pins, fenced=fenced, prune=prune)
            + "\n"
            + total_line(infos, every, prune)
            + "".join(
                f"\nexported: step {r['step']} -> {', '.join(r['exports'])}"
                for r in records
                if "exports" in r
            )
        ),
    )


def _ls_stores_below(ctx: click.Context, store: CheckpointStore, data: dict[str, Any]) -> None:
    """``ls`` of a URI without committed steps: the stores below it, else "no step" (exit 3)."""
    search = discover.find_stores(store.backend)
    found = discover.summarize(
        [join(store.uri, path) for path in search.found], lambda uri: open_store(ctx, uri)
    )
    data["stores"] = [s.record() for s in found]
    data["search"] = {"depth": discover.SEARCH_DEPTH, "truncated": search.truncated}
    if not found:
        set_partial(ctx, data)
        raise empty_store(store)
    emit(ctx, data, lambda: discover.stores_text(store.uri, found, search, discover.SEARCH_DEPTH))


@click.command("show")
@click.argument("uri")
@click.argument("step", type=STEP, default="latest")
@common_options
@click.pass_context
def show_command(ctx: click.Context, uri: str, step: StepRef) -> None:
    """Show one step's manifest (default: latest): files, metadata, environment."""
    store = open_store(ctx, uri)
    latest = latest_step(store)
    info = store.info(resolve_step(store, step))
    pinned = info.step in store.pins()
    manifest = json.loads(info.manifest.encode())
    signature = signature_status(info.manifest, checked=store.signer is not None)
    exports = list_records(store.backend, info.step)
    data = {
        "uri": info.uri,
        "latest": info.step == latest,
        "pinned": pinned,
        "signature": signature,
        "manifest": manifest,
        "exports": [asdict(e) for e in exports],
    }
    emit(
        ctx,
        data,
        lambda: (
            _show_text(info, latest=info.step == latest, pinned=pinned, signature=signature)
            + "".join(f"\n{line}" for line in _exports_text(exports))
        ),
    )
    if signature == SIGNATURE_NOT_CHECKED:
        click.echo(_NO_KEY_HINT, err=True)
        ctx.exit(EXIT_UNCHECKED)


def _exports_text(exports: list[ExportRecord]) -> list[str]:
    """The ``exports:`` section of ``show``, empty when the step was never exported."""
    if not exports:
        return []
    rows = [
        [e.out, e.format, e.options.get("dtype") or "as saved", e.tensors, iso_time(e.created)]
        for e in exports
    ]
    return ["", "exports:", format_table(["OUT", "FORMAT", "DTYPE", "TENSORS", "TIME"], rows, "  ")]


def _show_text(info: CheckpointInfo, *, latest: bool, pinned: bool, signature: str) -> str:
    m = info.manifest
    marks = [name for name, on in (("latest", latest), ("pinned", pinned)) if on]
    summary = [
        ("step", f"{m.step}" + (f" ({', '.join(marks)})" if marks else "")),
        ("uri", info.uri),
        ("kind", m.kind),
        ("created", iso_time(m.created)),
        ("size", f"{human_size(m.size)} ({m.size} bytes) in {plural(len(m.files), 'file')}"),
        ("writer", m.writer),
        ("schema", m.schema_version),
        ("signature", "signed; " + signature if m.signature is not None else signature),
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
def verify_command(ctx: click.Context, uri: str, step: StepRef | None, all_steps: bool) -> None:
    """Check every byte of a step (default: latest) against its manifest; exit 4 on problems."""
    if all_steps and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    store = open_store(ctx, uri)
    if all_steps:
        reports = store.verify_all()
    else:
        reports = [store.verify(None if step is None else resolve_step(store, step))]
    if not reports:
        raise empty_store(store)
    ok = all(r.ok for r in reports)
    unchecked = [r.step for r in reports if r.signature == SIGNATURE_NOT_CHECKED]
    data = {
        "uri": store.uri,
        "ok": ok,
        "signatures_checked": not unchecked,
        "steps": [
            {"step": r.step, "ok": r.ok, "signature": r.signature, "problems": list(r.problems)}
            for r in reports
        ],
    }
    lines = []
    for r in reports:
        verdict = "OK" if r.ok else "FAILED"
        if r.signature == SIGNATURE_NOT_CHECKED:
            verdict += " (bytes only: signed; signature not checked (no key))"
        lines.append(f"step {r.step}: {verdict}")
        lines += [f"  {problem}" for problem in r.problems]
    if unchecked:
        lines.append(_NO_KEY_HINT)
    emit(ctx, data, "\n".join(lines))
    if not ok:
        ctx.exit(EXIT_VERIFY)
    if unchecked:
        ctx.exit(EXIT_UNCHECKED)


_NO_KEY_HINT = (
    "signed steps were verified without the key: an edited manifest would pass. Set "
    f"{SIGNING_KEY} or {SIGNING_KEY_FILE} to check the signatures (exit {EXIT_UNCHECKED})"
)


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
def pin_command(ctx: click.Context, uri: str, step: StepRef) -> None:
    """Protect STEP (a number or 'latest') from retention (prune, keep_last) until unpinned."""
    store = open_store(ctx, uri)
    number = resolve_step(store, step)
    changed = number not in store.pins()
    store.pin(number)
    data = {"uri": store.uri, "step": number, "pinned": True, "changed": changed}
    emit(ctx, data, f"pinned step {number}" if changed else f"step {number} was already pinned")


@click.command("unpin")
@click.argument("uri")
@click.argument("step", type=STEP)
@common_options
@click.pass_context
def unpin_command(ctx: click.Context, uri: str, step: StepRef) -> None:
    """Let retention delete STEP (a number or 'latest') again."""
    store = open_store(ctx, uri)
    number = resolve_step(store, step)
    changed = store.unpin(number)
    data = {"uri": store.uri, "step": number, "pinned": False, "changed": changed}
    emit(ctx, data, f"unpinned step {number}" if changed else f"step {number} was not pinned")


@click.command("rm")
@click.argument("uri")
@click.argument("steps", metavar="STEP...", type=STEP, nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Also delete the latest or a pinned step.")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@common_options
@click.pass_context
def rm_command(
    ctx: click.Context, uri: str, steps: tuple[StepRef, ...], force: bool, dry_run: bool
) -> None:
    """Delete committed steps (numbers or 'latest'); latest moves back to the newest step left.

    Every STEP is checked first: one that is not committed, or is latest or pinned without
    --force, refuses the whole command and nothing is deleted.
    """
    store = open_store(ctx, uri)
    doomed = sorted({resolve_step(store, s) for s in steps})
    committed = [i.step for i in store.list()]
    latest = latest_step(store) if committed else None
    _check_removable(store.uri, doomed, committed, latest, store.pins(), force=force)
    if not dry_run:
        for step in doomed:  # oldest first: latest, if it goes, moves back only once
            store.delete(step, force=force)
    if not dry_run:
        after = latest_step(store)
    elif latest in doomed:  # the store moves latest back to the newest older step left
        after = max((s for s in committed if s not in doomed and s < latest), default=None)
    else:
        after = latest
    data = {"uri": store.uri, "dry_run": dry_run, "deleted": doomed, "latest": after}
    verb = "would delete" if dry_run else "deleted"
    now = "would be" if dry_run else "is now"
    emit(
        ctx,
        data,
        f"{verb} {'step' if len(doomed) == 1 else 'steps'} {step_list(doomed)}; "
        f"latest {now} {after if after is not None else '-'}",
    )


def _check_removable(
    uri: str,
    doomed: list[int],
    committed: list[int],
    latest: int | None,
    pins: list[int],
    *,
    force: bool,
) -> None:
    """Refuse the whole ``rm`` if any step is not committed, or is protected without force."""
    missing = [s for s in doomed if s not in committed]
    if missing:
        raise NotFoundError(
            f"{plural(len(missing), 'step')} {step_list(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not committed in {uri} (committed: "
            f"{step_list(committed)}); nothing was deleted",
            uri=uri,
            step=missing[0],
        )
    if force:
        return
    protected = [(s, "latest" if s == latest else "pinned") for s in doomed if s in {latest, *pins}]
    if protected:
        what = ", ".join(f"{s} ({why})" for s, why in protected)
        raise ConflictError(
            f"{uri}: {'step' if len(protected) == 1 else 'steps'} {what} cannot be deleted "
            "without --force (or unpin a pinned step first); nothing was deleted",
            uri=uri,
            step=protected[0][0],
        )


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
        "kept": [{"path": path, "why": report.why.get(path, "")} for path in report.kept],
        "foreign": list(report.foreign),
    }
    verb = "would remove" if dry_run else "removed"
    lines = [
        f"{verb} {plural(len(report.deleted), 'object')} and "
        f"{plural(len(report.aborted_uploads), 'upload')}"
    ]
    lines += [f"  {path}" for path in (*report.deleted, *report.aborted_uploads)]
    if report.kept:
        lines.append(f"kept {plural(len(report.kept), 'uncommitted attempt')} (may be live):")
        lines += [f"  {path}: {report.why.get(path, '')}" for path in report.kept]
    if report.foreign:
        lines.append(
            f"left {plural(len(report.foreign), 'foreign file')} that ckptstore did not write "
            "(adopt them with `ckptstore adopt`, or remove them yourself):"
        )
        lines += [f"  {path}" for path in report.foreign]
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
