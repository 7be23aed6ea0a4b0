"""What ``gc`` reads: one listing of the store, and a manifest only where garbage may be.

A clean committed step (one attempt directory, its marker, a manifest key larger than any
tombstone) must cost nothing beyond the listing. Each other test builds one kind of garbage
that hides under a manifest key or beside a step, the way a crash leaves it, and checks that
gc reads that step's manifest and removes (or reports) exactly what it did before.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.proxy import BackendProxy
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from ckptstore.domain.manifest import KIND_STATE, encode_tombstone
from ckptstore.errors import NotFoundError
from ckptstore.protocol.garbage import TOMBSTONE_MAX_SIZE
from counting import CountingBackend

DAY = 86400.0


@pytest.fixture
def opened(backend_uri: tuple[str, dict[str, Any]]) -> Iterator[CheckpointStore]:
    uri, options = backend_uri
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        yield store


def counted(store: CheckpointStore) -> tuple[CheckpointStore, CountingBackend]:
    """A fresh store object (nothing remembered) over a counting view of the same backend."""
    backend = CountingBackend(store.backend, heads=True)
    return CheckpointStore(store.uri, backend=backend, lease=False), backend


def attempt_of(store: CheckpointStore, step: int) -> str:
    (attempt,) = {f.attempt for f in store.info(step).files}
    assert attempt is not None
    return attempt


def files_of(store: CheckpointStore, step: int) -> list[str]:
    return sorted(o.path for o in store.backend.list(layout.step_dir(step) + "/"))


def race(store: CheckpointStore, step: int) -> list[str]:
    """Two writers stage ``step``; the first commits, the rival dies: returns its files."""
    rival = CheckpointStore(store.uri, backend=store.backend, lease=False)
    winner = store.stage_files(step, [SourceFile("won.bin", lambda: [b"won"])])
    loser = rival.stage_files(step, [SourceFile("lost.bin", lambda: [b"lost"])])
    store.commit_files(step, winner, kind=KIND_STATE)
    return [e.key(step) for e in loser]


def test_gc_of_clean_committed_steps_reads_no_manifest(opened: CheckpointStore) -> None:
    steps = 12 if opened.uri.startswith("s3://") else 40
    for step in range(1, steps + 1):
        opened.save(step, {"x": step})
    store, backend = counted(opened)
    report = store.gc(older_than=0)
    assert report.deleted == () and report.foreign == () and report.kept == ()
    calls = backend.calls
    assert calls["manifest GET"] == 0 and calls["LIST dirs"] == 0, calls
    assert calls["LIST"] == 1 and calls["HEAD"] == 0, calls  # the store, nothing per step
    assert len(store.list()) == steps


def test_gc_cost_does_not_grow_with_clean_steps(tmp_path: Path) -> None:
    costs = []
    for steps in (5, 50):
        with CheckpointStore(str(tmp_path / f"s{steps}"), lease=False) as seed:
            for step in range(steps):
                seed.save(step, {"x": step})
            store, backend = counted(seed)
            store.gc(older_than=0)
            costs.append(backend.calls)
    assert costs[0] == costs[1], costs


def test_a_loser_beside_the_winner_is_read_and_removed(opened: CheckpointStore) -> None:
    opened.save(1, {"x": 1})
    loser = race(opened, 2)
    store, backend = counted(opened)
    report = store.gc(older_than=3600)  # a lost attempt is dead whatever its age
    assert set(loser) <= set(report.deleted)
    assert backend.calls["manifest GET"] == 1, backend.calls  # step 2 only
    assert opened.verify(2).ok and store.gc(older_than=0).deleted == ()


def test_an_interrupted_uncommit_under_a_long_named_tombstone_is_finished(
    opened: CheckpointStore,
) -> None:
    """The tombstone that replaced the manifest names the one attempt, which is whole: the
    listing looks like a clean step but for the key's size, the largest a tombstone can be."""
    opened.save(1, {"x": 1})
    opened.save(2, {"x": 2})
    attempt = attempt_of(opened, 2)
    writer = f"{'h' * 255}:4194304:0123abcd"  # the longest host name, a large pid
    tombstone = encode_tombstone(writer, 1.0e12 + 0.123456789, [attempt])
    assert len(tombstone) <= TOMBSTONE_MAX_SIZE
    opened.backend.write(layout.manifest_path(2), [tombstone])
    store, backend = counted(opened)
    report = store.gc(older_than=3600)  # the tombstone's attempts are dead: finish the work
    assert layout.attempt_marker_path(2, attempt) in report.deleted
    assert files_of(opened, 2) == [layout.manifest_path(2)]
    assert backend.calls["manifest GET"] >= 1
    assert [i.step for i in store.list()] == [1]


