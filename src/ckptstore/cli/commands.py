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
    tier_options,
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
from ckptstore.domain.info import SIGNATURE_NOT_CHECKED, CheckpointInfo, signature_status
from ckptstore.domain.retention import metric_value
from ckptstore.export.records import ExportRecord, by_step, list_records
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
@tier_options
@common_options
@click.pass_context
def verify_command(
    ctx: click.Context,
    uri: str,
    step: StepRef | None,
    all_steps: bool,
    local: str | None,
    tier: str | None,
) -> None:
    """Check every byte of a step (default: latest) against its manifest; exit 4 on problems.
    With --local, each tier's copy."""
    if all_steps and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    store = open_store(ctx, uri, local=local)
    if all_steps:
        reports = store.verify_all(tier=tier)
    else:
        number = None if step is None else resolve_step(store, step)
        reports = [store.verify(number, tier=tier)]
    if not reports:
        raise empty_store(store)
    ok = all(r.ok for r in reports)
    unchecked = [r.step for r in reports if r.signature == SIGNATURE_NOT_CHECKED]
    data = {
        "uri": store.uri,
        "ok": ok,
        "signatures_checked": not unchecked,
        "steps": [
            {
                "step": r.step,
                "ok": r.ok,
                "signature": r.signature,
                "problems": list(r.problems),
                "tiers": list(r.tiers),
            }
            for r in reports
        ],
    }
    lines = []
    for r in reports:
        verdict = "OK" if r.ok else "FAILED"
        if r.signature == SIGNATURE_NOT_CHECKED:
            verdict += " (bytes only: signed; signature not checked (no key))"
        where = f" ({', '.join(r.tiers)})" if local is not None else ""
        lines.append(f"step {r.step}: {verdict}{where}")
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


COMMANDS = [ls_command, show_command, verify_command]
