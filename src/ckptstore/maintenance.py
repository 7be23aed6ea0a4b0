"""Keeping a store healthy: verify, pin, delete and replicate.

These are the operations that touch many steps at once, built from the read side (catalog.py,
resolver.py) and the write side (commit.py, removal.py); retention is pruning.py's. The store
only forwards to them. Each follows the commit protocol's rules: deleting uncommits first, and
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
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo, VerifyReport, signature_status
from ckptstore.manifest import FileEntry
from ckptstore.payload import Progress
from ckptstore.pruning import Pins, Pruner
from ckptstore.removal import Remover
from ckptstore.resolver import Resolver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Maintenance:
    """One store's many-step operations. ``hold_lease`` takes or renews the writer lease and
    returns its epoch (0 without leases)."""

    catalog: Catalog
    resolver: Resolver
    committer: Committer
    remover: Remover
    pins: Pins
    pruner: Pruner
    hold_lease: Callable[[], int]

    @property
    def backend(self) -> Backend:
        return self.catalog.backend

    # -- verify ----------------------------------------------------------------------------

    def verify(self, step: int | None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        if step is None:
            latest = self.resolver.latest()
            if latest is None:
                raise NotFoundError(
                    f"{self.backend.uri} holds no committed step to verify", uri=self.backend.uri
                )
            step = latest.step
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
        signature = signature_status(info.manifest, checked=self.catalog.signer is not None)
        return VerifyReport(step, tuple(problems), signature)

    def verify_all(self) -> list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        committed, broken = self.catalog.scan()
        reports = [self.verify(m.step) for m in committed]
        reports += [VerifyReport(step, (str(e),)) for step, e in broken.items()]
        return sorted(reports, key=lambda r: r.step)

    # -- pins and delete -------------------------------------------------------------------

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        self.pins.add(self.catalog.info(step).step)

    def delete(self, step: int, force: bool) -> None:
        """Delete a committed step. ``latest`` or a pinned step needs ``force``.

        Deleting the latest step with ``force`` moves ``latest`` back to the newest step left.
        """
        info = self.catalog.info(step)
        pointer, _ = self.catalog.read_pointer()
        is_latest = pointer is not None and pointer.step == info.step
        if not force and (is_latest or info.step in self.pins.steps()):
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
            other.pruner.after_save()
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