def many_attempts(*also: str) -> list[str]:
    """Attempt ids enough to make a tombstone larger than one naming a single attempt."""
    return [*also, *(f"{n:016x}" for n in range(1, 31))]


def test_a_removal_that_died_leaving_markers_alone_is_finished(opened: CheckpointStore) -> None:
    """Removals delete payload before markers: the last attempt of a many-attempt step,
    holding its marker alone under a tombstone too large to be told by size, is read."""
    opened.save(1, {"x": 1})
    opened.save(2, {"x": 2})
    attempt = attempt_of(opened, 2)
    payload = [f.key(2) for f in opened.info(2).files]
    tombstone = encode_tombstone("w", 1.0, many_attempts(attempt))
    assert len(tombstone) > TOMBSTONE_MAX_SIZE
    opened.backend.write(layout.manifest_path(2), [tombstone])
    opened.backend.delete(payload)
    store, _ = counted(opened)
    assert store.gc(older_than=3600).deleted == (layout.attempt_marker_path(2, attempt),)
    assert files_of(opened, 2) == [layout.manifest_path(2)]


def test_a_committed_step_with_a_missing_marker_is_read_not_harmed(
    opened: CheckpointStore,
) -> None:
    opened.save(1, {"x": 1})
    opened.backend.delete([layout.attempt_marker_path(1, attempt_of(opened, 1))])
    store, backend = counted(opened)
    assert store.gc(older_than=0).deleted == ()
    assert backend.calls["manifest GET"] == 1 and opened.verify(1).ok


def test_an_uncommitted_step_and_a_foreign_directory_need_no_manifest_read(
    opened: CheckpointStore,
) -> None:
    opened.save(1, {"x": 1})
    staged = opened.stage_files(2, [SourceFile("a.bin", lambda: [b"a"])])
    opened.backend.write("global_step_7/synced.bin", [b"not ours"])
    store, backend = counted(opened)
    report = store.gc(older_than=0)
    assert {e.key(2) for e in staged} <= set(report.deleted)
    assert report.foreign == ("global_step_7/synced.bin",)
    assert backend.calls["manifest GET"] == 0, backend.calls  # the claim re-checks instead
    assert opened.backend.stat("global_step_7/synced.bin") is not None


def test_foreign_files_beside_an_attempt_are_reported(opened: CheckpointStore) -> None:
    opened.save(1, {"x": 1})
    opened.backend.write("global_step_1/by-hand.bin", [b"y"])
    report = counted(opened)[0].gc(older_than=0)
    assert report.foreign == ("global_step_1/by-hand.bin",) and report.deleted == ()


def test_a_pinned_step_is_judged_by_its_manifest(opened: CheckpointStore) -> None:
    opened.save(1, {"x": 1})
    opened.save(2, {"x": 2})
    opened.pin(1)
    opened.pin(2)
    removed = [f.key(2) for f in opened.info(2).files]
    removed.append(layout.attempt_marker_path(2, attempt_of(opened, 2)))
    opened.backend.write(layout.manifest_path(2), [encode_tombstone("w", 1.0, many_attempts())])
    opened.backend.delete(removed)  # a young tombstone alone: not read, but for the pin
    report = counted(opened)[0].gc(older_than=0)
    assert layout.pin_path(2) in report.deleted and layout.pin_path(1) not in report.deleted


