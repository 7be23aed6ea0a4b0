"""Keeping a store healthy: verify, pins, retention, delete, replicate, garbage collection.

These are the operations that touch many steps at once. Each follows the commit protocol's
rules (commit.py): deleting uncommits first, nothing younger than a grace period is treated as
garbage, and ``latest`` only moves backwards when someone deletes it explicitly.
CheckpointStore exposes each as a method; they live here to keep store.py about saving and
loading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ckptstore import layout
from ckptstore.commit import Committer, Progress, SourceFile
from ckptstore.errors import (
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo, GcReport, VerifyReport
from ckptstore.manifest import FileEntry
from ckptstore.retention import steps_to_delete

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)


def verify(store: CheckpointStore, step: int | None) -> VerifyReport:
    """Check every file of ``step`` (default: latest) against its manifest."""
    if step is None:
        latest = store.latest()
        if latest is None:
            raise NotFoundError(f"{store.uri} holds no committed step to verify")
        step = latest.step
    step = layout.check_step(step)
    try:
        info = store.info(step)
    except CorruptCheckpointError as e:
        return VerifyReport(step, (str(e),))
    problems = []
    for entry in info.files:
        try:
            store._committer.read_verified(step, entry)
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            problems.append(str(e))
    return VerifyReport(step, tuple(problems))


def verify_all(store: CheckpointStore) -> list[VerifyReport]:
    """``verify`` for every committed step, including those with unreadable manifests."""
    committed, broken = store._scan()
    reports = [verify(store, m.step) for m in committed]
    reports += [VerifyReport(step, (str(e),)) for step, e in broken.items()]
    return sorted(reports, key=lambda r: r.step)


def pin(store: CheckpointStore, step: int) -> None:
    """Protect a committed step from retention until ``unpin``."""
    info = store.info(step)
    store.backend.write(layout.pin_path(info.step), [b"pinned\n"])


def unpin(store: CheckpointStore, step: int) -> bool:
    """Remove a pin; returns False if the step was not pinned."""
    step = layout.check_step(step)
    if store.backend.stat(layout.pin_path(step)) is None:
        return False
    store.backend.delete([layout.pin_path(step)])
    return True


def pins(store: CheckpointStore) -> list[int]:
    names = (o.path.rsplit("/", 1)[-1] for o in store.backend.list(layout.PINS_DIR + "/"))
    return sorted(s for s in map(layout.parse_step_dir, names) if s is not None)


def prune(store: CheckpointStore, dry_run: bool) -> list[int]:
    """Delete the committed steps the retention policy does not keep; returns them."""
    if not store.retention.enabled:
        raise ConfigError(
            f"{store.uri}: no retention policy to prune by; open the store with keep_last "
            "and/or keep_every (CLI: --keep-last N --keep-every K)"
        )
    pointer, _ = store._committer.read_pointer()
    committed = [i.step for i in store.list()]
    latest = pointer.step if pointer is not None and pointer.step in committed else None
    doomed = steps_to_delete(store.retention, committed, latest=latest, pinned=pins(store))
    if not dry_run:
        for step in doomed:
            store._committer.uncommit(step)
            log.info("retention deleted step %d from %s", step, store.uri)
    return doomed


def delete(store: CheckpointStore, step: int, force: bool) -> None:
    """Delete a committed step. ``latest`` or a pinned step needs ``force``.

    Deleting the latest step with ``force`` moves ``latest`` back to the newest step left.
    """
    info = store.info(step)
    pointer, _ = store._committer.read_pointer()
    is_latest = pointer is not None and pointer.step == info.step
    if not force and (is_latest or info.step in pins(store)):
        what, fix = ("the latest step", "") if is_latest else ("pinned", "unpin it first or ")
        raise ConflictError(
            f"step {info.step} in {store.uri} is {what}; {fix}pass force=True to delete it "
            "anyway (CLI: --force)"
        )
    store._committer.uncommit(info.step)
    store.backend.delete([layout.pin_path(info.step)])
    if is_latest:
        remaining = [i.step for i in store.list() if i.step < info.step]
        if remaining:
            store._committer.advance_latest(remaining[-1], rollback=True)
        else:
            store.backend.delete([layout.LATEST_NAME])


def copy_to(
    store: CheckpointStore,
    other: CheckpointStore,
    steps: Iterable[int] | None,
    progress: Progress | None,
) -> list[CheckpointInfo]:
    """Replicate committed steps (default: all) into ``other``, verified, same manifests.

    Steps ``other`` already holds with identical files are skipped. ``other``'s ``latest``
    moves forward to the newest copied step, then ``other``'s retention applies.
    """
    chosen = store.list() if steps is None else [store.info(s) for s in steps]
    copied = []
    epoch = 0
    for info in chosen:
        try:
            existing = other.info(info.step)
        except NotFoundError:
            existing = None
        if existing is not None:
            if existing.files != info.files:
                raise ConflictError(
                    f"step {info.step} exists in {other.uri} with other contents; remove it "
                    "there first (ckptstore rm) or copy other steps"
                )
            continue
        files = [
            SourceFile(e.path, _verified_reader(store._committer, info.step, e)) for e in info.files
        ]
        try:
            entries = other._committer.write_payload(info.step, files, progress)
            other._committer.confirm_payload(info.step, entries)
            epoch = other.hold_lease()
            manifest = other._committer.commit(info.manifest)
        except BaseException:
            other.discard(info.step)
            raise
        copied.append(other._info(manifest))
    if copied:
        other._committer.advance_latest(max(i.step for i in copied), epoch=epoch)
        other._retain_after_save()
    return copied


def gc(store: CheckpointStore, dry_run: bool, older_than: float) -> GcReport:
    """Remove garbage: uncommitted step files, unlisted files, stray uploads, stale pins.

    Only objects older than ``older_than`` seconds are touched, so a save in flight in
    another process keeps its files. Steps with unreadable manifests are left alone.
    """
    cutoff = store.clock() - older_than
    committed, broken = store._scan()
    manifests = {m.step: m for m in committed}
    doomed: list[str] = []
    for step in store._committer.step_dirs():
        if step in broken:
            continue
        objects = list(store.backend.list(layout.step_dir(step) + "/"))
        if step in manifests:
            listed = {layout.payload_path(step, f.path) for f in manifests[step].files}
            listed.add(layout.manifest_path(step))
            doomed += [o.path for o in objects if o.path not in listed and _old(o.mtime, cutoff)]
        elif all(_old(o.mtime, cutoff) for o in objects):
            doomed += [o.path for o in objects]
    for pin in store.backend.list(layout.PINS_DIR + "/"):
        pinned = layout.parse_step_dir(pin.path.rsplit("/", 1)[-1])
        if pinned not in manifests and pinned not in broken and _old(pin.mtime, cutoff):
            doomed.append(pin.path)
    partial = [p for p in store.backend.partial_writes("") if _old(p.started, cutoff)]
    if not dry_run:
        store.backend.delete(doomed)
        for upload in partial:
            store.backend.abort(upload)
    return GcReport(tuple(doomed), tuple(p.path for p in partial))


def _old(mtime: float | None, cutoff: float) -> bool:
    return mtime is None or mtime <= cutoff


def _verified_reader(
    committer: Committer, step: int, entry: FileEntry
) -> Callable[[], list[bytes]]:
    return lambda: [bytes(committer.read_verified(step, entry))]
