"""Defects the interleaving explorer and the stateful model found (issue 19), each reproduced
here without them, deterministically, as regression tests of their fixes.

* A coordinator that discarded its step removed a rival's attempt too and dropped its
  tombstone at once: the rival (a new lease holder, say, while the old job's rank failed) then
  committed a manifest whose files were gone. Now a discard removes only its own save's
  attempts (reported ones, and those whose marker names the save). Explorer:
  ``coordinated-discard``.
* gc dropped a tombstone by a read and then an unconditional delete; a writer that committed
  over the tombstone in between (allowed: the tombstone names none of its attempts) lost its
  manifest to that delete. Now the drop marks the tombstone by compare-and-swap first and
  deletes only within a window, and commits wait the mark out (removal.py). Explorer:
  ``takeover-gc`` and ``fenced-gc``.
* ``latest.json`` left behind the newest committed step (a writer killed between its commit
  and the pointer's move): ``delete`` and the save's behind-latest refusal judged "latest" by
  the pointer, while ``latest()`` (and every load) says the newest step. State machine.
* A local tier shared by a writer that lost the lease (a zombie on the same node) and its
  replacement. The local tier took the zombie's commits and nothing judged its pointer by the
  durable fences: the zombie's step was latest() (the resolver took a faster tier's pointer
  step unjudged), the new holder persisted it as the durable latest (close() and start()
  persisted without the fences) and could not save over it (the step was judged free by
  the local pointer, which has no fences); and a zombie's failed persist deleted the files
  of the new holder's persist of the same step, which shares its attempt ids (persisting
  commits the local manifest verbatim). Explorer: ``tiers`` with the next writer beside the
  first (no ``after``), at preemption bound 1 with a crash, or 2.

Each test drives the public API; where a race is needed, a backend proxy runs the other
party's call at the one point the explorer's schedule interleaves it.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, wiring
from ckptstore.backends.base import Backend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.core.reports import Staged
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from ckptstore.domain.manifest import (
    KIND_DIRECTORY,
    dropping_tombstone,
    encode_tombstone,
    tombstone_dropping,
)
from ckptstore.errors import CheckpointError, ConflictError, NotFoundError, StepBehindLatestError
from ckptstore.protocol import tombstones
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.removal import Remover
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
            contextvars.Context().run(other)  # the other party: not under this one's deadline

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


def test_a_discarding_coordinator_leaves_the_new_holders_step_whole(tmp_path: Path) -> None:
    """The old job (coordinator of a 2-rank save of step 2) is taken over; the new job saves
    step 2; right before the new job writes its manifest, the old job's rank 1 reports a
    failure and the old coordinator discards step 2. The new job's step must be whole (or
    its save must fail); the discard deleted its files under a committed manifest."""
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


class Observed(BackendProxy):
    """Sets ``saw_dropping`` once a read of ``path`` returns a tombstone being dropped."""

    def __init__(self, inner: Backend, path: str) -> None:
        super().__init__(inner)
        self.path = path
        self.saw_dropping = threading.Event()

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data, version = super().read_versioned(path)
        if path == self.path and tombstone_dropping(data) is not None:
            self.saw_dropping.set()
        return data, version


def test_gc_spares_a_step_committed_over_the_tombstone_it_drops(tmp_path: Path) -> None:
    """A job died staging step 2; a new job took the store over (so the lease proves the
    attempt dead). gc removes the attempt under a tombstone and, right before it deletes the
    tombstone, the new job saves step 2 over it (its attempt is not the one the tombstone
    names). The new job's step 2 must survive gc: a read-then-delete drop deleted its
    manifest, and latest() fell back to step 1. Now the commit waits while the tombstone is
    being dropped, and commits once it is gone."""
    uri = str(tmp_path / "run")
    manifest = layout.manifest_path(2)
    killed = _leased(uri)
    killed.save(1, state(1))
    begun = killed.begin_save(2)
    killed.stage_files(2, [SourceFile("half.bin", lambda: [b"half a save"])], plan=begun.plan)
    observed = Observed(open_backend(uri), manifest)
    new = _leased(uri, takeover=True, backend=observed)
    errors: list[BaseException] = []

    def rival_save() -> None:
        try:
            new.save(2, state(2))
        except BaseException as e:
            errors.append(e)

    rival = threading.Thread(target=rival_save)

    def rival_commits_meanwhile() -> None:
        rival.start()
        assert observed.saw_dropping.wait(30), "the rival never met the dropping tombstone"

    interleave = Interleave(open_backend(uri))
    interleave.before[("delete", manifest)] = rival_commits_meanwhile
    CheckpointStore(uri, backend=interleave, lease=False).gc(older_than=0)
    rival.join(60)
    assert not interleave.before, "the save did not run where the explorer ran it"
    assert not errors, f"the rival's save failed: {errors}"
    latest = CheckpointStore(uri, lease=False).latest()
    assert latest is not None and latest.step == 2, f"step 2 is gone; latest: {latest}"
    assert CheckpointStore(uri, lease=False).verify(2).ok


def _remover(uri: str, **clocks: Any) -> Remover:
    backend = open_backend(uri)
    return Remover(backend, writer="dropper", catalog=Catalog(backend), **clocks)


def test_a_commit_swaps_over_a_tombstone_whose_dropper_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dropper marked the tombstone and died: a save of the step waits out the window
    (shortened here), then commits over it."""
    monkeypatch.setattr(tombstones, "DROP_WINDOW", 0.2)
    monkeypatch.setattr(tombstones, "DROP_MARGIN", 0.1)
    uri = str(tmp_path / "run")
    store = CheckpointStore(uri, lease=False)
    store.save(1, state(1))
    abandoned = encode_tombstone("dead", time.time(), ["0123456789abcdef"])
    store.backend.write(
        layout.manifest_path(2), [dropping_tombstone(abandoned, "dead", time.time())]
    )
    store.save(2, state(2))
    assert torch.equal(CheckpointStore(uri, lease=False).load(2)["w"], state(2)["w"])


