"""Removing steps and attempts, so that no reader ever sees half a step.

* Uncommitting (retention, ``rm``) swaps the manifest for a tombstone first, then deletes the
  payload, so an interrupted delete never leaves a half-deleted committed step; the next prune
  or ``gc`` that finds the tombstone finishes the removal (``roll_forward``).
* Removing the attempts of an uncommitted step (``abort_step``, used by ``discard`` and ``gc``)
  first puts a tombstone at the manifest key with a create-only write. While it stands no commit
  of the step can succeed, so no file is deleted from under a step being committed.
* A tombstone is deleted in two phases, so that a manifest committed over it in between is
  never deleted (tombstones.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable

from ckptstore.backends.base import Backend
from ckptstore.domain import layout
from ckptstore.domain.manifest import (
    Manifest,
    encode_tombstone,
    is_tombstone,
    tombstone_attempts,
    tombstone_of_commit,
)
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.tombstones import Tombstones

log = logging.getLogger(__name__)


class Remover:
    """Deletes steps and attempts from one backend, tombstone first."""

    def __init__(
        self,
        backend: Backend,
        *,
        writer: str,
        catalog: Catalog,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.backend = backend
        self.writer = writer
        self.catalog = catalog
        self.clock = clock
        self.monotonic = monotonic
        self.sleep = sleep
        self.tombstones = Tombstones(backend, writer, clock, monotonic, sleep)
        """The step's manifest key claimed and dropped (tombstones.py)."""

    def uncommit(self, step: int) -> None:
        """Delete one committed step (:meth:`uncommit_all`)."""
        self.uncommit_all([step])

    def uncommit_all(self, steps: Iterable[int]) -> list[int]:
        """Delete committed steps, a batch of up to a segment's size at a time: the step index
        claims the batch first (readers then look at those manifests instead of trusting the
        index), and drops it once every step of it is gone (step_index.py). A failure to drop
        is logged: the claims stay, and readers repair the index. Returns the steps that
        were committed (and readable) and are gone now: a removal found half done is
        finished, an unreadable manifest left alone."""
        chosen: list[int] = list(steps)
        removed: list[int] = []
        size = self.catalog.index.segment_size
        for batch in (chosen[i : i + size] for i in range(0, len(chosen), size)):
            self.claim_removals(batch)
            finished = []
            for step in batch:
                uncommitted, gone = self._uncommit(step)
                removed += [step] if uncommitted else []
                finished += [step] if gone else []
            self.forget_removed(finished)
        return removed

    def claim_removals(self, steps: Iterable[int]) -> None:
        """Claim steps in the step index before any of them is uncommitted, so readers look
        at their manifests instead of trusting the index (step_index.py)."""
        self.catalog.index.removing(steps)

    def forget_removed(self, steps: Iterable[int]) -> None:
        """Take removed steps (and their claims) out of the step index. A failure is logged:
        the claims stay, and readers repair the index."""
        try:  # a tombstone left standing keeps its claim: a prune's reader finishes it
            self.catalog.index.drop(steps)
        except CheckpointError as e:
            log.warning(
                "%s: removed steps stay in the step index (%s); readers drop them",
                self.backend.uri,
                e,
            )

    def _uncommit(self, step: int) -> tuple[bool, bool]:
        """Delete a committed step: its manifest is swapped for a tombstone first (the step is
        uncommitted from that instant), then the files it lists go, then the tombstone. A
        delete that dies half-way leaves a tombstone and files that ``gc`` removes, never a
        half step. Removing the tombstone at once is safe here, unlike in :meth:`abort_step`:
        the files deleted belong to attempts that were committed, which nobody commits again.

        Returns whether it uncommitted the step, and whether nothing of a removal is left
        there (no tombstone: the step index may forget it)."""
        try:
            manifest, held = self._mark(step)
        except (CorruptCheckpointError, CompatibilityError) as e:
            log.warning("step %d is left alone: %s", step, e)
            return False, False
        if manifest is not None:
            return True, self.finish_uncommit(manifest)
        if held is not None and tombstone_of_commit(held):
            self.roll_forward(step)
            return False, not self.tombstones.stands(step)
        return False, True  # nothing, or gc's tombstone over attempts nobody committed

    def finish_uncommit(self, manifest: Manifest) -> bool:
        """The second half of :meth:`uncommit`, once its tombstone stands: the files the
        manifest lists (an adopted step's too, which have no attempt), the attempts'
        markers, then the tombstone. Returns whether no tombstone is left there (the step
        index may forget the step)."""
        step = manifest.step
        attempts = {f.attempt for f in manifest.files if f.attempt is not None}
        markers = {layout.attempt_marker_path(step, a) for a in attempts}
        delete_attempt_files(self.backend, [f.key(step) for f in manifest.files] + [*markers])
        return self.tombstones.drop(step, gone=True)

    def mark_uncommitted(self, step: int) -> Manifest | None:
        """The first half of :meth:`uncommit`: swap the manifest for a tombstone naming its
        attempts, so the step is uncommitted from that instant and whoever finds the
        tombstone (:meth:`roll_forward`, the next prune or gc) finishes the removal. Returns
        the manifest swapped out; ``None`` when the step was not committed here."""
        return self._mark(step)[0]

    def _mark(self, step: int) -> tuple[Manifest | None, bytes | None]:
        """:meth:`mark_uncommitted`, and the tombstone found instead of a manifest."""
        path = layout.manifest_path(step)
        try:
            data, version = self.backend.read_versioned(path)
        except NotFoundError:
            return None, None
        if is_tombstone(data):
            return None, data
        manifest = Manifest.decode(data, where=self.catalog.uri(path))
        attempts = {f.attempt for f in manifest.files if f.attempt is not None}
        tombstone = encode_tombstone(self.writer, self.clock(), attempts, committed=True)
        self.tombstones.swap(path, tombstone, version)
        self.catalog.forget(step)
        return manifest, None

    def roll_forward(self, step: int) -> list[str] | None:
        """Finish an uncommit that died half-way (its tombstone stands): delete what is left
        of the attempts it names, then the tombstone. Returns what was deleted; ``None`` when
        the key holds no uncommit's tombstone (nothing to finish here)."""
        path = layout.manifest_path(step)
        try:
            data = self.backend.read(path)
        except NotFoundError:
            return None
        if not tombstone_of_commit(data):
            return None
        attempts = tombstone_attempts(data) or frozenset()
        doomed = [
            o.path
            for o in self.backend.list(layout.step_dir(step) + "/")
            if layout.parse_attempt_path(step, o.path) in attempts
        ]
        delete_attempt_files(self.backend, doomed)
        self.tombstones.drop(step)
        log.info("finished the removal of step %d from %s", step, self.backend.uri)
        return [*doomed, path]

    def discard_attempts(self, step: int, attempts: Iterable[str]) -> None:
        """Remove our own attempts' files, unless a manifest of the step lists them (a commit
        whose answer was lost). Another writer cannot commit our attempts, so no tombstone is
        needed. Failures are logged: ``gc`` removes what is left."""
        doomed = set(attempts)
        try:
            with contextlib.suppress(NotFoundError):
                doomed -= {f.attempt for f in self.catalog.read_manifest(step).files}
            paths = [
                o.path
                for o in self.backend.list(layout.step_dir(step) + "/")
                if layout.parse_attempt_path(step, o.path) in doomed
            ]
            delete_attempt_files(self.backend, paths)
        except CheckpointError as e:
            log.warning("could not remove the files of uncommitted step %d (gc will): %s", step, e)

    def discard_step(self, step: int) -> None:
        """Remove every staged file of an uncommitted step, whoever staged it; the tombstone
        stays (a committer of those attempts may be alive), and gc removes it. A failure is
        logged, gc finishes."""
        try:
            self.abort_step(step)
        except CheckpointError as e:
            log.warning("could not clean up uncommitted step %d (gc will): %s", step, e)

    def discard_save(self, step: int, save: str | None, attempts: Iterable[str] = ()) -> None:
        """Remove the attempts of one coordinated save that will not be committed: those its
        participants reported, and those whose marker names ``save`` (a participant that
        failed half-way); never another writer's, a new lease holder saving the same step
        included. Nobody else commits these attempts, so the tombstone goes at once. A
        failure is raised: the coordinator's error says the files are not removed (gc
        finishes)."""
        doomed = set(attempts) | self._attempts_of(step, save)
        if doomed:
            self.abort_step(step, doomed, keep_tombstone=False)

    def _attempts_of(self, step: int, save: str | None) -> set[str]:
        """The attempts of ``step`` whose marker names ``save`` (one GET per attempt)."""
        if save is None:
            return set()
        found = set()
        for attempt in {
            a
            for o in self.backend.list(layout.step_dir(step) + "/")
            if (a := layout.parse_attempt_path(step, o.path)) is not None
        }:
            try:
                marker = json.loads(self.backend.read(layout.attempt_marker_path(step, attempt)))
            except (CheckpointError, ValueError):
                continue  # no marker (yet), or unreadable: gc judges it
            if isinstance(marker, dict) and marker.get("save") == save:
                found.add(attempt)
        return found

    def abort_step(
        self, step: int, attempts: set[str] | None = None, *, keep_tombstone: bool = True
    ) -> list[str] | None:
        """Remove the files of the step's uncommitted attempts (all of those present now, or
        only ``attempts``); returns what was deleted, or ``None`` if the step is committed.

        The attempts are chosen first, then the step's manifest key is claimed with a fresh
        tombstone, then their files are deleted. A committer of a chosen attempt began before
        the claim, so its create-only (or compare-and-swap) commit fails: no file is ever
        deleted from under a step being committed. Files outside attempts are never touched.
        ``keep_tombstone=False`` (a coordinator discarding its own ranks' attempts, which it
        will not commit) removes the tombstone at the end; ``gc``, which removes attempts of
        writers it does not know, keeps it, as :meth:`Tombstones.claim` explains.
        """
        prefix = layout.step_dir(step) + "/"
        if attempts is None:
            attempts = {
                a
                for o in self.backend.list(prefix)
                if (a := layout.parse_attempt_path(step, o.path)) is not None
            }
        if not self.tombstones.claim(step, attempts):
            return None
        doomed = [
            o.path
            for o in self.backend.list(prefix)
            if layout.parse_attempt_path(step, o.path) in attempts
        ]
        delete_attempt_files(self.backend, doomed)
        if not keep_tombstone:
            self.tombstones.drop(step)
        return doomed


def delete_attempt_files(backend: Backend, paths: Iterable[str]) -> None:
    """Delete attempt files, markers last, so an interrupted delete leaves a recognisable
    attempt (marker present) rather than anonymous files, and one that ``gc``'s listing tells
    from a committed attempt without reading the manifest (its marker alone; garbage.py)."""
    paths = list(paths)
    markers = [p for p in paths if p.endswith("/" + layout.ATTEMPT_MARKER)]
    backend.delete([p for p in paths if p not in markers])
    backend.delete(markers)
