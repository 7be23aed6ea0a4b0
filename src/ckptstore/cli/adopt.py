"""``ckptstore adopt``: commit in place the step directories other tools wrote into a store.

The migration path for runs that began before ckptstore (a verl run uploaded with
``aws s3 sync``): the files stay where they are, each read once to checksum it; only a manifest
is written. The engine is :mod:`ckptstore.core.adoption`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import click

from ckptstore.cli.common import (
    STEP,
    StepRef,
    common_options,
    emit,
    open_store,
    parse_pair,
    retention_of,
)
from ckptstore.cli.format import human_size, plural
from ckptstore.cli.transfer import (
    metadata_option,
    progress_bar,
    progress_option,
    step_number,
    steps_text,
    writer_options,
)
from ckptstore.store import CheckpointStore


@click.command("adopt")
@click.argument("uri")
@click.argument("step", type=STEP, nargs=-1)
@click.option("--dry-run", is_flag=True, help="List what would be adopted; read no file.")
@metadata_option
@writer_options
@progress_option
@common_options
@click.pass_context
def adopt_command(
    ctx: click.Context,
    uri: str,
    step: Sequence[StepRef],
    dry_run: bool,
    metadata_pairs: Sequence[str],
    takeover: bool,
    progress: bool | None,
) -> None:
    """Commit in place the step directories of URI that ckptstore did not write.

    For a verl run uploaded with `aws s3 sync` or copied by another tool: each
    global_step_N (only the STEPs given, else all such, oldest first) gets a manifest, its
    files read once to checksum them and never copied. Run it when nothing writes there: a
    file changed afterwards fails verify. A STEP already committed is a conflict; all STEPs
    are checked before any is adopted.
    """
    why = "adopt takes directories ckptstore did not write, and latest is a committed step"
    numbers = sorted({n for s in step if (n := step_number(s, "adopt", why)) is not None})
    metadata = dict(parse_pair(p, "--metadata") for p in metadata_pairs)
    store = open_store(ctx, uri, retention=retention_of(ctx), takeover=takeover)
    found = [f for n in numbers for f in store.adoptable(n)] if numbers else store.adoptable()
    if dry_run or not found:
        planned = [(f.step, f.uri, len(f.files), f.size) for f in found]
        _emit_adoption(ctx, store, planned, dry_run=dry_run, seconds=0.0)
        return
    started = time.perf_counter()
    with progress_bar(sum(f.size for f in found), "adopt", progress) as update:
        adopted = [
            info
            for foreign in found
            for info in store.adopt(foreign.step, metadata=metadata, progress=update)
        ]
    rows = [(i.step, i.uri, len(i.files), i.size) for i in adopted]
    _emit_adoption(ctx, store, rows, dry_run=False, seconds=time.perf_counter() - started)


def _emit_adoption(
    ctx: click.Context,
    store: CheckpointStore,
    rows: list[tuple[int, str, int, int]],
    *,
    dry_run: bool,
    seconds: float,
) -> None:
    """``rows``: (step, its URI, files, bytes) adopted, or that would be."""
    files = sum(r[2] for r in rows)
    size = sum(r[3] for r in rows)
    data = {
        "uri": store.uri,
        "dry_run": dry_run,
        "steps": [{"step": s, "uri": u, "files": n, "size": b} for s, u, n, b in rows],
        "files": files,
        "size": size,
        "seconds": round(seconds, 3),
    }
    if not rows:
        text = (
            f"nothing to adopt in {store.uri}: no step directory holds files that ckptstore "
            "did not write"
        )
    elif dry_run:
        lines = [f"  step {s}: {plural(n, 'file')}, {human_size(b)}" for s, _, n, b in rows]
        text = "\n".join(
            [
                f"would adopt {plural(len(rows), 'step')} in {store.uri} "
                f"({plural(files, 'file')}, {human_size(size)}):",
                *lines,
            ]
        )
    else:
        text = (
            f"adopted {steps_text([r[0] for r in rows])} in {store.uri}: "
            f"{plural(files, 'file')}, {human_size(size)} checksummed in {seconds:.2f} s"
        )
    emit(ctx, data, text)


COMMANDS = [adopt_command]
