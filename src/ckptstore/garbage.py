"""Garbage collection: removing what failed saves left, and proving it dead first.

Never a manifest, never a file a manifest lists, never anything ckptstore did not write (files
outside attempt directories are reported as foreign). An uncommitted step's attempts are
removed only when every one of them looks dead: nothing in them is younger than ``older_than``
seconds and none was started under the writer lease that is held now; and then under a
tombstone (removal.py), so a commit cannot land while its files go. Attempts that lost the race
for a committed step are dead whatever their age.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckptstore import layout
from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.catalog import Catalog
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.info import GcReport
from ckptstore.lease_record import Process, read_lease
from ckptstore.manifest import Manifest, tombstone_attempts
from ckptstore.removal import Remover, delete_attempt_files

log = logging.getLogger(__name__)

GC_GRACE_SECONDS = 3600.0
"""gc leaves younger uncommitted objects alone: they may belong to a save in flight."""
TOMBSTONE_GRACE_SECONDS = 86400.0
"""gc removes a tombstone (removal.py) only once it is this old, whatever ``older_than`` says: a
committer stalled for that long between staging and committing is taken for dead."""


@dataclass
class _Findings:
    deleted: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    committed: set[int] = field(default_factory=set)


class GarbageCollector:
    """One gc pass over a store; :meth:`run` returns what it removed (or would remove)."""

    def __init__(
        self,
        catalog: Catalog,
        remover: Remover,
        clock: Callable[[], float],
        *,
        dry_run: bool,
        older_than: float,
    ) -> None:
        self.catalog = catalog
        self.backend: Backend = catalog.backend
        self.remover = remover
        self.dry_run = dry_run
        now = clock()
        self.cutoff = now - older_than
        self.tombstone_cutoff = now - max(older_than, TOMBSTONE_GRACE_SECONDS)
        self.live_epoch = held_lease_epoch(self.backend)

    def run(self) -> GcReport:
        found = _Findings()
        for step in self.catalog.step_dirs():
            self._collect_step(step, found)
        pins = self._stale_pins(found.committed)
        partial = [
            p
            for p in self.backend.partial_writes("")
            if _old(p.started, self.cutoff)
            and not any(p.path.startswith(k + "/") for k in found.kept)
        ]
        if not self.dry_run:
            self.backend.delete(pins)
            for upload in partial:
                self.backend.abort(upload)
        return GcReport(
            tuple(found.deleted + pins),
            tuple(p.path for p in partial),
            foreign=tuple(found.foreign),
            kept=tuple(found.kept),
        )

    def _collect_step(self, step: int, found: _Findings) -> None:
        objects = list(self.backend.list(layout.step_dir(step) + "/"))
        attempts = _by_attempt(step, objects)
        marker = layout.manifest_path(step)
        try:
            manifest: Manifest | None = self.catalog.read_manifest(step)
        except NotFoundError:
            manifest = None
        except (CorruptCheckpointError, CompatibilityError):
            found.committed.add(step)  # unreadable: not ours to judge; verify reports it
            return
        listed = {f.key(step) for f in manifest.files} if manifest is not None else set()
        found.foreign += [
            o.path
            for o in objects
            if o.path != marker
            and o.path not in listed
            and layout.parse_attempt_path(step, o.path) is None
        ]
        if manifest is not None:
            found.committed.add(step)
            owners = {f.attempt for f in manifest.files}
            losers = [o.path for a, files in attempts.items() if a not in owners for o in files]
            if losers and not self.dry_run:
                delete_attempt_files(self.backend, losers)
            found.deleted += losers
            return
        tombstone = next((o for o in objects if o.path == marker), None)
        self._collect_uncommitted(step, attempts, tombstone, found)

    def _collect_uncommitted(
        self,
        step: int,
        attempts: dict[str, list[ObjectInfo]],
        tombstone: ObjectInfo | None,
        found: _Findings,
    ) -> None:
        removed = self._removed_attempts(step) if tombstone is not None else frozenset()
        alive = [
            a
            for a, files in attempts.items()
            if a not in removed  # chosen by a remover that died half-way: finish its work
            and (
                any(not _old(o.mtime, self.cutoff) for o in files)
                or (self.live_epoch and self._marker_epoch(step, a) == self.live_epoch)
            )
        ]
        if alive:
            found.kept += [layout.attempt_dir(step, a) for a in attempts]
        elif attempts and self.dry_run:
            found.deleted += [o.path for files in attempts.values() for o in files]
        elif attempts:
            found.deleted += self.remover.abort_step(step, set(attempts)) or []
        elif tombstone is not None and _old(tombstone.mtime, self.tombstone_cutoff):
            if not self.dry_run:
                self.remover.drop_tombstone(step)
            found.deleted.append(layout.manifest_path(step))

    def _stale_pins(self, committed: set[int]) -> list[str]:
        return [
            pin.path
            for pin in self.backend.list(layout.PINS_DIR + "/")
            if _old(pin.mtime, self.cutoff)
            and layout.parse_step_dir(pin.path.rsplit("/", 1)[-1]) not in committed
        ]

    def _removed_attempts(self, step: int) -> frozenset[str]:
        """The attempts the step's tombstone says were being removed."""
        try:
            data = self.backend.read(layout.manifest_path(step))
        except NotFoundError:
            return frozenset()
        return tombstone_attempts(data) or frozenset()

    def _marker_epoch(self, step: int, attempt: str) -> int | None:
        """The lease epoch an attempt was started under, from its marker; None if unreadable."""
        try:
            body = json.loads(self.backend.read(layout.attempt_marker_path(step, attempt)))
            epoch = body["lease_epoch"]
        except (NotFoundError, ValueError, KeyError, TypeError):
            return None
        return epoch if isinstance(epoch, int) else None


def held_lease_epoch(backend: Backend) -> int | None:
    """The epoch of the writer lease if someone may hold it now: not released, and not held
    by a process on this machine that has exited. None otherwise."""
    try:
        record, _, _ = read_lease(backend)
    except CheckpointError:
        return None
    if record is None or record.released:
        return None
    holder = record.process()
    if holder is not None and Process.current().same_machine(holder) and holder.gone():
        return None
    return record.epoch


def _by_attempt(step: int, objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """The step's objects that lie in attempt directories, by attempt id."""
    found: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        attempt = layout.parse_attempt_path(step, obj.path)
        if attempt is not None:
            found.setdefault(attempt, []).append(obj)
    return found


def _old(mtime: float | None, cutoff: float) -> bool:
    return mtime is None or mtime <= cutoff
