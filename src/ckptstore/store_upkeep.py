"""The part of CheckpointStore that acts on many steps at once: verify, pins, retention,
removal, garbage collection, replication and adoption (core/maintenance.py, pruning.py,
garbage.py, adoption.py, replication/replicator.py). A base class of the facade, so that
store.py stays about saving and loading one step."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any

from ckptstore.core.adoption import ForeignStep
from ckptstore.data.payload import Progress
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, GcReport, VerifyReport
from ckptstore.domain.manifest import check_metadata
from ckptstore.protocol.garbage import GC_GRACE_SECONDS
from ckptstore.replication.replicator import Replicable, replicate
from ckptstore.store_engines import StoreEngines


class StoreUpkeep(StoreEngines):
    """Many-step operations of :class:`~ckptstore.store.CheckpointStore`."""

    # With a local tier, each of these acts on both tiers, or on the one ``tier`` names
    # ("local" or "durable"): core/maintenance.py.

    def verify(self, step: int | None = None, *, tier: str | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest, each tier's
        copy (``VerifyReport.tiers`` names them)."""
        checked = None if step is None else layout.check_step(step)
        return self._maintenance.verify(checked, tier)

    def verify_all(self, *, tier: str | None = None) -> builtins.list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        return self._maintenance.verify_all(tier)

    def rebuild_index(self, *, tier: str | None = None) -> dict[str, int]:
        """Rebuild the step index of every tier (or ``tier``) from its manifests
        (docs/design.md "The step index"); returns each tier's URI and how many committed
        steps its index holds. Readers repair the index by themselves: this is for an index
        that older ckptstore versions left behind, or that lists a step someone deleted by
        hand."""
        return self._maintenance.rebuild_index(tier)

    def pin(self, step: int, *, tier: str | None = None) -> None:
        """Protect a committed step from retention until ``unpin``, in every tier."""
        self._maintenance.pin(layout.check_step(step), tier)

    def unpin(self, step: int, *, tier: str | None = None) -> bool:
        """Remove a pin; returns False if the step was not pinned. A local pin of a step not
        yet durable stays until its copy lands."""
        return self._maintenance.unpin(layout.check_step(step), tier)

    def pins(self, *, tier: str | None = None) -> builtins.list[int]:
        """The steps pinned in any tier, ascending."""
        return self._maintenance.pinned(tier)

    def prune(self, dry_run: bool = False, *, tier: str | None = None) -> builtins.list[int]:
        """Delete the committed steps each tier's retention does not keep (the store's
        policy; ``local_keep_last``); returns them, ascending."""
        return self._maintenance.prune(dry_run, tier)

    def delete(
        self,
        step: int | Iterable[int],
        *,
        force: bool = False,
        tier: str | None = None,
        dry_run: bool = False,
    ) -> builtins.list[int]:
        """Delete committed steps from every tier (or ``tier``), all checked before any is
        deleted; ``latest`` or a pinned one needs ``force``. ``latest`` moves back to the
        newest step left; the step can be saved again. Returns the steps."""
        steps = [step] if isinstance(step, int) else step
        self._async.drain()  # a save in flight commits before, not under, the delete
        return self._maintenance.delete(map(layout.check_step, steps), force, tier, dry_run=dry_run)

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

    def gc(
        self,
        dry_run: bool = False,
        *,
        older_than: float = GC_GRACE_SECONDS,
        tier: str | None = None,
    ) -> GcReport:
        """Remove what failed saves and interrupted removals left, once proven dead
        (garbage.py), in every tier (paths then by full URI); NotFoundError, deleting
        nothing, if the URI holds no store."""
        return self._maintenance.gc(dry_run, older_than, tier)

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
