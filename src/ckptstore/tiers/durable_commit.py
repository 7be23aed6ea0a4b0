"""The commit of one local step in the durable tier: :func:`persist`.

Persisting a step is a coordinated save (core/coordination.py: begin, stage, commit) of one
participant whose staging is a copy of the local tier's files: the same sequence as every save,
written once here, with the very manifest the local tier committed. What a kill or a rival left
(the step committed there already), a writer fenced off by a takeover, and a failure before the
manifest (what was copied leaves, under the lease only) are settled here. The thread that calls
it for each due step is persist_queue.py's.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

from ckptstore.core.coordination import Coordinator
from ckptstore.core.saving import Saver
from ckptstore.deadline import clean_up, within
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.plan import Plan, Previous
from ckptstore.errors import (
    CheckpointError,
    ConflictError,
    FencedError,
)

log = logging.getLogger("ckptstore.tiers.persister")  # one logger for all of persisting


def persist(
    saver: Saver, manifest: Manifest, copy: Callable[[int, Sequence[FileEntry]], None]
) -> CheckpointInfo:
    """Commit ``manifest``, a step committed in a faster tier of the same store, verbatim in
    ``saver``'s tier (tiers/local.py): the coordinated save of one participant whose staging is
    ``copy(step, files)`` of the files not there yet, by the save's deadline. The same
    sequence as every save: the writer lease, attempt markers, the files, the fence check, the
    manifest create-only, ``latest`` forward only, retention. A step already committed there
    with the same files (a kill after the commit) is done; with other files, a ConflictError.
    A step that a writer fenced off by a takeover committed (a zombie beside the new holder on
    one node) is never persisted. A failure before the manifest removes what was copied, but
    only under the lease (:func:`_abandon`)."""
    step = manifest.step
    with within(saver.save_timeout):
        epoch = saver.ensure_lease()
        _refuse_fenced(saver, manifest)
        held = _committed_manifest(saver, step)
        if held is not None:
            return _persisted_before(saver, held, manifest)
        plan = Plan(step, manifest.kind, epoch, Previous(None), secrets.token_hex(8))
        coordinator = Coordinator(saver, step, manifest.kind, plan, dict(manifest.metadata))
        attempts = sorted({f.attempt for f in manifest.files if f.attempt is not None})
        present = saver.catalog.payload_sizes(step)

        def abandon(_: set[str]) -> None:
            _abandon(coordinator, set(attempts))

        try:
            for attempt in attempts:  # the markers say whose files these are (garbage.py)
                saver.committer.begin_attempt(step, epoch, attempt, save=plan.save)
            copy(step, [f for f in manifest.files if present.get(f.key(step)) != f.size])
        except BaseException:
            _abandon(coordinator, set(attempts))
            raise
        try:
            return coordinator.publish(manifest.files, lambda _: manifest, on_failure=abandon)
        except ConflictError:
            held = _committed_manifest(saver, step)  # a rival persisted it meanwhile?
            if held is None:
                raise
            return _persisted_before(saver, held, manifest)


def _refuse_fenced(saver: Saver, manifest: Manifest) -> None:
    pointer = saver.fences()
    if pointer is not None and pointer.fenced(manifest.step, manifest.writer, manifest.lease_epoch):
        if manifest.writer == saver.committer.writer:
            saver.hold_lease()  # fenced itself (a takeover during an outage): the renewal
            # finds the new holder, so this writer knows and commits nothing more, not even
            # locally (lease.py)
        raise FencedError(
            f"{saver.uri}: step {manifest.step} of the local tier was committed by "
            f"{manifest.writer} after it lost the writer lease; it is not persisted (it is "
            "never latest; `ckptstore rm` it in the local tier)",
            uri=saver.catalog.uri(layout.step_dir(manifest.step)),
            step=manifest.step,
        )


def _abandon(coordinator: Coordinator, attempts: set[str]) -> None:
    """Remove what a failed persist copied. Its attempts are the local manifest's, which the
    store's next lease holder may be persisting at the same moment (a writer fenced beside it
    on one node): so only under the lease, renewed now. A fenced writer deletes nothing (gc
    does); the holder may, as no other writer can commit these attempts meanwhile."""
    saver = coordinator.saver
    try:
        saver.hold_lease()
    except CheckpointError as e:
        log.warning(
            "%s: the files of step %d's failed persist are left to gc: %s",
            saver.uri,
            coordinator.step,
            e,
        )
        return
    step = coordinator.step
    clean_up(lambda: saver.remover.discard_attempts(step, attempts), f"step {step}'s copied files")


def _committed_manifest(saver: Saver, step: int) -> Manifest | None:
    if not saver.catalog.state_of(step, fresh=True).committed:
        return None
    return saver.catalog.read_manifest(step)


def _persisted_before(saver: Saver, held: Manifest, wanted: Manifest) -> CheckpointInfo:
    """``wanted``'s step is committed in ``saver``'s tier already: done if with the same
    files (``latest`` still moves forward to it), else a ConflictError."""
    step = wanted.step
    if held.files != wanted.files:
        raise ConflictError(
            f"step {step} is committed in {saver.uri} with other files than the local tier's; "
            "committed steps are immutable, so the local copy cannot be persisted. Remove one "
            f"of them (ckptstore rm {saver.uri} {step}) or keep saving later steps",
            uri=saver.catalog.uri(layout.step_dir(step)),
            path=layout.step_dir(step),
            step=step,
        )
    saver.advance_latest(step, epoch=saver.hold_lease(), newest_before=None)
    return saver.catalog.info_of(held)
