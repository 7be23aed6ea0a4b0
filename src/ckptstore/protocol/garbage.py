"""Garbage collection: removing what failed saves and interrupted removals left, and proving
it dead first.

Never a manifest, never a file a manifest lists, never anything ckptstore did not write (files
outside attempt directories are reported as foreign). An uncommitted attempt is removed once
it is proven dead: by the writer lease (its marker's epoch is older than the lease's, or the
lease of its epoch was released or its holder is gone; epoch 0, a writer without a lease,
proves nothing), or by age (nothing in it younger than ``older_than`` seconds, and not
started under the lease held now). Its files go under a tombstone (removal.py), so a commit
cannot land while they go. The tombstone keeps a late commit of those attempts out: it goes
at once when the lease proved them dead, else once no writer holds the lease, and in a store
without leases only after a day. Attempts that lost the race for a committed step are dead
whatever their age, and an uncommit that died half-way (its tombstone stands) is finished.
What is left alone is reported with the reason (``GcReport.kept`` and ``why``): after
``gc(older_than=0)`` with no live writer, a store that uses the lease holds committed steps
and nothing else.

A prefix that holds no store at all (no ``latest.json``, nothing under ``.ckptstore/``, no
step with a manifest or a save attempt) is refused before anything is listed for deletion:
``gc`` on a mistyped URI, or on a run copied there with ``aws s3 sync``, would otherwise
report its files as foreign at best, and abort another tool's multipart uploads at worst.

One recursive listing of the whole store, paginated (on S3, one request per 1,000 keys), tells
gc what it needs about nearly every step, so a store of 10,000 clean steps costs its LIST pages
and no GET. The listing cannot tell a manifest from a tombstone, nor the manifest's attempts
from a loser's; a step is clean on its word alone when its manifest key is larger than any
tombstone naming one attempt (``TOMBSTONE_MAX_SIZE``) and it holds exactly one attempt
directory, with its marker and files beside it, none newer than the key. A step committed
there was committed from that attempt: the only other way to be alone there is to have lost a
create-only race to a manifest whose own attempt has vanished, which no removal does (they
delete payload before markers, so a removal that died half-way leaves an attempt with its
marker alone, or several attempts). Every other step with a manifest key is read: two or more
attempts, an attempt without a marker or with nothing but it, a file newer than the key (a save
staged over a tombstone), files beside an attempt, a small key, a pinned step, and a key alone
a day old (a tombstone to drop). A step without a key needs no GET: nothing is committed there,
and the tombstone claim (removal.py) re-checks before anything goes. Schema-1 and adopted steps
(files, no attempt) are read only when their key is small; their foreign files go unreported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.domain import layout
from ckptstore.domain.info import GcReport
from ckptstore.domain.manifest import (
    Manifest,
    encode_tombstone,
    tombstone_attempts,
    tombstone_of_commit,
)
from ckptstore.domain.step_index import INDEX_DIR
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.lease_record import Process, read_lease
from ckptstore.protocol.removal import Remover, delete_attempt_files
from ckptstore.protocol.step_index import Snapshot

log = logging.getLogger(__name__)

GC_GRACE_SECONDS = 3600.0
"""gc leaves younger uncommitted objects alone: they may belong to a save in flight."""
TOMBSTONE_MAX_SIZE = len(encode_tombstone("w" * 300, -1.2345678901234567e300, ["0" * 16]))
"""The largest tombstone naming one attempt: a writer id is ``host:pid:hex`` (a host name has
at most 255 characters). A manifest key larger than this over one attempt is a manifest."""
TOMBSTONE_GRACE_SECONDS = 86400.0
"""gc removes a tombstone (removal.py) only once it is this old, whatever ``older_than`` says: a
committer stalled for that long between staging and committing is taken for dead."""


@dataclass
class _Findings:
    deleted: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    """What was left alone although uncommitted, and why."""
    committed: set[int] = field(default_factory=set)


class GarbageCollector:
    """One gc pass over a store; :meth:`run` returns what it removed (or would remove)."""

    def __init__(
        self,
        catalog: Catalog,
        remover: Remover,
        clock: Callable[[], float],
        *,
        dry_run: bool,
        older_than: float,
        lease_of: Backend | None = None,
        held_elsewhere: frozenset[int] = frozenset(),
    ) -> None:
        """``lease_of``: the backend whose writer lease guards this one's writes (a local
        tier's is its store's durable tier; default this one); ``held_elsewhere``: steps
        committed in another tier of the store, whose pins here are not stale."""
        self.catalog = catalog
        self.backend: Backend = catalog.backend
        self.remover = remover
        self.dry_run = dry_run
        now = clock()
        self.older_than = older_than
        self.cutoff = now - older_than
        self.lease = LeaseView.read(lease_of if lease_of is not None else self.backend)
        self.held_elsewhere = held_elsewhere
        # A tombstone keeps a late commit of the attempts it names out. It goes once the lease
        # proves their writers dead; a tombstone whose writers nothing can prove dead (a
        # store without leases) waits a day, whatever older_than says.
        self.tombstone_grace = max(older_than, TOMBSTONE_GRACE_SECONDS)
        if self.lease.epoch is not None and self.lease.live is None:
            self.tombstone_grace = older_than  # a store with leases and no live writer
        self.tombstone_cutoff = now - self.tombstone_grace

    def run(self) -> GcReport:
        listing = _StoreListing.scan(self.backend)
        self._check_is_store(listing)
        found = _Findings()
        pinned = {s for p in listing.pins if (s := _pinned_step(p.path)) is not None}
        for step in sorted(listing.steps):
            self._collect_step(step, listing.steps[step], step in pinned, found)
        pins = self._stale_pins(listing.pins, found.committed | self.held_elsewhere)
        index = self._index() if listing.index else None
        if index is not None:  # and segments the step index dropped
            pins += self.catalog.index.orphans(index.head, listing.index, self.cutoff)
        kept = tuple(k + "/" for k in found.kept)
        partial = [  # an abandoned upload's writer gave up on it: dead, however young
            p
            for p in self.backend.partial_writes("")
            if p.abandoned or (_old(p.started, self.cutoff) and not p.path.startswith(kept))
        ]
        if not self.dry_run:
            if index is not None:
                self._forget_in_index(index, found.committed)
            self.backend.delete(pins)
            for upload in partial:
                self.backend.abort(upload)
        return GcReport(
            tuple(found.deleted + pins),
            tuple(p.path for p in partial),
            foreign=tuple(found.foreign),
            kept=tuple(found.kept),
            why=dict(found.kept),
        )

    def _check_is_store(self, listing: _StoreListing) -> None:
        """NotFoundError unless the prefix holds a store (module docstring)."""
        if listing.has_latest or listing.has_meta:
            return
        if any(s.key is not None or s.attempts for s in listing.steps.values()):
            return
        uri = self.backend.uri
        raise NotFoundError(
            f"{uri} holds no ckptstore store (no {layout.LATEST_NAME}, no {layout.META_DIR}/, "
            "no committed step or save attempt), so gc deleted nothing: it removes only what "
            "failed saves of a store leave. Check the URI (and endpoint); a store is created "
            "by its first save",
            uri=uri,
        )

    def _collect_step(self, step: int, seen: _StepListing, pinned: bool, found: _Findings) -> None:
        if seen.key is None:  # nothing committed: no GET; the claim re-checks before deleting
            found.foreign += [o.path for o in seen.other]
            self._collect_uncommitted(step, seen.attempts, None, found)
            return
        if not seen.may_hold_garbage(step, self.tombstone_cutoff, pinned=pinned):
            found.committed.add(step)
            return
        try:
            manifest: Manifest | None = self.catalog.read_manifest(step)
        except NotFoundError:
            manifest = None
        except (CorruptCheckpointError, CompatibilityError):
            found.committed.add(step)  # unreadable: not ours to judge; verify reports it
            return
        listed = {f.key(step) for f in manifest.files} if manifest is not None else set()
        found.foreign += [o.path for o in seen.other if o.path not in listed]
        if manifest is None:
            self._collect_uncommitted(step, seen.attempts, seen.key, found)
            return
        found.committed.add(step)
        owners = {f.attempt for f in manifest.files}
        losers = [o.path for a, files in seen.attempts.items() if a not in owners for o in files]
        if losers and not self.dry_run:
            delete_attempt_files(self.backend, losers)
        found.deleted += losers

    def _collect_uncommitted(
        self,
        step: int,
        attempts: dict[str, list[ObjectInfo]],
        tombstone: ObjectInfo | None,
        found: _Findings,
    ) -> None:
        removed: frozenset[str] = frozenset()
        if tombstone is not None:
            data = self._read_key(step)
            if data is not None and tombstone_of_commit(data):  # an uncommit died half-way
                named = tombstone_attempts(data) or frozenset()
                if self.dry_run:
                    found.deleted += [o.path for a in named for o in attempts.get(a, [])]
                    found.deleted.append(layout.manifest_path(step))
                else:
                    found.deleted += self.remover.roll_forward(step) or []
                attempts = {a: files for a, files in attempts.items() if a not in named}
                tombstone = None
            elif data is not None:
                removed = tombstone_attempts(data) or frozenset()
        verdicts = {a: self._judge(step, a, files) for a, files in attempts.items()}
        for attempt, (reason, _) in verdicts.items():
            if reason is not None and attempt not in removed:
                found.kept[layout.attempt_dir(step, attempt)] = reason
        # named by a tombstone: chosen by a remover that died half-way, so finish its work
        dead = {a for a, (reason, _) in verdicts.items() if reason is None or a in removed}
        if dead and self.dry_run:
            found.deleted += [o.path for a in dead for o in attempts[a]]
        elif dead:
            proven = all(verdicts[a][1] for a in dead)  # else a late committer may be alive
            found.deleted += self.remover.abort_step(step, dead, keep_tombstone=not proven) or []
        elif tombstone is not None and _old(tombstone.mtime, self.tombstone_cutoff):
            if self.dry_run or self.remover.tombstones.drop(step):
                found.deleted.append(layout.manifest_path(step))
            else:
                found.kept[layout.manifest_path(step)] = (
                    "a tombstone whose deletion took too long (a slow request); gc retries it"
                )
        elif tombstone is not None:
            found.kept[layout.manifest_path(step)] = (
                "a tombstone that keeps a late commit of removed files out; it goes once no "
                "writer holds the lease, or after "
                f"{TOMBSTONE_GRACE_SECONDS / 3600:g} h in a store without leases"
            )

    def _judge(self, step: int, attempt: str, files: list[ObjectInfo]) -> tuple[str | None, bool]:
        """Why an uncommitted attempt may still be live (None: dead), and whether the writer
        lease proves it dead: its epoch is older than the lease's, or the lease of its epoch
        was released or its holder's process is gone (epoch 0, a writer without a lease,
        proves nothing). Otherwise it is dead once nothing in it is younger than the grace."""
        lease = self.lease
        epoch = self._marker_epoch(step, attempt) if lease.epoch is not None else None
        if lease.epoch is not None and epoch is not None and epoch > 0:
            if epoch < lease.epoch or (epoch == lease.epoch and lease.live is None):
                return None, True
            if epoch == lease.live:
                return (
                    f"started under the writer lease held now (epoch {epoch}): the running "
                    "job's save in flight",
                    False,
                )
        if any(not _old(o.mtime, self.cutoff) for o in files):
            return (
                f"younger than {self.older_than:g} s, so it may be a save in flight; "
                "use --older-than (older_than=) to remove it sooner",
                False,
            )
        return None, False

    def _read_key(self, step: int) -> bytes | None:
        try:
            return self.backend.read(layout.manifest_path(step))
        except NotFoundError:
            return None

    def _index(self) -> Snapshot | None:
        """The step index, or None where there is none to tend (absent, unreadable: the next
        reader rebuilds it; of a newer schema: not ours to change)."""
        try:
            return self.catalog.index.snapshot()
        except (CorruptCheckpointError, CompatibilityError):
            return None

    def _forget_in_index(self, snapshot: Snapshot, committed: set[int]) -> None:
        """Drop from the step index the steps it lists that have no manifest (deleted by
        hand, or by a ckptstore without the index), each confirmed by a read of its
        manifest key now; claims stay (their writers, or readers, settle them)."""
        claimed = {p.step for p in snapshot.head.pending} | set(snapshot.head.removing)
        stale = [s for s in snapshot.summaries if s not in committed and s not in claimed]
        stale = [s for s in stale if not self.catalog.state_of(s, fresh=True).committed]
        if stale:
            self.catalog.index.drop(stale, removals=snapshot.head.removals, claims=False)
            log.info(
                "%s: the step index listed steps without a manifest: %s", self.backend.uri, stale
            )

    def _stale_pins(self, pins: list[ObjectInfo], committed: set[int]) -> list[str]:
        return [
            pin.path
            for pin in pins
            if _old(pin.mtime, self.cutoff) and _pinned_step(pin.path) not in committed
        ]

    def _marker_epoch(self, step: int, attempt: str) -> int | None:
        """The lease epoch an attempt was started under, from its marker; None if unreadable."""
        try:
            body = json.loads(self.backend.read(layout.attempt_marker_path(step, attempt)))
            epoch = body["lease_epoch"]
        except (NotFoundError, ValueError, KeyError, TypeError):
            return None
        return epoch if isinstance(epoch, int) else None


@dataclass
class _StepListing:
    """What the listing shows of one step directory."""

    key: ObjectInfo | None = None
    """The object at the manifest key: a manifest or a tombstone (the listing cannot tell)."""
    attempts: dict[str, list[ObjectInfo]] = field(default_factory=dict)
    other: list[ObjectInfo] = field(default_factory=list)
    """Objects outside attempt directories: a schema-1 or adopted step's files, or foreign."""

    def add(self, step: int, obj: ObjectInfo) -> None:
        attempt = layout.parse_attempt_path(step, obj.path)
        if obj.path == layout.manifest_path(step):
            self.key = obj
        elif attempt is not None:
            self.attempts.setdefault(attempt, []).append(obj)
        else:
            self.other.append(obj)

    def may_hold_garbage(self, step: int, tombstone_cutoff: float, *, pinned: bool) -> bool:
        """Whether the manifest must be read to judge the step (module docstring); ``pinned``:
        a stale pin is judged by whether its step is committed, which a tombstone is not."""
        key = self.key
        assert key is not None
        small = key.size <= TOMBSTONE_MAX_SIZE
        if pinned or len(self.attempts) > 1:
            return True
        if not self.attempts:  # a schema-1 or adopted step, or a tombstone alone
            return small if self.other else _old(key.mtime, tombstone_cutoff)
        if small or self.other:
            return True
        ((attempt, files),) = self.attempts.items()
        marker = layout.attempt_marker_path(step, attempt)
        return (
            all(o.path != marker for o in files)  # a removal died after deleting it
            or len(files) == 1  # the marker alone: a removal died before deleting it
            or any(_newer(o.mtime, key.mtime) for o in files)  # staged after the key
        )


