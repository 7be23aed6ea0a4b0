"""Removals that finish and killed saves that go (invariant 10): a removal killed at any
point is rolled forward by the next prune or gc; attempts of a killed writer, proven dead by
the lease, are removed with their tombstone; whatever gc leaves, it says why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from faults import FaultyBackend, InjectedFault


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(n)), "b": torch.arange(n + 4)}


def objects(store: CheckpointStore) -> set[str]:
    return {o.path for o in store.backend.list("") if o.path.startswith(layout.STEP_PREFIX)}


def committed_objects(store: CheckpointStore) -> set[str]:
    """Every object the committed steps account for: manifests, files, attempt markers."""
    keep = set()
    for info in store.list():
        keep.add(layout.manifest_path(info.step))
        keep.update(f.key(info.step) for f in info.files)
        keep.update(
            layout.attempt_marker_path(info.step, f.attempt) for f in info.files if f.attempt
        )
    return keep


def mutations_of_a_delete(root: Path) -> int:
    """How many mutating backend calls a ``delete`` of step 1 makes (the points to kill at)."""
    with CheckpointStore(str(root), lease=False) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
    counter = FaultyBackend(CheckpointStore(str(root), lease=False).backend, fail_at=None)
    CheckpointStore(str(root), backend=counter, lease=False).delete(1)
    return counter.count


@pytest.mark.parametrize("finisher", ["gc", "prune"])
def test_a_removal_killed_at_every_point_is_rolled_forward(tmp_path: Path, finisher: str) -> None:
    points = mutations_of_a_delete(tmp_path / "count")
    assert points >= 4  # the tombstone swap, the payload, the markers, the tombstone
    for fail_at in range(1, points + 1):
        root = tmp_path / f"kill-{fail_at}"
        with CheckpointStore(str(root)) as store:  # a store that uses the writer lease
            for step in (1, 2, 3):
                store.save(step, state(step))
        killed = FaultyBackend(CheckpointStore(str(root), lease=False).backend, fail_at=fail_at,
                               mode="crash")  # fmt: skip
        try:
            CheckpointStore(str(root), backend=killed, lease=False).delete(1)
        except InjectedFault:
            pass
        else:  # only the step index's update after the removal is best effort (logged)
            assert fail_at == points, fail_at
        with CheckpointStore(str(root), lease=False, keep_last=2) as store:
            steps = [i.step for i in store.list()]
            assert steps in ([1, 2, 3], [2, 3]), (fail_at, steps)  # never half a step
            if finisher == "gc":  # gc finishes a removal that began, and keeps step 1 otherwise
                store.gc(older_than=0)
            else:  # prune finishes it, or (killed before it began) deletes step 1 itself
                store.prune()
                steps = [2, 3]
            assert [i.step for i in store.list()] == steps, fail_at
            assert objects(store) == committed_objects(store), fail_at
            assert all(store.verify(s).ok for s in (2, 3))


def test_a_killed_save_is_removed_once_the_lease_proves_its_writer_dead(tmp_path: Path) -> None:
    """A save killed while staging (its store never closed, its lease never released), then a
    job that takes the store over and finishes: gc --older-than 0 leaves committed steps only."""
    uri = str(tmp_path / "run")
    killed = CheckpointStore(uri)
    killed.save(1, state(1))
    entries = killed.stage_files(2, [SourceFile("partial.bin", lambda: [b"half a save"])])
    assert entries  # staged under epoch 1, never committed: the process "dies" here
    with CheckpointStore(uri, takeover=True) as resumed:  # epoch 2, released at close
        resumed.save(2, state(2))
    with CheckpointStore(uri, lease=False) as store:
        report = store.gc(older_than=0)
        assert entries[0].key(2) in report.deleted
        assert objects(store) == committed_objects(store)
        assert report.kept == ()


def test_gc_says_why_it_kept_what_it_kept(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    with CheckpointStore(uri) as live:
        live.save(1, state(1))
        mine = live.stage_files(2, [SourceFile("in-flight.bin", lambda: [b"x"])])
        with CheckpointStore(uri, lease=False) as janitor:
            report = janitor.gc(older_than=0)
            attempt = layout.attempt_dir(2, mine[0].attempt or "")
            assert report.kept == (attempt,)
            assert "writer lease held now (epoch 1)" in report.why[attempt]
            young = janitor.gc()  # the default grace: the attempt is young as well
            assert young.kept == (attempt,) and young.deleted == ()