def test_a_tombstone_alone_is_kept_a_day_while_a_writer_holds_the_lease(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path / "s")) as opened:  # it holds the lease once it saves
        opened.save(1, {"x": 1})
        key = tmp_path / "s" / layout.manifest_path(3)
        key.parent.mkdir()
        key.write_bytes(encode_tombstone("w", 1.0, ["0" * 16]))
        store, backend = counted(opened)
        report = store.gc(older_than=0)
        assert report.deleted == ()  # young, with a live writer: left alone, and not read
        assert backend.calls["manifest GET"] == 0
        os.utime(key, (key.stat().st_mtime - DAY - 60,) * 2)
        assert store.gc(older_than=0).deleted == (layout.manifest_path(3),)
        assert not key.exists()


def test_a_tombstone_alone_goes_at_once_when_no_writer_holds_the_lease(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path / "s")) as writer:
        writer.save(1, {"x": 1})  # the store uses the lease; closing releases it
    with CheckpointStore(str(tmp_path / "s"), lease=False) as opened:
        key = tmp_path / "s" / layout.manifest_path(3)
        key.parent.mkdir()
        key.write_bytes(encode_tombstone("w", 1.0, ["0" * 16]))
        assert counted(opened)[0].gc(older_than=3600).deleted == ()  # younger than the grace
        assert counted(opened)[0].gc(older_than=0).deleted == (layout.manifest_path(3),)
        assert not key.exists()


def test_a_prefix_without_a_store_is_refused_for_one_listing(opened: CheckpointStore) -> None:
    opened.backend.write("global_step_1/actor/model.pt", [b"verl's, not ours"])
    store, backend = counted(opened)
    with pytest.raises(NotFoundError, match="holds no ckptstore store"):
        store.gc(older_than=0)
    assert backend.calls == Counter({"LIST": 1, "other GET": 1}), backend.calls  # + the lease
    assert opened.backend.stat("global_step_1/actor/model.pt") is not None


def test_a_commit_between_the_listing_and_the_claim_wins(opened: CheckpointStore) -> None:
    """gc lists an uncommitted step without reading it; the writer commits before gc claims
    the step: the claim fails and nothing of the committed step goes."""
    opened.save(1, {"x": 1})
    entries = opened.stage_files(2, [SourceFile("a.bin", lambda: [b"a"])])

    class CommitFirst(BackendProxy):
        def create(self, path: str, data: bytes) -> None:
            if path == layout.manifest_path(2) and not opened.backend.stat(path):
                opened.commit_files(2, entries, kind=KIND_STATE)
            super().create(path, data)

    janitor = CheckpointStore(opened.uri, backend=CommitFirst(opened.backend), lease=False)
    assert janitor.gc(older_than=0).deleted == ()
    assert opened.verify(2).ok


def test_a_dead_save_staged_over_a_tombstone_is_read_and_removed(tmp_path: Path) -> None:
    """The one attempt is newer than the key: a save began after a removal's tombstone (too
    large to be told by size) and died before committing over it."""
    with CheckpointStore(str(tmp_path / "s"), lease=False) as opened:
        opened.save(1, {"x": 1})
        key = tmp_path / "s" / layout.manifest_path(2)
        key.parent.mkdir()
        key.write_bytes(encode_tombstone("w", 1.0, many_attempts()))
        os.utime(key, (key.stat().st_mtime - 60,) * 2)
        staged = opened.stage_files(2, [SourceFile("a.bin", lambda: [b"a"])])
        report = counted(opened)[0].gc(older_than=0)
        assert {e.key(2) for e in staged} <= set(report.deleted)
        assert files_of(opened, 2) == [layout.manifest_path(2)]  # no lease: it stays a day
