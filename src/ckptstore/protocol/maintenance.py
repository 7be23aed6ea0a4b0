"""Keeping a store healthy: verify, pin and delete.

These are the operations that touch many steps at once, built from the read side (catalog.py,
resolver.py) and the write side (commit.py, removal.py); retention is pruning.py's. The store
only forwards to them. Each follows the commit protocol's rules: deleting uncommits first, and
``latest`` only moves backwards when someone deletes it explicitly. Garbage collection, which
judges what failed saves left behind, is garbage.py's; copying steps into another store is
replication/replicator.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.core.resolver import Resolver
from ckptstore.domain import layout
from ckptstore.domain.info import VerifyReport, signature_status
from ckptstore.errors import (
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.pruning import Pins, Pruner
from ckptstore.protocol.removal import Remover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Maintenance:
    """One store's many-step operations."""

    catalog: Catalog
    resolver: Resolver
    committer: Committer
    remover: Remover
    pins: Pins
    pruner: Pruner

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
        """Delete a committed step. The latest step (the resolver's, which a pointer left
        behind by a killed writer does not hide) or a pinned step needs ``force``.

        Deleting the latest step with ``force`` moves ``latest`` back to the newest step left.
        """
        info = self.catalog.info(step)
        latest = self.resolver.latest()
        is_latest = latest is not None and latest.step == info.step
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