def test_a_dropper_past_its_window_leaves_the_tombstone(tmp_path: Path) -> None:
    """Marking took longer than the window (a stalled request): the dropper must not delete
    any more, since a waiter may already have swapped a manifest over the mark."""
    uri = str(tmp_path / "run")
    CheckpointStore(uri, lease=False).save(1, state(1))
    ticks = itertools.chain([0.0], itertools.repeat(tombstones.DROP_WINDOW + 1))
    remover = _remover(uri, monotonic=lambda: next(ticks))
    tombstone = encode_tombstone("gc", time.time(), ["0123456789abcdef"])
    remover.backend.write(layout.manifest_path(2), [tombstone])
    remover.tombstones.drop(2)
    held = remover.backend.read(layout.manifest_path(2))
    assert tombstone_dropping(held) is not None, "the tombstone was deleted past the window"


def test_a_dropper_within_its_window_deletes_the_tombstone(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    CheckpointStore(uri, lease=False).save(1, state(1))
    remover = _remover(uri)
    remover.backend.write(
        layout.manifest_path(2), [encode_tombstone("gc", time.time(), ["0123456789abcdef"])]
    )
    remover.tombstones.drop(2)
    with pytest.raises(NotFoundError):
        remover.backend.read(layout.manifest_path(2))


def test_a_dropper_never_deletes_a_manifest_committed_over_its_tombstone(tmp_path: Path) -> None:
    """The commit lands between the dropper's read and its mark: the mark's compare-and-swap
    fails and the manifest stays."""
    uri = str(tmp_path / "run")
    store = CheckpointStore(uri, lease=False)
    store.save(1, state(1))
    path = layout.manifest_path(1)
    manifest = store.backend.read(path)
    tombstone = encode_tombstone("gc", time.time(), ["0123456789abcdef"])
    inner = open_backend(uri)
    inner.write(path, [tombstone])
    interleave = Interleave(inner)
    remover = Remover(interleave, writer="gc", catalog=Catalog(inner))
    original = interleave.swap

    def commit_first(p: str, data: bytes, expected: str | None) -> str:
        if p == path:
            _, version = inner.read_versioned(path)
            inner.swap(path, manifest, version)  # the rival's commit over the tombstone
        return original(p, data, expected)

    interleave.swap = commit_first  # type: ignore[method-assign]
    remover.tombstones.drop(1)
    assert inner.read(path) == manifest


# -- a pointer left behind latest() ----------------------------------------------------------


def _pointer_step(store: CheckpointStore) -> int | None:
    try:
        step = json.loads(store.backend.read(layout.LATEST_NAME)).get("step")
    except NotFoundError:
        return None
    return step if isinstance(step, int) else None


def _stale_pointer(root: Path, newest: int = 3) -> CheckpointStore:
    """Step 1 committed and latest; then step ``newest`` committed by a writer killed right
    before it moved ``latest.json``: latest() is ``newest``, the pointer says 1."""
    uri = str(root / "run")
    CheckpointStore(uri, lease=False).save(1, state(1))
    switch = FaultyBackend(open_backend(uri), fail_at=None, mode="crash")
    original_swap = switch.swap

    def die_at_the_pointer(path: str, data: bytes, expected: str | None) -> str:
        if path == layout.LATEST_NAME:
            raise InjectedFault("killed between the commit and the pointer's move")
        return original_swap(path, data, expected)

    switch.swap = die_at_the_pointer  # type: ignore[method-assign]
    with contextlib.suppress(InjectedFault):  # a step committed is reported committed
        CheckpointStore(uri, backend=switch, lease=False).save(newest, state(newest))
    store = CheckpointStore(uri, lease=False)
    latest = store.latest()
    assert latest is not None and latest.step == newest and _pointer_step(store) == 1
    return store


def test_rm_of_the_latest_step_behind_a_stale_pointer_needs_force(tmp_path: Path) -> None:
    """State machine: kill_saving, then rm_latest. The step latest() returns is deleted
    without ``force``; the step the pointer names is the one refused as latest."""
    with pytest.raises(ConflictError):
        _stale_pointer(tmp_path).delete(3)


def test_a_save_behind_latest_behind_a_stale_pointer_is_refused(tmp_path: Path) -> None:
    """State machine: kill_saving, then save_behind_latest_is_refused. Step 2, behind
    latest() = 3, is committed, where a rerun that forgot to resume must be refused."""
    with pytest.raises(StepBehindLatestError):
        _stale_pointer(tmp_path).save(2, state(2))


def test_a_refused_save_does_not_make_a_stale_pointer_trusted(tmp_path: Path) -> None:
    """State machine (full suite): kill_saving, save_behind_latest_is_refused(0), then (2).
    The first refusal listed the steps and found 3 past the pointer; the second save must
    not then take the pointer (1) at its word and commit step 2 behind latest() = 3."""
    store = _stale_pointer(tmp_path)
    with pytest.raises(StepBehindLatestError):
        store.save(0, state(0))
    with pytest.raises(StepBehindLatestError):
        store.save(2, state(2))
    assert [i.step for i in store.list()] == [1, 3]


def test_an_older_step_saved_on_purpose_does_not_make_a_stale_pointer_trusted(
    tmp_path: Path,
) -> None:
    """allow_older commits step 2 and moves the pointer from 1 to 2; step 5 is still newer,
    so a save of step 4 after it is refused as behind latest."""
    store = _stale_pointer(tmp_path, newest=5)
    store.save(2, state(2), allow_older=True)
    with pytest.raises(StepBehindLatestError):
        store.save(4, state(4))
    assert [i.step for i in store.list()] == [1, 2, 5]


# -- a local tier shared by a fenced writer and its replacement (explorer: tiers, zombie) --------
#
# Found by the ``tiers`` scenario run with the next writer *beside* the first (no ``after``:
# it takes the store over while the first is alive, a zombie on the same node) at preemption
# bound 2 (and bound 1 with a crash). The local tier has no lease of its own and no fences:
# a zombie still commits there, so every way from the local tier to a load or to the durable
# tier must apply the durable pointer's fences to the local pointer's step.


def _tiered(durable: str, local: str, **options: Any) -> CheckpointStore:
    return _leased(durable, local=local, persist_every=2, **options)


def _zombie_commits_locally_after_a_takeover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, str, CheckpointStore, CheckpointStore]:
    """Job A (local tier L) saved step 1, durable. It saves step 2: right after its last
    renewal of the lease and before its local manifest, job B opens the store with the same
    local tier and ``takeover=True``, which fences A's steps above 1 (step 2 is not committed
    anywhere yet). A, not killed, commits step 2 in L and moves L's latest to it."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    interleave = Interleave(open_backend(local))
    with monkeypatch.context() as patched:
        patched.setattr(wiring, "open_backend", lambda uri, options=None: interleave)
        zombie = _tiered(durable, local)
    zombie.save(1, state(1), persist=True)
    zombie.wait()
    taken: list[CheckpointStore] = []
    interleave.before[("create", layout.manifest_path(2))] = lambda: taken.append(
        _tiered(durable, local, takeover=True)
    )
    with contextlib.suppress(CheckpointError):
        zombie.save(2, state(2))
    assert taken and not interleave.before, "the takeover did not run where the explorer ran it"
    new = taken[0]
    assert 2 in new.fenced_steps(), "step 2 should be the zombie's: committed after the fence"
    return durable, local, zombie, new


def test_a_zombies_local_step_is_never_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explorer ``tiers`` (zombie variant), invariant tiered-latest: latest() of the new
    holder, and of any store over both tiers, was A's fenced step 2 (the local pointer's),
    and load() loaded it. It is step 1."""
    durable, local, _, new = _zombie_commits_locally_after_a_takeover(tmp_path, monkeypatch)
    reader = CheckpointStore(durable, local=local, lease=False)
    for store in (new, reader):
        latest = store.latest()
        found = latest.step if latest is not None else None
        assert found == 1, f"latest() is step {found} ({latest.tier if latest else ''}), fenced"
        assert torch.equal(store.load()["w"], state(1)["w"])


