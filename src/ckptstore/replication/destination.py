"""A store as the destination of a replication: the write side replicator.py commits through.

The destination keeps its own rules. Its writer lease is taken before the first file lands and
renewed right before each commit (the fence check), so a second replicator, or a training job,
writing the same store is refused or fenced like any writer. Its retention is asked before
anything is copied (:meth:`Replica.doomed`), so no step is copied only to be deleted, then
carried out after each pass. Its commit marker is written create-only after every file is
listed in place, and its ``latest`` only moves forward (commit.py).

What differs from a save: the manifest is the source's, verbatim (same digests, same signature;
invariants 12 and 17), and so are the payload keys (the attempt ids the manifest names), which
is what lets a copy killed half-way resume where it stopped: a file already at its key with its
manifest size was written whole (writes are atomic) from bytes that were checked on their way
(copying.py), so one listing of the step's directory tells what is left to copy, and nothing
needs to be read back. A destination with a signing key accepts only manifests that its key
verifies: signing another key's (or nobody's) manifest here would make this key vouch for
digests it never saw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.step_index import Summary
from ckptstore.errors import CheckpointError, ConflictError, UntrustedCheckpointError
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.pruning import Pruner
from ckptstore.protocol.removal import Remover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holdings:
    """What the destination holds now: summaries of its readable steps (from its step index)
    and unreadable steps, by step."""

    manifests: dict[int, Summary]
    broken: dict[int, CheckpointError]


@dataclass(frozen=True)
class Replica:
    """One store's side of a replication into it (module docstring)."""

    catalog: Catalog
    committer: Committer
    remover: Remover
    pruner: Pruner
    hold_lease: Callable[[], int]
    """Take or renew this store's writer lease; its epoch (0 without leases)."""
    save_timeout: float | None = None
    """Each step's copy and commit into this store commits within it or fails
    (:class:`~ckptstore.errors.SaveTimeoutError`), as a save here would."""

    @property
    def backend(self) -> Backend:
        return self.catalog.backend

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri

    def holdings(self) -> Holdings:
        """The step index's summaries (a few GETs however many steps it holds)."""
        committed, broken = self.catalog.summaries()
        return Holdings({s.step: s for s in committed}, dict(broken))

    def check_trusted(self, manifest: Manifest, where: str) -> None:
        """Refuse a manifest this store's signing key does not verify (none: anything goes)."""
        signer = self.catalog.signer
        if signer is None:
            return
        try:
            signer.check(manifest, where)
        except UntrustedCheckpointError as e:
            raise UntrustedCheckpointError(
                f"{e}. {self.uri} has a signing key, so it only takes steps its key signed: "
                f"open it with the source's key (or without a key to keep the source's "
                f"signature as it is); step {manifest.step} was not replicated",
                uri=e.uri,
                step=manifest.step,
                path=e.path,
            ) from e

    def same_step(self, held: Summary, wanted: CheckpointInfo) -> bool:
        """Whether ``held`` (here) is ``wanted``'s step with the same files; ConflictError if
        the step is here with other files (a run that went its own way here). Equal digests
        (a step replicated verbatim) answer without reading either manifest."""
        if held.digest == wanted.summary.digest:
            return True
        if self.catalog.manifest(held.step).files == wanted.manifest.files:
            return True
        raise ConflictError(
            f"step {wanted.step} exists in {self.uri} with other contents than the source's; "
            "committed steps are immutable, so it cannot be replicated. Remove it there "
            f"(ckptstore rm {self.uri} {wanted.step}) or replicate other steps",
            uri=self.catalog.uri(layout.step_dir(wanted.step)),
            path=layout.step_dir(wanted.step),
            step=wanted.step,
        )

    def doomed(
        self, wanted: Iterable[Manifest], held: Mapping[int, Manifest | Summary]
    ) -> set[int]:
        """The steps of ``wanted`` this store's retention would delete as soon as they landed
        beside ``held`` (one GET of the pointer and a listing of pins, with a policy only)."""
        wanted = list(wanted)
        if not wanted or not self.pruner.policy.enabled:
            return set()
        pointer = self.catalog.pointer_or_none()
        ahead = pointer.step if pointer is not None and pointer.step is not None else -1
        latest = max(ahead, *(m.step for m in wanted))
        everything = {**held, **{m.step: m for m in wanted}}
        doomed = self.pruner.would_delete(everything.values(), latest=latest)
        return set(doomed) & {m.step for m in wanted}

    def prepare(self, manifest: Manifest) -> list[FileEntry]:
        """Take the lease, mark the manifest's attempts as this writer's, and return the files
        still to copy: those not already at their key with their size (one listing)."""
        step = manifest.step
        epoch = self.hold_lease()
        present = self.catalog.payload_sizes(step)
        for attempt in sorted({f.attempt for f in manifest.files if f.attempt is not None}):
            # (re)written even when present: the marker says the attempt is ours now, so a
            # gc here does not judge a resumed copy's files abandoned (garbage.py)
            self.committer.begin_attempt(step, epoch, attempt)
        return [f for f in manifest.files if present.get(f.key(step)) != f.size]

    def discard(self, manifest: Manifest) -> None:
        """Remove what was staged of ``manifest``'s step here (never a committed step's)."""
        attempts = {f.attempt for f in manifest.files if f.attempt is not None}
        self.remover.discard_attempts(manifest.step, attempts)

    def commit(self, manifest: Manifest) -> tuple[CheckpointInfo, int]:
        """Confirm every file is in place (one listing), renew the lease (the fence check),
        write the manifest create-only; the step's info and the lease epoch. The same step
        already committed here with the same files (a lost answer, a rival replicator of the
        same source) counts as done."""
        self.committer.confirm_payload(manifest.step, manifest.files)
        epoch = self.hold_lease()
        try:
            written = self.committer.commit(manifest)
        except ConflictError as e:
            try:
                held = self.catalog.read_manifest(manifest.step)
            except CheckpointError:
                raise e from None
            if held.files != manifest.files:
                raise
            log.info("step %d was already committed in %s", manifest.step, self.uri)
            written = held
        return self.catalog.info_of(written), epoch

    def advance(self, step: int, epoch: int | None = None) -> bool:
        """Move ``latest`` forward to ``step`` (never back) under the lease ``epoch``; False if
        it was there or ahead already. Without an epoch (no commit just renewed the lease) the
        pointer is read first, and the lease renewed only if it has to move."""
        if epoch is None:
            pointer = self.catalog.pointer_or_none()
            if pointer is not None and pointer.step is not None and pointer.step >= step:
                return False
            epoch = self.hold_lease()
        return self.committer.advance_latest(step, epoch=epoch)

    def retain(self) -> None:
        """Apply this store's retention (a failure is logged; commits are never undone)."""
        self.pruner.after_save()
