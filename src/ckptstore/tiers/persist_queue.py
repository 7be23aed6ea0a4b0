"""The persisting thread: queued local steps committed in the durable tier, one at a time.

:class:`PersistQueue` pins each queued step in the local tier, commits it in the durable tier
in one background thread (durable_commit.py's :func:`persist`, copying the files this node
holds and waiting for those the other nodes of a multi-node save persist), then drops the pin
and supersedes the failed copies of older steps. What is due, and ``close``, are the
:class:`~ckptstore.tiers.persister.Persister`'s.

Why copies wait out an outage rather than fail: a local tier exists to keep training through a
slow or absent bucket. Local commits ask nothing of it (the lease's renewal, the proof of
ownership, is made here, when a step is persisted: lease.py), and a copy that failed for the
bucket's sake (a storage error, its deadline, the lease in doubt) is tried again after a pause,
for as long as no later step is queued behind it (:meth:`PersistQueue._waits_out`); once close
begins, each try runs by close's deadline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ckptstore.core.observer import PersistStats, SaveObserver, TierObserver
from ckptstore.core.saving import Saver
from ckptstore.data.copying import FileCopier
from ckptstore.deadline import Deadline, bounded, remaining
from ckptstore.domain.manifest import FileEntry
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    DeadlineExceededError,
    FencedError,
    IncompleteCheckpointError,
)
from ckptstore.retry import Backoff, Pauses
from ckptstore.tiers.durable_commit import persist
from ckptstore.tiers.local import LocalTier
from ckptstore.tiers.node_tier import NodeTier

log = logging.getLogger("ckptstore.tiers.persister")  # one logger for all of persisting

OTHER_NODES_WAIT = 600.0
"""Seconds a persist waits for the other nodes' files of a multi-node save to reach the
durable tier, unless the save's deadline (``save_timeout``) comes first."""
OTHER_NODES_POLL = Backoff(base=0.05, cap=2.0, factor=1.5, jitter=0.0)
"""The pauses between listings of those files: 50 ms, half as long again each time, to 2 s."""
RESUME_PAUSES = Backoff(base=0.5, cap=8.0, factor=2.0, jitter=0.0)
"""The pauses before a copy that failed for the bucket's sake is tried again: 0.5 s, doubling,
to 8 s (module docstring)."""


class PersistQueue:
    """Persists the queued local steps in the durable tier, in one background thread (the
    module docstring)."""

    def __init__(
        self,
        local: LocalTier,
        durable: Saver,
        observer: SaveObserver | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = local
        self.durable = durable
        """The durable tier's saver: persisting is a commit of the store there."""
        self.observer = observer
        self.clock = clock
        self._committed_at: dict[int, float] = {}
        self._copying: set[int] = set()
        self._failures: dict[int, CheckpointError] = {}
        self._durable_latest: int | None = None
        self._durable_known = False
        self._dropped: set[int] = set()
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

    def retain_local(self) -> None:
        """Apply the local tier's retention, after a local commit or a persist (one at a
        time: two prunes of one tier would race on the same manifests)."""
        with self.local.retention:
            self.local.pruner.after_save()

    def copying(self) -> set[int]:
        """The steps on their way to the durable tier from this process."""
        with self._lock:
            return self._copying | self.node.copying()

    def drop(self, step: int) -> None:
        """``step`` is being deleted from the store (core/maintenance.py): no copy of it
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
        failed and is not superseded: its local pin must stay (core/maintenance.py)."""
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
            log.warning(
                "%s: steps %s, whose copies failed, are superseded by durable step %d; "
                "they stay in the local tier until its retention drops them",
                self.uri,
                superseded,
                step,
            )
        self.retain_local()  # the pin is gone: the local tier keeps its count again
        stats = self._stats(step, self.clock() - committed)
        log.info(
            "%s: step %d is durable, %.2f s after its local commit",
            self.uri,
            step,
            stats.seconds_to_durable,
        )
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
                log.warning(
                    "%s: step %d is not durable yet, the bucket failed (%s); trying "
                    "again in %.1f s",
                    self.uri,
                    step,
                    e,
                    pause,
                )
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
        log.error(
            "%s: step %d stays in the local tier %s; persisting it failed (retried when "
            "the store is opened again, unless a later step is durable first): %s",
            self.uri,
            step,
            self.local.uri,
            error,
        )
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


def _nothing() -> None:
    """A task for the copier's queue: once it ran, every copy queued before it has ended."""


def _newer(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
