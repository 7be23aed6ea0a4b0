"""``ckptstore`` commands that move bytes: push, pull, cp, with tqdm progress bars on stderr.

The store reports bytes through a ``progress`` callback, from several upload or download threads
at once; the bar's counter is updated under a lock. By default a bar shows only when stderr is a
terminal, so logs and CI output stay clean; ``--progress`` forces it.
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
    STEP,
    common_options,
    emit,
    empty_store,
    open_store,
    parse_pair,
    retention_of,
    retention_options,
    settings_of,
    step_list,
)
from ckptstore.cli.format import human_size, step_record
from ckptstore.errors import NotFoundError
from ckptstore.payload import Progress
from ckptstore.store import CheckpointStore
from ckptstore.transfer import path_filter, scan_dir

F = TypeVar("F", bound=Callable[..., Any])

# -- transfers -------------------------------------------------------------------------------


def _progress_option(f: F) -> F:
    return click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress bar on stderr (default: when stderr is a terminal).",
    )(f)


@contextmanager
def _bar(total: int | None, desc: str, show: bool | None) -> Iterator[Progress]:
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


def _writer_options(f: F) -> F:
    """Options of the commands that commit steps: retention, and the writer lease."""
    f = click.option(
        "--takeover",
        is_flag=True,
        help="Take the store's writer lease even if another writer holds it (only when that "
        "job is known to be dead: it will be fenced).",
    )(f)
    return retention_options(f)


@click.command("push")
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("uri")
@click.option("--step", type=STEP, required=True, help="The step to commit the files as.")
@click.option(
    "--metadata",
    "-m",
    "metadata_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Metadata to record (repeatable; VALUE parsed as JSON when it parses).",
)
@_writer_options
@_progress_option
@common_options
@click.pass_context
def push_command(
    ctx: click.Context,
    local_dir: Path,
    uri: str,
    step: int,
    metadata_pairs: Sequence[str],
    takeover: bool,
    progress: bool | None,
) -> None:
    """Commit the files under LOCAL_DIR (e.g. verl's global_step_N) as STEP of URI."""
    metadata = dict(parse_pair(p, "--metadata") for p in metadata_pairs)
    total = sum(path.stat().st_size for _, path in scan_dir(local_dir))
    store = open_store(ctx, uri, retention=retention_of(ctx), takeover=takeover)
    started = time.perf_counter()
    with _bar(total, f"push step {step}", progress) as update:
        info = store.push_dir(step, local_dir, metadata, progress=update)
    seconds = time.perf_counter() - started
    data = {**step_record(info, latest=step, pins=()), "seconds": round(seconds, 3)}
    del data["latest"], data["pinned"]
    emit(
        ctx,
        data,
        f"pushed {local_dir} as step {step} to {store.uri}: {len(info.files)} files, "
        f"{human_size(info.size)} in {seconds:.2f} s",
    )


@click.command("pull")
@click.argument("uri")
@click.argument("local_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=STEP, help="The step to fetch (default: latest good step).")
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
@_progress_option
@common_options
@click.pass_context
def pull_command(
    ctx: click.Context,
    uri: str,
    local_dir: Path,
    step: int | None,
    force: bool,
    delete: bool,
    exclude: Sequence[str],
    include: Sequence[str],
    progress: bool | None,
) -> None:
    """Download a committed step's files into LOCAL_DIR, every byte verified.

    LOCAL_DIR must be new or empty (else --force or --delete); it appears only once the whole
    step is downloaded and verified.
    """
    store = open_store(ctx, uri)
    expected = store.info(step) if step is not None else store.latest()
    if expected is None:
        raise empty_store(store)
    takes = path_filter(include, exclude)
    total = sum(f.size for f in expected.files if takes(f.path))
    started = time.perf_counter()
    with _bar(total, f"pull step {expected.step}", progress) as update:
        info = store.pull_dir(
            local_dir,
            step,
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
    what = f"{len(pulled)} files"
    if partial:
        what = f"{len(pulled)} of {len(info.files)} files (partial: --include/--exclude)"
    emit(
        ctx,
        data,
        f"pulled step {info.step} from {store.uri} into {local_dir}: {what}, "
        f"{human_size(size)} in {seconds:.2f} s",
    )


@click.command("cp")
@click.argument("src_uri")
@click.argument("dst_uri")
@click.option("--step", "steps", type=STEP, multiple=True, help="A step to copy (repeatable).")
@click.option(
    "--dst-storage-option",
    multiple=True,
    metavar="KEY=VALUE",
    help="Option for DST_URI only, over the global ones (another endpoint or account).",
)
@click.option("--dst-endpoint-url", metavar="URL", help="Endpoint for DST_URI only.")
@_writer_options
@_progress_option
@common_options
@click.pass_context
def cp_command(
    ctx: click.Context,
    src_uri: str,
    dst_uri: str,
    steps: Sequence[int],
    dst_storage_option: Sequence[str],
    dst_endpoint_url: str | None,
    takeover: bool,
    progress: bool | None,
) -> None:
    """Replicate committed steps (default: all) from SRC_URI to DST_URI, verified."""
    dst_options = dict(settings_of(ctx).storage_options)
    dst_options.update(parse_pair(p, "--dst-storage-option") for p in dst_storage_option)
    if dst_endpoint_url:
        dst_options["endpoint_url"] = dst_endpoint_url
    src = open_store(ctx, src_uri)
    dst = open_store(
        ctx,
        dst_uri,
        retention=retention_of(ctx),
        options=dst_options,
        takeover=takeover,
    )
    chosen = [src.info(s) for s in steps] if steps else src.list()
    if not chosen:
        raise empty_store(src)
    todo = [i for i in chosen if not _has_step(dst, i.step)]
    started = time.perf_counter()
    with _bar(sum(i.size for i in todo), "copy", progress) as update:
        copied = src.copy_to(dst, [i.step for i in chosen], progress=update)
    seconds = time.perf_counter() - started
    done = [i.step for i in copied]
    skipped = [i.step for i in chosen if i.step not in done]
    size = sum(i.size for i in copied)
    data = {
        "src": src.uri,
        "dst": dst.uri,
        "copied": done,
        "skipped": skipped,
        "size": size,
        "seconds": round(seconds, 3),
    }
    text = f"copied steps {step_list(done)} ({human_size(size)} in {seconds:.2f} s) to {dst.uri}"
    if skipped:
        text += f"\nskipped steps {step_list(skipped)}: already in {dst.uri} with the same files"
    emit(ctx, data, text)


def _has_step(store: CheckpointStore, step: int) -> bool:
    try:
        store.info(step)
    except NotFoundError:
        return False
    return True


COMMANDS = [push_command, pull_command, cp_command]