def test_the_new_holder_never_persists_a_zombies_local_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explorer ``tiers`` (zombie variant), invariant latest-never-fenced (durable tier): B
    resumed from step 1 before A's local commit; its save of step 2 failed (see the next
    test), and its close() persisted A's step 2 as the durable latest, a fenced step every
    plain store resumed from. Whatever B's save does, the durable latest is never fenced."""
    durable, _, _, new = _zombie_commits_locally_after_a_takeover(tmp_path, monkeypatch)
    with contextlib.suppress(CheckpointError):
        new.save(2, state(22))
    with contextlib.suppress(CheckpointError):
        new.close()
    plain = CheckpointStore(durable, lease=False)
    latest = plain.latest()
    assert latest is not None and latest.step not in plain.fenced_steps(), (
        f"the durable latest is step {latest.step if latest else None}, fenced "
        f"({plain.fenced_steps()})"
    )


def test_the_new_holder_saves_over_a_zombies_local_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explorer ``tiers`` (zombie variant): B, resumed from step 1, saves step 2 over A's
    fenced local step 2, as a durable-only store does (fenced-gc); it was refused as
    committed."""
    _, _, _, new = _zombie_commits_locally_after_a_takeover(tmp_path, monkeypatch)
    new.save(2, state(22))
    assert torch.equal(new.load(2)["w"], state(22)["w"])


class Gate(BackendProxy):
    """Holds the first write under ``prefix`` until ``go`` is set (``reached`` says it
    waits): a thread of the process stopped there, as the explorer's schedule stops it."""

    def __init__(self, inner: Backend, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.reached, self.go = threading.Event(), threading.Event()

    def write(self, path: str, chunks: Any) -> int:
        if path.startswith(self.prefix) and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(30), "the gate was never opened"
        return super().write(path, chunks)


def test_a_zombies_failed_persist_leaves_the_new_holders_persist_whole(tmp_path: Path) -> None:
    """Explorer ``tiers`` (zombie variant), invariant committed-step-whole (durable tier):
    A's step 2 is due; its persist stops before its first durable write. B takes over (the
    fence admits step 2: it is committed in the local tier) and persists the pinned step 2
    itself; right before B's manifest, A's persist goes on and fails at its fence check. Its
    cleanup discarded the attempt, which is B's too (the local manifest's), and B committed
    a step whose files were gone. B's step 2 is whole."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    gate = Gate(open_backend(durable), layout.step_dir(2) + "/")
    zombie = _tiered(durable, local, backend=gate)
    zombie.save(1, state(1), persist=True)
    zombie.wait()
    zombie.save(2, state(2), persist=True)  # committed locally; its persist runs in the back
    assert gate.reached.wait(30), "the zombie's persist never reached the durable tier"
    interleave = Interleave(open_backend(durable))
    new = _tiered(durable, local, backend=interleave, takeover=True)

    def zombie_persist_goes_on() -> None:
        gate.go.set()
        with contextlib.suppress(CheckpointError):
            zombie.wait()  # fails: FencedError at its renewal, after which it cleans up

    interleave.before[("create", layout.manifest_path(2))] = zombie_persist_goes_on
    new.save(3, state(3))  # the first write: persists the pinned step 2 in the background
    with contextlib.suppress(CheckpointError):
        new.wait()
    assert not interleave.before, "the zombie did not go on where the explorer ran it"
    plain = CheckpointStore(durable, lease=False)
    assert 2 in [i.step for i in plain.list()], "the new holder did not persist step 2"
    report = plain.verify(2)
    assert report.ok, f"step 2 is committed in the durable tier but broken: {report.problems}"
