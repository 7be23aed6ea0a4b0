"""The step index kept up to date beside the manifests (values: domain/step_index.py).

Every change is one compare-and-swap of the head (two writers never lose each other's update);
sealed segments are written create-only under fresh names before the swap that names them, so
a reader never sees a segment change under it and caches each one by name. A swap that loses
its race leaves an unreferenced segment behind, deleted at once (best effort).

The write side follows the commit (commit.py): a writer *announces* a step in the head before
its manifest is written and *adds* its summary after; a removal announces the steps it is
about to uncommit and *drops* them after. Each is one PUT when this process wrote the head
last (it keeps the version its swap returned), so a steady save adds two requests. What a
reader does with the index, and how it repairs it, is catalog.py's.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore.backends.base import Backend, ObjectInfo, join
from ckptstore.deadline import map_in_context
from ckptstore.domain import layout
from ckptstore.domain.step_index import (
    HEAD_NAME,
    SEGMENT_SIZE,
    Head,
    Pending,
    Summary,
    decode_segment,
    encode_segment,
    segment_path,
)
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    CorruptCheckpointError,
    NotFoundError,
    PreconditionFailedError,
)
from ckptstore.protocol.cas import BACKOFF, MAX_SWAP_ATTEMPTS

log = logging.getLogger(__name__)

SEGMENTS_PER_PACK = 10
"""A sealed segment grows by a head-full at a time up to this many (10,000 summaries by
default, about 3 MB): fewer, larger objects are what makes a listing fast, and rewriting one
costs a save only once per head-full."""
SEGMENT_THREADS = 8
"""Sealed segments fetched at once by a reader that has not cached them."""
STALE_PENDING = 24 * 3600.0
"""Seconds after which a reader drops an announced step that never got a manifest (its
writer died before the commit); a save in flight is never that old."""


@dataclass(frozen=True)
class Snapshot:
    """The index as one read found it: its head, and every summary it holds by step."""

    head: Head
    version: str | None
    summaries: dict[int, Summary]


class StepIndex:
    """Reads and updates one backend's step index."""

    def __init__(
        self,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        segment_size: int = SEGMENT_SIZE,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.sleep = sleep
        self.segment_size = segment_size
        self._segments: dict[str, tuple[Summary, ...]] = {}
        self._last: tuple[Head, str] | None = None
        """The head this process last swapped in, and its version: tried first by the next
        update, so a steady writer does not read the head back."""
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return join(self.backend.uri, HEAD_NAME)

    # -- reading -------------------------------------------------------------------------

    def read_head(self) -> tuple[Head | None, str | None]:
        """``(head, version)``, ``(None, None)`` without an index; raises CompatibilityError
        (newer schema) or CorruptCheckpointError."""
        try:
            data, version = self.backend.read_versioned(HEAD_NAME)
        except NotFoundError:
            return None, None
        return Head.decode(data, self.uri), version

    def snapshot(self) -> Snapshot | None:
        """The whole index, or ``None`` without one. A segment deleted under the read (a
        removal rewrote it) makes it read the head again."""
        for _ in range(3):
            head, version = self.read_head()
            if head is None:
                return None
            try:
                segments = self.segments(head.segments)
            except NotFoundError:
                continue
            summaries = {s.step: s for segment in segments for s in segment}
            summaries.update((s.step, s) for s in head.steps)
            return Snapshot(head, version, summaries)
        raise CorruptCheckpointError(
            f"{self.uri}: unreadable index head: it names a segment that is gone (deleted by "
            "hand, or by a gc racing a writer); it is ignored and rebuilt from the manifests",
            uri=self.uri,
        )

    def segments(self, names: Iterable[str]) -> list[tuple[Summary, ...]]:
        """Sealed segments by name (cached: a sealed segment never changes)."""
        names = list(names)
        with self._lock:
            missing = [n for n in names if n not in self._segments]
        if missing:
            with ThreadPoolExecutor(SEGMENT_THREADS, thread_name_prefix="ckpt-index") as pool:
                found = map_in_context(pool, self._fetch, missing)
            with self._lock:
                self._segments.update(zip(missing, found, strict=True))
        with self._lock:
            return [self._segments[n] for n in names]

    def _fetch(self, name: str) -> tuple[Summary, ...]:
        path = segment_path(name)
        return decode_segment(self.backend.read(path), join(self.backend.uri, path))

    # -- the writer's side -----------------------------------------------------------------

    def announce(self, step: int, writer: str) -> None:
        """Claim ``step`` before its manifest is written (module doc)."""
        claim = Pending(step, writer, self.clock())
        change = lambda head: self._or_new(head, step).with_pending(claim)  # noqa: E731
        self.update(change, f"announce step {step}")

    def add(self, summaries: Iterable[Summary], writer: str) -> None:
        """Record steps ``writer`` committed, where its claims still stand (and drop them):
        a claim gone means a removal took the step out again, or a reader already added it
        from its manifest, and a late update must not bring back what was removed."""
        chosen = list(summaries)
        what = f"add step {chosen[0].step}" if len(chosen) == 1 else "add steps"
        self.update(lambda head: head.with_claimed(chosen, writer) if head else None, what)

    def removing(self, steps: Iterable[int]) -> None:
        """Claim steps about to be uncommitted: readers check them against their manifests."""
        chosen = list(steps)
        if chosen:
            self.update(lambda head: self._or_new(head).with_removing(chosen), "claim removals")

    def drop(
        self, steps: Iterable[int], *, removals: int | None = None, claims: bool = True
    ) -> bool:
        """Take steps out of the index (and their claims), rewriting the sealed segments that
        hold them. With ``removals`` (a reader's repair) nothing is changed if a removal
        dropped steps since that count was read; without ``claims`` the claims on them stay
        (a writer may be committing one of those steps again). Returns whether the head
        changed."""
        doomed = set(steps)
        if not doomed:
            return False

        def change(head: Head | None) -> Head | None:
            if removals is not None and (head is None or head.removals != removals):
                return None
            head = self._or_new(head)
            names = []
            for name, segment in zip(head.segments, self.segments(head.segments), strict=True):
                if not any(s.step in doomed for s in segment):
                    names.append(name)
                elif kept := [s for s in segment if s.step not in doomed]:
                    names.append(self._write_segment(kept))
            return head.dropped(doomed, tuple(names), claims=claims)

        return self.update(change, "drop steps")

    def update(self, change: Callable[[Head | None], Head | None], what: str) -> bool:
        """Swap the head to ``change(head)`` (``None``: leave it), sealing the open segment
        when it is full; retried on a lost race. Returns whether the head changed."""
        last = self._last
        for attempt in range(MAX_SWAP_ATTEMPTS):
            head, version = last if last is not None else self._head_for_update()
            before = set(head.segments) if head is not None else set()
            new = change(head)
            if new is None:
                return False
            new = self._sealed(new)
            written = [n for n in new.segments if n not in before]
            data = new.encode()
            try:
                swapped = self.backend.swap(HEAD_NAME, data, version)
            except PreconditionFailedError:
                landed = self._landed(data)  # our swap landed, its answer was lost?
                if landed is None:
                    self._delete(written)
                    last = self._last = None
                    self.sleep(BACKOFF.delay(attempt))
                    continue
                swapped = landed
            self._last = (new, swapped)
            self._delete([n for n in before if n not in set(new.segments)])
            return True
        raise BackendError(
            f"{self.uri}: could not {what} in the step index after {MAX_SWAP_ATTEMPTS} "
            "attempts (too many concurrent writers); try again",
            retryable=True,
        )

    def _sealed(self, head: Head) -> Head:
        """The head with its oldest summaries moved into a sealed segment while it is full:
        merged into the newest sealed segment while that holds fewer than
        :data:`SEGMENTS_PER_PACK` head-fulls (so a reader of 10,000 steps GETs two objects),
        else into a new one."""
        while len(head.steps) >= self.segment_size:
            batch, rest = head.steps[: self.segment_size], head.steps[self.segment_size :]
            names = list(head.segments)
            last = self.segments(names[-1:])
            if last and len(last[0]) + len(batch) <= self.segment_size * SEGMENTS_PER_PACK:
                names[-1] = self._write_segment((*last[0], *batch))
            else:
                names.append(self._write_segment(batch))
            head = Head(
                tuple(names), rest, head.pending, head.removing, head.complete, head.removals
            )
        return head

    def _write_segment(self, summaries: Iterable[Summary]) -> str:
        chosen = tuple(sorted(summaries, key=lambda s: s.step))
        name = f"seg-{chosen[0].step}-{chosen[-1].step}-{secrets.token_hex(4)}.json"
        self.backend.create(segment_path(name), encode_segment(chosen))
        with self._lock:
            self._segments[name] = chosen
        return name

    def _delete(self, names: Iterable[str]) -> None:
        """Delete segments no head names any more (best effort: a reader that still holds
        an older head reads that head again when one is gone)."""
        paths = [segment_path(n) for n in names]
        if not paths:
            return
        try:
            self.backend.delete(paths)
        except CheckpointError as e:
            log.debug("%s: unreferenced index segments left behind: %s", self.uri, e)

    # -- rebuilding ------------------------------------------------------------------------

    def rebuild(
        self,
        summaries: Iterable[Summary],
        *,
        merge: bool,
        removals: int | None,
    ) -> bool:
        """Replace the index's summaries by ``summaries`` (listed from the manifests; with
        ``merge``, those writers put in the head meanwhile are kept too); the claims stay.
        Nothing is written if a removal dropped steps since ``removals`` (0 for no index)
        was read before the listing: the listing might hold one of them. Overwrites an
        unreadable head, never one of a newer schema. Returns whether it wrote."""
        found = {s.step: s for s in summaries}
        self._last = None
        try:
            old, version = self.read_head()
        except CorruptCheckpointError:
            old, version = None, self._raw_version()
        if old is not None and removals is not None and old.removals != removals:
            return False
        keep = old if old is not None else Head()
        steps = found | ({s.step: s for s in keep.steps} if merge else {})
        ordered = sorted(steps.values(), key=lambda s: s.step)
        pending = tuple(p for p in keep.pending if p.step not in steps)
        names: list[str] = []
        pack = self.segment_size * SEGMENTS_PER_PACK
        while len(ordered) >= self.segment_size:
            size = min(pack, len(ordered) - len(ordered) % self.segment_size)
            names.append(self._write_segment(ordered[:size]))
            ordered = ordered[size:]
        new = Head(tuple(names), tuple(ordered), pending, keep.removing, True, keep.removals)
        try:
            swapped = self.backend.swap(HEAD_NAME, new.encode(), version)
        except PreconditionFailedError:
            self._delete(names)
            return False
        self._last = (new, swapped)
        self._delete(n for n in keep.segments if n not in set(names))
        return True

    def _or_new(self, head: Head | None, announced: int | None = None) -> Head:
        """A head to change: without an index, a new one, complete if the store holds no
        step directory but the ``announced`` step's (one listing, once per store), else one
        that readers complete from the manifests."""
        if head is not None:
            return head
        found = (layout.parse_step_dir(name) for name in self.backend.list_dirs(""))
        return Head(complete=all(step in (None, announced) for step in found))

    def _landed(self, data: bytes) -> str | None:
        """The head's version if it holds exactly ``data``, else ``None``."""
        try:
            held, version = self.backend.read_versioned(HEAD_NAME)
        except NotFoundError:
            return None
        return version if held == data else None

    def _head_for_update(self) -> tuple[Head | None, str | None]:
        """The head to change; an unreadable one is replaced as if absent (readers then
        complete the new head from the manifests)."""
        try:
            return self.read_head()
        except CorruptCheckpointError as e:
            log.warning("%s; replacing it", e)
            return None, self._raw_version()

    def _raw_version(self) -> str | None:
        try:
            return self.backend.read_versioned(HEAD_NAME)[1]
        except NotFoundError:
            return None

    def orphans(self, head: Head | None, objects: Iterable[ObjectInfo], cutoff: float) -> list[str]:
        """Of ``objects`` (gc's listing of the index's folder), the sealed segments ``head``
        (the index's, just read) does not name, last written before ``cutoff``: a writer
        killed between writing one and the swap that would have named it."""
        named = set(head.segments) if head is not None else set()
        return [
            o.path
            for o in objects
            if o.path.rsplit("/", 1)[-1].startswith("seg-")
            and o.path.rsplit("/", 1)[-1] not in named
            and (o.mtime is None or o.mtime < cutoff)
        ]

    def forget(self) -> None:
        """Forget the head this process wrote last (another process changed the store)."""
        self._last = None


def stale(claim: Pending, now: float) -> bool:
    """Whether an announced step without a manifest was abandoned by its writer."""
    return now - claim.since > STALE_PENDING
