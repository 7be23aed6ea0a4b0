"""One node's side of the tiers of a multi-process save: what a participant does with its
node's local tier (tiers/local.py, "every rank on its node's tier").

A participant stages its files in its node's local tier (coordination.py's ``stage``). Of a
step due for the durable tier (``Plan.due``), it copies them there at once, in the
background, under the save's attempt markers: the coordinator's persist (durable_commit.py) waits
for every node's share before it commits the step there. When the coordinator has committed
the step, a face that hears of it (``save_distributed``, verl's driver) has every other node
commit the same manifest in its own tier (:meth:`NodeTier.join`), so the step resolves on
that node too; DCP tells its participants nothing, so their tiers keep files without the
manifest, which :meth:`NodeTier.staged` keeps within the local retention's count. Copies to a
peer node (peers.py) run here too, in the order of the steps.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ckptstore.data.copying import FileCopier
from ckptstore.domain import layout
from ckptstore.errors import CheckpointError, ConflictError
from ckptstore.protocol.step_state import StepState
from ckptstore.tiers.local import DEFAULT_LOCAL_KEEP_LAST, LocalTier
from ckptstore.tiers.placement import PeerLayout

if TYPE_CHECKING:
    from ckptstore.core.saving import Saver
    from ckptstore.domain.manifest import FileEntry, Manifest
    from ckptstore.domain.plan import Plan

log = logging.getLogger(__name__)


class NodeTier:
    """A participant's work on its node's local tier (the module docstring)."""

    def __init__(
        self,
        local: LocalTier,
        durable: Saver,
        *,
        failed: Callable[[int, CheckpointError], None],
        retain: Callable[[], None],
    ) -> None:
        self.local = local
        self.durable = durable
        """The durable tier's saver: shares are written through its committer and backend."""
        self._failed = failed
        """Told of a share that failed (the persister: ``wait`` raises it, unless superseded)."""
        self._retain = retain
        """Applies the local tier's retention (the persister's, one at a time)."""
        self._lock = threading.Lock()
        self._staged: dict[int, tuple[Plan, list[FileEntry]]] = {}
        """What this process staged as a participant, by step (:meth:`staged`)."""
        self._sharing: dict[int, set[str]] = {}
        """Keys of the files this process copies as its shares, by step (:meth:`share`)."""
        self._copying: set[int] = set()
        self._in_flight: dict[int, list[Future[None]]] = {}
        """This process's shares by step, until they end (:meth:`abandon` waits for them)."""
        self._shares = ThreadPoolExecutor(1, thread_name_prefix="ckpt-share")
        self._peers = ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer")
        self._pending: list[Future[None]] = []
        self.peer_layout: PeerLayout | None = None
        """Which node each rank is on (placement.py), gathered at the first peer copy (peers.py)."""

    def sharing(self, step: int) -> set[str]:
        """Keys of ``step``'s files this process shares (the persist need not copy them)."""
        with self._lock:
            return set(self._sharing.get(step, ()))

    def copying(self) -> set[int]:
        with self._lock:
            return set(self._copying)

    def join(self, manifest: Manifest) -> None:
        """On a participant of a multi-node save (distributed.py): the coordinator committed
        ``manifest``, some of whose files this process staged (and, the step being due,
        shares: :meth:`share`). Commit it in this node's local tier too, so the step resolves
        on this node, and apply the local retention."""
        self.hold(manifest)
        self._retain()

    def hold(self, manifest: Manifest) -> None:
        """Commit ``manifest`` in this node's local tier if it lacks it (its files may be
        here, at a peer's, or in the durable tier: reads find each one) and move the local
        ``latest`` forward to it."""
        if self.local.catalog.state_of(manifest.step, fresh=True) is StepState.ABSENT:
            # another rank of this node may commit it first: the same manifest
            with contextlib.suppress(ConflictError):
                self.local.committer.commit(manifest)
        self.local.committer.advance_latest(manifest.step, epoch=manifest.lease_epoch)

    def staged(self, plan: Plan, entries: Sequence[FileEntry]) -> None:
        """A participant staged ``entries`` of ``plan.step`` in this node's local tier:
        share them if the step is due (:meth:`share`), and drop what it staged of older
        steps that this tier never committed (their manifest is on another node, or nobody
        committed them), beyond the local retention's count: a node's disk holds no more
        than its tier keeps, whatever the face tells it of commits."""
        step = plan.step
        keep = self.local.pruner.policy.keep_last or DEFAULT_LOCAL_KEEP_LAST
        with self._lock:
            self._staged.setdefault(step, (plan, []))[1].extend(entries)
            older = sorted(s for s in self._staged if s < step)
            doomed = {s: self._staged.pop(s) for s in older[: max(0, len(older) - keep + 1)]}
        if plan.due:
            self.share(plan, entries)
        busy = set(self.local.pins.steps())
        for old, (_, files) in doomed.items():
            if old not in busy and not self.local.catalog.state_of(old, fresh=True).committed:
                self.local.remover.discard_attempts(old, {f.attempt for f in files if f.attempt})

    def share(self, plan: Plan, entries: Sequence[FileEntry]) -> None:
        """A participant's files of a step due for the durable tier, just staged in this
        node's local tier: copy them there in the background, under attempt markers of the
        save (so gc knows whose they are if the step is never committed). The coordinator's
        persist waits for them, then commits the step (persist_queue.py)."""
        step = plan.step
        with self._lock:
            self._sharing.setdefault(step, set()).update(e.key(step) for e in entries)
            self._copying.add(step)
            self.local.pins.hold(step)
            future = self._shares.submit(self._share, plan, tuple(entries))
            self._pending.append(future)
            self._in_flight.setdefault(step, []).append(future)

    def _share(self, plan: Plan, entries: tuple[FileEntry, ...]) -> None:
        step = plan.step
        durable = self.durable
        attempts = {e.attempt for e in entries if e.attempt is not None}
        try:
            for attempt in sorted(attempts):
                durable.committer.begin_attempt(step, plan.epoch, attempt, save=plan.save)
            FileCopier(self.local.catalog.backend, durable.catalog.backend).copy_files(
                step, entries
            )
        except CheckpointError as e:
            if not self._withdrawn(step, attempts):
                self._failed(step, e)
                return
            log.info(
                "%s: step %d was not saved (its staged files on this node were removed "
                "as this process copied them); removing its copies from %s",
                self.local.uri,
                step,
                durable.uri,
            )
            durable.remover.discard_attempts(step, attempts)
        finally:
            with self._lock:
                self._copying.discard(step)
                self._in_flight.pop(step, None)
                self.local.pins.release(step)

    def abandon(self, step: int, attempts: set[str]) -> None:
        """A coordinated save of ``step`` that this process staged ``attempts`` of failed:
        wait for its shares of the step (they run behind the staging), then remove those
        attempts from the durable tier and from this node's local tier, so a failed save
        leaves nothing of this node in the bucket. A removal that fails is logged; ``gc``
        removes what is left (the attempt markers name the save)."""
        with self._lock:
            waiting = list(self._in_flight.get(step, ()))
            self._staged.pop(step, None)
            shared = self._sharing.pop(step, None)
        for future in waiting:
            with contextlib.suppress(Exception):  # a failed share went to ``failed``
                future.result()
        if shared:
            self.durable.remover.discard_attempts(step, attempts)
        self.local.remover.discard_attempts(step, attempts)

    def _withdrawn(self, step: int, attempts: set[str]) -> bool:
        """Whether a coordinator discarded the save of ``step`` on this node while this
        process copied ``attempts`` of it (DCP tells its participants nothing): a tombstone
        claims the step in this node's tier (it comes before any file is removed), or the
        attempts' markers, removed last, are gone."""
        if self.local.catalog.state_of(step, fresh=True) is StepState.REMOVING:
            return True
        backend = self.local.catalog.backend
        return bool(attempts) and all(
            backend.stat(layout.attempt_marker_path(step, a)) is None for a in attempts
        )

    def to_peer(self, step: int, copy: Callable[[], None]) -> None:
        """Run ``copy`` (peers.py: this node's files of ``step`` to a peer node) in the
        background, after the copies before it; the step stays in the local tier meanwhile.
        A failure is logged: the step is still in this node's tier and on its way to the
        durable one."""
        self.local.pins.hold(step)

        def run() -> None:
            try:
                copy()
            except Exception as e:
                log.warning(
                    "%s: the peer copy of step %d failed; a lost node resumes it from "
                    "the durable tier instead: %s",
                    self.local.uri,
                    step,
                    e,
                )
            finally:
                self.local.pins.release(step)

        with self._lock:
            self._pending.append(self._peers.submit(run))

    def share_last(self) -> None:
        """Share the last step this process staged, if it was not due: the coordinator's
        close makes it durable and waits for every node's share of it."""
        with self._lock:
            last = max(self._staged, default=None)
            if last is None or last in self._sharing:
                return
            plan, files = self._staged[last]
        self.share(plan, files)

    def drain(self) -> None:
        """Wait for the shares and peer copies in flight (failures went to ``failed``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._shares.shutdown(wait=True)
            self._peers.shutdown(wait=True)
