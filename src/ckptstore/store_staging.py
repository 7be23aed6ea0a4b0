"""The part of CheckpointStore that a multi-process save goes through: a coordinator on one
process, participants that stage their files uncommitted, one commit (coordination.py). A
base class of the facade, so that store.py stays about saving and loading one step."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any

from ckptstore.core.coordination import Coordinator, stage
from ckptstore.data.payload import Progress, SourceFile
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry
from ckptstore.domain.plan import Plan, Previous
from ckptstore.store_engines import StoreEngines


class StoreStaging(StoreEngines):
    """Multi-process saves of :class:`~ckptstore.store.CheckpointStore` (coordination.py)."""

    def begin_save(
        self,
        step: int,
        *,
        kind: str = KIND_DIRECTORY,
        metadata: Mapping[str, Any] | None = None,
        allow_older: bool = False,
        persist: bool = False,
    ) -> Coordinator:
        """Begin a multi-process save on its coordinator (coordination.py): hand each
        participant its cut of ``.plan``, then ``.commit(entries)`` or ``.conclude(reports)``.
        ``persist`` as for :meth:`~ckptstore.store.CheckpointStore.save`."""
        step = self._writing(layout.check_step(step), persist)
        return self._saver.begin(step, kind, metadata=metadata, allow_older=allow_older)

    def stage_files(
        self,
        step: int,
        files: Iterable[SourceFile],
        *,
        plan: Plan | None = None,
        kind: str = KIND_DIRECTORY,
        progress: Progress | None = None,
        rank: int | None = None,
    ) -> builtins.list[FileEntry]:
        """On a participant (its store opened with ``lease=False``): upload files of ``step``
        uncommitted, reusing unchanged files the coordinator's ``plan`` names; the entries."""
        step = layout.check_step(step)
        if plan is None:
            epoch = self._lease.epoch or 0 if self._lease is not None else 0
            plan = Plan(step, kind, epoch, Previous(None), seconds=self.options.save_timeout)
        return stage(self._saver, plan, files, progress, rank=rank)

    def commit_files(
        self,
        step: int,
        entries: Iterable[FileEntry],
        *,
        kind: str = KIND_DIRECTORY,
        metadata: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Commit staged files as ``step`` (``begin_save`` then ``commit``): on failure
        before the manifest is written, nothing is committed and the files are removed."""
        step = self._writing(layout.check_step(step))
        return self._saver.commit_staged(
            step, kind, tuple(entries), metadata, world_size=world_size, allow_older=allow_older
        )

    def discard(self, step: int) -> None:
        """Remove every staged file of an uncommitted ``step`` (never a committed one's)."""
        self._remover.discard_step(layout.check_step(step))

    def hold_lease(self) -> int:
        """Take or renew the writer lease (lease.py); the epoch, or 0 without leases."""
        return self._saver.hold_lease()
