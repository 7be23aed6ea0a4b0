"""Persisting: a local tier's due steps committed in the durable tier (tiers/local.py).

:class:`Persister` decides which local commits are due (``PersistPolicy``, judged when a save
begins so its participants know it), pins them in the local tier, and commits each in the
durable tier in one background thread with :func:`persist`, the coordinated save (begin,
stage, commit) whose staging is a copy: the same sequence as every save, written once here.
It resumes what a kill interrupted (the pins), supersedes failed copies once a later step is
durable, and makes a writer's last step durable at ``close``. The participant's side of a
multi-process save is :class:`~ckptstore.tiers.node_tier.NodeTier`.

Why copies wait out an outage rather than fail: a local tier exists to keep training through a
slow or absent bucket. Local commits ask nothing of it (the lease's renewal, the proof of
ownership, is made here, when a step is persisted: lease.py), and a copy that failed for the
bucket's sake (a storage error, its deadline, the lease in doubt) is tried again after a pause,
for as long as no later step is queued behind it. ``close`` is bounded by ``save_timeout``
whatever the bucket does, and says which steps stay local only.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

from ckptstore.core.coordination import Coordinator
from ckptstore.core.observer import PersistStats, SaveObserver, TierObserver
from ckptstore.core.resolver import Resolver
from ckptstore.core.saving import Saver
from ckptstore.data.copying import FileCopier
from ckptstore.deadline import Deadline, bounded, clean_up, current_deadline, remaining, within
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, SaveStats
from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.plan import Plan
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    ConflictError,
    DeadlineExceededError,
    FencedError,
    IncompleteCheckpointError,
    SaveTimeoutError,
)
from ckptstore.protocol.catalog import StepState, fenced
from ckptstore.protocol.commit import Previous
from ckptstore.protocol.pointer import Pointer
from ckptstore.retry import Backoff, Pauses
from ckptstore.tiers.local import LocalTier, PersistPolicy
from ckptstore.tiers.node_tier import NodeTier

log = logging.getLogger(__name__)

OTHER_NODES_WAIT = 600.0
"""Seconds a persist waits for the other nodes' files of a multi-node save to reach the
durable tier, unless the save's deadline (``save_timeout``) comes first."""
OTHER_NODES_POLL = Backoff(base=0.05, cap=2.0, factor=1.5, jitter=0.0)
"""The pauses between listings of those files: 50 ms, half as long again each time, to 2 s."""
RESUME_PAUSES = Backoff(base=0.5, cap=8.0, factor=2.0, jitter=0.0)
"""The pauses before a copy that failed for the bucket's sake is tried again: 0.5 s, doubling,
to 8 s (module docstring)."""
CLOSE_SLACK = 2.0
"""Seconds past close's deadline (``save_timeout``) that close waits for a copy in flight to
stop: its requests end by that deadline plus the abort of an upload (README "Bounded saves")."""


def persist(
    saver: Saver, manifest: Manifest, copy: Callable[[int, Sequence[FileEntry]], None]
) -> CheckpointInfo:
    """Commit ``manifest``, a step committed in a faster tier of the same store, verbatim in
    ``saver``'s tier (tiers/local.py): the coordinated save of one participant whose staging is
    ``copy(step, files)`` of the files not there yet, by the save's deadline. The same
    sequence as every save: the writer lease, attempt markers, the files, the fence check, the
    manifest create-only, ``latest`` forward only, retention. A step already committed there
    with the same files (a kill after the commit) is done; with other files, a ConflictError.
    A step that a writer fenced off by a takeover committed (a zombie beside the new holder on
    one node) is never persisted. A failure before the manifest removes what was copied, but
    only under the lease (:func:`_abandon`)."""
    step = manifest.step
    with within(saver.save_timeout):
        epoch = saver.ensure_lease()
        _refuse_fenced(saver, manifest)
        held = _committed_manifest(saver, step)
        if held is not None:
            return _persisted_before(saver, held, manifest)
        plan = Plan(step, manifest.kind, epoch, Previous(None), secrets.token_hex(8))
        coordinator = Coordinator(saver, step, manifest.kind, plan, dict(manifest.metadata))
        attempts = sorted({f.attempt for f in manifest.files if f.attempt is not None})
        present = saver.catalog.payload_sizes(step)

        def abandon(_: set[str]) -> None:
            _abandon(coordinator, set(attempts))

        try:
            for attempt in attempts:  # the markers say whose files these are (garbage.py)
                saver.committer.begin_attempt(step, epoch, attempt, save=plan.save)
            copy(step, [f for f in manifest.files if present.get(f.key(step)) != f.size])
        except BaseException:
            _abandon(coordinator, set(attempts))
            raise
        try:
            return coordinator.publish(manifest.files, lambda _: manifest, on_failure=abandon)
        except ConflictError:
            held = _committed_manifest(saver, step)  # a rival persisted it meanwhile?
            if held is None:
                raise
            return _persisted_before(saver, held, manifest)


