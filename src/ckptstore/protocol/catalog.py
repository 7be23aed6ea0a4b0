"""The read side of a store: the pointer, the step listing, manifests and payload bytes.

Manifests are the truth and ``latest`` is a fast path (commit.py); which step a load starts
from is resolver.py's. Everything here only reads,
and everything it returns has been checked: manifests strictly decoded (and their signature
checked, in a signed store), payload bytes against their entries (verified.py).

Listing reads the step index (step_index.py), a few objects however many steps there are,
and checks each step the index holds a claim on (a save or a removal in flight, or one killed
half-way) against its manifest, repairing the index with what it found (index_check.py);
where the index is missing, incomplete or unreadable it reads every manifest and rebuilds it.
A listed step's manifest is read when first asked for (``CheckpointInfo.manifest``).

A committed manifest never changes, so the catalog keeps every manifest it has decoded, by
step. An entry is dropped when its step directory disappears from a listing or this process
removes the step. Reads that act on one step (``info``, ``load``, ``verify``) always fetch its
manifest afresh.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ckptstore.backends.base import Backend, join
from ckptstore.data.verified import payload_sizes, read_verified
from ckptstore.deadline import map_in_context
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo, SaveStats
from ckptstore.domain.manifest import FileEntry, Manifest, is_tombstone
from ckptstore.domain.signing import Signer
from ckptstore.domain.step_index import SEGMENT_SIZE, Summary, manifest_digest
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    CompatibilityError,
    ConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.protocol.index_check import check_claims, rebuild, repair
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.step_index import Snapshot, StepIndex
from ckptstore.protocol.step_state import StepState
from ckptstore.retry import Backoff, Retry

log = logging.getLogger(__name__)
T = TypeVar("T")

TORN_READ = Retry(Backoff(base=0.02, cap=1.0, jitter=0.0), attempts=4)
"""Small control objects are re-read after an undecodable read, 20, 40 and 80 ms later: some
S3-compatible servers let a reader see a PUT in progress. (No rival to step aside for: no
jitter.)"""
SCAN_THREADS = 16
"""Manifests fetched at once by a listing: each is one small GET, so latency, not bandwidth,
bounds them."""


class Catalog:
    """Reads one backend's steps, manifests and pointer; remembers the manifests it read."""

    def __init__(
        self,
        backend: Backend,
        *,
        signer: Signer | None = None,
        sleep: Callable[[float], None] = time.sleep,
        segment_size: int = SEGMENT_SIZE,
    ) -> None:
        self.backend = backend
        self.signer = signer
        self.sleep = sleep
        self._manifests: dict[int, Manifest] = {}
        self._lock = threading.Lock()
        self.half_removed: set[int] = set()
        """Steps the index claims are being removed whose tombstone a reader found: a prune
        finishes their removal (pruning.py)."""
        self.index = StepIndex(backend, sleep=sleep, segment_size=segment_size)

    def uri(self, path: str) -> str:
        return join(self.backend.uri, path) if path else self.backend.uri

    # -- manifests -----------------------------------------------------------------------

    def read_manifest(self, step: int) -> Manifest:
        """The step's manifest, fetched now; NotFoundError if the step is not committed."""
        path = layout.manifest_path(step)
        try:
            data = self.backend.read(path)
        except NotFoundError as e:
            self.forget(step)
            raise NotFoundError(
                f"step {step} is not committed in {self.backend.uri} (no {path})",
                uri=self.uri(path),
                step=step,
                path=path,
            ) from e
        return self._decode(step, data)

    def _decode(self, step: int, data: bytes) -> Manifest:
        """Decode, check the signature and the step, remember; NotFoundError for a tombstone."""
        where = self.uri(layout.manifest_path(step))
        if is_tombstone(data):
            self.forget(step)
        manifest = Manifest.decode(data, where=where)
        if self.signer is not None:
            self.signer.check(manifest, where)
        if manifest.step != step:
            raise CorruptCheckpointError(
                f"{where}: manifest says step {manifest.step}, expected {step}",
                uri=where,
                step=step,
                path=layout.manifest_path(step),
            )
        self.remember(manifest)
        return manifest

    def manifest(self, step: int) -> Manifest:
        """The step's manifest, from memory when this catalog has read it before."""
        with self._lock:
            known = self._manifests.get(step)
        return known if known is not None else self.read_manifest(step)

    def remember(self, manifest: Manifest) -> None:
        with self._lock:
            self._manifests[manifest.step] = manifest

    def forget(self, step: int) -> None:
        with self._lock:
            self._manifests.pop(step, None)

    def forget_all(self) -> None:
        with self._lock:
            self._manifests.clear()

    def state_of(self, step: int, *, fresh: bool = False) -> StepState:
        """Whether the step is committed, and readable (from memory when known, unless
        ``fresh``). Callers decide what an unreadable manifest means for them: a pointer is
        never moved back past one, retention never deletes one, a save is not refused
        because of one."""
        with self._lock:
            if not fresh and step in self._manifests:
                return StepState.COMMITTED
        try:
            data = self.backend.read(layout.manifest_path(step))
        except NotFoundError:
            self.forget(step)
            return StepState.ABSENT
        if is_tombstone(data):
            self.forget(step)
            return StepState.REMOVING
        try:
            self._decode(step, data)
        except (CorruptCheckpointError, CompatibilityError) as e:
            log.warning("step %d has an unreadable manifest: %s", step, e)
            return StepState.UNREADABLE
        return StepState.COMMITTED

    def is_committed(self, step: int, *, fresh: bool = False) -> bool:
        """Whether the step has a readable manifest (:meth:`state_of`)."""
        return self.state_of(step, fresh=fresh) is StepState.COMMITTED

    def info(self, step: int) -> CheckpointInfo:
        """The committed step's info, its manifest fetched now; NotFoundError if uncommitted."""
        return self.info_of(self.read_manifest(layout.check_step(step)))

    def info_of(self, manifest: Manifest, stats: SaveStats | None = None) -> CheckpointInfo:
        return CheckpointInfo.of(self.uri(layout.step_dir(manifest.step)), manifest, stats)

    def info_of_summary(self, summary: Summary) -> CheckpointInfo:
        """An info from the index: its manifest is read (and checked against the summary)
        only when asked for."""
        uri = self.uri(layout.step_dir(summary.step))
        return CheckpointInfo(uri, summary, source=lambda: self._indexed_manifest(summary))

    def _indexed_manifest(self, summary: Summary) -> Manifest:
        manifest = self.manifest(summary.step)
        if manifest_digest(manifest) != summary.digest:
            log.warning(
                "%s: the step index's summary of step %d does not match its manifest; using "
                "the manifest (`ckptstore index --rebuild %s` repairs the index)",
                self.backend.uri,
                summary.step,
                self.backend.uri,
            )
        return manifest

    # -- listings ------------------------------------------------------------------------

    def step_dirs(self) -> builtins.list[int]:
        """Steps that have a directory in the store, committed or not, ascending (one LIST)."""
        found = (layout.parse_step_dir(name) for name in self.backend.list_dirs(""))
        steps = sorted(s for s in found if s is not None)
        present = set(steps)
        with self._lock:
            for gone in [s for s in self._manifests if s not in present]:
                del self._manifests[gone]
        return steps

    def scan(self) -> tuple[list[Manifest], dict[int, CheckpointError]]:
        """Manifests of committed steps, and the steps whose manifest cannot be read."""

        def read(step: int) -> Manifest | CheckpointError | None:
            try:
                return self.manifest(step)
            except NotFoundError:
                return None  # a directory without a manifest: not committed
            except (CorruptCheckpointError, CompatibilityError) as e:
                return e

        steps = self.step_dirs()
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="ckpt-scan") as pool:
            results = map_in_context(pool, read, steps)  # by the caller's deadline
        committed = [r for r in results if isinstance(r, Manifest)]
        broken = {
            s: r for s, r in zip(steps, results, strict=True) if isinstance(r, CheckpointError)
        }
        return committed, broken

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every readable committed step, ascending. Broken manifests are logged, not listed."""
        summaries, broken = self.summaries()
        for step, error in broken.items():
            log.warning("step %d has an unreadable manifest: %s", step, error)
        return [self.info_of_summary(s) for s in summaries]

    def summaries(self) -> tuple[builtins.list[Summary], dict[int, CheckpointError]]:
        """Summaries of the committed steps, ascending, and the steps whose manifest cannot be
        read: from the step index (step_index.py), checking each step it holds a claim on
        against its manifest, or from the manifests where the index is missing, incomplete
        or unreadable (and the index is then completed from what was read). A newer
        schema's index is refused (CompatibilityError), never overwritten."""
        try:
            snapshot = self.index.snapshot()
        except CorruptCheckpointError as e:
            log.warning("%s", e)
            return self._summaries_from_manifests(None, removals=None)
        if snapshot is None or not snapshot.head.complete:
            removals = snapshot.head.removals if snapshot is not None else 0
            return self._summaries_from_manifests(snapshot, removals=removals)
        return self._checked(snapshot)

    def _summaries_from_manifests(
        self, snapshot: Snapshot | None, *, removals: int | None
    ) -> tuple[builtins.list[Summary], dict[int, CheckpointError]]:
        committed, broken = self.scan()
        found = [Summary.of(m) for m in committed]
        try:
            self.index.rebuild(found, merge=snapshot is not None, removals=removals)
        except (BackendError, ConflictError) as e:  # a read-only reader lists all the same
            log.info("%s: the step index was not written: %s", self.backend.uri, e)
        return found, broken

    def rebuild_index(self) -> int:
        """Rebuild the step index from the manifests (``ckptstore index --rebuild``;
        index_check.py). Returns how many steps it holds."""

        def scan() -> builtins.list[Manifest]:
            self.forget_all()
            return self.scan()[0]

        return rebuild(self.index, scan)

    def _checked(
        self, snapshot: Snapshot
    ) -> tuple[builtins.list[Summary], dict[int, CheckpointError]]:
        """The index's summaries, with every claimed step looked up in its manifest; what
        was found repairs the index (index_check.py)."""
        checked = check_claims(
            snapshot,
            lambda step: self.state_of(step, fresh=True),
            lambda step: Summary.of(self.manifest(step)),
            time.time(),
        )
        self.half_removed.update(checked.half_removed)
        repair(self.index, checked, snapshot.head.removals, self.backend.uri)
        return checked.summaries, checked.broken

    def retention_view(self, newest: int) -> builtins.list[int]:
        """Step numbers for a retention policy to judge, at a cost bounded by ``newest``.

        The newest ``newest`` committed steps are confirmed by reading their manifests now (a
        remembered one may have been removed by another process since, and counting it would
        let the policy delete one step too many); older step directories are taken on the
        listing's word, since a policy can only choose to delete those, and each deletion is
        confirmed by the uncommit itself.
        """
        older = self.step_dirs()
        confirmed: builtins.list[int] = []
        while older and len(confirmed) < newest:
            step = older.pop()
            if self.is_committed(step, fresh=True):
                confirmed.append(step)
        return older + confirmed[::-1]

    # -- the pointer and latest ----------------------------------------------------------

    def read_pointer(self) -> tuple[Pointer | None, str | None]:
        """``(pointer, version)``; ``(None, None)`` if absent. Raises if it stays unreadable."""
        where = self.uri(layout.LATEST_NAME)

        def read() -> tuple[Pointer | None, str | None]:
            try:
                data, version = self.backend.read_versioned(layout.LATEST_NAME)
            except NotFoundError:
                return None, None
            return Pointer.decode(data, where), version

        return TORN_READ.run(read, retryable=_torn, target=where, doing="read", sleep=self.sleep)

    def pointer_or_none(self) -> Pointer | None:
        try:
            return self.read_pointer()[0]
        except CorruptCheckpointError:
            return None

    # -- payload -------------------------------------------------------------------------

    def read_verified(
        self, step: int, entry: FileEntry, *, actual_size: int | None = None
    ) -> memoryview:
        """A payload file's bytes, checked against its manifest entry (verified.py)."""
        return read_verified(self.backend, step, entry, actual_size=actual_size)

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of a committed step by its path in the step, verified."""
        return self.read_verified(info.step, self.entry(info, path))

    @staticmethod
    def entry(info: CheckpointInfo, path: str) -> FileEntry:
        """The manifest entry of ``path`` in ``info``'s step; NotFoundError if it has none."""
        try:
            return info.manifest.file(path)
        except KeyError as e:
            raise NotFoundError(
                f"{info.uri} has no file {path!r} in its manifest",
                uri=info.uri,
                step=info.step,
                path=layout.step_dir(info.step),
            ) from e

    def payload_sizes(self, step: int) -> dict[str, int]:
        return payload_sizes(self.backend, step)


def fenced(pointer: Pointer | None, info: CheckpointInfo) -> bool:
    """Whether ``info`` was committed by a writer that had lost the lease (pointer.py)."""
    return pointer is not None and pointer.fenced(info.step, info.writer, info.lease_epoch)


def _torn(e: Exception) -> bool:
    """An undecodable control object: perhaps a write in progress, worth another read."""
    return isinstance(e, CorruptCheckpointError)
