"""The write side of one store: what a save needs, and the saves of one process.

:class:`Saver` holds the parts a save uses (catalog, committer, remover, writer lease,
retention, observer) and runs a save in this process as the coordinated save of one
participant (coordination.py): ``save`` (a state, serialized by serialize.py) and ``push_dir``
(a directory, such as verl's ``global_step_N``). Multi-process saves start from
:meth:`Saver.begin` too, so every face follows the same sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckptstore.core.coordination import Coordinator
from ckptstore.core.observer import SaveObserver
from ckptstore.core.resolver import Resolver
from ckptstore.data.background import Abandon
from ckptstore.data.payload import Progress, SourceFile, file_reader
from ckptstore.data.transfer import scan_dir
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, SaveStats
from ckptstore.domain.manifest import KIND_DIRECTORY, KIND_STATE, Environment, FileEntry
from ckptstore.domain.plan import Plan
from ckptstore.errors import CheckpointError, ConfigError
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.lease import WriterLease
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.removal import Remover
from ckptstore.protocol.step_state import StepState

log = logging.getLogger(__name__)


class Tiers(Protocol):
    """What a saver that commits in a local tier asks of its store's tiers (persister.py)."""

    def durable_latest(self) -> int | None: ...

    def durable_holds(self, step: int) -> bool: ...

    def durable_uri(self, path: str = "") -> str: ...

    def fences(self) -> Pointer | None: ...

    def decide(self, step: int) -> bool: ...

    def saved(self, stats: SaveStats) -> None: ...

    def failed(self, step: int) -> None: ...

    def staged(self, plan: Plan, entries: Sequence[FileEntry]) -> None: ...

    def abandon(self, step: int, attempts: set[str]) -> None: ...


