"""CheckpointStore: the one object users hold.

It ties the pieces together: serialize a state (serialize.py), write and commit it (commit.py),
move ``latest``, then apply retention (retention.py). Reads verify every byte against the
manifest. It knows nothing of HTTP or file descriptors; backends do.
"""

from __future__ import annotations

import builtins
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from ckptstore import housekeeping, layout
from ckptstore.backends.base import Backend, join
from ckptstore.backends.registry import open_backend
from ckptstore.background import BackgroundSaver, SaveHandle
from ckptstore.catalog import Catalog
from ckptstore.commit import Committer, Progress, SourceFile, iter_file
from ckptstore.compat import check_compat, check_mode, current_environment
from ckptstore.config import key_bytes, signing_key_from_env
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo, GcReport, Loaded, SaveStats, VerifyReport
from ckptstore.lease import DEFAULT_TTL, WriterLease, check_ttl
from ckptstore.manifest import KIND_DIRECTORY, KIND_STATE, Environment, FileEntry, Manifest
from ckptstore.metrics import SaveObserver
from ckptstore.pointer import Pointer
from ckptstore.retention import RetentionPolicy
from ckptstore.signing import Signer
from ckptstore.transfer import download_dir, scan_dir

if TYPE_CHECKING:  # torch loads lazily: the CLI's listing commands start in a blink
    from ckptstore.snapshot import Snapshotter

log = logging.getLogger(__name__)
T = TypeVar("T")

GC_GRACE_SECONDS = 3600.0
"""gc leaves younger uncommitted objects alone: they may belong to a save in flight."""


