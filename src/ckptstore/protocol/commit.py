"""The commit protocol, over any backend: how a step comes to exist.

1. Each save attempt writes into a directory of its own (layout.py), an attempt marker first,
   then every payload file, each atomically, with a CRC32C (and, in signed stores, a SHA-256)
   computed as the bytes stream past. Rival writers of one step never share a key.
2. One listing of the step directory confirms each file is present with its size, then the
   manifest, the commit marker, is written last with a create-only write: a step exists if and
   only if its manifest does, it can be committed once, and the manifest that wins describes
   exactly the bytes of the attempt(s) it lists.
3. ``latest`` then moves by compare-and-swap, only forward: on a lost race the pointer is
   re-read and the move retried only while our step is still newer. A pointer left ahead of
   every committed step (its step was deleted) is repaired by the next move.

How steps and attempts go away again, tombstone first, is removal.py's part. Readers treat
manifests as the truth and ``latest`` as a fast path (catalog.py)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from ckptstore.backends.base import Backend
from ckptstore.data.payload import Progress, SourceFile
from ckptstore.deadline import clean_up, map_in_context
from ckptstore.domain import layout
from ckptstore.domain.manifest import (
    FileEntry,
    Manifest,
    tombstone_attempts,
    tombstone_dropping,
)
from ckptstore.domain.plan import Previous
from ckptstore.domain.step_index import Summary
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    ErrorContext,
    FencedError,
    IncompleteCheckpointError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)
from ckptstore.protocol.cas import BACKOFF, swap_loop
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.payload_files import PayloadFiles
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.removal import Remover
from ckptstore.retry import Retry

log = logging.getLogger(__name__)

COMMIT_OVER = Retry(BACKOFF, attempts=5)
"""Looks at a manifest key a commit finds taken, while removals keep changing it, with
cas.py's backoff between them (they race those removals for the key)."""


