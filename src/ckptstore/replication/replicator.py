"""Replication: the committed steps of one store mirrored into another, resumably.

``replicate(src, dst)`` copies the steps ``dst`` lacks; ``follow(src, dst)`` keeps doing it as
``src`` commits new ones (``ckptstore replicate SRC DST [--follow]``). ``src`` is only read;
``dst`` is written under its own writer lease and retention (destination.py), so another
cluster resumes from ``dst`` with the URI alone. Each rule is written once:

* **Which steps.** ``src``'s committed steps (one listing: manifests are the truth), or those
  named. Never one a fenced writer committed in ``src`` (pointer.py): it is never latest there,
  and nothing in ``dst`` would mark it. Never one ``dst``'s retention would delete at once (a
  follower would copy it again at every poll). One ``dst`` holds with the same files is done;
  with other files it is a ConflictError.
* **Order.** Newest first: the step a resume wants lands first.
* **One step.** ``dst``'s lease; the files not yet there, checked as they stream (copying.py);
  one listing proves them in place; ``src``'s manifest, verbatim, create-only; then ``dst``'s
  ``latest`` forward to it, never back (commit.py). So ``dst``'s latest only ever names a step
  whose copy is complete, and a reader of ``dst`` never sees a partial step.
* **Failures.** A step whose ``src`` bytes fail their check (or whose manifest ``dst``'s signing
  key refuses) is not committed, what was staged of it is removed, and it is reported
  (``failed``) while the other steps go on: a corrupt step stays corrupt, so a follower does not
  try it again. Any other error (storage, lease, conflict) ends the pass and keeps the files it
  finished, which the next pass does not copy again (destination.py says why one listing is
  proof enough). A kill is such an error.

Requests per pass, beyond the bytes: on ``src`` one LIST of step directories, one GET of the
pointer and one GET per manifest not seen before; on ``dst`` one LIST of step directories (and
GETs of manifests not seen before); per step copied, two listings of its directory, a PUT per
attempt marker, the manifest PUT, the lease renewals and the pointer's GET and swap. An idle
poll of a follower is therefore three requests, and its pauses grow from ``interval`` to
``max_interval`` (:func:`~ckptstore.replication.follow.poll_backoff`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptstore.core.resolver import Resolver
from ckptstore.data.copying import READ_AHEAD, READ_CHUNK, FileCopier
from ckptstore.data.payload import Progress
from ckptstore.deadline import within
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import Manifest
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UntrustedCheckpointError,
)
from ckptstore.replication.destination import Replica
from ckptstore.replication.follow import DEFAULT_INTERVAL, MAX_INTERVAL, poll_backoff
from ckptstore.retry import Pauses


class Replicable(Protocol):
    """A store as replication sees it (CheckpointStore): a resolver to read, a replica to
    write."""

    @property
    def uri(self) -> str: ...

    @property
    def resolver(self) -> Resolver: ...

    @property
    def replica(self) -> Replica: ...


log = logging.getLogger(__name__)

SOURCE_FAILURES = (CorruptCheckpointError, IncompleteCheckpointError)
"""What a source file's check raises (UntrustedCheckpointError is a CorruptCheckpointError)."""
FENCED = "committed in the source by a writer that had lost its lease (never latest there)"
DOOMED = "the destination's retention would delete it at once"
FAILED_BEFORE = "failed its check in an earlier pass; not tried again"


