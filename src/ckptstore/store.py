"""CheckpointStore: the one object users hold, a thin facade over the engines.

A save goes: serialize the state into payload files (serialize.py), stage and commit them
(saving.py, commit.py), move ``latest``, apply retention (maintenance.py). A load resolves the
step (catalog.py) and reads every byte verified (loading.py, verified.py). Many-step operations
are maintenance.py's and garbage.py's. None of it knows HTTP or file descriptors; backends do.
"""

from __future__ import annotations

import builtins
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from ckptstore import layout
from ckptstore.adoption import Adopter, ForeignStep
from ckptstore.async_saving import AsyncSaver
from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.background import SaveHandle
from ckptstore.commit import Committer, Previous
from ckptstore.compat import check_compat, check_mode
from ckptstore.config import key_bytes, signing_key_from_env
from ckptstore.environment import current_environment, world_size
from ckptstore.errors import CheckpointError
from ckptstore.follow import DEFAULT_INTERVAL, wait_for_step
from ckptstore.garbage import GC_GRACE_SECONDS, GarbageCollector
from ckptstore.info import CheckpointInfo, GcReport, Loaded, VerifyReport
from ckptstore.lease import DEFAULT_TTL, WriterLease, check_ttl
from ckptstore.loading import download_step, load_state
from ckptstore.maintenance import Maintenance
from ckptstore.manifest import KIND_DIRECTORY, Environment, FileEntry, check_metadata
from ckptstore.observer import SaveObserver
from ckptstore.payload import Progress, SourceFile
from ckptstore.retention import Policy, RetentionPolicy, as_policies
from ckptstore.saving import StepWriter
from ckptstore.signing import Signer
from ckptstore.transfer import check_target

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger(__name__)


