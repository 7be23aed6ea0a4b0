"""The one coordinated save under every face: begin once, stage per participant, commit or
discard once.

A step may be written by one process (``store.save``, ``push_dir``), by the ranks of a
torch.distributed job (distributed.py), by DCP's writers (integrations/dcp.py) or by one agent
per node of a verl job (integrations/verl.py). All of them run this sequence, and only this
module writes it:

1. **begin**, on the coordinator: wait for this store's save in flight, take or renew the
   writer lease, refuse a step that is committed (removing one a fenced writer committed) or
   behind ``latest``, and read ``latest``'s manifest once. The result is a Plan (plan.py),
   cut per participant so none reads the pointer or the manifest (README "Scale").
2. **stage**, on every participant (:func:`stage`): upload its files into an attempt
   directory of its own, uncommitted. :meth:`Staged.of` (reports.py) runs it so that it never
   raises: a failure travels to the coordinator as text, since a participant that skips a
   collective hangs the others.
3. **conclude**, on the coordinator: if any participant failed, discard every staged file and
   raise one error naming each failure; else confirm the files, renew the lease (the fence
   check), write the manifest create-only, move ``latest`` and apply retention.

The save's deadline is set at begin and cut into each plan, so every face gets it. A failure
before the manifest is written leaves nothing committed and removes the staged files (in the
background past the deadline); after it, the step is committed and is reported so.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptstore.core.reports import Staged, describe, label
from ckptstore.core.save_target import (
    SaveTarget,
    check_not_behind,
    check_step_is_free,
    read_latest,
)
from ckptstore.data.payload import Progress, SourceFile
from ckptstore.deadline import Deadline, bounded, clean_up, current_deadline, within
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, SaveStats
from ckptstore.domain.manifest import FileEntry, Manifest, check_metadata
from ckptstore.domain.plan import Plan, Previous
from ckptstore.errors import (
    CheckpointError,
    DistributedCheckpointError,
    FencedError,
)

if TYPE_CHECKING:
    from ckptstore.data.background import Abandon

log = logging.getLogger(__name__)


def not_saved(removal: str | None = None, *, shared: str | None = None) -> str:
    """What became of a step not saved, its staged files' ``removal`` (clean_up's) included;
    ``shared``: the durable tier that the participants of a tiered save were copying their
    files to, which each participant that hears of the failure clears of its own copies once
    they end (node_tier.py); DCP's participants hear nothing, so ``gc`` removes theirs."""
    if shared is not None:
        tail = (
            f"; what a node was still copying to {shared} is removed by that node once it "
            "hears of the failure, or else by `ckptstore gc` there"
        )
    else:
        tail = ""
    if removal is None:
        return f"was not saved (nothing committed, staged files discarded{tail})"
    return (
        f"was not saved (nothing committed; removing its staged files {removal}, "
        f"`ckptstore gc` removes what is left{tail})"
    )


def stage(
    saver: SaveTarget,
    plan: Plan,
    files: Iterable[SourceFile],
    progress: Progress | None = None,
    *,
    rank: int | None = None,
    share: bool = True,
) -> list[FileEntry]:
    """A participant's part: upload ``files`` into an attempt of their own, uncommitted, by
    the save's deadline (the store's ``save_timeout``; ``rank`` names it in a timeout); in a
    store with local tiers, hand them to the tiers (``share``: persisted in the background
    when the step is due).
    Checks nothing the coordinator checked in :meth:`Coordinator.begin`."""
    previous = plan.previous if saver.incremental else None
    with within(plan.seconds, rank=rank):
        entries = saver.committer.write_payload(
            plan.step, files, progress, previous=previous, epoch=plan.epoch, save=plan.save
        )
    if share:
        saver.share(plan, entries)
    return entries


