"""Defects the interleaving explorer and the stateful model found (issue 19), each reproduced
here without them, deterministically, and pinned ``xfail(strict=True)``: once one is fixed its
test passes, strict xfail fails the run, and the mark comes off, leaving a regression test.

* A coordinator that discards its step removes a rival's attempt too and drops its tombstone
  at once (``Remover.discard_step``): the rival (a new lease holder, say, while the old job's
  rank failed) then commits a manifest whose files are gone. Explorer: ``coordinated-discard``.
* gc drops a tombstone by a read and then an unconditional delete
  (``Remover.drop_tombstone``); a writer that commits over the tombstone in between (allowed:
  the tombstone names none of its attempts) loses its committed manifest to that delete.
  Explorer: ``takeover-gc`` and ``fenced-gc``.
* ``latest.json`` left behind the newest committed step (a writer killed between its commit
  and the pointer's move): ``delete`` and the save's behind-latest refusal judge "latest" by
  the pointer, while ``latest()`` (and every load) says the newest step. State machine.

Each test drives the public API; where a race is needed, a backend proxy runs the other
party's call at the one point the explorer's schedule interleaves it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, layout
from ckptstore.backends.base import Backend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.coordination import Staged
from ckptstore.errors import CheckpointError, ConflictError, NotFoundError, StepBehindLatestError
from ckptstore.manifest import KIND_DIRECTORY
from ckptstore.payload import SourceFile
from faults import FaultyBackend, InjectedFault


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(step)), "step": step}


class Interleave(BackendProxy):
    """Runs ``before[(op, path)]`` once, right before this backend's first ``op`` on ``path``
    (``create`` or ``delete``): where the explorer's schedule switched to the other party."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.before: dict[tuple[str, str], Callable[[], object]] = {}

    def _point(self, op: str, path: str) -> None:
        other = self.before.pop((op, path), None)
        if other is not None:
            other()

    def create(self, path: str, data: bytes) -> None:
        self._point("create", path)
        super().create(path, data)

    def delete(self, paths: list[str]) -> None:  # type: ignore[override]
        for path in paths:
            self._point("delete", path)
        super().delete(paths)


def _leased(uri: str, **options: Any) -> CheckpointStore:
    return CheckpointStore(uri, lease_ttl=math.inf, **options)


# -- a discarding coordinator and a rival's save ------------------------------------------------


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="Remover.discard_step")
def test_a_discarding_coordinator_leaves_the_new_holders_step_whole(tmp_path: Path) -> None:
    """The old job (coordinator of a 2-rank save of step 2) is taken over; the new job saves
    step 2; right before the new job writes its manifest, the old job's rank 1 reports a
    failure and the old coordinator discards step 2. The new job's step must be whole (or
    its save must fail): here it commits a manifest whose files the discard deleted."""
    uri = str(tmp_path / "run")
    old = _leased(uri)
    old.save(1, state(1))
    begun = old.begin_save(2, kind=KIND_DIRECTORY)
    begun.stage_here([SourceFile("rank_00000/part.bin", lambda: [b"rank 0"])])
    interleave = Interleave(open_backend(uri))
    new = _leased(uri, backend=interleave, takeover=True)
    failed = Staged.failure(1, OSError("rank 1: no space left on device"))

    def old_rank_fails() -> None:
        with contextlib.suppress(CheckpointError):
            begun.conclude([failed])  # discards step 2, raising DistributedCheckpointError

    interleave.before[("create", layout.manifest_path(2))] = old_rank_fails
    with contextlib.suppress(CheckpointError):
        new.save(2, state(2))
    assert not interleave.before, "the discard did not run where the explorer ran it"
    if any(i.step == 2 for i in new.list()):
        report = new.verify(2)
        assert report.ok, f"step 2 is committed but broken: {report.problems}"


# -- gc's tombstone and a commit over it ------------------------------------------------------


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="Remover.drop_tombstone")
def test_gc_spares_a_step_committed_over_the_tombstone_it_drops(tmp_path: Path) -> None:
    """A job died staging step 2; a new job took the store over (so the lease proves the
    attempt dead). gc removes the attempt under a tombstone and, between reading the
    tombstone and deleting it, the new job saves step 2 over it (its attempt is not the one
    the tombstone names). The new job's committed step 2 must survive gc: here gc deletes
    its manifest, and latest() falls back to step 1."""
    uri = str(tmp_path / "run")
    killed = _leased(uri)
    killed.save(1, state(1))
    begun = killed.begin_save(2)
    killed.stage_files(2, [SourceFile("half.bin", lambda: [b"half a save"])], plan=begun.plan)
    new = _leased(uri, takeover=True)
    interleave = Interleave(open_backend(uri))
    interleave.before[("delete", layout.manifest_path(2))] = lambda: new.save(2, state(2))
    CheckpointStore(uri, backend=interleave, lease=False).gc(older_than=0)
    assert not interleave.before, "the save did not run where the explorer ran it"
    latest = CheckpointStore(uri, lease=False).latest()
    assert latest is not None and latest.step == 2, f"step 2 is gone; latest: {latest}"


# -- a pointer left behind latest() ----------------------------------------------------------

STALE_POINTER = (
    "delete() and the save's behind-latest check judge 'latest' by latest.json, which a "
    "writer killed between its commit and the pointer's move leaves behind latest()"
)


def _pointer_step(store: CheckpointStore) -> int | None:
    try:
        step = json.loads(store.backend.read(layout.LATEST_NAME)).get("step")
    except NotFoundError:
        return None
    return step if isinstance(step, int) else None


def _stale_pointer(root: Path) -> CheckpointStore:
    """Step 1 committed and latest; then step 3 committed by a writer killed right before it
    moved ``latest.json``: latest() is 3, the pointer says 1."""
    uri = str(root / "run")
    CheckpointStore(uri, lease=False).save(1, state(1))
    switch = FaultyBackend(open_backend(uri), fail_at=None, mode="crash")
    original_swap = switch.swap

    def die_at_the_pointer(path: str, data: bytes, expected: str | None) -> str:
        if path == layout.LATEST_NAME:
            raise InjectedFault("killed between the commit and the pointer's move")
        return original_swap(path, data, expected)

    switch.swap = die_at_the_pointer  # type: ignore[method-assign]
    with pytest.raises(InjectedFault):
        CheckpointStore(uri, backend=switch, lease=False).save(3, state(3))
    store = CheckpointStore(uri, lease=False)
    latest = store.latest()
    assert latest is not None and latest.step == 3 and _pointer_step(store) == 1
    return store


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=STALE_POINTER)
def test_rm_of_the_latest_step_behind_a_stale_pointer_needs_force(tmp_path: Path) -> None:
    """State machine: kill_saving, then rm_latest. The step latest() returns is deleted
    without ``force``; the step the pointer names is the one refused as latest."""
    with pytest.raises(ConflictError):
        _stale_pointer(tmp_path).delete(3)


@pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=STALE_POINTER)
def test_a_save_behind_latest_behind_a_stale_pointer_is_refused(tmp_path: Path) -> None:
    """State machine: kill_saving, then save_behind_latest_is_refused. Step 2, behind
    latest() = 3, is committed, where a rerun that forgot to resume must be refused."""
    with pytest.raises(StepBehindLatestError):
        _stale_pointer(tmp_path).save(2, state(2))