class CheckpointStore:
    """Atomic, verified checkpoints under one URI (local path, NFS, ``s3://``, fsspec URL)."""

    def __init__(
        self,
        uri: str,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] | None = None,
        keep_every_seconds: float | None = None,
        retention: Policy | Sequence[Policy] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        compat: str = "warn",
        shard_size: int = layout.DEFAULT_SHARD_SIZE,
        incremental: bool = True,
        lease: bool = True,
        takeover: bool = False,
        lease_ttl: float = DEFAULT_TTL,
        signing_key: bytes | str | None = None,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.time,
        observer: SaveObserver | None = None,
    ) -> None:
        """Open the store at ``uri``; nothing is written until the first save.

        Retention (``keep_*``, ``best_*``, ``retention=`` policy objects: retention.py, and
        the README's "Retention, pins and garbage") runs after each save and on ``prune()``;
        its rules keep by union, and never delete ``latest``, a pinned step or a newer one.
        A bad rule raises ConfigError here, not at the first save.
        """
        self.retention = RetentionPolicy(
            keep_last,
            keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
            keep_every_seconds=keep_every_seconds,
            custom=as_policies(retention),
        )
        self.compat = check_mode(compat)
        check_ttl(lease_ttl)  # also without a lease: a typo should not wait for lease=True
        self.backend = backend if backend is not None else open_backend(uri, storage_options)
        self.uri = self.backend.uri
        self.clock = clock
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        key = key_bytes(signing_key) if signing_key is not None else signing_key_from_env()
        self.signer = Signer(key) if key is not None else None
        self._committer = Committer(
            self.backend, writer=self.writer, clock=clock, signer=self.signer
        )
        self._catalog, self._remover = self._committer.catalog, self._committer.remover
        self._lease = (
            WriterLease(
                self.backend,
                self.writer,
                ttl=lease_ttl,
                takeover=takeover,
                clock=clock,
                on_takeover=self._committer.stamp_latest,
            )
            if lease
            else None
        )
        self._maintenance = Maintenance(
            self._catalog, self._committer, self.retention, self.hold_lease
        )
        self._saver = StepWriter(
            self._maintenance, self._lease, self._env, clock, incremental, shard_size, observer
        )
        self._async = AsyncSaver(self._saver)
        if self._lease is not None:
            self._lease.release_when_collected(self)  # a dropped store lets the lease go
            if takeover:
                self._lease.hold()  # fence the old holder now, before this job loads anything
        self._environment: Environment | None = None
        # adoption records the world size its files' names say: no torch.distributed import
        self._adopter = Adopter(
            self._maintenance, lambda: self._environment or current_environment(), clock
        )
        self.last_loaded: CheckpointInfo | None = None
        """The step the last ``load`` returned (it may fall back past a corrupt latest)."""

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, retention={self.retention})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush the save in flight (raising its error), release the writer lease (so the
        next job writes without ``takeover``), then the backend."""
        try:
            self._async.close()
        finally:
            try:
                if self._lease is not None:
                    self._lease.release()
            finally:
                self.backend.close()

    @property
    def shard_size(self) -> int:
        """Tensor bytes per safetensors file; a state's files are written in parallel."""
        return self._saver.shard_size

    @property
    def incremental(self) -> bool:
        """Copy files unchanged since the latest step instead of uploading them again."""
        return self._saver.incremental

    @incremental.setter
    def incremental(self, value: bool) -> None:
        self._saver.incremental = value

    # -- writing -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Write ``state`` as ``step``, commit it, move ``latest``, apply retention.

        Waits for an async save in flight first (and raises its error if nobody heard of it).
        A step older than ``latest``'s is refused with StepBehindLatestError before anything
        is uploaded (a rerun that forgot to resume); ``allow_older=True`` commits it anyway,
        ``latest`` stays, and retention applies as usual (``keep_last`` may delete it at once).
        """
        return self._saver.save(step, state, metadata, allow_pickle, allow_older=allow_older)

    def save_async(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
        allow_older: bool = False,
        overlap: bool | Optimizer | Iterable[Optimizer] = False,
    ) -> SaveHandle[CheckpointInfo]:
        """Snapshot ``state`` and save it in the background; returns at once after the copy.

        One save is in flight at a time: this first waits for the previous one to commit, and
        raises its error if nobody heard of it. Tensors are copied into buffers reused across
        saves (pinned host memory for CUDA tensors), so training may change them right away.
        With ``overlap=optimizer`` (or a list), the copy of that optimizer's parameters and
        state runs in the background too, and its next ``step()`` waits for what is left;
        other tensors are copied here. ``overlap=True`` defers every tensor: call
        ``before_update()`` (or ``handle.snapshot_done()``) before changing any.
        A step older than ``latest``'s raises StepBehindLatestError here (as ``save``).
        At exit, a pending save is finished (announced on stderr); a Ctrl-C then abandons it.
        """
        return self._async.save_async(
            step, state, metadata, allow_pickle, allow_older=allow_older, overlap=overlap
        )

    def before_update(self) -> None:
        """Return once the tensors of an overlapped ``save_async`` may change (optimizer
        steps wait by themselves); copies what is left of the snapshot. Never raises."""
        self._async.before_update()

    def wait(self) -> None:
        """Wait for the async save in flight; raise its error if nobody heard of it."""
        self._saver.background.drain()

    def push_dir(
        self,
        step: int,
        local_dir: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        progress: Progress | None = None,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Commit every file under ``local_dir`` as ``step`` (a verl ``global_step_N`` dir);
        ``allow_older`` as in ``save``."""
        return self._saver.push_dir(step, Path(local_dir), metadata, progress, allow_older)

    def adopt(
        self,
        step: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Commit in place step directories already in the store that ckptstore did not
        write (a verl run uploaded with ``aws s3 sync``): ``step``'s, or with ``None`` every
        such directory, oldest first. Each file is read once to checksum it; nothing is
        copied, and ``latest`` only moves forward (older steps are adopted too). Run it on a
        quiescent directory: a file changed afterwards fails ``verify``. A committed step, or
        one without foreign files, is a ConflictError or NotFoundError (adoption.py)."""
        user_metadata = check_metadata(metadata)
        self._saver.background.drain()
        return self._adopter.adopt(step, user_metadata, progress)

    def adoptable(self, step: int | None = None) -> builtins.list[ForeignStep]:
        """What ``adopt(step)`` would commit, without reading or writing a byte of it."""
        return self._adopter.find(step)

    def previous(self, kind: str = KIND_DIRECTORY) -> Previous:
        """What a coordinator reads once for all its stagers: ``latest``'s step and (if the
        store is incremental and that step is of ``kind``) its files. Cut it per stager with
        ``Previous.only``/``among`` and pass each part to ``stage_files(previous=...)``."""
        return self._saver.previous_for(kind)

    def stage_files(
        self,
        step: int,
        files: Iterable[SourceFile],
        *,
        kind: str = KIND_DIRECTORY,
        progress: Progress | None = None,
        allow_older: bool = False,
        previous: Previous | None = None,
    ) -> builtins.list[FileEntry]:
        """Upload payload files of ``step`` without committing it; returns their entries.

        The building block of multi-process saves: every rank or node stages its own files
        (paths must not collide), then one process passes all entries to ``commit_files``.
        Files unchanged since the latest step (same path, size and checksum) are copied
        server-side instead of uploaded when the store is ``incremental``. Each call writes
        into an attempt directory of its own, so callers never collide on a key.
        A step older than ``latest``'s is refused before any upload unless ``allow_older``.
        ``previous``: ``latest``'s step and this process's entries of it, read once by a
        coordinator (``store.previous_for(kind).only(folder)``) so that stagers read neither
        the pointer nor the manifest; None reads them here.
        """
        return self._saver.stage(
            step, files, kind=kind, progress=progress, allow_older=allow_older, previous=previous
        )

    def commit_files(
        self,
        step: int,
        entries: Iterable[FileEntry],
        *,
        kind: str = KIND_DIRECTORY,
        metadata: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        started: float | None = None,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Commit staged files as ``step``: confirm them, write the manifest, move ``latest``,
        apply retention. On failure before the manifest is written nothing is committed.
        ``started``, a ``time.perf_counter()`` taken before staging, makes the returned
        stats count the staging too. A step older than ``latest``'s is refused (its staged
        files removed) unless ``allow_older``."""
        timing = (started, 0.0) if started is not None else None
        return self._saver.commit(
            step,
            entries,
            kind=kind,
            metadata=metadata or {},
            world_size=world_size,
            timing=timing,
            allow_older=allow_older,
        )

    def discard(self, step: int) -> None:
        """Remove every staged file of an uncommitted ``step`` (never a committed one's), for
        a coordinator whose ranks staged files it will not commit. A rival writer of the same
        step, if any, fails to commit with a clear error while this runs."""
        try:
            self._remover.abort_step(layout.check_step(step), keep_tombstone=False)
        except CheckpointError as e:
            log.warning("could not clean up uncommitted step %d (gc will): %s", step, e)

    def hold_lease(self) -> int:
        """Take or renew the writer lease (lease.py); the epoch, or 0 without leases."""
        return self._saver.hold_lease()

    def _env(self) -> Environment:
        if self._environment is None:
            self._environment = current_environment(world_size=world_size())
        return self._environment

    # -- reading -------------------------------------------------------------------------

    def info(self, step: int) -> CheckpointInfo:
        """The committed step's info; NotFoundError if it is not committed."""
        return self._catalog.info(step)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed step (the pointer's, unless a listing finds a newer one);
        ``None`` only when the store holds no committed step."""
        return self._catalog.latest()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every readable committed step, ascending. Broken manifests are logged, not listed."""
        return self._catalog.list()

    def reload(self) -> None:
        """Forget the manifests this object has read (catalog.py), so the next listing reads
        them again: after another process removed a step whose directory is still there."""
        self._catalog.forget_all()

    def wait_for_step(
        self,
        newer_than: int | None = None,
        *,
        timeout: float | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> CheckpointInfo:
        """Block until a step newer than ``newer_than`` (default: the latest now) is committed,
        and return the newest such; one listing per poll, the pause growing from ``interval``
        seconds (follow.py). WaitTimeoutError (a NotFoundError) after ``timeout`` seconds."""
        return wait_for_step(self, newer_than, timeout=timeout, interval=interval)

    def fenced_steps(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Committed steps (of ``infos``, default all) that a writer committed after it lost
        the writer lease: never returned by ``latest()``/``load()``; ``delete`` removes them."""
        return self._catalog.fenced_steps(infos)

    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[False] = False,
        keys: Sequence[str] | None = None,
    ) -> Any: ...

    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[True],
        keys: Sequence[str] | None = None,
    ) -> Loaded: ...

    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: bool = False,
        keys: Sequence[str] | None = None,
    ) -> Any:
        """The state saved as ``step`` (default: latest), every byte verified.

        With no ``step`` and ``fallback``, a latest step that fails verification is skipped
        with a warning for the newest older one that passes; never silently none at all.
        ``with_info=True`` returns :class:`~ckptstore.info.Loaded`, the state together with
        the info of the step it came from (``.step``, ``.metadata``): a separate ``latest()``
        call may name another step if a writer commits in between.
        ``keys=["model"]`` (dotted paths: ``"model.encoder"``) loads only those parts of a dict
        state, nested as saved, reading only the files that hold them.
        """

        def load(info: CheckpointInfo) -> Any:
            check_compat(info.manifest.environment, self._env(), mode=self.compat, where=info.uri)
            state = load_state(self._catalog, info, allow_pickle=allow_pickle, keys=keys)
            self.last_loaded = info
            return state

        info, state = self._catalog.resolve(step, fallback, load)
        return Loaded(state, info) if with_info else state

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of a committed step, size and CRC32C verified against its manifest,
        so each rank of a multi-rank load reads only its own files (distributed.py, DCP)."""
        return self._catalog.read_file(info, path)

    def pull_dir(
        self,
        local_dir: str | os.PathLike[str],
        step: int | None = None,
        *,
        fallback: bool = True,
        progress: Progress | None = None,
        force: bool = False,
        delete: bool = False,
        include: str | Sequence[str] = (),
        exclude: str | Sequence[str] = (),
    ) -> CheckpointInfo:
        """Download a committed step's files into ``local_dir``, every byte verified; returns
        the step's info. ``local_dir`` holds the whole step or does not exist: the files stream
        (in ranged chunks, about 64 MiB in memory at most) into a temporary directory beside
        it, renamed into place once all are verified.

        A non-empty ``local_dir`` is refused unless ``force`` (merge: the step's files
        overwrite same-named ones) or ``delete`` (exact copy, like ``aws s3 sync --delete``).
        ``include``/``exclude`` globs select files with the aws CLI's rules
        (:func:`~ckptstore.transfer.path_filter`); such a pull is partial. ``fallback`` as in
        ``load``.
        """
        target = Path(local_dir)
        check_target(target, force=force or delete)  # before any read

        def pull(info: CheckpointInfo) -> None:
            download_step(
                self._catalog,
                info,
                target,
                progress,
                force=force,
                delete=delete,
                include=include,
                exclude=exclude,
            )

        return self._catalog.resolve(step, fallback, pull)[0]

    # -- many steps at once (maintenance.py, garbage.py) -----------------------------------

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        return self._maintenance.verify(step)

    def verify_all(self) -> builtins.list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        return self._maintenance.verify_all()

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        self._maintenance.pin(step)

    def unpin(self, step: int) -> bool:
        """Remove a pin; returns False if the step was not pinned."""
        return self._maintenance.unpin(step)

    def pins(self) -> builtins.list[int]:
        """The pinned steps, ascending."""
        return self._maintenance.pins()

    def prune(self, dry_run: bool = False) -> builtins.list[int]:
        """Delete the committed steps the retention policy does not keep; returns them."""
        return self._maintenance.prune(dry_run)

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step; ``latest`` or a pinned one needs ``force``."""
        self._maintenance.delete(step, force)

    def copy_to(
        self,
        other: CheckpointStore,
        steps: Iterable[int] | None = None,
        *,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Replicate committed steps (default: all) into ``other``, verified."""
        return self._maintenance.copy_to(other._maintenance, steps, progress)

    def gc(self, dry_run: bool = False, *, older_than: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove uncommitted files, stray uploads and stale pins older than ``older_than`` s.

        NotFoundError, deleting nothing, if the URI holds no store (a mistyped URI, or files
        that another tool put there): gc removes only what a store's failed saves leave."""
        collector = GarbageCollector(
            self._catalog, self._remover, self.clock, dry_run=dry_run, older_than=older_than
        )
        return collector.run()