@dataclass
class Coordinator:
    """One coordinated save of ``step`` into the saver's store (module docstring)."""

    saver: SaveTarget
    step: int
    kind: str
    plan: Plan
    metadata: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    deadline: Deadline | None = None
    """The save's deadline (``save_timeout``), set at begin: every phase runs by it."""

    @classmethod
    def begin(
        cls,
        saver: SaveTarget,
        step: int,
        kind: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        allow_older: bool = False,
    ) -> Coordinator:
        """Step 1: everything checked and read once, before any participant uploads, by
        the save's deadline, which starts now (one in force already is kept)."""
        started = time.perf_counter()
        user_metadata = check_metadata(metadata)
        deadline = current_deadline() or Deadline.of(saver.save_timeout)
        with bounded(deadline):
            saver.drain()
            epoch = saver.ensure_lease()  # fail before any upload if another writer holds it
            check_step_is_free(saver, step)
            latest_step, manifest = read_latest(saver, kind)
            if not allow_older:
                check_not_behind(saver, step, latest_step)
        previous = Previous.of(manifest, latest_step)
        left = deadline.remaining() if deadline is not None else None
        plan = Plan(step, kind, epoch, previous, secrets.token_hex(8), saver.due(step), left)
        return cls(saver, step, kind, plan, user_metadata, started, deadline)

    def running(self) -> contextlib.AbstractContextManager[Deadline | None]:
        """The save's deadline in force for the block (a face's waits on participants)."""
        return bounded(self.deadline) if self.deadline is not None else contextlib.nullcontext()

    def stage_here(
        self, files: Iterable[SourceFile], progress: Progress | None = None
    ) -> list[FileEntry]:
        """Stage files from the coordinator's own process (a single-process save: its
        persist copies them, no share)."""
        with self.running():
            return stage(self.saver, self.plan, files, progress, share=False)

    def conclude(
        self,
        reports: Iterable[Staged],
        *,
        world_size: int | None = None,
        coordinator: int | str = "the coordinator",
    ) -> CheckpointInfo:
        """Step 3 for many participants: commit if every one staged its files, else discard
        the step. Every failure is a DistributedCheckpointError naming each participant's
        error (the coordinator's own as ``coordinator``: rank 0, say) and what became of the
        step."""
        reports = list(reports)
        failures = {r.participant: r.error for r in reports if r.error is not None}
        if failures:
            removal = self.discard(e.attempt for r in reports for e in r.entries if e.attempt)
            shared = self.saver.shares_to(self.plan)
            raise self._failed(failures, not_saved(removal, shared=shared), discarded=True)
        entries = [e for r in reports for e in r.entries]
        seen = [e for r in reports if self.sees(r) for e in r.entries]
        try:
            return self.commit(entries, world_size=world_size, confirm=seen)
        except Exception as e:
            log.exception("%s could not commit step %d", label(coordinator), self.step)
            with self.running():  # a server that stopped answering: "may be committed"
                what, discarded = self._what_became(label(coordinator))
            raise self._failed({coordinator: describe(e)}, what, discarded=discarded) from e

    def sees(self, report: Staged) -> bool:
        """Whether ``report``'s files are where this coordinator can confirm them: staged in
        the store it commits in, on its own node. Another node's files are on that node's
        disk, which this process never reads (the same path here is another disk): the
        participant wrote them whole (each write is checked as it is made), and a step due
        for the durable tier is committed there only once every node's share is in it
        (persist_queue.py)."""
        return report.node == self.saver.node

    def commit(
        self,
        entries: Iterable[FileEntry],
        *,
        world_size: int | None = None,
        files_by_key: Mapping[str, tuple[str, ...]] | None = None,
        blocked: float = 0.0,
        abandon: Abandon | None = None,
        confirm: Iterable[FileEntry] | None = None,
    ) -> CheckpointInfo:
        """Step 3 with the entries in hand: confirm them (those of ``confirm``, when only
        they were staged where this store sees them), write the manifest, move ``latest``,
        apply retention. Before the manifest, a failure removes the staged files and is
        raised as it came."""
        saver = self.saver
        entries = tuple(entries)
        environment = saver.environment()
        if world_size is not None:
            environment = replace(environment, world_size=world_size)

        def manifest(epoch: int) -> Manifest:
            return Manifest(
                step=self.step,
                created=saver.clock(),
                kind=self.kind,
                files=entries,
                environment=environment,
                writer=saver.committer.writer,
                metadata=self.metadata,
                lease_epoch=epoch,
                files_by_key=dict(files_by_key) if files_by_key is not None else None,
            )

        seen = entries if confirm is None else tuple(confirm)
        with self.running():
            return self.publish(entries, manifest, blocked=blocked, abandon=abandon, confirm=seen)

    def publish(
        self,
        entries: tuple[FileEntry, ...],
        manifest_under: Callable[[int], Manifest],
        *,
        blocked: float = 0.0,
        abandon: Abandon | None = None,
        confirm: tuple[FileEntry, ...] | None = None,
        on_failure: Callable[[set[str]], None] | None = None,
    ) -> CheckpointInfo:
        """Confirm ``entries`` (or ``confirm``), renew the lease (the fence check, right
        before the commit), write ``manifest_under(epoch)`` create-only, move ``latest``,
        apply retention. A failure before the manifest removes the staged attempts (or hands
        them to ``on_failure``)."""
        saver = self.saver
        try:
            saver.committer.confirm_payload(self.step, entries if confirm is None else confirm)
            epoch = saver.hold_lease()
            manifest = manifest_under(epoch)
            if abandon is not None:
                abandon.check()
            manifest = saver.committer.commit(manifest)
        except BaseException:
            attempts = {e.attempt for e in entries if e.attempt}
            if on_failure is not None:
                on_failure(attempts)
            else:
                clean_up(lambda: saver.remover.discard_attempts(self.step, attempts), self._files)
            raise
        self._advance(epoch)
        stats = SaveStats.of(manifest, time.perf_counter() - self.started, blocked)
        saver.saved(stats)
        return saver.catalog.info_of(manifest, stats)

    def _advance(self, epoch: int) -> None:
        """Move ``latest`` to the step just committed: a pointer that cannot be moved is a
        warning, not a failed save (readers find the step by listing, the next save moves
        it); a newer lease holder's pointer (FencedError) stops the writer."""
        try:
            self.saver.advance_latest(self.step, epoch=epoch, newest_before=self.plan.previous.step)
        except FencedError:
            raise
        except CheckpointError as e:
            log.warning(
                "%s: step %d is committed, but latest could not be moved to it (%s); "
                "readers find it by listing, and the next save moves latest",
                self.saver.uri,
                self.step,
                e,
            )

    def discard(self, attempts: Iterable[str] = ()) -> str | None:
        """Remove what this save's participants staged (``attempts`` they reported, and any
        attempt whose marker names this save), and nothing of a rival's save of the step; by
        the save's deadline, then in the background, so every participant learns the outcome in
        time. What became of the removal: :func:`~ckptstore.deadline.clean_up`'s answer."""
        doomed, saver = set(attempts), self.saver
        with self.running():
            return clean_up(
                lambda: saver.discard_save(self.step, self.plan.save, doomed), self._files
            )

    @property
    def _files(self) -> str:
        return f"the staged files of step {self.step} in {self.saver.uri}"

    def _what_became(self, coordinator: str) -> tuple[str, bool]:
        """What became of the step after a failed commit, and whether it is certainly not
        committed (its staged files are being removed)."""
        try:
            committed = self.saver.catalog.state_of(self.step, fresh=True).committed
        except CheckpointError:
            return f"failed on {coordinator} and may be committed (see `ckptstore ls`)", False
        if committed:
            return f"is committed, but {coordinator} failed after committing it", False
        return not_saved(shared=self.saver.shares_to(self.plan)), True

    def _failed(
        self, failures: Mapping[int | str, str], what: str, *, discarded: bool
    ) -> DistributedCheckpointError:
        listed = "; ".join(f"{label(p)}: {text}" for p, text in _ordered(failures))
        uri = self.saver.catalog.uri(layout.step_dir(self.step))
        return DistributedCheckpointError(
            f"step {self.step} {what}: {listed}",
            failures,
            uri=uri,
            step=self.step,
            path=layout.step_dir(self.step),
            discarded=discarded,
        )


def _ordered(failures: Mapping[int | str, str]) -> list[tuple[int | str, str]]:
    def key(item: tuple[int | str, str]) -> tuple[bool, int, str]:
        who = item[0]
        return (isinstance(who, str), who if isinstance(who, int) else 0, str(who))

    return sorted(failures.items(), key=key)