@dataclass
class ReplicationReport:
    """What one pass did; ``copied`` are the steps as committed in the destination."""

    src: str
    dst: str
    copied: list[CheckpointInfo] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    """Steps the destination already held with the same files."""
    excluded: dict[int, str] = field(default_factory=dict)
    """Steps not copied on purpose, and why."""
    failed: dict[int, CheckpointError] = field(default_factory=dict)
    """Steps whose source bytes (or manifest) failed their check: nothing committed."""
    latest: int | None = None
    """The step this pass moved the destination's ``latest`` to (None: not moved)."""
    files_resumed: int = 0
    """Files an earlier, interrupted pass had finished: not copied again."""
    bytes_resumed: int = 0
    files_streamed: int = 0
    bytes_streamed: int = 0
    files_server_side: int = 0
    bytes_server_side: int = 0
    seconds: float = 0.0

    @property
    def busy(self) -> bool:
        """Whether the pass copied or refused anything (a follower polls again soon)."""
        return bool(self.copied or self.failed)

    def raise_failures(self) -> None:
        """Raise the first failure, naming how many steps failed."""
        if not self.failed:
            return
        step, error = min(self.failed.items())
        if len(self.failed) == 1:
            raise error
        others = ", ".join(str(s) for s in sorted(self.failed) if s != step)
        raise type(error)(
            f"{error} (steps {others} failed too)", uri=error.uri, step=step, path=error.path
        ) from error

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values (``ckptstore replicate --json``, ``cp --json``)."""
        return {
            "src": self.src,
            "dst": self.dst,
            "copied": [i.step for i in self.copied],
            "skipped": self.present,
            "excluded": {str(s): why for s, why in sorted(self.excluded.items())},
            "failed": {str(s): str(e) for s, e in sorted(self.failed.items())},
            "latest": self.latest,
            "files": sum(len(i.files) for i in self.copied),
            "size": sum(i.size for i in self.copied),
            "streamed": self.bytes_streamed,
            "server_side": self.bytes_server_side,
            "resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 3),
        }


class Replicator:
    """Replicates from one store (its resolver) into another (its replica side); keeps what a
    follower must remember between passes: how far ``latest`` is known to be, and the steps
    that failed their check."""

    def __init__(
        self,
        origin: Resolver,
        replica: Replica,
        *,
        chunk_size: int = READ_CHUNK,
        read_ahead: int = READ_AHEAD,
        check_server_copies: bool = True,
    ) -> None:
        self.origin = origin
        self.replica = replica
        self.chunk_size = chunk_size
        self.read_ahead = read_ahead
        self.check_server_copies = check_server_copies
        self._latest_at_least: int | None = None
        self._failed: dict[int, Manifest] = {}
        _refuse_same_store(origin, replica)

    @property
    def src(self) -> str:
        return self.origin.uri

    def run(
        self, steps: Iterable[int] | None = None, progress: Progress | None = None
    ) -> ReplicationReport:
        """One pass: copy the chosen steps (default: all) the destination lacks."""
        started = time.perf_counter()
        report = ReplicationReport(self.src, self.replica.uri)
        todo = self._plan(report, steps)
        copier = FileCopier(
            self.origin.catalog.backend,
            self.replica.backend,
            chunk_size=self.chunk_size,
            read_ahead=self.read_ahead,
            check_server_copies=self.check_server_copies,
        )
        for manifest in todo:
            done = self._copy_step(manifest, copier, report, progress)
            if isinstance(done, CheckpointError):  # the source's bytes: not tried again
                self._failed[manifest.step] = manifest
                report.failed[manifest.step] = done
                log.error("%s", done)
                continue
            info, epoch = done
            report.copied.append(info)
            self._advance(report, info.step, epoch)
        complete = [i.step for i in report.copied] + report.present
        if complete and (self._latest_at_least is None or max(complete) > self._latest_at_least):
            self._advance(report, max(complete), None)  # a pass killed before it moved latest
        if report.copied:
            self.replica.retain()
        report.copied.sort(key=lambda i: i.step)
        tally = copier.tally
        report.files_streamed, report.bytes_streamed = tally.files_streamed, tally.bytes_streamed
        report.files_server_side = tally.files_server_side
        report.bytes_server_side = tally.bytes_server_side
        report.seconds = time.perf_counter() - started
        return report

    def _plan(self, report: ReplicationReport, steps: Iterable[int] | None) -> list[Manifest]:
        """The manifests to copy, newest first; the others go into the report."""
        catalog = self.origin.catalog
        if steps is None:
            infos = catalog.list()
        else:
            infos = [catalog.info(layout.check_step(s)) for s in sorted(set(steps))]
        fenced = set(self.origin.fenced_steps(infos)) if infos else set()
        held = self.replica.holdings()
        candidates: list[Manifest] = []
        for info in infos:
            step = info.step
            if step in fenced:
                report.excluded[step] = FENCED
                continue
            if step in held.manifests:
                if self.replica.same_step(held.manifests[step], info):
                    report.present.append(step)
                continue
            manifest = info.manifest  # read only for steps to copy (the index listed them)
            if step in held.broken:
                raise _unreadable_there(self.replica, step, held.broken[step])
            elif self._failed.get(step) == manifest:
                report.excluded[step] = FAILED_BEFORE
            else:
                try:
                    self.replica.check_trusted(manifest, info.uri)
                except UntrustedCheckpointError as e:
                    self._failed[step] = manifest
                    report.failed[step] = e
                    continue
                candidates.append(manifest)
        doomed = self.replica.doomed(candidates, held.manifests)
        for step in sorted(doomed):
            report.excluded[step] = DOOMED
        return sorted((m for m in candidates if m.step not in doomed), key=lambda m: -m.step)

    def _copy_step(
        self,
        manifest: Manifest,
        copier: FileCopier,
        report: ReplicationReport,
        progress: Progress | None,
    ) -> tuple[CheckpointInfo, int] | CheckpointError:
        """Copy what is missing of one step and commit it: the step's info and the lease
        epoch, or the error of a source file that failed its check (then nothing is committed
        and what was staged is removed). Errors on the destination's side are raised, its
        ``save_timeout`` (SaveTimeoutError) included: files copied whole stay staged, and the
        next pass resumes from them."""
        with within(self.replica.save_timeout, operation="save"):
            return self._copy_within(manifest, copier, report, progress)

    def _copy_within(
        self,
        manifest: Manifest,
        copier: FileCopier,
        report: ReplicationReport,
        progress: Progress | None,
    ) -> tuple[CheckpointInfo, int] | CheckpointError:
        step = manifest.step
        missing = self.replica.prepare(manifest)
        resumed = [f for f in manifest.files if f not in missing]
        report.files_resumed += len(resumed)
        report.bytes_resumed += sum(f.size for f in resumed)
        if progress and resumed:
            progress(sum(f.size for f in resumed))
        try:
            copier.copy_files(step, missing, progress)
        except SOURCE_FAILURES as e:
            self.replica.discard(manifest)
            gone = " (or whether its retention deleted the step meanwhile)"
            failure = type(e)(
                f"{e}. Step {step} was not replicated to {self.replica.uri}: nothing was "
                f"committed there and its staged files were removed; check the source with "
                f"`ckptstore verify {self.src} {step}`"
                f"{gone if isinstance(e, IncompleteCheckpointError) else ''}",
                uri=e.uri,
                step=step,
                path=e.path,
            )
            failure.__cause__ = e
            return failure
        return self.replica.commit(manifest)

    def _advance(self, report: ReplicationReport, step: int, epoch: int | None) -> None:
        if self._latest_at_least is not None and step <= self._latest_at_least:
            return
        if self.replica.advance(step, epoch):
            report.latest = step
        self._latest_at_least = step


def replicate(
    src: Replicable,
    dst: Replicable,
    steps: Iterable[int] | None = None,
    *,
    progress: Progress | None = None,
    chunk_size: int = READ_CHUNK,
    read_ahead: int = READ_AHEAD,
    check_server_copies: bool = True,
) -> ReplicationReport:
    """Copy ``src``'s committed steps (default: all) that ``dst`` lacks into ``dst`` (module
    docstring); the report says what was copied, found, left out and refused. Steps whose
    bytes fail their check are in ``report.failed`` (``report.raise_failures()``); other
    errors are raised. ``chunk_size`` and ``read_ahead`` bound the bytes read ahead;
    ``check_server_copies=False`` lets a server-side copy trust the source's bytes."""
    replicator = Replicator(
        src.resolver,
        dst.replica,
        chunk_size=chunk_size,
        read_ahead=read_ahead,
        check_server_copies=check_server_copies,
    )
    return replicator.run(steps, progress)


