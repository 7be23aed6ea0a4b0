"""CheckpointStore: the one object users hold.

It ties the pieces together: serialize a state (serialize.py), write and commit it (commit.py),
move ``latest``, then apply retention (retention.py). Reads verify every byte against the
manifest. It knows nothing of HTTP or file descriptors; backends do.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ckptstore import layout
from ckptstore.backends.base import Backend, join
from ckptstore.backends.registry import open_backend
from ckptstore.background import BackgroundSaver, SaveHandle
from ckptstore.commit import Committer, Progress, SourceFile, iter_file
from ckptstore.compat import check_compat, check_mode, current_environment
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.manifest import KIND_DIRECTORY, KIND_STATE, Environment, FileEntry, Manifest
from ckptstore.retention import RetentionPolicy, steps_to_delete
from ckptstore.serialize import DEFAULT_SHARD_SIZE, decode_state, encode_state
from ckptstore.snapshot import Snapshotter
from ckptstore.transfer import download_dir, scan_dir

log = logging.getLogger(__name__)
T = TypeVar("T")

GC_GRACE_SECONDS = 3600.0
"""gc leaves younger uncommitted objects alone: they may belong to a save in flight."""


@dataclass(frozen=True)
class SaveStats:
    """What one save cost: bytes written and reused, wall time, and time the caller waited."""

    step: int
    bytes_total: int
    bytes_reused: int
    """Bytes copied from the previous step instead of uploaded (incremental saves)."""
    seconds: float
    """From the first byte written to ``latest`` moved (retention not included)."""
    blocked_seconds: float
    """Time the caller was blocked by the snapshot (async saves; 0 for sync saves)."""

    @classmethod
    def of(cls, manifest: Manifest, seconds: float, blocked: float) -> SaveStats:
        reused = sum(f.size for f in manifest.files if f.copied_from is not None)
        return cls(manifest.step, manifest.size, reused, seconds, blocked)

    @property
    def bytes_uploaded(self) -> int:
        return self.bytes_total - self.bytes_reused

    @property
    def mb_per_s(self) -> float:
        return self.bytes_total / 1e6 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"committed step {self.step}: {self.bytes_total / 1e6:.1f} MB "
            f"({self.bytes_reused / 1e6:.1f} MB reused) in {self.seconds:.2f} s "
            f"({self.mb_per_s:.1f} MB/s), trainer blocked {self.blocked_seconds:.3f} s"
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed step: where it is and what its manifest says."""

    uri: str
    manifest: Manifest
    stats: SaveStats | None = field(default=None, compare=False)
    """Set on the info a save returns."""

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def time(self) -> float:
        return self.manifest.created

    @property
    def size(self) -> int:
        return self.manifest.size

    @property
    def files(self) -> tuple[FileEntry, ...]:
        return self.manifest.files

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.manifest.metadata


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found for one step; ``ok`` when ``problems`` is empty."""

    step: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``)."""

    deleted: tuple[str, ...]
    aborted_uploads: tuple[str, ...]


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
        shard_size: int = DEFAULT_SHARD_SIZE,
        incremental: bool = True,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention = RetentionPolicy(keep_last, keep_every)
        self.compat = check_mode(compat)
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ConfigError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
        self.shard_size = shard_size
        self.backend = backend if backend is not None else open_backend(uri, storage_options)
        self.uri = self.backend.uri
        self.clock = clock
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._committer = Committer(self.backend, writer=self.writer, clock=clock)
        self._environment: Environment | None = None
        self.incremental = incremental
        self.last_loaded: CheckpointInfo | None = None
        """The step the last ``load`` returned (it may fall back past a corrupt latest)."""
        self._background: BackgroundSaver[CheckpointInfo] = BackgroundSaver()
        self._snapshotter = Snapshotter()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, retention={self.retention})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush the save in flight (raising its error), then release the backend."""
        try:
            self._background.close()
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
        self._snapshotter.begin()
        encoded = encode_state(
            state,
            shard_size=self.shard_size,
            allow_pickle=allow_pickle,
            snapshot=self._snapshotter,
        )
        self._snapshotter.finish()
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
        if self.backend.stat(layout.manifest_path(step)) is not None:
            raise ConflictError(
                f"step {step} is already committed in {self.uri}; committed steps are "
                "immutable. Save under a new step, or `ckptstore rm` it first"
            )
        started = time.perf_counter()
        previous = self._previous_manifest(kind) if self.incremental else None
        try:
            entries = self._committer.write_payload(step, files, progress, previous=previous)
            self._committer.confirm_payload(step, entries)
            manifest = Manifest(
                step=step,
                created=self.clock(),
                kind=kind,
                files=tuple(entries),
                environment=self._env(),
                writer=self.writer,
                metadata=metadata,
            )
            self._committer.commit(manifest)
        except BaseException:
            self._discard_uncommitted(step)
            raise
        self._committer.advance_latest(step)
        stats = SaveStats.of(manifest, time.perf_counter() - started, blocked)
        log.info("%s: %s", self.uri, stats)
        self._retain_after_save()
        return self._info(manifest, stats)

    def _previous_manifest(self, kind: str) -> Manifest | None:
        """The latest step's manifest, whose unchanged files a save copies instead of uploading."""
        try:
            pointer, _ = self._committer.read_pointer()
            if pointer is None:
                return None
            manifest = self._committer.read_manifest(pointer.step)
        except (NotFoundError, CorruptCheckpointError, CompatibilityError) as e:
            log.debug("no previous step to reuse files from: %s", e)
            return None
        return manifest if manifest.kind == kind else None

    def _discard_uncommitted(self, step: int) -> None:
        """Best effort after a failed save: remove what it wrote, unless the step committed."""
        try:
            if self.backend.stat(layout.manifest_path(step)) is None:
                self._committer.delete_prefix(layout.step_dir(step) + "/")
        except CheckpointError as e:
            log.warning("could not clean up uncommitted step %d (gc will): %s", step, e)

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
        return self._info(self._committer.read_manifest(layout.check_step(step)))

    def _info(self, manifest: Manifest, stats: SaveStats | None = None) -> CheckpointInfo:
        return CheckpointInfo(join(self.uri, layout.step_dir(manifest.step)), manifest, stats)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed step by the ``latest`` pointer, or by listing if it is broken.

        ``None`` only when the store holds no committed step.
        """
        pointer = None
        try:
            pointer, _ = self._committer.read_pointer()
            if pointer is not None:
                return self.info(pointer.step)
        except (NotFoundError, CorruptCheckpointError) as e:
            log.warning("%s: latest pointer is unusable (%s); falling back to listing", self.uri, e)
        infos = self.list()
        if infos and pointer is None:
            log.warning(
                "%s: no %s, but committed steps exist; using the newest, %d",
                self.uri,
                layout.LATEST_NAME,
                infos[-1].step,
            )
        return infos[-1] if infos else None

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
                return self._committer.read_manifest(step)
            except NotFoundError:
                return None  # a directory without a manifest: not committed
            except (CorruptCheckpointError, CompatibilityError) as e:
                return e

        steps = self._committer.step_dirs()
        with ThreadPoolExecutor(16, thread_name_prefix="ckpt-scan") as pool:
            results = list(pool.map(read, steps))
        committed = [r for r in results if isinstance(r, Manifest)]
        broken = {
            s: r for s, r in zip(steps, results, strict=True) if isinstance(r, CheckpointError)
        }
        return committed, broken

    def load(
        self, step: int | None = None, *, fallback: bool = True, allow_pickle: bool = False
    ) -> Any:
        """The state saved as ``step`` (default: latest), every byte verified.

        With no ``step`` and ``fallback``, a latest step that fails verification is skipped
        with a warning for the newest older one that passes; never silently none at all.
        """
        info = self._resolve(step, fallback, lambda i: self._load(i, allow_pickle))
        return info[1]

    def _load(self, info: CheckpointInfo, allow_pickle: bool) -> Any:
        if info.manifest.kind != KIND_STATE:
            raise ConfigError(
                f"{info.uri} was pushed as a directory of files, not saved as a state; fetch "
                "it with pull_dir() (CLI: ckptstore pull)"
            )
        check_compat(info.manifest.environment, self._env(), mode=self.compat, where=info.uri)
        data = self._read_all(info)
        state = decode_state(data.__getitem__, where=info.uri, allow_pickle=allow_pickle)
        self.last_loaded = info
        return state

    def _read_all(self, info: CheckpointInfo) -> dict[str, bytearray]:
        def read(entry: FileEntry) -> bytearray:
            return self._committer.read_verified(info.step, entry)

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
            def read(entry: FileEntry) -> bytearray:
                data = self._committer.read_verified(info.step, entry)
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
            older = (i for i in reversed(self.list()) if i.step < latest.step)
            candidates = _chain([latest], older)
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

    # -- verifying -----------------------------------------------------------------------

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest."""
        if step is None:
            latest = self.latest()
            if latest is None:
                raise NotFoundError(f"{self.uri} holds no committed step to verify")
            step = latest.step
        step = layout.check_step(step)
        try:
            info = self.info(step)
        except CorruptCheckpointError as e:
            return VerifyReport(step, (str(e),))
        problems = []
        for entry in info.files:
            try:
                self._committer.read_verified(step, entry)
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                problems.append(str(e))
        return VerifyReport(step, tuple(problems))

    def verify_all(self) -> builtins.list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        committed, broken = self._scan()
        reports = [self.verify(m.step) for m in committed]
        reports += [VerifyReport(step, (str(e),)) for step, e in broken.items()]
        return sorted(reports, key=lambda r: r.step)

    # -- managing ------------------------------------------------------------------------

    def pin(self, step: int) -> None:
        """Protect a committed step from retention until ``unpin``."""
        info = self.info(step)
        self.backend.write(layout.pin_path(info.step), [b"pinned\n"])

    def unpin(self, step: int) -> bool:
        """Remove a pin; returns False if the step was not pinned."""
        step = layout.check_step(step)
        if self.backend.stat(layout.pin_path(step)) is None:
            return False
        self.backend.delete([layout.pin_path(step)])
        return True

    def pins(self) -> builtins.list[int]:
        names = (o.path.rsplit("/", 1)[-1] for o in self.backend.list(layout.PINS_DIR + "/"))
        return sorted(s for s in map(layout.parse_step_dir, names) if s is not None)

    def prune(self, dry_run: bool = False) -> builtins.list[int]:
        """Delete the committed steps the retention policy does not keep; returns them."""
        if not self.retention.enabled:
            raise ConfigError(
                f"{self.uri}: no retention policy to prune by; open the store with keep_last "
                "and/or keep_every (CLI: --keep-last N --keep-every K)"
            )
        pointer, _ = self._committer.read_pointer()
        committed = [i.step for i in self.list()]
        latest = pointer.step if pointer is not None and pointer.step in committed else None
        doomed = steps_to_delete(self.retention, committed, latest=latest, pinned=self.pins())
        if not dry_run:
            for step in doomed:
                self._committer.uncommit(step)
                log.info("retention deleted step %d from %s", step, self.uri)
        return doomed

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step. ``latest`` or a pinned step needs ``force``.

        Deleting the latest step with ``force`` moves ``latest`` back to the newest step left.
        """
        info = self.info(step)
        pointer, _ = self._committer.read_pointer()
        is_latest = pointer is not None and pointer.step == info.step
        if not force and (is_latest or info.step in self.pins()):
            what = "the latest step" if is_latest else "pinned"
            raise ConflictError(
                f"step {info.step} in {self.uri} is {what}; unpin it first or pass force=True "
                "(CLI: --force)"
            )
        self._committer.uncommit(info.step)
        self.backend.delete([layout.pin_path(info.step)])
        if is_latest:
            remaining = [i.step for i in self.list() if i.step < info.step]
            if remaining:
                self._committer.advance_latest(remaining[-1], rollback=True)
            else:
                self.backend.delete([layout.LATEST_NAME])

    def copy_to(
        self,
        other: CheckpointStore,
        steps: Iterable[int] | None = None,
        *,
        progress: Progress | None = None,
    ) -> builtins.list[CheckpointInfo]:
        """Replicate committed steps (default: all) into ``other``, verified, same manifests.

        Steps ``other`` already holds with identical files are skipped. ``other``'s ``latest``
        moves forward to the newest copied step, then ``other``'s retention applies.
        """
        chosen = self.list() if steps is None else [self.info(s) for s in steps]
        copied = []
        for info in chosen:
            try:
                existing = other.info(info.step)
            except NotFoundError:
                existing = None
            if existing is not None:
                if existing.files != info.files:
                    raise ConflictError(
                        f"step {info.step} exists in {other.uri} with other contents; remove it "
                        "there first (ckptstore rm) or copy other steps"
                    )
                continue
            files = [
                SourceFile(e.path, _verified_reader(self._committer, info.step, e))
                for e in info.files
            ]
            try:
                entries = other._committer.write_payload(info.step, files, progress)
                other._committer.confirm_payload(info.step, entries)
                other._committer.commit(info.manifest)
            except BaseException:
                other._discard_uncommitted(info.step)
                raise
            copied.append(other._info(info.manifest))
        if copied:
            other._committer.advance_latest(max(i.step for i in copied))
            other._retain_after_save()
        return copied

    def gc(self, dry_run: bool = False, *, older_than: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove garbage: uncommitted step files, unlisted files, stray uploads, stale pins.

        Only objects older than ``older_than`` seconds are touched, so a save in flight in
        another process keeps its files. Steps with unreadable manifests are left alone.
        """
        cutoff = self.clock() - older_than
        committed, broken = self._scan()
        manifests = {m.step: m for m in committed}
        doomed: builtins.list[str] = []
        for step in self._committer.step_dirs():
            if step in broken:
                continue
            objects = list(self.backend.list(layout.step_dir(step) + "/"))
            if step in manifests:
                listed = {layout.payload_path(step, f.path) for f in manifests[step].files}
                listed.add(layout.manifest_path(step))
                doomed += [
                    o.path for o in objects if o.path not in listed and _old(o.mtime, cutoff)
                ]
            elif all(_old(o.mtime, cutoff) for o in objects):
                doomed += [o.path for o in objects]
        for pin in self.backend.list(layout.PINS_DIR + "/"):
            pinned = layout.parse_step_dir(pin.path.rsplit("/", 1)[-1])
            if pinned not in manifests and pinned not in broken and _old(pin.mtime, cutoff):
                doomed.append(pin.path)
        partial = [p for p in self.backend.partial_writes("") if _old(p.started, cutoff)]
        if not dry_run:
            self.backend.delete(doomed)
            for upload in partial:
                self.backend.abort(upload)
        return GcReport(tuple(doomed), tuple(p.path for p in partial))


def _old(mtime: float | None, cutoff: float) -> bool:
    return mtime is None or mtime <= cutoff


def _chain(first: Iterable[T], rest: Iterable[T]) -> Iterator[T]:
    yield from first
    yield from rest


def _file_reader(path: Path) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from iter_file(f.read)

    return chunks


def _verified_reader(
    committer: Committer, step: int, entry: FileEntry
) -> Callable[[], list[bytes]]:
    return lambda: [bytes(committer.read_verified(step, entry))]


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
