"""The commands that change which steps a store keeps: prune, pin, unpin, rm and gc.

Each opens the store with :func:`~ckptstore.cli.common.open_store` and calls one store method;
retention, pins, tombstone-first deletes and gc's proofs are the store's (pruning.py,
removal.py, garbage.py).
"""

from __future__ import annotations

import click

from ckptstore.cli.common import (
    STEP,
    StepRef,
    common_options,
    emit,
    latest_step,
    open_store,
    resolve_step,
    retention_of,
    retention_options,
    step_list,
)
from ckptstore.cli.format import (
    plural,
)
from ckptstore.errors import ConflictError, NotFoundError

# -- -----------------------------------------------------------------------


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


@click.command("index")
@click.argument("uri")
@click.option("--rebuild", is_flag=True, help="Rebuild the step index from the manifests.")
@common_options
@click.pass_context
def index_command(ctx: click.Context, uri: str, rebuild: bool) -> None:
    """Show the step index of URI (how many steps it lists in how many requests), or rebuild
    it from the manifests with --rebuild. Readers keep the index repaired by themselves;
    rebuild after steps were deleted by hand or written by a ckptstore without the index."""
    store = open_store(ctx, uri)
    if rebuild:
        count = store.rebuild_index()
        data = {"uri": store.uri, "rebuilt": True, "steps": count}
        emit(ctx, data, f"rebuilt the step index of {store.uri}: {plural(count, 'step')}")
        return
    count = len(store.list())
    data = {"uri": store.uri, "rebuilt": False, "steps": count}
    emit(ctx, data, f"the step index of {store.uri} lists {plural(count, 'step')}")


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


COMMANDS = [prune_command, pin_command, unpin_command, rm_command, gc_command, index_command]