@dataclass
class _StoreListing:
    """One recursive listing of the store, sorted by what gc asks of it."""

    steps: dict[int, _StepListing] = field(default_factory=dict)
    pins: list[ObjectInfo] = field(default_factory=list)
    index: list[ObjectInfo] = field(default_factory=list)
    """The step index's objects (step_index.py)."""
    has_latest: bool = False
    has_meta: bool = False

    @classmethod
    def scan(cls, backend: Backend) -> _StoreListing:
        found = cls()
        for obj in backend.list(""):
            head, slash, _ = obj.path.partition("/")
            if obj.path == layout.LATEST_NAME:
                found.has_latest = True
            elif head == layout.META_DIR and slash:
                found.has_meta = True
                if obj.path.startswith(layout.PINS_DIR + "/"):
                    found.pins.append(obj)
                elif obj.path.startswith(INDEX_DIR + "/"):
                    found.index.append(obj)
            elif slash and (step := layout.parse_step_dir(head)) is not None:
                found.steps.setdefault(step, _StepListing()).add(step, obj)
        return found


@dataclass(frozen=True)
class LeaseView:
    """What gc reads of the writer lease: its epoch (None: the store has never used one),
    and that epoch again if someone may hold it now (not released, and not held by a process
    on this machine that has exited), else None."""

    epoch: int | None
    live: int | None

    @classmethod
    def read(cls, backend: Backend) -> LeaseView:
        try:
            record, _, _ = read_lease(backend)
        except CheckpointError:
            return cls(None, None)  # unreadable: prove nothing by it
        if record is None:
            return cls(None, None)
        holder = record.process()
        gone = holder is not None and Process.current().same_machine(holder) and holder.gone()
        return cls(record.epoch, None if record.released or gone else record.epoch)


def _old(mtime: float | None, cutoff: float) -> bool:
    return mtime is None or mtime <= cutoff


def _newer(mtime: float | None, than: float | None) -> bool:
    """Whether ``mtime`` is after ``than``; an unknown time may be."""
    return mtime is None or than is None or mtime > than


def _pinned_step(path: str) -> int | None:
    return layout.parse_step_dir(path.rsplit("/", 1)[-1])