def _refuse_fenced(saver: Saver, manifest: Manifest) -> None:
    pointer = saver.fences()
    if pointer is not None and pointer.fenced(manifest.step, manifest.writer, manifest.lease_epoch):
        if manifest.writer == saver.committer.writer:
            saver.hold_lease()  # fenced itself (a takeover during an outage): the renewal
            # finds the new holder, so this writer knows and commits nothing more, not even
            # locally (lease.py)
        raise FencedError(
            f"{saver.uri}: step {manifest.step} of the local tier was committed by "
            f"{manifest.writer} after it lost the writer lease; it is not persisted (it is "
            "never latest; `ckptstore rm` it in the local tier)",
            uri=saver.catalog.uri(layout.step_dir(manifest.step)),
            step=manifest.step,
        )


def _abandon(coordinator: Coordinator, attempts: set[str]) -> None:
    """Remove what a failed persist copied. Its attempts are the local manifest's, which the
    store's next lease holder may be persisting at the same moment (a writer fenced beside it
    on one node): so only under the lease, renewed now. A fenced writer deletes nothing (gc
    does); the holder may, as no other writer can commit these attempts meanwhile."""
    saver = coordinator.saver
    try:
        saver.hold_lease()
    except CheckpointError as e:
        log.warning("%s: the files of step %d's failed persist are left to gc: %s",
                    saver.uri, coordinator.step, e)  # fmt: skip
        return
    step = coordinator.step
    clean_up(lambda: saver.remover.discard_attempts(step, attempts), f"step {step}'s copied files")


def _committed_manifest(saver: Saver, step: int) -> Manifest | None:
    if not saver.catalog.state_of(step, fresh=True).committed:
        return None
    return saver.catalog.read_manifest(step)


def _persisted_before(saver: Saver, held: Manifest, wanted: Manifest) -> CheckpointInfo:
    """``wanted``'s step is committed in ``saver``'s tier already: done if with the same
    files (``latest`` still moves forward to it), else a ConflictError."""
    step = wanted.step
    if held.files != wanted.files:
        raise ConflictError(
            f"step {step} is committed in {saver.uri} with other files than the local tier's; "
            "committed steps are immutable, so the local copy cannot be persisted. Remove one "
            f"of them (ckptstore rm {saver.uri} {step}) or keep saving later steps",
            uri=saver.catalog.uri(layout.step_dir(step)),
            path=layout.step_dir(step),
            step=step,
        )
    saver.advance_latest(step, epoch=saver.hold_lease(), newest_before=None)
    return saver.catalog.info_of(held)


