"""Keeping a store healthy: verify, pins, retention, delete and replicate.

These are the operations that touch many steps at once, built from the read side (catalog.py),
the write side (commit.py, removal.py) and the retention policy (retention.py); the store only
forwards to them. Each follows the commit protocol's rules: deleting uncommits first, and
``latest`` only moves backwards when someone deletes it explicitly. Garbage collection, which
judges what failed saves left behind, is garbage.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptstore import layout
from ckptstore.backends.base import Backend
from ckptstore.catalog import Catalog
from ckptstore.commit import Committer
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo, VerifyReport
from ckptstore.manifest import FileEntry, Manifest
from ckptstore.payload import Progress
from ckptstore.removal import Remover
from ckptstore.retention import RetentionPolicy, StepRecord, steps_to_delete

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Maintenance:
    """One store's many-step operations. ``hold_lease`` takes or renews the writer lease and
    returns its epoch (0 without leases)."""

    catalog: Catalog
    committer: Committer
    retention: RetentionPolicy
    hold_lease: Callable[[], int]

    @property
    def backend(self) -> Backend:
        return self.catalog.backend

    @property
    def remover(self) -> Remover:
        return self.committer.remover

    # -- verify ----------------------------------------------------------------------------

    def verify(self, step: int | None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        if step is None:
            latest = self.catalog.latest()
            if latest is None:
                raise NotFoundError(
                    f"{self.backend.uri} holds no committed step to verify", uri=self.backend.uri
                )
            step = latest.step
        step = layout.check_step(step)
        try:
            info = self.catalog.info(step)
        except CorruptCheckpointError as e:
            return VerifyReport(step, (str(e),))
        problems = []
        for entry in info.files:
            try:
                self.catalog.read_verified(step, entry)
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                problems.append(str(e))
        return VerifyReport(step, tuple(problems))

    def verify_all(self) -> list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        committed, broken = self.catalog.scan()
        reports = [self.verify(m.step) for m in committed]
        reports += [VerifyReport(step, (str(e),)) for step, e in broken.items()]
        return sorted(reports, key=lambda r: r.step)

    # -- pins ------------------------------------------------------------------------------

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        info = self.catalog.info(step)
        self.backend.write(layout.pin_path(info.step), [b"pinned\n"])

    def unpin(self, step: int) -> bool:
        """Remove a pin; returns False if the step was not pinned."""
        step = layout.check_step(step)
        if self.backend.stat(layout.pin_path(step)) is None:
            return False
        self.backend.delete([layout.pin_path(step)])
        return True

    def pins(self) -> list[int]:
        names = (o.path.rsplit("/", 1)[-1] for o in self.backend.list(layout.PINS_DIR + "/"))
        return sorted(s for s in map(layout.parse_step_dir, names) if s is not None)

    # -- retention and delete --------------------------------------------------------------

    def prune(self, dry_run: bool = False) -> list[int]:
        """Delete the committed steps the retention policy does not keep; returns them.

        With only ``keep_last``/``keep_every`` this costs one listing of step directories and
        one of pins, the pointer, the newest ``keep_last`` manifests (remembered after the
        first time) and one manifest per step deleted: not a read of every manifest in the
        store. Rules that judge a step's time or metadata (``keep_best``,
        ``keep_every_seconds``, ``retention=`` policies) need every committed step's manifest:
        those this process has read are remembered (catalog.py), so after the first prune a
        save reads only its own step's, plus the steps counted by ``keep_last``/``keep_best``,
        confirmed afresh.
        """
        if not self.retention.enabled:
            raise ConfigError(
                f"{self.backend.uri}: no retention policy to prune by; open the store with "
                "keep_last, keep_every, keep_best, keep_every_seconds and/or retention (CLI: "
                "--keep-last N, --keep-every K, --keep-best K --best-metric NAME --best-mode "
                "min|max, --keep-every-seconds T)",
                uri=self.backend.uri,
            )
        pointer, _ = self.catalog.read_pointer()
        steps: list[int] | list[StepRecord]
        if self.retention.needs_records:
            steps = self._records()
        else:
            steps = self.catalog.retention_view(self.retention.keep_last or 0)
        latest = pointer.step if pointer is not None else None
        if latest is not None and not self.catalog.is_committed(latest):
            latest = None
        chosen = steps_to_delete(self.retention, steps, latest=latest, pinned=self.pins())
        doomed = [step for step in chosen if self.catalog.is_committed(step)]
        if not dry_run:
            for step in doomed:
                self.remover.uncommit(step)
                log.info("retention deleted step %d from %s", step, self.backend.uri)
        return doomed

    def _records(self) -> list[StepRecord]:
        """A record (step, time, metadata) of every readable committed step, ascending.

        Manifests come from the catalog's memory where it has them (one listing, a GET per
        manifest not read before). The steps ``keep_last``/``keep_best`` count are read
        afresh, as ``retention_view`` does for ``keep_last``: one another process removed (or
        removed and saved again) since would otherwise push out a step that should stay. A
        step whose manifest cannot be read gets no record, so retention never deletes it.
        """
        committed, broken = self.catalog.scan()
        for step in broken:
            log.debug("retention leaves step %d alone: its manifest is unreadable", step)
        manifests = {m.step: m for m in committed}
        confirmed: set[int] = set()
        while True:
            records = [record_of(manifests[step]) for step in sorted(manifests)]
            todo = self.retention.counted(records) - confirmed
            if not todo:
                return records
            for step in todo:  # each pass confirms new steps, so this ends
                fresh = self._fresh_manifest(step)
                if fresh is None:
                    del manifests[step]
                else:
                    manifests[step] = fresh
            confirmed |= todo

    def _fresh_manifest(self, step: int) -> Manifest | None:
        try:
            return self.catalog.read_manifest(step)
        except NotFoundError:
            return None
        except (CorruptCheckpointError, CompatibilityError) as e:
            log.warning("step %d has an unreadable manifest: %s", step, e)
            return None

    def retain_after_save(self) -> None:
        """Apply retention after a commit; a failure is logged, never undoes the commit."""
        if not self.retention.enabled:
            return
        try:
            self.prune()
        except CheckpointError as e:
            log.error("retention after save failed (committed steps are intact): %s", e)

    def delete(self, step: int, force: bool) -> None:
        """Delete a committed step. ``latest`` or a pinned step needs ``force``.

        Deleting the latest step with ``force`` moves ``latest`` back to the newest step left.
        """
        info = self.catalog.info(step)
        pointer, _ = self.catalog.read_pointer()
        is_latest = pointer is not None and pointer.step == info.step
        if not force and (is_latest or info.step in self.pins()):
            what, fix = ("the latest step", "") if is_latest else ("pinned", "unpin it first or ")
            raise ConflictError(
                f"step {info.step} in {self.backend.uri} is {what}; {fix}pass force=True to "
                "delete it anyway (CLI: --force)",
                uri=info.uri,
                path=layout.step_dir(info.step),
                step=info.step,
            )
        self.remover.uncommit(info.step)
        self.backend.delete([layout.pin_path(info.step)])
        if is_latest:
            remaining = [i.step for i in self.catalog.list() if i.step < info.step]
            if remaining:
                self.committer.advance_latest(remaining[-1], rollback=True)
            else:
                self.backend.delete([layout.LATEST_NAME])

    # -- replicate -------------------------------------------------------------------------

    def copy_to(
        self, other: Maintenance, steps: Iterable[int] | None, progress: Progress | None
    ) -> list[CheckpointInfo]:
        """Replicate committed steps (default: all) into ``other``, verified, same manifests.

        Steps ``other`` already holds with identical files are skipped. ``other``'s ``latest``
        moves forward to the newest copied step, then ``other``'s retention applies.
        """
        chosen = self.catalog.list() if steps is None else [self.catalog.info(s) for s in steps]
        copied = []
        epoch = 0
        for info in chosen:
            if other._holds_same(info):
                continue

            def read(entry: FileEntry, step: int = info.step) -> bytes:
                return bytes(self.catalog.read_verified(step, entry))

            try:
                epoch = other.hold_lease()
                other.committer.replicate(info.step, info.files, read, progress, epoch=epoch)
                other.committer.confirm_payload(info.step, info.files)
                epoch = other.hold_lease()
                manifest = other.committer.commit(info.manifest)
            except BaseException:
                attempts = {f.attempt for f in info.files if f.attempt is not None}
                other.remover.discard_attempts(info.step, attempts)
                raise
            copied.append(other.catalog.info_of(manifest))
        if copied:
            other.committer.advance_latest(max(i.step for i in copied), epoch=epoch)
            other.retain_after_save()
        return copied

    def _holds_same(self, info: CheckpointInfo) -> bool:
        """Whether this store already holds ``info``'s step; ConflictError if with other files."""
        try:
            existing = self.catalog.info(info.step)
        except NotFoundError:
            return False
        if existing.files != info.files:
            raise ConflictError(
                f"step {info.step} exists in {self.backend.uri} with other contents; remove it "
                "there first (ckptstore rm) or copy other steps",
                uri=existing.uri,
                path=layout.step_dir(info.step),
                step=info.step,
            )
        return True


def record_of(manifest: Manifest) -> StepRecord:
    """What a retention policy sees of a committed step (retention.py stays free of I/O)."""
    return StepRecord(manifest.step, manifest.created, manifest.metadata)
