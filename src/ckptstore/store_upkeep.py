"""The part of CheckpointStore that acts on many steps at once: verify, pins, retention,
removal, garbage collection, replication and adoption (protocol/maintenance.py, pruning.py,
garbage.py, adoption.py, replication/replicator.py). A base class of the facade, so that
store.py stays about saving and loading one step."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any

from ckptstore.data.payload import Progress
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, GcReport, VerifyReport
from ckptstore.domain.manifest import check_metadata
from ckptstore.protocol.adoption import ForeignStep
from ckptstore.protocol.garbage import GC_GRACE_SECONDS, GarbageCollector
from ckptstore.replication.replicator import Replicable, replicate
from ckptstore.store_engines import StoreEngines


class StoreUpkeep(StoreEngines):
    """Many-step operations of :class:`~ckptstore.store.CheckpointStore`."""

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        return self._maintenance.verify(None if step is None else layout.check_step(step))

    def verify_all(self) -> builtins.list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        return self._maintenance.verify_all()

    def rebuild_index(self) -> int:
        """Rebuild the step index from the manifests (docs/design.md "The step index");
        returns how many committed steps it holds. Readers repair the index by themselves:
        this is for an index that older ckptstore versions left behind, or that lists a step
        someone deleted by hand."""
        return self._catalog.rebuild_index()

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        self._maintenance.pin(layout.check_step(step))

    def unpin(self, step: int) -> bool:
        """Remove a pin; returns False if the step was not pinned."""
        return self._maintenance.pins.remove(layout.check_step(step))

    def pins(self) -> builtins.list[int]:
        """The pinned steps, ascending."""
        return self._maintenance.pins.steps()

    def prune(self, dry_run: bool = False) -> builtins.list[int]:
        """Delete the committed steps the retention policy does not keep; returns them."""
        return self._pruner.prune(dry_run)

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step; ``latest`` or a pinned one needs ``force``."""
        self._maintenance.delete(layout.check_step(step), force)

    def copy_to(
        self,
        other: Replicable,
        steps: Iterable[int] | None = None,
        *,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Replicate committed steps (default: all) into ``other``, streamed and verified
        (``replication.replicate`` returns the whole report); raises if a step fails its check."""
        report = replicate(self, other, steps, progress=progress)
        report.raise_failures()
        return report.copied

    def gc(self, dry_run: bool = False, *, older_than: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove what failed saves and interrupted removals left, once proven dead
        (garbage.py); NotFoundError, deleting nothing, if the URI holds no store."""
        collector = GarbageCollector(
            self._catalog, self._remover, self.clock, dry_run=dry_run, older_than=older_than
        )
        return collector.run()

    def adopt(
        self,
        step: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Commit in place step directories ckptstore did not write (adoption.py)."""
        user_metadata = check_metadata(metadata)
        self._async.drain()
        return self._adopter.adopt(step, user_metadata, progress)

    def adoptable(self, step: int | None = None) -> builtins.list[ForeignStep]:
        """What ``adopt(step)`` would commit, without reading or writing a byte of it."""
        return self._adopter.find(step)