def follow(
    src: Replicable,
    dst: Replicable,
    steps: Iterable[int] | None = None,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_interval: float = MAX_INTERVAL,
    on_pass: Callable[[ReplicationReport], None] | None = None,
    passes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    progress: Progress | None = None,
    check_server_copies: bool = True,
) -> None:
    """Replicate, then again after each pause, as ``src`` commits new steps; returns after
    ``passes`` passes (None: never, until Ctrl-C or an error).

    ``dst``'s lease is taken first, so a second replicator into ``dst`` is refused at once.
    ``on_pass`` sees each pass's report. A storage error that may pass (``retryable``) is
    logged and the next pass tries again; any other error ends the follow.
    """
    replicator = Replicator(src.resolver, dst.replica, check_server_copies=check_server_copies)
    pauses = Pauses(poll_backoff(interval, max_interval))
    dst.replica.hold_lease()
    done = 0
    while True:
        busy = False
        try:
            report = replicator.run(steps, progress)
        except BackendError as e:
            if not e.retryable:
                raise
            log.warning("replication from %s failed (retrying): %s", src.uri, e)
        else:
            busy = report.busy
            if on_pass is not None:
                on_pass(report)
        done += 1
        if passes is not None and done >= passes:
            return
        sleep(pauses.next(busy=busy))


def _refuse_same_store(origin: Resolver, replica: Replica) -> None:
    there, here = origin.catalog.backend, replica.backend
    if there.uri != replica.uri:
        return
    a, b = there.address(layout.LATEST_NAME), here.address(layout.LATEST_NAME)
    if a == b:  # both None (a path) or the same object on the same server
        raise ConfigError(
            f"{there.uri} is both the source and the destination; replicate into another "
            "store (another bucket, prefix, endpoint or path)",
            uri=there.uri,
        )


def _unreadable_there(replica: Replica, step: int, error: CheckpointError) -> ConflictError:
    where = replica.catalog.uri(layout.manifest_path(step))
    return ConflictError(
        f"step {step} is committed in {replica.uri}, but its manifest cannot be read there "
        f"({error}); it cannot be compared with the source's. Fix or remove it there "
        f"(ckptstore rm {replica.uri} {step} --force), or replicate other steps",
        uri=where,
        step=step,
        path=layout.manifest_path(step),
    )
