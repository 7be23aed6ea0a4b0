"""``ckptstore`` commands that move bytes: push and pull, with progress bars on stderr (``cp``
and ``replicate``, between two stores, are replicate.py's).

The store reports bytes through a ``progress`` callback, from several upload or download threads
at once; the bar's counter is updated under a lock. By default a bar shows only when stderr is a
terminal, so logs and CI output stay clean; ``--progress`` forces it.

STEP arguments are positional (``push DIR URI 100``, ``pull URI DIR latest``);
``--step`` still works, for older scripts. ``push`` of a verl run directory commits each
``global_step_N`` in it, so a run made without the verl integration moves into a store with one
command (``adopt``, in adopt.py, commits in place a run that is already in the bucket).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from ckptstore.cli.common import (
    LATEST,
    STEP,
    StepRef,
    common_options,
    emit,
    empty_store,
    load_timeout_option,
    on_store_option,
    open_store,
    parse_pair,
    retention_of,
    retention_options,
)
from ckptstore.cli.format import human_size, plural, step_record
from ckptstore.core.adoption import LocalPush, LocalStep, difference, local_steps
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import path_filter, scan_dir
from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import ConflictError, NotFoundError
from ckptstore.store import CheckpointStore

F = TypeVar("F", bound=Callable[..., Any])

# -- shared pieces ---------------------------------------------------------------------------


def progress_option(f: F) -> F:
    return click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress bar on stderr (default: when stderr is a terminal).",
    )(f)


def metadata_option(f: F) -> F:
    return click.option(
        "--metadata",
        "-m",
        "metadata_pairs",
        multiple=True,
        metavar="KEY=VALUE",
        help="Metadata to record (repeatable; VALUE parsed as JSON when it parses).",
    )(f)


@contextmanager
def progress_bar(total: int | None, desc: str, show: bool | None) -> Iterator[Progress]:
    """A tqdm byte counter on stderr; the callback is safe to call from worker threads."""
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None if show is None else not show,
        leave=True,
        dynamic_ncols=True,
    ) as bar:

        def update(n: int) -> None:
            with lock:
                bar.update(n)

        yield update


def writer_options(f: F) -> F:
    """Options of the commands that commit steps: retention, the save's deadline (kept with the
    retention options: both are the destination store's options), and the writer lease."""
    f = click.option(
        "--save-timeout",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        expose_value=False,
        callback=on_store_option,
        help="Fail a step's save (push, copy) that takes longer, leaving nothing committed "
        "and no upload open; default: no deadline.",
    )(f)
    f = click.option(
        "--takeover",
        is_flag=True,
        help="Take the store's writer lease even if another writer holds it (only when that "
        "job is known to be dead: it will be fenced).",
    )(f)
    return retention_options(f)


def steps_text(steps: Sequence[int]) -> str:
    """``step 5``, ``steps 5, 6``."""
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


def _one_step(positional: StepRef | None, option: StepRef | None) -> StepRef | None:
    if positional is not None and option is not None and positional != option:
        raise click.UsageError(f"STEP {positional} and --step {option} disagree; give one")
    return positional if positional is not None else option


def step_number(step: StepRef | None, command: str, why: str) -> int | None:
    """A step number for commands that write steps: ``latest`` names a committed one."""
    if step == LATEST:
        raise click.UsageError(f"{command} takes step numbers, not 'latest': {why}")
    return None if step is None else int(step)


def _step_summary(info: CheckpointInfo, seconds: float | None = None) -> dict[str, Any]:
    """A pushed step as JSON: ``ls --json``'s record, less what a push does not decide."""
    data = step_record(info, latest=None, pins=())
    del data["latest"], data["pinned"]
    return data if seconds is None else {**data, "seconds": round(seconds, 3)}


# -- push ------------------------------------------------------------------------------------


@click.command("push")
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("uri")
@click.argument("step", type=STEP, required=False)
@click.option("--step", "step_option", type=STEP, help="Same as STEP.")
@metadata_option
@click.option(
    "--allow-older",
    is_flag=True,
    help="Commit steps older than the store's latest (latest stays where it is).",
)
@writer_options
@progress_option
@common_options
@click.pass_context
def push_command(
    ctx: click.Context,
    local_dir: Path,
    uri: str,
    step: StepRef | None,
    step_option: StepRef | None,
    metadata_pairs: Sequence[str],
    allow_older: bool,
    takeover: bool,
    progress: bool | None,
) -> None:
    """Commit LOCAL_DIR to URI as STEP.

    LOCAL_DIR is one step's files (verl's global_step_N: STEP defaults to N), or a run
    directory holding global_step_N directories (verl's default_local_dir): each is committed,
    oldest first (only STEP's, if given). A step already committed with the same files is
    skipped; with other files it is a conflict, found before anything is uploaded.
    """
    chosen = step_number(
        _one_step(step, step_option), "push", "give the step to commit the files as"
    )
    plan = local_steps(local_dir, chosen)
    metadata = dict(parse_pair(p, "--metadata") for p in metadata_pairs)
    store = open_store(ctx, uri, retention=retention_of(ctx), takeover=takeover)
    todo, skipped = _push_plan(store, plan)
    total = sum(path.stat().st_size for local in todo for _, path in scan_dir(local.path))
    desc = f"push step {todo[0].step}" if len(todo) == 1 else "push"
    started = time.perf_counter()
    with progress_bar(total, desc, progress) as update:
        pushed = [
            store.push_dir(
                local.step, local.path, metadata, progress=update, allow_older=allow_older
            )
            for local in todo
        ]
    seconds = time.perf_counter() - started
    if plan.run:
        _emit_run_push(ctx, store, local_dir, pushed, [s.step for s in skipped], seconds)
    elif pushed:
        info = pushed[0]
        emit(
            ctx,
            {**_step_summary(info, seconds), "skipped": False},
            f"pushed {plan.steps[0].path} as step {info.step} to {store.uri}: "
            f"{plural(len(info.files), 'file')}, {human_size(info.size)} in {seconds:.2f} s",
        )
    else:
        info = store.info(skipped[0].step)
        emit(
            ctx,
            {**_step_summary(info, seconds), "skipped": True},
            f"step {info.step} is already committed in {store.uri} with the same files as "
            f"{skipped[0].path}; nothing to push",
        )


