"""The write path of a save: stage the payload, commit it, move ``latest``, apply retention.

``CheckpointStore.save`` serializes a state into payload files (serialize.py) and hands them
here; ``push_dir``, the distributed savers and the integrations stage and commit their own
files through the same two calls, :meth:`StepWriter.stage` and :meth:`StepWriter.commit`.

A save of a step older than ``latest``'s is refused (StepBehindLatestError) unless the caller
passes ``allow_older``: it is nearly always a rerun that forgot to resume, and retention
(which keeps the newest steps) would delete each of its saves right after committing it. The
check reads the pointer staging reads anyway (for the previous step's files), so ``save``
makes no extra request (``save_async`` reads it once more, to refuse in the caller at once);
``commit`` checks again for multi-rank saves, whose committer may not have staged.
It is a guard against mistakes, not a lock: a rival writer that moves ``latest`` past a save
while it stages does not stop it from committing (``latest`` never moves back).

A multi-rank save reads the pointer and the previous manifest once, on its coordinator, and
hands each rank a :class:`~ckptstore.commit.Previous` holding only that rank's entries
(``stage(previous=...)``): a rank then reads neither, so its staging costs the same whatever
the number of ranks (README "Scale").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptstore import layout
from ckptstore.background import Abandon, BackgroundSaver
from ckptstore.catalog import Catalog
from ckptstore.commit import Committer, Previous
from ckptstore.errors import (
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    NotFoundError,
    StepBehindLatestError,
)
from ckptstore.info import CheckpointInfo, SaveStats
from ckptstore.lease import WriterLease
from ckptstore.maintenance import Maintenance
from ckptstore.manifest import (
    KIND_DIRECTORY,
    KIND_STATE,
    Environment,
    FileEntry,
    Manifest,
    check_metadata,
)
from ckptstore.observer import SaveObserver
from ckptstore.payload import Progress, SourceFile, file_reader
from ckptstore.pointer import Pointer
from ckptstore.transfer import scan_dir

log = logging.getLogger(__name__)


@dataclass
class StepWriter:
    """Saves steps into one store, under its writer lease if it has one; ``environment``
    describes this process, for manifests."""

    maintenance: Maintenance
    lease: WriterLease | None
    environment: Callable[[], Environment]
    clock: Callable[[], float]
    incremental: bool
    shard_size: int
    observer: SaveObserver | None = None
    background: BackgroundSaver[CheckpointInfo] = field(default_factory=BackgroundSaver)
    """The one async save in flight (async_saving.py); every save waits for it first."""

    def __post_init__(self) -> None:
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise ConfigError(
                f"shard_size must be a positive number of bytes, got {self.shard_size!r}"
            )

    def hold_lease(self) -> int:
        """Take or renew the writer lease (lease.py); the epoch, or 0 without leases."""
        return self.lease.hold() if self.lease is not None else 0

    @property
    def catalog(self) -> Catalog:
        return self.maintenance.catalog

    @property
    def committer(self) -> Committer:
        return self.maintenance.committer

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri

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
        step = layout.check_step(step)
        user_metadata = check_metadata(metadata)
        self.background.drain()
        from ckptstore.serialize import encode_state

        encoded = encode_state(state, shard_size=self.shard_size, allow_pickle=allow_pickle)
        return self.write(
            step,
            encoded.files(),
            KIND_STATE,
            user_metadata,
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
        step = layout.check_step(step)
        user_metadata = check_metadata(metadata)
        self.background.drain()
        files = [
            SourceFile(rel, file_reader(path), path.stat().st_size)
            for rel, path in scan_dir(local_dir)
        ]
        return self.write(
            step, files, KIND_DIRECTORY, user_metadata, progress=progress, allow_older=allow_older
        )

    def write(
        self,
        step: int,
        files: list[SourceFile],
        kind: str,
        metadata: Mapping[str, Any],
        *,
        progress: Progress | None = None,
        blocked: float = 0.0,
        files_by_key: Mapping[str, tuple[str, ...]] | None = None,
        allow_older: bool = False,
        abandon: Abandon | None = None,
    ) -> CheckpointInfo:
        """Stage and commit ``files`` as ``step``, telling the observer how it went;
        ``files_by_key`` indexes a state's files in the manifest (manifest.py); ``abandon``
        (background.py) is checked once more right before the commit marker."""
        started = time.perf_counter()
        try:
            self.hold_lease()  # fail before uploading anything if another writer holds the store
            entries = self.stage(step, files, kind=kind, progress=progress, allow_older=allow_older)
            return self.commit(
                step,
                entries,
                kind=kind,
                metadata=metadata,
                timing=(started, blocked),
                files_by_key=files_by_key,
                allow_older=True,  # staging checked; a pointer read more buys nothing here
                abandon=abandon,
            )
        except BaseException as e:
            error = e  # bound for the lambda: ruff cannot see that it runs inside this block
            self._observe(lambda o: o.failed(self.uri, step, error))
            raise

    def stage(
        self,
        step: int,
        files: Iterable[SourceFile],
        *,
        kind: str,
        progress: Progress | None,
        allow_older: bool = False,
        previous: Previous | None = None,
    ) -> list[FileEntry]:
        """Upload payload files of ``step`` into an attempt of their own, uncommitted.

        ``previous``: what a coordinator read for this stager (:meth:`previous_for`); None
        reads the pointer (and, incremental, the previous manifest) here."""
        step = layout.check_step(step)
        self._check_step_is_free(step)
        if previous is None:
            previous = self.previous_for(kind, read=self.incremental or not allow_older)
        if not allow_older:
            self.check_not_behind(step, previous.step)
        return self.committer.write_payload(
            step,
            files,
            progress,
            previous=previous if self.incremental else None,
            epoch=self.lease.epoch or 0 if self.lease is not None else 0,
        )

    def previous_for(self, kind: str, *, read: bool = True) -> Previous:
        """``latest``'s step and, incremental and of ``kind``, its files: what stagers need
        to refuse a step behind it and to copy unchanged files; ``read=False`` reads
        nothing (no step)."""
        if not read:
            return Previous(None)
        pointer = self.catalog.pointer_or_none()
        latest = pointer.step if pointer is not None else None
        manifest = self._previous_manifest(pointer, kind) if self.incremental else None
        return Previous.of(manifest, latest)

    def commit(
        self,
        step: int,
        entries: Iterable[FileEntry],
        *,
        kind: str,
        metadata: Mapping[str, Any],
        world_size: int | None = None,
        timing: tuple[float, float] | None = None,
        files_by_key: Mapping[str, tuple[str, ...]] | None = None,
        allow_older: bool = False,
        abandon: Abandon | None = None,
    ) -> CheckpointInfo:
        """Commit staged files as ``step``: confirm them, write the manifest, move ``latest``,
        apply retention. On failure before the manifest is written nothing is committed, and
        the staged files are removed (a step behind ``latest`` fails so, unless
        ``allow_older``)."""
        started, blocked = timing or (time.perf_counter(), 0.0)
        step = layout.check_step(step)
        entries = tuple(entries)
        environment = self.environment()
        if world_size is not None:
            environment = replace(environment, world_size=world_size)
        try:
            if not allow_older:
                self.check_not_behind(step, step_of(self.catalog.pointer_or_none()))
            self.committer.confirm_payload(step, entries)
            epoch = self.hold_lease()  # renewing is the fence check: right before the commit
            manifest = Manifest(
                step=step,
                created=self.clock(),
                kind=kind,
                files=entries,
                environment=environment,
                writer=self.committer.writer,
                metadata=check_metadata(metadata),
                lease_epoch=epoch,
                files_by_key=dict(files_by_key) if files_by_key is not None else None,
            )
            if abandon is not None:
                abandon.check()
            manifest = self.committer.commit(manifest)
        except BaseException:
            attempts = {e.attempt for e in entries if e.attempt}
            self.committer.remover.discard_attempts(step, attempts)
            raise
        self.committer.advance_latest(step, epoch=epoch)
        stats = SaveStats.of(manifest, time.perf_counter() - started, blocked)
        log.info("%s: %s", self.uri, stats)
        self._observe(lambda o: o.saved(self.uri, stats))
        self.maintenance.retain_after_save()
        return self.catalog.info_of(manifest, stats)

    def _check_step_is_free(self, step: int) -> None:
        """Refuse a committed step before uploading anything; remove a step that a writer
        fenced off by a lease takeover committed (pointer.py), since it is never loaded."""
        if self.catalog.backend.stat(layout.manifest_path(step)) is None:
            return
        try:
            manifest: Manifest | None = self.catalog.read_manifest(step)
        except NotFoundError:
            return  # a tombstone: the step was removed, and may be saved anew (removal.py)
        except (CorruptCheckpointError, CompatibilityError):
            manifest = None
        pointer = self.catalog.pointer_or_none()
        if (
            manifest is not None
            and pointer is not None
            and pointer.fenced(step, manifest.lease_epoch)
        ):
            log.warning(
                "%s: removing step %d, committed by %s after it lost the writer lease (epoch "
                "%d); saving it anew",
                self.uri,
                step,
                manifest.writer,
                manifest.lease_epoch,
            )
            self.committer.remover.uncommit(step)
            return
        raise ConflictError(
            f"step {step} is already committed in {self.uri}; committed steps are "
            "immutable. Save under a new step, or `ckptstore rm` it first",
            uri=self.catalog.uri(layout.step_dir(step)),
            path=layout.step_dir(step),
            step=step,
        )

    def check_not_behind(self, step: int, latest: int | None) -> None:
        """Refuse a step older than ``latest`` (module docstring). A pointer left ahead of
        every committed step (its step deleted behind its back) is no reason to refuse:
        ``advance_latest`` repairs it."""
        if latest is None or step >= latest or not self.catalog.is_committed(latest, fresh=True):
            return
        raise StepBehindLatestError(
            f"{self.uri}: refusing to save step {step}: latest is step {latest}, so step "
            f"{step} would commit behind it and retention could delete it at once; nothing "
            "was uploaded. If this run continues the old one, resume first "
            "(`store.load()`, or `ckptstore.integrations.training.resume()`) and save the "
            "steps after it; to start afresh, save into a new URI; to add an older step on "
            "purpose, pass allow_older=True (latest stays, retention applies as usual)",
            uri=self.catalog.uri(layout.step_dir(step)),
            path=layout.step_dir(step),
            step=step,
        )

    def _previous_manifest(self, pointer: Pointer | None, kind: str) -> Manifest | None:
        """The latest step's manifest, whose unchanged files a save copies, if of ``kind``;
        from the pointer already read, so a save reads it once."""
        if pointer is None or pointer.step is None:
            return None
        try:
            manifest = self.catalog.read_manifest(pointer.step)  # fresh: its files are copied
        except (NotFoundError, CorruptCheckpointError, CompatibilityError) as e:
            log.debug("no previous step to reuse files from: %s", e)
            return None
        return manifest if manifest.kind == kind else None

    def _observe(self, tell: Callable[[SaveObserver], None]) -> None:
        """Tell the observer; its own failure is logged, never raised into the save."""
        if self.observer is None:
            return
        try:
            tell(self.observer)
        except Exception as e:
            log.warning("%s: the save observer raised %r; ignored", self.uri, e)


def step_of(pointer: Pointer | None) -> int | None:
    return pointer.step if pointer is not None else None
