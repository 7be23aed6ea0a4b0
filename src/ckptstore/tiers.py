"""The tiers of one store: a fast local tier in front of the durable store at its URI.

``CheckpointStore(uri, local="/nvme/ckpt/run")`` is one store with two tiers and one
``latest``; there is no second kind of store. The core knows the tiers:

* **Saving** (saving.py, coordination.py): every face's coordinated save commits in the local
  tier, the same protocol over a local directory, under the store's writer lease (the local
  tier has none of its own) and with the store's writer id, so a manifest is the store's
  wherever it lies. A save must not fall behind the newest step of *either* tier.
* **Persisting** (:class:`Persister`): a step is *due* for the durable tier when
  ``persist_every`` local saves were made since the last due one, when
  ``persist_interval_seconds`` passed since then, when the caller asks (``save(...,
  persist=True)``: a final or a preemption save), or on every save when neither is set. A due
  step is pinned in the local tier first, so local retention never deletes it before it is
  durable; one background thread then commits it in the durable tier by the coordinated save
  (coordination.py's :func:`~ckptstore.coordination.persist`): the writer lease, the files
  copied (only those not there yet), the very same manifest create-only (same digests, same
  signature), ``latest`` forward, the durable retention. Then the pin goes and the local
  retention runs again.
* **Resolving** (resolver.py): one resolver over both tiers: the newest step either holds,
  the local copy of a step first, the durable copy of the same step before any older one,
  the durable pointer's fences for both. Reads of a step's files take the local copy of each
  file where it is good and fetch only the rest (:class:`TieredFiles`).
* **Taking the lease over**: the fence a takeover stamps admits every step committed before
  it in any tier the new holder sees (commit.py), so a step its node committed locally and a
  kill kept from the bucket is persisted by the next writer as the store's, not a zombie's.

The pin is the record that survives a kill: a store opened again for writing persists every
pinned local step the durable tier lacks. A copy that failed is retried at the next open; once
a later step is durable it is superseded: its pin goes and ``close()`` does not fail the job
over it. What a lost node loses is at most the local steps newer than the last durable one;
:class:`~ckptstore.observer.PersistStats` reports that lag.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING

from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    ConflictError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.observer import PersistStats, SaveObserver, TierObserver
from ckptstore.pruning import Pins

if TYPE_CHECKING:
    from ckptstore.catalog import Catalog
    from ckptstore.commit import Committer
    from ckptstore.coordination import Plan
    from ckptstore.info import CheckpointInfo, SaveStats
    from ckptstore.manifest import FileEntry, Manifest
    from ckptstore.pruning import Pruner
    from ckptstore.removal import Remover
    from ckptstore.saving import Saver

log = logging.getLogger(__name__)
DEFAULT_LOCAL_KEEP_LAST = 2
"""Steps the local tier keeps besides those not yet durable, unless ``local_keep_last``."""
OTHER_NODES_WAIT = 600.0
"""Seconds a persist waits for the other nodes' files of a multi-node save to reach the
durable tier, unless the save's deadline (``save_timeout``) comes first."""


@dataclass(frozen=True)
class PersistPolicy:
    """When a local step is due for the durable tier (pure; the module docstring)."""

    every: int | None = None
    """Every this many local saves."""
    interval: float | None = None
    """Once this many seconds passed since the last due step."""
    spelling: InitVar[Callable[[str], str] | None] = None
    """How messages name the options (options.py)."""

    def __post_init__(self, spelling: Callable[[str], str] | None) -> None:
        name = spelling or str
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ConfigError(
                f"{name('persist_every')} must be a positive integer (saves), got {self.every!r}"
            )
        interval = self.interval
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ConfigError(
                f"{name('persist_interval_seconds')} must be a positive number of seconds, got "
                f"{interval!r}"
            )

    def due(self, saves_since: int, seconds_since: float | None, *, forced: bool) -> bool:
        """``saves_since``: local saves since the last due step, this one included;
        ``seconds_since``: since that step's commit (None: there was none)."""
        if forced or (self.every is None and self.interval is None):
            return True
        if self.every is not None and saves_since >= self.every:
            return True
        return self.interval is not None and (
            seconds_since is None or seconds_since >= self.interval
        )