class Committer:
    """Writes steps into one backend following the protocol above."""

    def __init__(
        self,
        catalog: Catalog,
        remover: Remover,
        *,
        writer: str,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        faster_tiers: tuple[Catalog, ...] = (),
    ) -> None:
        self.catalog = catalog
        self.faster_tiers = faster_tiers
        """The store's tiers in front of this one (tiers/local.py): a takeover's fence admits the
        steps committed there too."""
        self.backend: Backend = catalog.backend
        self.signer = catalog.signer
        self.remover = remover
        self.writer = writer
        self.clock = clock
        self.sleep = sleep
        self.digests = self.signer is not None
        """Record a SHA-256 of every file: signed manifests must cover the bytes themselves."""

    # -- writing -------------------------------------------------------------------------

    def write_payload(
        self,
        step: int,
        files: Iterable[SourceFile],
        progress: Progress | None = None,
        *,
        previous: Manifest | Previous | None = None,
        epoch: int = 0,
        save: str | None = None,
    ) -> list[FileEntry]:
        """Write every payload file (several at once) into a new attempt directory; returns
        their manifest entries. On failure the attempt's files are removed (best effort).

        A file whose size and checksum equal those of the same path in ``previous`` (a
        manifest, or the entries a coordinator handed over) is copied from there (server-side
        on S3, a hard link locally) instead of uploaded. ``progress``
        is called with each chunk's size as it is handed to the backend. ``save`` (a
        coordinated save's id) goes into the attempt's marker.
        """
        sources = list(files)
        if len({f.path for f in sources}) != len(sources):
            raise ConflictError(f"step {step}: two payload files share a path")
        for source in sources:
            layout.check_relpath(source.path, where=f"step {step}")
        reuse = Previous.of(previous) if isinstance(previous, Manifest) else previous
        attempt = self.begin_attempt(step, epoch, save=save)

        files_of = PayloadFiles(self.backend, step, attempt, reuse, self.digests, progress)
        workers = max(1, min(self.backend.parallel_writes, len(sources)))
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-write") as pool:
                return map_in_context(pool, files_of.write, sources)  # under the save's deadline
        except BaseException:
            what = f"the files of {self.catalog.uri(layout.step_dir(step))}'s failed attempt"
            clean_up(lambda: self.remover.discard_attempts(step, {attempt}), what)
            raise

    def begin_attempt(
        self, step: int, epoch: int, attempt: str | None = None, *, save: str | None = None
    ) -> str:
        """Write the marker of an attempt (a fresh one by default) before any of its files."""
        attempt = attempt if attempt is not None else secrets.token_hex(8)
        marker: dict[str, object] = {"writer": self.writer, "lease_epoch": epoch}
        marker |= {"started": self.clock()} | ({"save": save} if save is not None else {})
        self.backend.write(layout.attempt_marker_path(step, attempt), [json.dumps(marker).encode()])
        return attempt

    def confirm_payload(self, step: int, entries: Iterable[FileEntry]) -> None:
        """One listing proves every file is in place before the commit marker is written."""
        present = self.catalog.payload_sizes(step)
        for entry in entries:
            path = entry.key(step)
            if present.get(path) != entry.size:
                raise IncompleteCheckpointError(
                    f"{self.catalog.uri(path)} vanished or changed size before step {step} was "
                    "committed (a concurrent gc or rm?); nothing was committed, save again"
                )

    def commit(self, manifest: Manifest) -> Manifest:
        """Write the commit marker, create-only: the step exists from this moment.

        Returns the manifest as written (signed, when there is a signer).
        """
        path = layout.manifest_path(manifest.step)
        if self.signer is not None:
            undigested = [f.path for f in manifest.files if f.sha256 is None]
            if undigested and manifest.schema_version >= 2:
                raise ConfigError(
                    f"{self.backend.uri}: step {manifest.step} cannot be signed: "
                    f"{undigested[0]!r} was staged without a SHA-256 (by a process without the "
                    "signing key?). Set the key (CKPTSTORE_SIGNING_KEY) on every process that "
                    "stages files; nothing was committed"
                )
            manifest = self.signer.sign(manifest)
        data = manifest.encode()
        self.catalog.index.announce(manifest.step, self.writer)
        try:
            self.backend.create(path, data)
        except ObjectExistsError as e:
            self._commit_over(manifest, data, e)
        self.catalog.remember(manifest)
        self.index_committed(manifest)
        return manifest

    def index_committed(self, manifest: Manifest) -> None:
        """Record a committed step in the step index (step_index.py). A failure is logged:
        the step is committed, and its claim makes readers add it."""
        try:
            self.catalog.index.add([Summary.of(manifest)], self.writer)
        except CheckpointError as e:
            log.warning(
                "%s: step %d is committed but the step index was not updated (%s); readers "
                "add it from its manifest",
                self.backend.uri,
                manifest.step,
                e,
            )

    def _commit_over(self, manifest: Manifest, data: bytes, error: ObjectExistsError) -> None:
        """The manifest key is taken: by our own write whose answer was lost (done), by a
        tombstone naming none of our attempts (replace it by compare-and-swap; one being
        dropped is waited out first, removal.py), or else by a rival's manifest or a removal
        of our attempts (ConflictError)."""
        path = layout.manifest_path(manifest.step)
        where = self.catalog.uri(path)
        context = ErrorContext(uri=where, step=manifest.step, path=path)
        ours = {f.attempt for f in manifest.files}

        def look() -> None:
            """One look at the key; a lost race (the key changed) raises, to look again."""
            try:
                held, version = self.backend.read_versioned(path)
            except NotFoundError:
                self.backend.create(path, data)  # dropped meanwhile: create it
                return
            if held == data and manifest.writer == self.writer:
                return
            removed = tombstone_attempts(held)
            if removed is None:
                raise ConflictError(
                    f"step {manifest.step} is already committed in {self.backend.uri}; "
                    "committed steps are immutable. Save under a new step, or `ckptstore rm` "
                    "it first",
                    **context,
                ) from error
            if not removed.isdisjoint(ours):
                raise ConflictError(
                    f"step {manifest.step} in {self.backend.uri} was removed while this save "
                    "staged its files (gc judged them abandoned, or a coordinator discarded "
                    "the step); nothing was committed. Save again",
                    **context,
                ) from error
            if tombstone_dropping(held) is not None and self.remover.tombstones.outwait_drop(
                path, version
            ):
                raise PreconditionFailedError(f"{where} changed while it was waited on", **context)
            self.backend.swap(path, data, version)

        try:
            COMMIT_OVER.run(look, retryable=_raced, target=where, doing="commit", sleep=self.sleep)
        except (ObjectExistsError, PreconditionFailedError):
            raise BackendError(
                f"{where} keeps changing (removals of step {manifest.step} racing this commit); "
                "nothing was committed. Save again",
                retryable=True,
                **context,
            ) from error

    def advance_latest(self, step: int, *, epoch: int = 0, rollback: bool = False) -> bool:
        """Move ``latest`` to ``step`` by compare-and-swap; returns False if it was ahead.

        Without ``rollback`` the pointer only moves forward: if another writer already moved
        it past ``step`` to a committed step it stays there. A pointer stamped with a newer
        lease ``epoch`` than ours means we were fenced.
        """
        where = self.catalog.uri(layout.LATEST_NAME)

        def decide(data: bytes | None) -> bytes | None:
            current = self._decode_pointer(data, f"moving it to step {step}")
            if current is not None and not rollback and current.epoch > epoch:
                raise FencedError(
                    f"{where} was moved by {current.writer} holding a newer writer lease "
                    f"(epoch {current.epoch} > {epoch}); step {step} is committed but this "
                    "writer may no longer move latest. Stop this job"
                )
            ahead = current is not None and current.step is not None and current.step >= step
            if ahead and not rollback and current is not None and current.step is not None:
                held = self.catalog.state_of(current.step, fresh=True)
                if current.step == step or held.committed:
                    return None  # never back past a committed step, readable or not
                log.warning(
                    "%s pointed at step %d, which is not committed (deleted behind its back?); "
                    "repairing it: moving it to step %d",
                    where,
                    current.step,
                    step,
                )
            base = current if current is not None else Pointer(None, self.writer, 0.0)
            return base.moved(step, self.writer, self.clock(), epoch).encode()

        return swap_loop(
            self.backend,
            layout.LATEST_NAME,
            decide,
            what=f"move latest to step {step}",
            sleep=self.sleep,
        )

    def stamp_latest(self, epoch: int, displaced: str) -> None:
        """Stamp ``latest`` (same step) with a new lease epoch and a fence naming the holder
        it ``displaced`` (pointer.py), so that writer can neither move it nor have a late step
        of its taken for latest.

        The fence stands at the newest step committed now, found by listing, not at the
        pointer's: an older holder killed between its commit and moving ``latest`` committed
        that step while it held the lease, and fencing it would make ``latest`` go back. The
        same holds for a step committed in a faster tier of the store and not yet persisted
        (tiers/local.py): the new holder persists it as the store's own.
        """
        newest = self._newest_committed()

        def decide(data: bytes | None) -> bytes | None:
            current = self._decode_pointer(data, "stamping it")
            if current is not None and current.epoch >= epoch:
                return None
            base = current if current is not None else Pointer(None, self.writer, 0.0)
            return base.stamped(self.writer, self.clock(), epoch, displaced, newest).encode()

        swap_loop(
            self.backend,
            layout.LATEST_NAME,
            decide,
            what="stamp latest with a new lease epoch",
            sleep=self.sleep,
        )

    def _newest_committed(self) -> int | None:
        newest = None
        for catalog in (self.catalog, *self.faster_tiers):
            for step in reversed(catalog.step_dirs()):
                if newest is not None and step <= newest:
                    break
                if catalog.state_of(step, fresh=True).committed:
                    newest = step
                    break
        return newest

    def _decode_pointer(self, data: bytes | None, doing: str) -> Pointer | None:
        if data is None:
            return None
        try:
            return Pointer.decode(data, self.catalog.uri(layout.LATEST_NAME))
        except CorruptCheckpointError as e:
            log.warning("%s; replacing it, %s", e, doing)
            return None


def _raced(e: Exception) -> bool:
    """A create-only write or a compare-and-swap lost to a change of the key: look again."""
    return isinstance(e, (ObjectExistsError, PreconditionFailedError))