@dataclass
class Saver:
    """Saves steps into one store, under its writer lease if it has one."""

    catalog: Catalog
    committer: Committer
    remover: Remover
    lease: WriterLease | None
    retain: Callable[[], None]
    """Applies retention after a commit (maintenance.py); never raises."""
    environment: Callable[[], Environment]
    """Describes this process, for manifests."""
    clock: Callable[[], float]
    incremental: bool
    shard_size: int
    drain: Callable[[], None]
    """Waits for this store's save in flight (async_saving.py), raising its error."""
    observer: SaveObserver | None = None
    save_timeout: float | None = None
    """Seconds a save may take (deadline.py); None: no deadline."""
    tiers: Tiers | None = None
    """Set when this saver commits in the local tier of a store (tiers/local.py): a save must not
    fall behind the durable tier's latest either, and each commit is offered for persisting."""
    node: str | None = None
    """The node id of the local tier this saver commits in (``LocalTier.identity.node``);
    None for a store that every participant writes to itself (reports.py, ``Staged``)."""
    pointer_trusted: bool = field(default=False, init=False)
    """Whether :meth:`latest_step` may take ``latest.json`` at its word (module docstring)."""

    def __post_init__(self) -> None:
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise ConfigError(
                f"shard_size must be a positive number of bytes, got {self.shard_size!r}"
            )

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri

    def latest_step(self) -> int | None:
        """The step a save must not fall behind: ``latest``'s, or on this store's first save
        (and after a save that failed once committed) a step committed past it, by a writer
        killed between its commit and moving the pointer (one listing). Once a listing finds
        none, the pointer is trusted: under the lease, only this store's saves move it. A
        pointer found stale stays untrusted until a commit moves it (a refused save moves
        nothing)."""
        pointer = self.catalog.pointer_or_none()
        step = pointer.step if pointer is not None else None
        if not self.pointer_trusted:
            newer = Resolver(self.catalog).committed_after(pointer)
            step = newer.step if newer is not None else step
            self.pointer_trusted = newer is None
        if self.tiers is not None:
            durable = self.tiers.durable_latest()
            step = durable if step is None or (durable is not None and durable > step) else step
        return step

    def fences(self) -> Pointer | None:
        """The pointer whose fences judge this store's steps, in any tier: the durable one's
        (a local tier has no lease, so a writer fenced there still commits: node_tier.py)."""
        return self.tiers.fences() if self.tiers is not None else self.catalog.pointer_or_none()

    def holder(self, step: int) -> str | None:
        """``step``'s URI in a tier of this store that holds it committed and readable
        (fresh reads; this saver's tier first); ``None`` when none does."""
        path = layout.step_dir(step)
        if self.catalog.state_of(step, fresh=True) is StepState.COMMITTED:
            return self.catalog.uri(path)
        if self.tiers is not None and self.tiers.durable_holds(step):
            return self.tiers.durable_uri(path)
        return None

    def advance_latest(self, step: int, *, epoch: int, newest_before: int | None) -> None:
        """Move ``latest`` to ``step``, just committed. The pointer is trusted after that only
        if ``step`` is the newest committed (not an ``allow_older`` save behind
        ``newest_before``); a move that fails leaves it untrusted: list next time."""
        try:
            self.committer.advance_latest(step, epoch=epoch)
        except BaseException:
            self.pointer_trusted = False
            raise
        if newest_before is None or step >= newest_before:
            self.pointer_trusted = True

    def due(self, step: int) -> bool:
        """Whether ``step``, once committed here, is due for the durable tier (tiers/local.py)."""
        return self.tiers is not None and self.tiers.decide(step)

    def share(self, plan: Plan, entries: Sequence[FileEntry]) -> None:
        """A participant staged ``entries`` in the local tier (tiers/local.py)."""
        if self.tiers is not None:
            self.tiers.staged(plan, entries)

    def shares_to(self, plan: Plan) -> str | None:
        """The durable tier's URI if ``plan``'s participants copy their files there as they
        stage them (a due step of a tiered store: node_tier.py), else None."""
        return self.tiers.durable_uri() if self.tiers is not None and plan.due else None

    def discard_save(self, step: int, save: str | None, attempts: set[str]) -> None:
        """Remove what a coordinated save that will not be committed staged here (its
        ``attempts`` and those whose marker names ``save``), and, in a tiered store, what
        this process shared of it in the durable tier once its copies are done."""
        self.remover.discard_save(step, save, attempts)
        if self.tiers is not None:
            self.tiers.abandon(step, attempts)

    def hold_lease(self) -> int:
        """Take or renew the writer lease (lease.py); the epoch, or 0 without leases. In a
        local tier, the lease held and not known lost, with no request (``vouch``): the
        renewal is the persist's, so a local commit does not wait for the bucket."""
        if self.lease is None:
            return 0
        return self.lease.vouch() if self.tiers is not None else self.lease.hold()

    def ensure_lease(self) -> int:
        """Take the writer lease if not held, without renewing it (lease.py); the epoch."""
        if self.lease is None:
            return 0
        return self.lease.vouch() if self.tiers is not None else self.lease.ensure()

    def begin(
        self,
        step: int,
        kind: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        allow_older: bool = False,
    ) -> Coordinator:
        """Start a coordinated save of ``step`` (coordination.py)."""
        return Coordinator.begin(self, step, kind, metadata=metadata, allow_older=allow_older)

    def commit_staged(
        self,
        step: int,
        kind: str,
        entries: tuple[FileEntry, ...],
        metadata: Mapping[str, Any] | None,
        *,
        world_size: int | None = None,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Begin and commit at once, for files staged before the save began (the two-call
        API): a refusal removes them, as a failed commit does."""
        try:
            coordinator = self.begin(step, kind, metadata=metadata, allow_older=allow_older)
        except BaseException:
            self.remover.discard_attempts(step, {e.attempt for e in entries if e.attempt})
            raise
        return coordinator.commit(entries, world_size=world_size)

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None,
        allow_pickle: bool,
        *,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Serialize ``state`` (serialize.py) and write it as ``step``."""
        from ckptstore.data.serialize import encode_state

        encoded = encode_state(state, shard_size=self.shard_size, allow_pickle=allow_pickle)
        return self.write(
            step,
            lambda: encoded.files(),
            KIND_STATE,
            metadata,
            files_by_key=encoded.files_by_key,
            allow_older=allow_older,
        )

    def push_dir(
        self,
        step: int,
        local_dir: Path,
        metadata: Mapping[str, Any] | None,
        progress: Progress | None,
        allow_older: bool,
    ) -> CheckpointInfo:
        """Commit every file under ``local_dir`` (a verl ``global_step_N``) as ``step``."""

        def files() -> list[SourceFile]:
            return [
                SourceFile(rel, file_reader(path), path.stat().st_size)
                for rel, path in scan_dir(local_dir)
            ]

        return self.write(
            step, files, KIND_DIRECTORY, metadata, progress=progress, allow_older=allow_older
        )

    def write(
        self,
        step: int,
        files: Callable[[], list[SourceFile]],
        kind: str,
        metadata: Mapping[str, Any] | None,
        *,
        progress: Progress | None = None,
        blocked: float = 0.0,
        files_by_key: Mapping[str, tuple[str, ...]] | None = None,
        allow_older: bool = False,
        abandon: Abandon | None = None,
    ) -> CheckpointInfo:
        """The coordinated save of one participant, this process: begin, stage ``files()``
        (listed once the checks passed), commit; the observer hears how it went.
        ``abandon`` (background.py) is checked once more right before the commit marker."""
        started = time.perf_counter()
        try:  # the save's deadline is the coordinator's, from its begin to its commit
            coordinator = self.begin(step, kind, metadata=metadata, allow_older=allow_older)
            coordinator.started = started
            entries = coordinator.stage_here(files(), progress)
            return coordinator.commit(
                entries, files_by_key=files_by_key, blocked=blocked, abandon=abandon
            )
        except BaseException as e:
            if isinstance(e, CheckpointError):
                e.add_context(step=step)  # a timeout from deep in a backend knows no step
            error = e  # bound for the lambda: ruff cannot see that it runs inside this block
            self._observe(lambda o: o.failed(self.uri, step, error))
            if self.tiers is not None:
                self.tiers.failed(step)
            raise

    def saved(self, stats: SaveStats) -> None:
        """After a commit moved ``latest``: tell the log and the observer, offer the step for
        persisting (a due one is pinned before retention runs), apply retention."""
        log.info("%s: %s", self.uri, stats)
        self._observe(lambda o: o.saved(self.uri, stats))
        if self.tiers is not None:
            self.tiers.saved(stats)
        self.retain()

    def _observe(self, tell: Callable[[SaveObserver], None]) -> None:
        """Tell the observer; its own failure is logged, never raised into the save."""
        if self.observer is None:
            return
        try:
            tell(self.observer)
        except Exception as e:
            log.warning("%s: the save observer raised %r; ignored", self.uri, e)