@dataclass(frozen=True)
class TierPins(Pins):
    """A local tier's pins: those written (a due step not yet durable, kept across a kill),
    and the steps whose shares this process is copying now (:meth:`Persister.share`)."""

    _busy: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, step: int) -> None:
        with self._lock:
            self._busy[step] += 1

    def release(self, step: int) -> None:
        with self._lock:
            self._busy[step] -= 1
            if self._busy[step] <= 0:
                del self._busy[step]

    def steps(self) -> list[int]:
        with self._lock:
            busy = set(self._busy)
        return sorted(set(super().steps()) | busy)


@dataclass(frozen=True)
class LocalTier:
    """The local tier's engines (wiring.py builds them): the catalog, the commit protocol,
    removal, pins and retention of a store, over a local directory."""

    catalog: Catalog
    committer: Committer
    remover: Remover
    pins: TierPins
    pruner: Pruner

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri


@dataclass(frozen=True)
class TieredFiles:
    """Reads a committed step's files from the fastest tier that holds each one good: a rank
    whose node kept its shards reads none of them from the bucket, a wiped node reads all.
    Every tier's copy is checked against the one manifest the resolver chose (the tiers hold
    the same manifest), so a local copy is never trusted for being local."""

    tiers: Sequence[Catalog]
    """Fastest first; the durable tier last."""

    def read_verified(self, step: int, entry: FileEntry) -> memoryview:
        from ckptstore.resolver import VERIFY_ERRORS

        *faster, durable = self.tiers
        for catalog in faster:
            try:
                return catalog.read_verified(step, entry)
            except NotFoundError:
                pass
            except VERIFY_ERRORS as e:
                log.warning("%s; reading it from the next tier", e)
        return durable.read_verified(step, entry)

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of ``info``'s step by its path in the step, verified."""
        return self.read_verified(info.step, self.tiers[-1].entry(info, path))


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
        self._staged_here: dict[int, tuple[Plan, list[FileEntry]]] = {}
        """What this process staged as a participant, by step (:meth:`staged`)."""
        self._sharing: dict[int, set[str]] = {}
        """Keys of files this process persists as a participant's share (:meth:`share`)."""
        self._durable_latest: int | None = None
        self._durable_known = False
        self._started = False
        self._lock = threading.Lock()
        self._retention = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._pool_shares = ThreadPoolExecutor(1, thread_name_prefix="ckpt-share")
        """Shares run beside persists: a persist waits for this process's own shares."""
        self._pool_peers = ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer")
        """Copies to a peer node (peers.py), in the order of the steps, beside the others."""
        self._pending: list[Future[None]] = []

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
        resumed = []
        for step in self.local.pins.steps():
            if not self.local.catalog.is_committed(step, fresh=True):
                self.local.pins.remove(step)  # a pin of a step that is gone: nothing to copy
            elif self.durable.catalog.is_committed(step, fresh=True):
                self.local.pins.remove(step)
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
        with self._retention:
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
        with self._lock:
            return set(self._copying)

    # -- persisting --------------------------------------------------------------------------

    def queue(self, step: int) -> None:
        """Pin ``step`` in the local tier (retention keeps it) and persist it in the
        background."""
        self.local.pins.add(step)
        with self._lock:
            self._copying.add(step)
            self._pending.append(self._pool.submit(self._persist, step))

    def _persist(self, step: int) -> None:
        from ckptstore.coordination import persist

        started = self.clock()
        try:
            manifest = self.local.catalog.read_manifest(step)
            persist(self.durable, manifest, self._gather)
        except CheckpointError as e:
            self._failed(step, e)
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

    def _gather(self, step: int, entries: Sequence[FileEntry]) -> None:
        """Bring ``entries`` of ``step`` to the durable tier: copy those this node holds,
        then wait for the rest, which the other nodes of a multi-node save persist
        (:meth:`join`), by the persist's deadline (at most :data:`OTHER_NODES_WAIT`)."""
        from ckptstore.copying import FileCopier
        from ckptstore.deadline import remaining
        from ckptstore.follow import Backoff

        here = self.local.catalog.payload_sizes(step)
        with self._lock:
            shared = self._sharing.get(step, set())
        mine = [e for e in entries if here.get(e.key(step)) == e.size and e.key(step) not in shared]
        FileCopier(self.local.catalog.backend, self.durable.catalog.backend).copy_files(step, mine)
        rest = [e for e in entries if e not in mine]
        until = time.monotonic() + remaining(OTHER_NODES_WAIT)
        backoff = Backoff(0.05, 2.0)
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
                time.sleep(min(backoff.next(), left))

    def join(self, manifest: Manifest) -> None:
        """On a participant of a multi-node save (distributed.py): the coordinator committed
        ``manifest``, some of whose files this process staged (and, the step being due,
        shares: :meth:`share`). Commit it in this node's local tier too, so the step resolves
        on this node, and apply the local retention."""
        self.hold(manifest)
        self.retain_local()

    def hold(self, manifest: Manifest) -> None:
        """Commit ``manifest`` in this node's local tier if it lacks it (its files may be
        here, at a peer's, or in the durable tier: reads find each one) and move the local
        ``latest`` forward to it."""
        from ckptstore.catalog import StepState

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
            self._staged_here.setdefault(step, (plan, []))[1].extend(entries)
            older = sorted(s for s in self._staged_here if s < step)
            doomed = {s: self._staged_here.pop(s) for s in older[: max(0, len(older) - keep + 1)]}
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
        persist waits for them, then commits the step (:meth:`_gather`)."""
        step = plan.step
        with self._lock:
            self._sharing.setdefault(step, set()).update(e.key(step) for e in entries)
            self._copying.add(step)
            self.local.pins.hold(step)
            self._pending.append(self._pool_shares.submit(self._share, plan, tuple(entries)))

    def _share(self, plan: Plan, entries: tuple[FileEntry, ...]) -> None:
        from ckptstore.copying import FileCopier

        step = plan.step
        durable = self.durable
        try:
            for attempt in sorted({e.attempt for e in entries if e.attempt is not None}):
                durable.committer.begin_attempt(step, plan.epoch, attempt, save=plan.save)
            FileCopier(self.local.catalog.backend, durable.catalog.backend).copy_files(
                step, entries
            )
        except CheckpointError as e:
            self._failed(step, e)
        finally:
            with self._lock:
                self._copying.discard(step)
                self.local.pins.release(step)

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
                log.warning("%s: the peer copy of step %d failed; a lost node resumes it from "
                            "the durable tier instead: %s", self.local.uri, step, e)  # fmt: skip
            finally:
                self.local.pins.release(step)

        with self._lock:
            self._pending.append(self._pool_peers.submit(run))

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
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        with self._lock:
            failures, self._failures = self._failures, {}
        if failures:
            raise failures[max(failures)]

    def close(self) -> None:
        """A writer's last local step is always made durable (a participant shares its files
        of the last step it staged, which the coordinator's close waits for); then wait for
        every copy (raising as :meth:`wait` does) and stop the threads."""
        try:
            with self._lock:
                writing = self._started
                last = max(self._staged_here, default=None)
                unshared = last is not None and last not in self._sharing
            if writing:
                newest = self._newest_local()
                if newest is not None and not self.durable.catalog.is_committed(newest):
                    self.queue(newest)
            elif last is not None and unshared:
                self.share(*self._staged_here[last])
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._pool_shares.shutdown(wait=True)
            self._pool_peers.shutdown(wait=True)

    def _newest_local(self) -> int | None:
        from ckptstore.resolver import Resolver

        newest = Resolver(self.local.catalog).latest()
        return newest.step if newest is not None else None


def _newer(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def tier_listing(
    local: Sequence[CheckpointInfo], durable: Sequence[CheckpointInfo], copying: set[int]
) -> list[CheckpointInfo]:
    """Both tiers' committed steps as one list, ascending, each with where it is:
    ``local+durable``, ``local``, ``local (copying)`` or ``durable`` (the local info first:
    reads of a step both hold go there)."""
    held = {i.step: i for i in durable}
    here = {i.step: i for i in local}
    found = []
    for step in sorted(held.keys() | here.keys()):
        if step in here and step in held:
            found.append(replace(here[step], tier="local+durable"))
        elif step in here:
            tier = "local (copying)" if step in copying else "local"
            found.append(replace(here[step], tier=tier))
        else:
            found.append(replace(held[step], tier="durable"))
    return found
