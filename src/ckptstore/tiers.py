"""Two tiers under one store: every save lands in a fast local tier, due steps reach the
durable tier in the background.

A tiered store (tiered.py) commits each save in its local tier (a local disk, with the same
commit protocol) and returns. A step is *due* for the durable tier when ``persist_every``
local saves were made since the last due one, when ``persist_interval_seconds`` passed since
then, when the caller asks (``save(..., persist=True)``: a final or a preemption save), or on
every save when neither is set. A due step is pinned in the local tier first, so local
retention never deletes it before it is durable, then one background thread copies it: its
files first, then the very same manifest (same digests, same signature), create-only, then
the durable ``latest`` moves forward and the durable tier applies its own retention under its
own writer lease (maintenance.py's ``copy_to``). Then the local pin goes.

The pin is also the record that survives a kill: a store opened again copies every pinned
local step the durable tier lacks. What a lost node loses is at most the local steps newer than
the last durable one; :class:`~ckptstore.observer.PersistStats` reports that lag.
"""

from __future__ import annotations

import builtins
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckptstore.errors import CheckpointError, ConfigError, NotFoundError
from ckptstore.observer import PersistStats, SaveObserver, TierObserver

if TYPE_CHECKING:
    from ckptstore.info import CheckpointInfo, SaveStats


class Tier(Protocol):
    """What the persister uses of each tier (a CheckpointStore)."""

    @property
    def uri(self) -> str: ...

    def info(self, step: int) -> CheckpointInfo: ...

    def pin(self, step: int) -> None: ...

    def unpin(self, step: int) -> bool: ...

    def pins(self) -> builtins.list[int]: ...

    def copy_to(self, other: Any, steps: Iterable[int] | None = None) -> Any: ...


log = logging.getLogger(__name__)


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


class Persister:
    """The local tier's observer and the background copier to the durable tier."""

    def __init__(
        self,
        durable: Tier,
        durable_holds: Callable[[int], bool],
        policy: PersistPolicy,
        observer: SaveObserver | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.durable = durable
        self.durable_holds = durable_holds
        """Whether the durable tier alone holds a step (a tiered store's own ``info`` sees
        both tiers)."""
        self.policy = policy
        self.observer = observer
        self.clock = clock
        self.local: Tier | None = None
        """Set once the local tier is open (it is built with this as its observer)."""
        self._forced: set[int] = set()
        self._saves_since = 0
        self._last_due: float | None = None
        self._committed_at: dict[int, float] = {}
        self._copying: set[int] = set()
        self._errors: list[CheckpointError] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._pending: list[Future[None]] = []

    # -- the local tier's observer ----------------------------------------------------------

    def saved(self, uri: str, stats: SaveStats) -> None:
        """A step was committed in the local tier: pin and queue it if it is due."""
        now = self.clock()
        with self._lock:
            self._committed_at[stats.step] = now
            self._saves_since += 1
            since = None if self._last_due is None else now - self._last_due
            forced = stats.step in self._forced
            if not self.policy.due(self._saves_since, since, forced=forced):
                due = False
            else:
                due, self._saves_since, self._last_due = True, 0, now
                self._forced.discard(stats.step)
        if self.observer is not None:
            self.observer.saved(uri, stats)
        if due:
            self.queue(stats.step)

    def failed(self, uri: str, step: int, error: BaseException) -> None:
        self._forced.discard(step)
        if self.observer is not None:
            self.observer.failed(uri, step, error)

    def force(self, step: int) -> None:
        """Make ``step`` due when it commits (``save(..., persist=True)``)."""
        with self._lock:
            self._forced.add(step)

    # -- copying ---------------------------------------------------------------------------

    def queue(self, step: int) -> None:
        """Pin ``step`` in the local tier (retention keeps it) and copy it in the background."""
        local = self._local()
        local.pin(step)
        with self._lock:
            self._copying.add(step)
            self._pending.append(self._pool.submit(self._copy, step))

    def resume(self) -> list[int]:
        """Queue the pinned local steps the durable tier lacks (a copy a kill interrupted);
        unpin those it holds. Returns the steps queued."""
        local = self._local()
        queued = []
        for step in local.pins():
            try:
                local.info(step)
            except NotFoundError:
                local.unpin(step)  # a pin of a step that is gone: nothing to copy
                continue
            if self.durable_holds(step):
                local.unpin(step)
            else:
                queued.append(step)
                self.queue(step)
        return queued

    def copying(self) -> set[int]:
        with self._lock:
            return set(self._copying)

    def _copy(self, step: int) -> None:
        local = self._local()
        started = self.clock()
        try:
            local.copy_to(self.durable, [step])
            local.unpin(step)
        except CheckpointError as e:
            log.error(
                "%s: step %d stays in the local tier %s; its copy failed (retried when the "
                "store is opened again): %s",
                self.durable.uri,
                step,
                local.uri,
                e,
            )
            with self._lock:
                self._errors.append(e)
                self._copying.discard(step)
            if isinstance(self.observer, TierObserver):
                self.observer.persist_failed(self.durable.uri, step, e)
            return
        with self._lock:
            self._copying.discard(step)
            committed = self._committed_at.pop(step, started)
        stats = self._stats(step, self.clock() - committed)
        log.info(
            "%s: step %d is durable, %.2f s after its local commit",
            self.durable.uri,
            step,
            stats.seconds_to_durable,
        )
        if isinstance(self.observer, TierObserver):
            self.observer.persisted(self.durable.uri, stats)

    def _stats(self, step: int, seconds: float) -> PersistStats:
        now = self.clock()
        with self._lock:
            newer = {s: t for s, t in self._committed_at.items() if s > step}
        oldest = min(newer.values(), default=now)
        return PersistStats(step, seconds, len(newer), now - oldest)

    def wait(self) -> None:
        """Wait for every queued copy; raise the first failure nobody heard of."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _local(self) -> Tier:
        if self.local is None:
            raise CheckpointError("the local tier is not open")
        return self.local
