"""Keeping a store healthy: verify, pins, retention, delete, replicate, garbage collection.

These are the operations that touch many steps at once. Each follows the commit protocol's
rules (commit.py): deleting uncommits first, nothing younger than a grace period is treated as
garbage, and ``latest`` only moves backwards when someone deletes it explicitly.
CheckpointStore exposes each as a method; they live here to keep store.py about saving and
loading.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckptstore import layout
from ckptstore.backends.base import ObjectInfo
from ckptstore.commit import Progress, delete_attempt_files
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo, GcReport, VerifyReport
from ckptstore.lease_record import Process, read_lease
from ckptstore.manifest import FileEntry, tombstone_attempts
from ckptstore.retention import steps_to_delete

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

TOMBSTONE_GRACE_SECONDS = 86400.0
"""gc removes a tombstone (commit.py) only once it is this old, whatever ``older_than`` says: a
committer stalled for that long between staging and committing is taken for dead."""


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
            store._catalog.read_verified(step, entry)
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
    pointer, _ = store._catalog.read_pointer()
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
    pointer, _ = store._catalog.read_pointer()
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

        def read(entry: FileEntry, step: int = info.step) -> bytes:
            return bytes(store._catalog.read_verified(step, entry))

        try:
            epoch = other.hold_lease()
            other._committer.replicate(info.step, info.files, read, progress, epoch=epoch)
            other._committer.confirm_payload(info.step, info.files)
            epoch = other.hold_lease()
            manifest = other._committer.commit(info.manifest)
        except BaseException:
            attempts = {f.attempt for f in info.files if f.attempt is not None}
            other._committer.discard_attempts(info.step, attempts)
            raise
        copied.append(other._info(manifest))
    if copied:
        other._committer.advance_latest(max(i.step for i in copied), epoch=epoch)
        other._retain_after_save()
    return copied


def gc(store: CheckpointStore, dry_run: bool, older_than: float) -> GcReport:
    """Remove what failed saves left: dead attempts, stray uploads, pins of deleted steps.

    Never a manifest, never a file a manifest lists, never anything ckptstore did not write
    (files outside attempt directories are reported as foreign). An uncommitted step's attempts
    are removed only when every one of them looks dead: nothing in them is younger than
    ``older_than`` seconds and none was started under the writer lease that is held now; and
    then under a tombstone (commit.py), so a commit cannot land while its files go. Attempts
    that lost the race for a committed step are dead whatever their age.
    """
    cutoff = store.clock() - older_than
    tombstone_cutoff = store.clock() - max(older_than, TOMBSTONE_GRACE_SECONDS)
    live_epoch = _held_lease_epoch(store)
    deleted: list[str] = []
    foreign: list[str] = []
    kept: list[str] = []
    committed: set[int] = set()
    for step in store._catalog.step_dirs():
        objects = list(store.backend.list(layout.step_dir(step) + "/"))
        attempts = _by_attempt(step, objects)
        marker = layout.manifest_path(step)
        try:
            manifest = store._catalog.read_manifest(step)
        except NotFoundError:
            manifest = None
        except (CorruptCheckpointError, CompatibilityError):
            committed.add(step)  # unreadable: not ours to judge; verify reports it
            continue
        listed = {f.key(step) for f in manifest.files} if manifest is not None else set()
        foreign += [
            o.path
            for o in objects
            if o.path != marker
            and o.path not in listed
            and layout.parse_attempt_path(step, o.path) is None
        ]
        if manifest is not None:
            committed.add(step)
            owners = {f.attempt for f in manifest.files}
            losers = [o.path for a, files in attempts.items() if a not in owners for o in files]
            if losers and not dry_run:
                delete_attempt_files(store.backend, losers)
            deleted += losers
            continue
        tombstone = next((o for o in objects if o.path == marker), None)
        removed = _removed_attempts(store, step) if tombstone is not None else frozenset()
        alive = [
            a
            for a, files in attempts.items()
            if a not in removed  # chosen by a remover that died half-way: finish its work
            and (
                any(not _old(o.mtime, cutoff) for o in files)
                or (live_epoch and _marker_epoch(store, step, a) == live_epoch)
            )
        ]
        if alive:
            kept += [layout.attempt_dir(step, a) for a in attempts]
        elif attempts and dry_run:
            deleted += [o.path for files in attempts.values() for o in files]
        elif attempts:
            deleted += store._committer.abort_step(step, set(attempts)) or []
        elif tombstone is not None and _old(tombstone.mtime, tombstone_cutoff):
            if not dry_run:
                store._committer.drop_tombstone(step)
            deleted.append(marker)
    pins = [
        pin.path
        for pin in store.backend.list(layout.PINS_DIR + "/")
        if _old(pin.mtime, cutoff)
        and layout.parse_step_dir(pin.path.rsplit("/", 1)[-1]) not in committed
    ]
    partial = [
        p
        for p in store.backend.partial_writes("")
        if _old(p.started, cutoff) and not any(p.path.startswith(k + "/") for k in kept)
    ]
    if not dry_run:
        store.backend.delete(pins)
        for upload in partial:
            store.backend.abort(upload)
    return GcReport(
        tuple(deleted + pins),
        tuple(p.path for p in partial),
        foreign=tuple(foreign),
        kept=tuple(kept),
    )


def _removed_attempts(store: CheckpointStore, step: int) -> frozenset[str]:
    """The attempts the step's tombstone says were being removed."""
    try:
        data = store.backend.read(layout.manifest_path(step))
    except NotFoundError:
        return frozenset()
    return tombstone_attempts(data) or frozenset()


def _by_attempt(step: int, objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """The step's objects that lie in attempt directories, by attempt id."""
    found: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        attempt = layout.parse_attempt_path(step, obj.path)
        if attempt is not None:
            found.setdefault(attempt, []).append(obj)
    return found


def _marker_epoch(store: CheckpointStore, step: int, attempt: str) -> int | None:
    """The lease epoch an attempt was started under, from its marker; None if unreadable."""
    try:
        body = json.loads(store.backend.read(layout.attempt_marker_path(step, attempt)))
        epoch = body["lease_epoch"]
    except (NotFoundError, ValueError, KeyError, TypeError):
        return None
    return epoch if isinstance(epoch, int) else None


def _held_lease_epoch(store: CheckpointStore) -> int | None:
    """The epoch of the writer lease if someone may hold it now: not released, and not held
    by a process on this machine that has exited. None otherwise."""
    try:
        record, _, _ = read_lease(store.backend)
    except CheckpointError:
        return None
    if record is None or record.released:
        return None
    holder = record.process()
    if holder is not None and Process.current().same_machine(holder) and holder.gone():
        return None
    return record.epoch


def _old(mtime: float | None, cutoff: float) -> bool:
    return mtime is None or mtime <= cutoff
