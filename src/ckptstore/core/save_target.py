"""What a coordinated save needs of the store it commits in (:class:`SaveTarget`: saving.py's
``Saver`` is one), and what ``Coordinator.begin`` (coordination.py) checks against it before
any participant uploads: the step is not committed already (one a fenced writer committed is
removed), it is not behind ``latest``, and ``latest``'s manifest is read once for the
participants to copy unchanged files from. ``save_async`` runs the
``latest`` check in the caller too, before it snapshots anything (async_saving.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from ckptstore.domain import layout
from ckptstore.domain.info import SaveStats
from ckptstore.domain.manifest import Environment, FileEntry, Manifest
from ckptstore.domain.plan import Plan
from ckptstore.errors import CheckpointError, ConflictError, NotFoundError, StepBehindLatestError
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.removal import Remover

log = logging.getLogger(__name__)


class SaveTarget(Protocol):
    """What a coordinated save needs of the store it commits in (saving.py's ``Saver`` has it)."""

    catalog: Catalog
    committer: Committer
    remover: Remover
    incremental: bool
    save_timeout: float | None
    node: str | None  # the node whose disk the store's staged files are on (Staged.node)

    @property
    def uri(self) -> str: ...

    def latest_step(self) -> int | None: ...  # the step not to fall behind, in any tier

    def holder(self, step: int) -> str | None: ...  # the step's URI in a tier holding it

    def fences(self) -> Pointer | None: ...  # the pointer whose fences judge every tier

    def drain(self) -> None: ...

    def environment(self) -> Environment: ...

    def clock(self) -> float: ...

    def hold_lease(self) -> int: ...

    def ensure_lease(self) -> int: ...

    def discard_save(self, step: int, save: str | None, attempts: set[str]) -> None:
        """Remove what a save that will not be committed staged, in every tier (saving.py)."""
        ...

    def shares_to(self, plan: Plan) -> str | None:
        """The durable tier the participants of ``plan`` copy their files to as they stage
        them (a due step of a tiered store), or None (saving.py)."""
        ...

    def due(self, step: int) -> bool:
        """Whether ``step``, once committed, is due for the durable tier (saving.py)."""
        ...

    def share(self, plan: Plan, entries: Sequence[FileEntry]) -> None:
        """A participant staged ``entries`` (in a local tier: node_tier.py)."""
        ...

    def advance_latest(self, step: int, *, epoch: int, newest_before: int | None) -> None:
        """Move ``latest`` to the step just committed (saving.py)."""
        ...

    def saved(self, stats: SaveStats) -> None:
        """After a commit moved ``latest``: log, tell the observer, apply retention."""
        ...


def check_not_behind(saver: SaveTarget, step: int, latest: int | None) -> None:
    """Refuse a step older than ``latest``: nearly always a rerun that forgot to resume,
    whose saves retention would delete right after committing them. A pointer ahead of every
    committed step (its step deleted behind its back) is no reason to refuse:
    ``advance_latest`` repairs it. A guard against mistakes, not a lock."""
    if latest is None or step >= latest:
        return
    where = saver.holder(latest)
    if where is None:
        return  # a pointer at a step deleted or unreadable: a resume fell back past it
    raise StepBehindLatestError(
        f"{saver.uri}: refusing to save step {step}: latest is step {latest} ({where}), so step "
        f"{step} would commit behind it and retention could delete it at once; nothing "
        "was uploaded. If this run continues the old one, resume first "
        "(`store.load()`, or `ckptstore.integrations.training.resume()`) and save the "
        "steps after it; to start afresh, save into a new URI; to add an older step on "
        "purpose, pass allow_older=True (CLI: --allow-older; latest stays, retention applies "
        "as usual)",
        uri=saver.catalog.uri(layout.step_dir(step)),
        path=layout.step_dir(step),
        step=step,
    )


def check_step_is_free(saver: SaveTarget, step: int) -> None:
    """Refuse a committed step before anything is uploaded; remove a step that a writer
    fenced off by a lease takeover committed (pointer.py), since it is never loaded."""
    catalog = saver.catalog
    if catalog.backend.stat(layout.manifest_path(step)) is None:
        return
    try:
        manifest: Manifest | None = catalog.read_manifest(step)
    except NotFoundError:
        return  # a tombstone: the step was removed, and may be saved anew (removal.py)
    except CheckpointError:
        manifest = None  # unreadable, but there: committed all the same
    pointer = saver.fences()
    if (
        manifest is not None
        and pointer is not None
        and pointer.fenced(step, manifest.writer, manifest.lease_epoch)
    ):
        log.warning(
            "%s: removing step %d, committed by %s after it lost the writer lease (epoch %d); "
            "saving it anew",
            saver.uri,
            step,
            manifest.writer,
            manifest.lease_epoch,
        )
        saver.remover.uncommit(step)
        return
    raise ConflictError(
        f"step {step} is already committed in {saver.uri}; committed steps are immutable. "
        "Save under a new step, or `ckptstore rm` it first",
        uri=catalog.uri(layout.step_dir(step)),
        path=layout.step_dir(step),
        step=step,
    )


def read_latest(saver: SaveTarget, kind: str) -> tuple[int | None, Manifest | None]:
    """``latest``'s step, and (incremental, same kind) its manifest, whose unchanged files
    the participants copy: one pointer read and one manifest read per save."""
    latest = saver.latest_step()
    if latest is None:
        return None, None
    if not saver.incremental:
        return latest, None
    try:
        manifest = saver.catalog.read_manifest(latest)  # fresh: its files are copied
    except CheckpointError as e:
        log.debug("no previous step to reuse files from: %s", e)
        return latest, None
    return latest, manifest if manifest.kind == kind else None
