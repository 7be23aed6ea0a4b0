"""The commands that change which steps a store keeps: prune, pin, unpin, rm and gc.

Each opens the store with :func:`~ckptstore.cli.common.open_store` and calls one store method;
retention, pins, tombstone-first deletes, gc's proofs, and which tiers of a tiered store
(``--local``, ``--tier``) each acts on are the store's (core/maintenance.py).
"""

from __future__ import annotations

import click

from ckptstore.cli.common import (
    COUNT,
    STEP,
    StepRef,
    common_options,
    emit,
    latest_step,
    on_store_option,
    open_store,
    resolve_step,
    retention_of,
    retention_options,
    step_list,
    tier_options,
)
from ckptstore.cli.format import (
    plural,
)

# -- -----------------------------------------------------------------------


@click.command("prune")
@click.argument("uri")
@retention_options
@click.option(
    "--local-keep-last",
    type=COUNT,
    metavar="N",
    expose_value=False,
    callback=on_store_option,
    help="Retention of the local tier (with --local): keep its N newest steps (default 2).",
)
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@tier_options
@common_options
@click.pass_context
def prune_command(
    ctx: click.Context, uri: str, dry_run: bool, local: str | None, tier: str | None
) -> None:
    """Delete the steps no retention option keeps (a step is kept if any option keeps it;
    never latest, pinned, or newer than latest). With --local, each tier by its own
    retention: the options above for URI, --local-keep-last for the local tier."""
    store = open_store(ctx, uri, retention=retention_of(ctx), local=local)
    doomed = store.prune(dry_run=dry_run, tier=tier)
    kept = [i.step for i in store.list() if not (dry_run and i.step in doomed)]
    data = {"uri": store.uri, "dry_run": dry_run, "deleted": doomed, "kept": kept}
    verb = "would delete" if dry_run else "deleted"
    emit(ctx, data, f"{verb} steps: {step_list(doomed)}\nkept steps: {step_list(kept)}")


@click.command("index")
@click.argument("uri")
@click.option("--rebuild", is_flag=True, help="Rebuild the step index from the manifests.")
@tier_options
@common_options
@click.pass_context
def index_command(
    ctx: click.Context, uri: str, rebuild: bool, local: str | None, tier: str | None
) -> None:
    """Show the step index of URI (how many steps it lists in how many requests), or rebuild
    it from the manifests with --rebuild (with --local, each tier's, or the one --tier
    names). Readers keep the index repaired by themselves; rebuild after steps were deleted
    by hand or written by a ckptstore without the index."""
    store = open_store(ctx, uri, local=local)
    if rebuild:
        counts = store.rebuild_index(tier=tier)
        lines = [f"rebuilt the step index of {u}: {plural(n, 'step')}" for u, n in counts.items()]
        data = {"uri": store.uri, "rebuilt": True, "steps": sum(counts.values()), "tiers": counts}
        emit(ctx, data, "\n".join(lines))
        return
    count = len(store.list())
    data = {"uri": store.uri, "rebuilt": False, "steps": count}
    emit(ctx, data, f"the step index of {store.uri} lists {plural(count, 'step')}")


@click.command("pin")
@click.argument("uri")
@click.argument("step", type=STEP)
@tier_options
@common_options
@click.pass_context
def pin_command(
    ctx: click.Context, uri: str, step: StepRef, local: str | None, tier: str | None
) -> None:
    """Protect STEP (a number or 'latest') from retention (prune, keep_last) until unpinned."""
    store = open_store(ctx, uri, local=local)
    number = resolve_step(store, step)
    changed = number not in store.pins(tier=tier)
    store.pin(number, tier=tier)
    data = {"uri": store.uri, "step": number, "pinned": True, "changed": changed}
    emit(ctx, data, f"pinned step {number}" if changed else f"step {number} was already pinned")


@click.command("unpin")
@click.argument("uri")
@click.argument("step", type=STEP)
@tier_options
@common_options
@click.pass_context
def unpin_command(
    ctx: click.Context, uri: str, step: StepRef, local: str | None, tier: str | None
) -> None:
    """Let retention delete STEP (a number or 'latest') again."""
    store = open_store(ctx, uri, local=local)
    number = resolve_step(store, step)
    changed = store.unpin(number, tier=tier)
    data = {"uri": store.uri, "step": number, "pinned": False, "changed": changed}
    emit(ctx, data, f"unpinned step {number}" if changed else f"step {number} was not pinned")


@click.command("rm")
@click.argument("uri")
@click.argument("steps", metavar="STEP...", type=STEP, nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Also delete the latest or a pinned step.")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@tier_options
@common_options
@click.pass_context
def rm_command(
    ctx: click.Context,
    uri: str,
    steps: tuple[StepRef, ...],
    force: bool,
    dry_run: bool,
    local: str | None,
    tier: str | None,
) -> None:
    """Delete committed steps (numbers or 'latest'); latest moves back to the newest step left.

    Every STEP is checked first: one that is not committed, or is latest or pinned without
    --force, refuses the whole command and nothing is deleted. With --local, from both tiers.
    """
    store = open_store(ctx, uri, local=local)
    wanted = {resolve_step(store, s) for s in steps}
    committed = [i.step for i in store.list()]
    latest = latest_step(store) if committed else None
    doomed = store.delete(wanted, force=force, tier=tier, dry_run=dry_run)
    if not dry_run:
        after = latest_step(store) if store.list() else None
    elif latest in doomed and tier is None:  # the store moves latest back past them
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
@tier_options
@common_options
@click.pass_context
def gc_command(
    ctx: click.Context,
    uri: str,
    dry_run: bool,
    older_than: float,
    local: str | None,
    tier: str | None,
) -> None:
    """Remove garbage: uncommitted step files, stray temp files and uploads, stale pins.
    With --local, in both tiers (paths then by full URI)."""
    store = open_store(ctx, uri, local=local)
    report = store.gc(dry_run=dry_run, older_than=older_than, tier=tier)
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