def _push_plan(store: CheckpointStore, plan: LocalPush) -> tuple[list[LocalStep], list[LocalStep]]:
    """``(to push, to skip)``: a step committed with the same files is skipped, one committed
    with other files is a ConflictError before anything is uploaded."""
    todo, skipped = [], []
    for local in plan.steps:
        try:
            info = store.info(local.step)
        except NotFoundError:
            todo.append(local)
            continue
        why = difference(local.path, info)
        if why is not None:
            raise ConflictError(
                f"step {local.step} is already committed in {store.uri} with other files than "
                f"{local.path} ({why}); committed steps are immutable. Push it as another "
                f"step, or `ckptstore rm {store.uri} {local.step}` first. Nothing was pushed",
                uri=info.uri,
                step=local.step,
            )
        skipped.append(local)
    return todo, skipped


def _emit_run_push(
    ctx: click.Context,
    store: CheckpointStore,
    local_dir: Path,
    pushed: list[CheckpointInfo],
    skipped: list[int],
    seconds: float,
) -> None:
    files = sum(len(i.files) for i in pushed)
    size = sum(i.size for i in pushed)
    data = {
        "uri": store.uri,
        "local_dir": str(local_dir),
        "pushed": [_step_summary(i) for i in pushed],
        "skipped": skipped,
        "files": files,
        "size": size,
        "seconds": round(seconds, 3),
    }
    lines = [f"nothing to push from {local_dir} to {store.uri}"]
    if pushed:
        lines = [
            f"pushed {steps_text([i.step for i in pushed])} from {local_dir} to {store.uri}: "
            f"{plural(files, 'file')}, {human_size(size)} in {seconds:.2f} s"
        ]
    if skipped:
        lines.append(
            f"skipped {steps_text(skipped)}: already committed in {store.uri} with the same files"
        )
    emit(ctx, data, "\n".join(lines))


# -- pull ------------------------------------------------------------------------------------


@click.command("pull")
@click.argument("uri")
@click.argument("local_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("step", type=STEP, required=False)
@click.option("--step", "step_option", type=STEP, help="Same as STEP.")
@click.option(
    "--force",
    is_flag=True,
    help="Pull into a non-empty LOCAL_DIR: overwrite the step's files there, keep all others.",
)
@click.option(
    "--delete",
    is_flag=True,
    help="Make LOCAL_DIR an exact copy of the step: also remove the files there that the step "
    "lacks (not those --exclude leaves out). Implies --force.",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="GLOB",
    help="Leave out the files whose path in the step matches ('*' also matches '/'; "
    "repeatable). The pull is then partial.",
)
@click.option(
    "--include",
    multiple=True,
    metavar="GLOB",
    help="Take back files an --exclude left out (repeatable). Excludes apply first, then "
    "includes, whatever their order here: --exclude '*' --include 'actor/*' pulls only actor/.",
)
@progress_option
@load_timeout_option
@common_options
@click.pass_context
def pull_command(
    ctx: click.Context,
    uri: str,
    local_dir: Path,
    step: StepRef | None,
    step_option: StepRef | None,
    force: bool,
    delete: bool,
    exclude: Sequence[str],
    include: Sequence[str],
    progress: bool | None,
) -> None:
    """Download a committed step's files into LOCAL_DIR, every byte verified.

    STEP defaults to latest, the newest step that verifies (a corrupt one is skipped with a
    warning). LOCAL_DIR must be new or empty (else --force or --delete); it appears only once
    the whole step is downloaded and verified.
    """
    chosen = _one_step(step, step_option)
    number = None if chosen in (None, LATEST) else int(chosen)  # latest: with its fallback
    store = open_store(ctx, uri, retention=retention_of(ctx))
    with store.resolver.loading():  # choosing the step and pulling it: one load
        expected = store.info(number) if number is not None else store.latest()
        if expected is None:
            raise empty_store(store)
        takes = path_filter(include, exclude)
        total = sum(f.size for f in expected.files if takes(f.path))
        started = time.perf_counter()
        with progress_bar(total, f"pull step {expected.step}", progress) as update:
            info = store.pull_dir(
                local_dir,
                number,
                progress=update,
                force=force,
                delete=delete,
                include=include,
                exclude=exclude,
            )
    seconds = time.perf_counter() - started
    pulled = [f for f in info.files if takes(f.path)]
    size = sum(f.size for f in pulled)
    partial = len(pulled) < len(info.files)
    data = {
        "uri": info.uri,
        "step": info.step,
        "local_dir": str(local_dir),
        "files": len(pulled),
        "size": size,
        "partial": partial,
        "seconds": round(seconds, 3),
    }
    what = plural(len(pulled), "file")
    if partial:
        what = f"{len(pulled)} of {plural(len(info.files), 'file')} (partial: --include/--exclude)"
    emit(
        ctx,
        data,
        f"pulled step {info.step} from {store.uri} into {local_dir}: {what}, "
        f"{human_size(size)} in {seconds:.2f} s",
    )


COMMANDS = [push_command, pull_command]