class Persister:
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
        self.local = local
        self.durable = durable
        """The durable tier's saver: persisting is a commit of the store there."""
        self.policy = policy
        self.observer = observer
        self.clock = clock
        self._forced: set[int] = set()
        self._saves_since = 0
        self._last_due: float | None = None
        self._committed_at: dict[int, float] = {}
        self._copying: set[int] = set()
        self._failures: dict[int, CheckpointError] = {}
        self._decided: dict[int, bool] = {}
        self._durable_latest: int | None = None
        self._durable_known = False
        self._dropped: set[int] = set()
        self._started = False
        self._closing = threading.Event()
        """Set when ``close`` begins: copies waiting out an outage try once more now."""
        self._close_deadline: Deadline | None = None
        """close's deadline (``save_timeout`` from its start): every try runs by it."""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._pending: list[Future[None]] = []
        self.node = NodeTier(local, durable, failed=self._failed, retain=self.retain_local)
        """This process as a participant of multi-process saves (node_tier.py)."""

    @property
    def uri(self) -> str:
        return self.durable.uri

    # -- what the local saver asks and tells -------------------------------------------------

    def durable_latest(self) -> int | None:
        """The durable tier's latest step: read once (its pointer, and a listing for a step
        committed past it), then kept, since under the writer lease only this store's
        persists move it. A local save reads nothing of the bucket."""
        with self._lock:
            if self._durable_known:
                return self._durable_latest
        step = self.durable.latest_step()
        with self._lock:
            self._durable_known = True
            self._durable_latest = _newer(self._durable_latest, step)
            return self._durable_latest

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
            log.warning("%s: persisting steps %s from the local tier %s, where a kill left them",
                        self.uri, resumed, self.local.uri)  # fmt: skip

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

    def retain_local(self) -> None:
        """Apply the local tier's retention, after a local commit or a persist (one at a
        time: two prunes of one tier would race on the same manifests)."""
        with self.local.retention:
            self.local.pruner.after_save()

    def failed(self, step: int) -> None:
        """The local save of ``step`` failed: a ``persist=True`` on it lapses."""
        with self._lock:
            self._forced.discard(step)

    def force(self, step: int) -> None:
        """Make ``step`` due when it commits (``save(..., persist=True)``)."""
        with self._lock:
            self._forced.add(step)

    def copying(self) -> set[int]:
        """The steps on their way to the durable tier from this process."""
        with self._lock:
            return self._copying | self.node.copying()

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

    # -- persisting --------------------------------------------------------------------------

    def drop(self, step: int) -> None:
        """``step`` is being deleted from the store (protocol/maintenance.py): no copy of it
        runs once this returns (a queued one is skipped, the one in flight waited for), a
        failure of its copy is no longer news, and the durable tier's latest is read again
        at the next save. A later save of the step is persisted as any other."""
        with self._lock:
            self._dropped.add(step)
        with contextlib.suppress(RuntimeError):  # closed: no copy can run
            self._pool.submit(_nothing).result()
        with self._lock:
            self._failures.pop(step, None)
            self._durable_known, self._durable_latest = False, None

    def pending(self, step: int) -> bool:
        """Whether ``step`` is on its way to the durable tier from this process, or its copy
        failed and is not superseded: its local pin must stay (protocol/maintenance.py)."""
        with self._lock:
            if step in self._copying or step in self._failures:
                return True
        return step in self.node.copying()

    def queue(self, step: int) -> None:
        """Pin ``step`` in the local tier (retention keeps it) and persist it in the
        background."""
        self.local.pins.add(step)
        with self._lock:
            self._dropped.discard(step)
            self._copying.add(step)
            self._pending.append(self._pool.submit(self._persist, step))

    def _persist(self, step: int) -> None:
        started = self.clock()
        with self._lock:
            if step in self._dropped:  # deleted while it waited: nothing to copy
                self._copying.discard(step)
                return
        try:
            if not self._persist_waiting_out(step):
                return
        finally:
            with self._lock:
                self._copying.discard(step)
        with self._lock:
            self._durable_latest = _newer(self._durable_latest, step)
            committed = self._committed_at.pop(step, started)
            superseded = [s for s in self._failures if s < step]
            for old in superseded:
                del self._failures[old]
        for old in [step, *superseded]:
            self.local.pins.remove(old)
        if superseded:
            log.warning("%s: steps %s, whose copies failed, are superseded by durable step %d; "
                        "they stay in the local tier until its retention drops them",
                        self.uri, superseded, step)  # fmt: skip
        self.retain_local()  # the pin is gone: the local tier keeps its count again
        stats = self._stats(step, self.clock() - committed)
        log.info("%s: step %d is durable, %.2f s after its local commit",
                 self.uri, step, stats.seconds_to_durable)  # fmt: skip
        if isinstance(self.observer, TierObserver):
            self.observer.persisted(self.uri, stats)

    def _persist_waiting_out(self, step: int) -> bool:
        """Persist ``step``, trying again after a pause while it fails for the bucket's sake
        (:meth:`_waits_out`); False once it failed for good (told to :meth:`_failed`). During
        ``close``, each try runs by close's deadline."""
        pauses = Pauses(RESUME_PAUSES)
        while True:
            deadline = self._close_deadline
            try:
                with bounded(deadline) if deadline is not None else contextlib.nullcontext():
                    persist(self.durable, self.local.catalog.read_manifest(step), self._gather)
                return True
            except CheckpointError as e:
                if not self._waits_out(step, e):
                    self._failed(step, e)
                    return False
                pause = pauses.next()
                log.warning("%s: step %d is not durable yet, the bucket failed (%s); trying "
                            "again in %.1f s", self.uri, step, e, pause)  # fmt: skip
                if deadline is not None:
                    time.sleep(min(pause, deadline.remaining()))
                else:
                    self._closing.wait(pause)

    def _waits_out(self, step: int, error: CheckpointError) -> bool:
        """Whether a persist of ``step`` that failed with ``error`` is tried again: the bucket
        not answering (a storage error that retrying may cure, a deadline, the lease in doubt;
        not a takeover, a refusal, a conflict or a missing file), while no later step is
        queued behind it (that one carries on: it supersedes this one once durable), and while
        close's deadline allows (a ``close`` without ``save_timeout`` tries once more, then
        reports)."""
        lease = self.durable.lease
        if isinstance(error, FencedError):
            if lease is None or lease.lost is not None or lease.unconfirmed() is None:
                return False
        elif not isinstance(error, DeadlineExceededError) and not (
            isinstance(error, BackendError) and error.retryable
        ):
            return False
        with self._lock:
            if any(s > step for s in self._copying):
                return False
        if not self._closing.is_set():
            return True
        deadline = self._close_deadline
        return deadline is not None and not deadline.expired

    def _gather(self, step: int, entries: Sequence[FileEntry]) -> None:
        """Bring ``entries`` of ``step`` to the durable tier: copy those this node holds,
        then wait for the rest, which the other nodes of a multi-node save persist
        (node_tier.py), by the persist's deadline (at most :data:`OTHER_NODES_WAIT`)."""
        here = self.local.catalog.payload_sizes(step)
        shared = self.node.sharing(step)
        mine = [e for e in entries if here.get(e.key(step)) == e.size and e.key(step) not in shared]
        FileCopier(self.local.catalog.backend, self.durable.catalog.backend).copy_files(step, mine)
        rest = [e for e in entries if e not in mine]
        until = time.monotonic() + remaining(OTHER_NODES_WAIT)
        pauses = Pauses(OTHER_NODES_POLL)
        while rest:
            there = self.durable.catalog.payload_sizes(step)
            rest = [e for e in rest if there.get(e.key(step)) != e.size]
            left = until - time.monotonic()
            if rest and left <= 0:
                raise IncompleteCheckpointError(
                    f"{self.uri}: step {step} was not persisted: {len(rest)} of its files, "
                    f"held by other nodes (first: {rest[0].path}), never reached it; a node "
                    "died or failed before persisting its share. The step stays in the local "
                    "tiers; a later durable step supersedes it",
                    uri=self.durable.catalog.uri(rest[0].key(step)),
                    step=step,
                )
            if rest:
                time.sleep(min(pauses.next(), left))

    def _failed(self, step: int, error: CheckpointError) -> None:
        log.error("%s: step %d stays in the local tier %s; persisting it failed (retried when "
                  "the store is opened again, unless a later step is durable first): %s",
                  self.uri, step, self.local.uri, error)  # fmt: skip
        with self._lock:
            self._failures[step] = error
        if isinstance(self.observer, TierObserver):
            self.observer.persist_failed(self.uri, step, error)

    def _stats(self, step: int, seconds: float) -> PersistStats:
        now = self.clock()
        with self._lock:
            newer = {s: t for s, t in self._committed_at.items() if s > step}
        oldest = min(newer.values(), default=now)
        return PersistStats(step, seconds, len(newer), now - oldest)

    def wait(self) -> None:
        """Wait for every queued copy; raise the newest failure no later durable step
        superseded (older ones are logged: their steps stay local until retention)."""
        self.node.drain()
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        with self._lock:
            failures, self._failures = self._failures, {}
        if failures:
            raise failures[max(failures)]

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

    def fences(self) -> Pointer | None:
        """The durable tier's pointer: its fences judge the steps of both tiers."""
        return self.durable.catalog.pointer_or_none()


def _nothing() -> None:
    """A task for the copier's queue: once it ran, every copy queued before it has ended."""


def _newer(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