class CheckpointStore:
    """Atomic, verified checkpoints under one URI (local path, NFS, ``s3://``, fsspec URL)."""

    def __init__(
        self,
        uri: str,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
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
        self.retention = RetentionPolicy(keep_last, keep_every)
        self.compat = check_mode(compat)
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ConfigError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
        self.shard_size = shard_size
        self.backend = backend if backend is not None else open_backend(uri, storage_options)
        self.uri = self.backend.uri
        self.clock = clock
        self.observer = observer
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        key = key_bytes(signing_key) if signing_key is not None else signing_key_from_env()
        self.signer = Signer(key) if key is not None else None
        self._catalog = Catalog(self.backend, signer=self.signer)
        self._committer = Committer(
            self.backend, writer=self.writer, clock=clock, signer=self.signer, catalog=self._catalog
        )
        check_ttl(lease_ttl)  # also without a lease: a typo should not wait for lease=True
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
        if self._lease is not None:
            self._lease.release_when_collected(self)  # a dropped store lets the lease go
            if takeover:
                self._lease.hold()  # fence the old holder now, before this job loads anything
        self._environment: Environment | None = None
        self.incremental = incremental
        self.last_loaded: CheckpointInfo | None = None
        """The step the last ``load`` returned (it may fall back past a corrupt latest)."""
        self._background: BackgroundSaver[CheckpointInfo] = BackgroundSaver()
        self._snapshotter: Snapshotter | None = None

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
            self._background.close()
        finally:
            try:
                if self._lease is not None:
                    self._lease.release()
            finally:
                self.backend.close()

    # -- writing -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
    ) -> CheckpointInfo:
        """Write ``state`` as ``step``, commit it, move ``latest``, apply retention.

        Waits for an async save in flight first (and raises its error if nobody heard of it).
        """
        step = layout.check_step(step)
        user_metadata = _check_metadata(metadata)
        self._background.drain()
        from ckptstore.serialize import encode_state

        encoded = encode_state(state, shard_size=self.shard_size, allow_pickle=allow_pickle)
        files = [SourceFile(f.path, f.chunks, f.size) for f in encoded.files()]
        return self._write_step(step, files, KIND_STATE, user_metadata)

    def save_async(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
    ) -> SaveHandle[CheckpointInfo]:
        """Snapshot ``state`` and save it in the background; returns at once after the copy.

        One save is in flight at a time: this first waits for the previous one to commit, and
        raises its error if nobody heard of it. Tensors are copied into buffers reused across
        saves (pinned host memory for CUDA tensors), so training may change them right away.
        """
        step = layout.check_step(step)
        user_metadata = _check_metadata(metadata)
        self._background.drain()
        started = time.perf_counter()
        from ckptstore.serialize import encode_state
        from ckptstore.snapshot import Snapshotter

        snapshotter = self._snapshotter = self._snapshotter or Snapshotter()
        snapshotter.begin()
        encoded = encode_state(
            state, shard_size=self.shard_size, allow_pickle=allow_pickle, snapshot=snapshotter
        )
        snapshotter.finish()
        blocked = time.perf_counter() - started
        files = [SourceFile(f.path, f.chunks, f.size) for f in encoded.files()]

        def work() -> CheckpointInfo:
            return self._write_step(step, files, KIND_STATE, user_metadata, blocked=blocked)

        return self._background.submit(step, work, blocked)

    def wait(self) -> None:
        """Wait for the async save in flight; raise its error if nobody heard of it."""
        self._background.drain()

    def push_dir(
        self,
        step: int,
        local_dir: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        progress: Progress | None = None,
    ) -> CheckpointInfo:
        """Commit every file under ``local_dir`` as ``step`` (a verl ``global_step_N`` dir)."""
        step = layout.check_step(step)
        user_metadata = _check_metadata(metadata)
        self._background.drain()
        files = [
            SourceFile(rel, _file_reader(path), path.stat().st_size)
            for rel, path in scan_dir(Path(local_dir))
        ]
        return self._write_step(step, files, KIND_DIRECTORY, user_metadata, progress=progress)

    def _write_step(
        self,
        step: int,
        files: builtins.list[SourceFile],
        kind: str,
        metadata: dict[str, Any],
        *,
        progress: Progress | None = None,
        blocked: float = 0.0,
    ) -> CheckpointInfo:
        started = time.perf_counter()
        try:
            self.hold_lease()  # fail before uploading anything if another writer holds the store
            entries = self.stage_files(step, files, kind=kind, progress=progress)
            return self.commit_files(
                step, entries, kind=kind, metadata=metadata, _timing=(started, blocked)
            )
        except BaseException as e:
            error = e  # bound for the lambda: ruff cannot see that it runs inside this block
            self._observe(lambda o: o.failed(self.uri, step, error))
            raise

    # -- staging: write from many processes, commit from one -------------------------------

    def stage_files(
        self,
        step: int,
        files: Iterable[SourceFile],
        *,
        kind: str = KIND_DIRECTORY,
        progress: Progress | None = None,
    ) -> builtins.list[FileEntry]:
        """Upload payload files of ``step`` without committing it; returns their entries.

        The building block of multi-process saves: every rank or node stages its own files
        (paths must not collide), then one process passes all entries to ``commit_files``.
        Files unchanged since the latest step (same path, size and checksum) are copied
        server-side instead of uploaded when the store is ``incremental``. Each call writes
        into an attempt directory of its own, so callers never collide on a key.
        """
        step = layout.check_step(step)
        self._check_step_is_free(step)
        previous = self._previous_manifest(kind) if self.incremental else None
        epoch = self._lease.epoch or 0 if self._lease is not None else 0
        return self._committer.write_payload(step, files, progress, previous=previous, epoch=epoch)

    def _check_step_is_free(self, step: int) -> None:
        """Refuse a committed step before uploading anything; remove a step that a writer
        fenced off by a lease takeover committed (pointer.py), since it is never loaded."""
        if self.backend.stat(layout.manifest_path(step)) is None:
            return
        try:
            manifest = self._catalog.read_manifest(step)
        except NotFoundError:
            return  # a tombstone: the step was removed, and may be saved anew (commit.py)
        except (CorruptCheckpointError, CompatibilityError):
            manifest = None
        pointer = self._pointer_or_none()
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
            self._committer.uncommit(step)
            return
        raise ConflictError(
            f"step {step} is already committed in {self.uri}; committed steps are "
            "immutable. Save under a new step, or `ckptstore rm` it first"
        )

    def commit_files(
        self,
        step: int,
        entries: Iterable[FileEntry],
        *,
        kind: str = KIND_DIRECTORY,
        metadata: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        _timing: tuple[float, float] | None = None,
    ) -> CheckpointInfo:
        """Commit staged files as ``step``: confirm them, write the manifest, move ``latest``,
        apply retention. On failure before the manifest is written nothing is committed."""
        started, blocked = _timing or (time.perf_counter(), 0.0)
        step = layout.check_step(step)
        entries = tuple(entries)
        environment = self._env()
        if world_size is not None:
            environment = replace(environment, world_size=world_size)
        try:
            self._committer.confirm_payload(step, entries)
            epoch = self.hold_lease()  # renewing is the fence check: right before the commit
            manifest = Manifest(
                step=step,
                created=self.clock(),
                kind=kind,
                files=entries,
                environment=environment,
                writer=self.writer,
                metadata=_check_metadata(metadata),
                lease_epoch=epoch,
            )
            manifest = self._committer.commit(manifest)
        except BaseException:
            self._committer.discard_attempts(step, {e.attempt for e in entries if e.attempt})
            raise
        self._committer.advance_latest(step, epoch=epoch)
        stats = SaveStats.of(manifest, time.perf_counter() - started, blocked)
        log.info("%s: %s", self.uri, stats)
        self._observe(lambda o: o.saved(self.uri, stats))
        self._retain_after_save()
        return self._info(manifest, stats)

    def _observe(self, tell: Callable[[SaveObserver], None]) -> None:
        """Tell the observer; its own failure is logged, never raised into the save."""
        if self.observer is None:
            return
        try:
            tell(self.observer)
        except Exception as e:
            log.warning("%s: the save observer raised %r; ignored", self.uri, e)

    def discard(self, step: int) -> None:
        """Remove every staged file of an uncommitted ``step`` (never a committed one's), for
        a coordinator whose ranks staged files it will not commit. A rival writer of the same
        step, if any, fails to commit with a clear error while this runs."""
        try:
            self._committer.abort_step(layout.check_step(step), keep_tombstone=False)
        except CheckpointError as e:
            log.warning("could not clean up uncommitted step %d (gc will): %s", step, e)

    def hold_lease(self) -> int:
        """Take or renew the writer lease (lease.py); the epoch, or 0 without leases."""
        return self._lease.hold() if self._lease is not None else 0

    def _previous_manifest(self, kind: str) -> Manifest | None:
        """The latest step's manifest, whose unchanged files a save copies instead of uploading."""
        try:
            pointer, _ = self._catalog.read_pointer()
            if pointer is None or pointer.step is None:
                return None
            manifest = self._catalog.read_manifest(pointer.step)
        except (NotFoundError, CorruptCheckpointError, CompatibilityError) as e:
            log.debug("no previous step to reuse files from: %s", e)
            return None
        return manifest if manifest.kind == kind else None

    def _retain_after_save(self) -> None:
        if not self.retention.enabled:
            return
        try:
            self.prune()
        except CheckpointError as e:  # the save itself is committed: report, don't undo it
            log.error("retention after save failed (committed steps are intact): %s", e)

    def _env(self) -> Environment:
        if self._environment is None:
            self._environment = current_environment(world_size=_world_size())
        return self._environment

    # -- reading -------------------------------------------------------------------------

    def info(self, step: int) -> CheckpointInfo:
        """The committed step's info; NotFoundError if it is not committed."""
        return self._info(self._catalog.read_manifest(layout.check_step(step)))

    def _info(self, manifest: Manifest, stats: SaveStats | None = None) -> CheckpointInfo:
        return CheckpointInfo(join(self.uri, layout.step_dir(manifest.step)), manifest, stats)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed step: the ``latest`` pointer's, unless one listing of step
        directories finds a newer committed step (the pointer is stale) or the pointer is
        broken (then by listing every step).

        ``None`` only when the store holds no committed step.
        """
        pointer = None
        try:
            pointer, _ = self._catalog.read_pointer()
            if pointer is not None and pointer.step is not None:
                newer = self._committed_after(pointer)
                return newer or self.info(pointer.step)
        except (NotFoundError, CorruptCheckpointError) as e:
            log.warning("%s: latest pointer is unusable (%s); falling back to listing", self.uri, e)
        infos = [i for i in self.list() if not _fenced(pointer, i)]
        if infos and pointer is None:
            log.warning(
                "%s: no %s, but committed steps exist; using the newest, %d",
                self.uri,
                layout.LATEST_NAME,
                infos[-1].step,
            )
        return infos[-1] if infos else None

    def _committed_after(self, pointer: Pointer) -> CheckpointInfo | None:
        """The newest committed step past a stale pointer's, if any (one listing).

        A writer killed between its commit and moving ``latest`` leaves one; resuming from the
        pointer would then save that step again and fail. Manifests are the truth, except a
        step that a writer committed after it lost the lease (pointer.py): never latest.
        """
        step = pointer.step if pointer.step is not None else -1
        for newer in reversed([s for s in self._catalog.step_dirs() if s > step]):
            try:
                info = self.info(newer)
            except NotFoundError:
                continue  # a save in flight, or garbage for gc
            except (CorruptCheckpointError, CompatibilityError) as e:
                log.warning("step %d has an unreadable manifest: %s", newer, e)
                continue
            if _fenced(pointer, info):
                log.warning(
                    "%s: step %d was committed by %s after it lost the writer lease (epoch "
                    "%d); ignoring it (ckptstore rm removes it)",
                    self.uri,
                    newer,
                    info.manifest.writer,
                    info.manifest.lease_epoch,
                )
                continue
            log.warning(
                "%s: %s is at step %d, but step %d is committed (its writer stopped before "
                "moving the pointer); using %d",
                self.uri,
                layout.LATEST_NAME,
                step,
                newer,
                newer,
            )
            return info
        return None

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every readable committed step, ascending. Broken manifests are logged, not listed."""
        committed, broken = self._scan()
        for step, error in broken.items():
            log.warning("step %d has an unreadable manifest: %s", step, error)
        return [self._info(m) for m in committed]

    def _scan(self) -> tuple[builtins.list[Manifest], dict[int, CheckpointError]]:
        """Manifests of committed steps, and the steps whose manifest cannot be read."""

        def read(step: int) -> Manifest | CheckpointError | None:
            try:
                return self._catalog.read_manifest(step)
            except NotFoundError:
                return None  # a directory without a manifest: not committed
            except (CorruptCheckpointError, CompatibilityError) as e:
                return e

        steps = self._catalog.step_dirs()
        with ThreadPoolExecutor(16, thread_name_prefix="ckpt-scan") as pool:
            results = list(pool.map(read, steps))
        committed = [r for r in results if isinstance(r, Manifest)]
        broken = {
            s: r for s, r in zip(steps, results, strict=True) if isinstance(r, CheckpointError)
        }
        return committed, broken

    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[False] = False,
    ) -> Any: ...

    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[True],
    ) -> Loaded: ...

    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: bool = False,
    ) -> Any:
        """The state saved as ``step`` (default: latest), every byte verified.

        With no ``step`` and ``fallback``, a latest step that fails verification is skipped
        with a warning for the newest older one that passes; never silently none at all.
        ``with_info=True`` returns :class:`~ckptstore.info.Loaded`, the state together with
        the info of the step it came from (``.step``, ``.metadata``): a separate ``latest()``
        call may name another step if a writer commits in between.
        """
        info, state = self._resolve(step, fallback, lambda i: self._load(i, allow_pickle))
        return Loaded(state, info) if with_info else state

    def _load(self, info: CheckpointInfo, allow_pickle: bool) -> Any:
        if info.manifest.kind != KIND_STATE:
            raise ConfigError(
                f"{info.uri} was pushed as a directory of files, not saved as a state; fetch "
                "it with pull_dir() (CLI: ckptstore pull)"
            )
        check_compat(info.manifest.environment, self._env(), mode=self.compat, where=info.uri)
        from ckptstore.serialize import SKELETON_FILE, decode_state

        paths = {f.path for f in info.files}
        if SKELETON_FILE not in paths and any(p.endswith("/" + SKELETON_FILE) for p in paths):
            raise ConfigError(
                f"{info.uri} holds one state per rank (saved by save_distributed); load it on "
                "every rank with ckptstore.distributed.load_distributed"
            )
        data = self._read_all(info)
        state = decode_state(data.__getitem__, where=info.uri, allow_pickle=allow_pickle)
        self.last_loaded = info
        return state

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of a committed step, size and CRC32C verified against its manifest,
        so each rank of a multi-rank load reads only its own files (distributed.py, DCP)."""
        try:
            entry = info.manifest.file(path)
        except KeyError as e:
            raise NotFoundError(f"{info.uri} has no file {path!r} in its manifest") from e
        return self._catalog.read_verified(info.step, entry)

    def _read_all(self, info: CheckpointInfo) -> dict[str, memoryview]:
        sizes = self._catalog.payload_sizes(info.step)  # one listing checks every size

        def read(entry: FileEntry) -> memoryview:
            return self._catalog.read_verified(
                info.step, entry, actual_size=sizes.get(entry.key(info.step), -1)
            )

        with ThreadPoolExecutor(8, thread_name_prefix="ckpt-read") as pool:
            return dict(zip((f.path for f in info.files), pool.map(read, info.files), strict=True))

    def pull_dir(
        self,
        local_dir: str | os.PathLike[str],
        step: int | None = None,
        *,
        fallback: bool = True,
        progress: Progress | None = None,
    ) -> CheckpointInfo:
        """Download a committed step's files into ``local_dir``, verified; returns its info."""
        target = Path(local_dir)

        def pull(info: CheckpointInfo) -> None:
            def read(entry: FileEntry) -> memoryview:
                data = self._catalog.read_verified(info.step, entry)
                if progress:
                    progress(entry.size)
                return data

            download_dir(info.files, target, read)

        return self._resolve(step, fallback, pull)[0]

    def _resolve(
        self, step: int | None, fallback: bool, action: Callable[[CheckpointInfo], T]
    ) -> tuple[CheckpointInfo, T]:
        """Run ``action`` on ``step``, or on latest, falling back to older good steps."""
        if step is not None:
            info = self.info(step)
            return info, action(info)
        latest = self.latest()
        if latest is None:
            raise NotFoundError(
                f"{self.uri} holds no committed step: nothing to resume from. Check the URI "
                "(and endpoint), or save a step first"
            )
        candidates: Iterator[CheckpointInfo] = iter([latest])
        if fallback:
            pointer = self._pointer_or_none()
            older = (
                i for i in reversed(self.list()) if i.step < latest.step and not _fenced(pointer, i)
            )
            candidates = itertools.chain([latest], older)
        failures: builtins.list[str] = []
        for info in candidates:
            try:
                return info, action(info)
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                if not fallback:
                    raise
                log.warning("step %d failed verification (%s); trying an older step", info.step, e)
                failures.append(f"step {info.step}: {e}")
        raise CorruptCheckpointError(
            f"{self.uri}: no committed step passed verification:\n  " + "\n  ".join(failures)
        )

    def fenced_steps(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Committed steps (of ``infos``, default all) that a writer committed after it lost
        the writer lease: never returned by ``latest()``/``load()``; ``delete`` removes them."""
        pointer = self._pointer_or_none()
        return [i.step for i in (self.list() if infos is None else infos) if _fenced(pointer, i)]

    def _pointer_or_none(self) -> Pointer | None:
        try:
            return self._catalog.read_pointer()[0]
        except CorruptCheckpointError:
            return None

    # -- housekeeping (see housekeeping.py) -------------------------------------------------

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        return housekeeping.verify(self, step)

    def verify_all(self) -> builtins.list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        return housekeeping.verify_all(self)

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        housekeeping.pin(self, step)

    def unpin(self, step: int) -> bool:
        """Remove a pin; returns False if the step was not pinned."""
        return housekeeping.unpin(self, step)

    def pins(self) -> builtins.list[int]:
        """The pinned steps, ascending."""
        return housekeeping.pins(self)

    def prune(self, dry_run: bool = False) -> builtins.list[int]:
        """Delete the committed steps the retention policy does not keep; returns them."""
        return housekeeping.prune(self, dry_run)

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step; ``latest`` or a pinned one needs ``force``."""
        housekeeping.delete(self, step, force)

    def copy_to(
        self,
        other: CheckpointStore,
        steps: Iterable[int] | None = None,
        *,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Replicate committed steps (default: all) into ``other``, verified."""
        return housekeeping.copy_to(self, other, steps, progress)

    def gc(self, dry_run: bool = False, *, older_than: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove uncommitted files, stray uploads and stale pins older than ``older_than`` s."""
        return housekeeping.gc(self, dry_run, older_than)


def _fenced(pointer: Pointer | None, info: CheckpointInfo) -> bool:
    """Whether ``info`` was committed by a writer that had lost the lease (pointer.py)."""
    return pointer is not None and pointer.fenced(info.step, info.manifest.lease_epoch)


def _file_reader(path: Path) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from iter_file(f.read)

    return chunks


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"metadata must hold only JSON values (str, numbers, bools, None, lists, dicts "
            f"with str keys): {e}; convert tensors with .item()"
        ) from e


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except (ImportError, RuntimeError):
        return 1
