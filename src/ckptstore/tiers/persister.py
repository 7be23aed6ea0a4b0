"""Persisting: a local tier's due steps committed in the durable tier (tiers/local.py).

:class:`Persister` decides which local commits are due (``PersistPolicy``, judged when a save
begins so its participants know it) and queues them: the thread that pins them and commits each
in the durable tier, waiting out an outage, is persist_queue.py's, and the commit of one step
(the coordinated save whose staging is a copy) is durable_commit.py's. It resumes what a kill
interrupted (the pins) and makes a writer's last step durable at ``close``: ``close`` is
bounded by ``save_timeout`` whatever the bucket does, and says which steps stay local only. The
participant's side of a multi-process save is :class:`~ckptstore.tiers.node_tier.NodeTier`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import TYPE_CHECKING

from ckptstore.core.observer import SaveObserver
from ckptstore.core.resolver import Resolver
from ckptstore.core.saving import Saver
from ckptstore.deadline import Deadline, current_deadline
from ckptstore.domain.info import CheckpointInfo, SaveStats
from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.plan import Plan
from ckptstore.errors import CheckpointError, DeadlineExceededError, SaveTimeoutError
from ckptstore.protocol.catalog import fenced
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.step_state import StepState
from ckptstore.tiers.local import LocalTier, PersistPolicy
from ckptstore.tiers.persist_queue import PersistQueue

if TYPE_CHECKING:  # torch.distributed: a store that never meets a peer never imports torch
    from ckptstore.core.collectives import Collectives

log = logging.getLogger(__name__)

CLOSE_SLACK = 2.0
"""Seconds past close's deadline (``save_timeout``) that close waits for a copy in flight to
stop: its requests end by that deadline plus the abort of an upload (README "Bounded saves")."""


class Persister(PersistQueue):
    """Commits the local tier's due steps in the durable tier, in one background thread
    (the module docstring); the local saver tells it of each local commit."""

    def __init__(
        self,
        local: LocalTier,
        durable: Saver,
        policy: PersistPolicy,
        observer: SaveObserver | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(local, durable, observer, clock)
        self.policy = policy
        self._forced: set[int] = set()
        self._saves_since = 0
        self._last_due: float | None = None
        self._decided: dict[int, bool] = {}
        self._started = False

    # -- what the local saver asks and tells -------------------------------------------------

    def start(self) -> None:
        """The first write of this store: persist the pinned local steps the durable tier
        lacks (a copy a kill interrupted); drop the pins of those it holds."""
        with self._lock:
            if self._started:
                return
            self._started = True
        resumed, fences = [], self.fences()
        for step in self.local.pins.written():
            if not self.local.catalog.is_committed(step, fresh=True):
                self.local.pins.remove(step)  # a pin of a step that is gone: nothing to copy
            elif self.durable.catalog.is_committed(step, fresh=True):
                self.local.pins.remove(step)
            elif fenced(fences, self.local.catalog.info(step)):
                self.local.pins.remove(step)  # a fenced writer's: never persisted
            else:
                resumed.append(step)
                self.queue(step)
        if resumed:
            log.warning(
                "%s: persisting steps %s from the local tier %s, where a kill left them",
                self.uri,
                resumed,
                self.local.uri,
            )

    def saved(self, stats: SaveStats) -> None:
        """A step was committed in the local tier: pin and queue it if it is due (before the
        local retention runs)."""
        now = self.clock()
        with self._lock:
            self._committed_at[stats.step] = now
            due = self._decided.pop(stats.step, None)
            if due is None:
                due = self._judge(stats.step, now)
            self._saves_since += 1
            if due:
                self._saves_since, self._last_due = 0, now
                self._forced.discard(stats.step)
        if due:
            self.queue(stats.step)

    def decide(self, step: int) -> bool:
        """Whether ``step`` will be due once committed, judged when its save begins, so
        that the participants of a coordinated save persist their shares as they stage them
        (coordination.py's ``Plan.due``); the commit keeps this verdict."""
        with self._lock:
            due = self._decided[step] = self._judge(step, self.clock())
            return due

    def _judge(self, step: int, now: float) -> bool:
        since = None if self._last_due is None else now - self._last_due
        return self.policy.due(self._saves_since + 1, since, forced=step in self._forced)

    def failed(self, step: int) -> None:
        """The local save of ``step`` failed: a ``persist=True`` on it lapses."""
        with self._lock:
            self._forced.discard(step)

    def force(self, step: int) -> None:
        """Make ``step`` due when it commits (``save(..., persist=True)``)."""
        with self._lock:
            self._forced.add(step)

    def staged(self, plan: Plan, entries: Sequence[FileEntry]) -> None:
        """A participant staged ``entries`` in this node's tier (node_tier.py)."""
        self.node.staged(plan, entries)

    def durable_uri(self, path: str = "") -> str:
        """``path``'s URI in the durable tier (its root's without one)."""
        return self.durable.catalog.uri(path)

    def abandon(self, step: int, attempts: set[str]) -> None:
        """A coordinated save of ``step`` failed: what this process staged of it leaves both
        tiers once its shares are done (node_tier.py). A share that failed meanwhile (the
        coordinator removed the step's files on this node) is no persist failure: the step
        was never committed, so ``wait`` does not raise it."""
        self.node.abandon(step, attempts)
        with self._lock:
            self._failures.pop(step, None)

    def durable_holds(self, step: int) -> bool:
        """Whether the durable tier holds ``step`` committed and readable (a fresh read)."""
        return self.durable.catalog.state_of(step, fresh=True) is StepState.COMMITTED

    # -- closing: what close finishes, and by when -------------------------------------------

    def close(self) -> None:
        """Make the pinned due steps and the newest local step durable, whether or not this
        writer saved (one that holds the lease: a kill's leftovers, a takeover; a participant
        instead shares the files of the last step it staged, which the coordinator's close
        waits for); wait for every copy; stop the threads, even when this raises.

        By the deadline in force (the store's close sets ``save_timeout``'s): past it, plus
        :data:`CLOSE_SLACK` for a copy in flight to stop, it returns whatever the bucket does,
        raising a SaveTimeoutError that names the steps left in the local tier only (pinned:
        the next writer on this node persists them). Else it raises as :meth:`wait` does."""
        if self._closing.is_set():
            return  # closed already (its threads are stopped): a second close does nothing
        deadline = current_deadline()
        with self._lock:
            self._close_deadline = deadline
        self._closing.set()
        unfinished: set[Future[None]] = set()
        try:
            try:
                if self._writing():
                    self.start()
                    newest = self._newest_local()
                    if newest is not None and not self.durable.catalog.is_committed(newest):
                        self.queue(newest)
                else:
                    self.node.share_last()
                self.node.drain()
            except DeadlineExceededError as e:
                raise self._not_durable(f"close() ran out of time ({e})") from e
            unfinished = self._drain_by(deadline)
            if unfinished:
                raise self._not_durable(
                    f"close() gave up waiting for the copies after save_timeout "
                    f"({deadline.seconds if deadline is not None else 0:g} s) and "
                    f"{CLOSE_SLACK:g} s more"
                )
            try:
                self.wait()
            except DeadlineExceededError as e:
                if deadline is None or not deadline.expired:
                    raise
                raise self._not_durable(f"close() ran out of time ({e})") from e
        finally:
            try:
                self.node.close()
            finally:
                self._pool.shutdown(wait=not unfinished, cancel_futures=True)

    def _writing(self) -> bool:
        """Whether this process is the store's writer: it saved, or holds the lease."""
        lease = self.durable.lease
        with self._lock:
            started = self._started
        return started or (lease is not None and lease.epoch is not None and lease.lost is None)

    def _drain_by(self, deadline: Deadline | None) -> set[Future[None]]:
        """Wait for the queued copies, by ``deadline`` plus :data:`CLOSE_SLACK`; those that
        did not finish."""
        with self._lock:
            pending = list(self._pending)
        end = None if deadline is None else time.monotonic() + deadline.remaining() + CLOSE_SLACK
        unfinished = set()
        for future in pending:  # each waited for by its own call: a pool may run it then
            try:
                future.exception(None if end is None else max(0.0, end - time.monotonic()))
            except FuturesTimeout:
                unfinished.add(future)
            except CancelledError:
                pass
        return unfinished

    def _not_durable(self, why: str) -> SaveTimeoutError:
        """The error of a close that could not make every due step durable in time."""
        steps = self.local.pins.written()
        message = (
            f"{self.uri}: {why}; steps {steps} are not durable: they are in the local tier "
            f"{self.local.uri} only, pinned there, and the next writer of this store on this "
            "node persists them (its first save, or its close()). Check the bucket"
            if steps
            else f"{self.uri}: {why}; every due step is durable"
        )
        log.error("%s", message)
        deadline = self._close_deadline
        return SaveTimeoutError(
            message, uri=self.uri, timeout=deadline.seconds if deadline is not None else None
        )

    def _newest_local(self) -> int | None:
        """The local tier's newest step, by the durable fences (never a fenced writer's)."""
        resolver = Resolver(self.durable.catalog, faster=(self.local.catalog,))
        newest = resolver.latest_in(self.local.catalog)
        return newest.step if newest is not None else None

    # -- what a multi-process face calls (integrations/distributed.py, verl_nodes.py) --------
    # Each forwards to this node's side of the save (node_tier.py) or to the peer copies
    # (peers.py), so that a face calls the store's tiers and never walks into their parts.

    def newest_here(self) -> CheckpointInfo | None:
        """The newest step this node's local tier holds, by the durable fences; None when it
        holds none or none is readable (said in a warning): a load then asks the others."""
        try:
            resolver = Resolver(self.durable.catalog, faster=(self.local.catalog,)).pinned()
            return resolver.latest_in(self.local.catalog)
        except CheckpointError as e:
            log.warning("%s: the local tier offers no step: %s", self.local.uri, e)
            return None

    def named_here(self, step: int | None = None) -> CheckpointInfo | None:
        """``step`` (default: the one this node's local tier's pointer names) as the local
        tier holds it, judged by nothing else (no durable read): the step a load will most
        likely be offered, whose files it may begin reading before the offer (distributed.py).
        None where the local tier has no such committed step or cannot read it."""
        catalog = self.local.catalog
        try:
            if step is None:
                pointer = catalog.pointer_or_none()
                step = pointer.step if pointer is not None else None
            return catalog.info(step) if step is not None else None
        except CheckpointError:
            return None

    def read_here(self, info: CheckpointInfo, path: str) -> memoryview:
        """One file of ``info``'s step from this node's local tier only, verified against
        ``info``'s manifest entry."""
        return self.local.catalog.read_file(info, path)

    def join(self, manifest: Manifest) -> None:
        """A step another rank committed: commit it in this node's local tier too."""
        self.node.join(manifest)

    def hold(self, manifest: Manifest) -> None:
        """This node's local tier holds ``manifest``'s step whole again (after a load)."""
        self.node.hold(manifest)

    def share_last(self) -> None:
        """Share the last step this process staged, if it was not due (node_tier.py)."""
        self.node.share_last()

    def send_to_peer(self, peers: Collectives, step: int, staged: Sequence[FileEntry]) -> None:
        """Behind the save: this rank's staged files of ``step`` copied to its peer on another
        node, and its peers' written here (peers.py); every rank of ``peers`` calls it."""
        from ckptstore.tiers import peers as peer_copies  # torch.distributed, when peers meet

        node = self.node
        node.to_peer(step, lambda: peer_copies.send_to_peer(peers, node, step, staged))

    def recover_from_peer(
        self, peers: Collectives, info: CheckpointInfo, paths: Sequence[str]
    ) -> int:
        """The files of ``paths`` this node lacks, asked of the peers holding them (peers.py);
        every rank of ``peers`` calls it. Returns how many files this rank recovered."""
        from ckptstore.tiers import peers as peer_copies  # torch.distributed, when peers meet

        return peer_copies.recover_from_peer(peers, self.node, info, paths)

    def fences(self) -> Pointer | None:
        """The durable tier's pointer: its fences judge the steps of both tiers."""
        return self.durable.catalog.pointer_or_none()
