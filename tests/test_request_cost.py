"""What each operation costs in backend calls on a store of 10,000 committed steps.

The formulas are the README's ("Request costs"); a counting backend measures them here, so a
change that makes a save or a listing read every manifest again fails a test rather than a
cluster's bill.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from ckptstore.domain.manifest import KIND_STATE, Manifest
from ckptstore.errors import ConflictError, NotFoundError, StepBehindLatestError
from counting import CountingBackend
from parts import committer_for

STEPS = 10_000
EVERY = 10
"""The stored steps are 10, 20, ... 100000, so ``keep_every=10`` keeps all of them."""


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 committed steps (manifests without payload files) and ``latest`` at the last."""
    root = tmp_path_factory.mktemp("cost") / "store"
    seed = CheckpointStore(str(root), lease=False)
    environment = seed.environment
    for n in range(1, STEPS + 1):
        manifest = Manifest(n * EVERY, float(n), KIND_STATE, (), environment, "seed")
        target = root / layout.manifest_path(n * EVERY)
        target.parent.mkdir(parents=True)
        target.write_bytes(manifest.encode())
    committer_for(seed.backend, writer="seed").advance_latest(STEPS * EVERY)
    assert len(seed.list()) == STEPS  # an index-less store: the listing builds the step index
    return root


def open_counted(root: Path, **options: int) -> tuple[CheckpointStore, CountingBackend]:
    backend = CountingBackend(LocalBackend(str(root), {}))
    return CheckpointStore(str(root), backend=backend, lease=False, **options), backend


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4)}


def test_a_save_with_retention_reads_a_bounded_number_of_manifests(big_store: Path) -> None:
    """keep_last=3 counts the three newest steps; the 9,997 older ones are judged on the
    listing's word (keep_every keeps them all). A save reads its previous step's manifest,
    the newest ones only once per process, and nothing that grows with the steps kept. The
    first save of a process also lists the steps, for any committed past the pointer (a
    writer killed between its commit and the pointer's move)."""
    store, backend = open_counted(big_store, keep_last=3, keep_every=EVERY)
    step = (STEPS + 1) * EVERY
    try:
        store.save(step, state())
        calls = backend.take()
        # the previous manifest (incremental, so remembered), then the third newest
        assert calls["manifest GET"] == 1 + 1, calls
        assert calls["LIST dirs"] == 0, calls  # the step index answers both
        assert calls["index GET"] <= 1 + 1 + 2, calls  # past the pointer, claim, retention
        store.save(step + EVERY, state())
        calls = backend.take()
        assert calls["manifest GET"] == 1, calls  # the previous step's, for incremental copies
        assert calls["LIST dirs"] == 0 and calls["index GET"] <= 2, calls  # segments cached
        assert len(store.list()) == STEPS + 2
    finally:
        for saved in (step + EVERY, step):
            with contextlib.suppress(NotFoundError):
                store.delete(saved, force=True)


def test_a_save_without_retention_reads_one_manifest(big_store: Path) -> None:
    """One listing in the process's first save (steps past the pointer), none after."""
    store, backend = open_counted(big_store)
    step = (STEPS + 1) * EVERY
    try:
        store.save(step, state())
        calls = backend.take()
        assert calls["manifest GET"] == 1, calls  # the previous step, for incremental copies
        assert calls["LIST dirs"] == 0 and calls["index GET"] == 2, calls  # past the pointer
        store.save(step + EVERY, state())
        calls = backend.take()
        assert calls["manifest GET"] == 1 and calls["LIST dirs"] == 0, calls
        assert calls["index GET"] == 0, calls  # the claim and the summary: one PUT each
    finally:
        for saved in (step + EVERY, step):
            with contextlib.suppress(NotFoundError):
                store.delete(saved, force=True)


def test_a_second_listing_reads_no_manifest(big_store: Path) -> None:
    store, backend = open_counted(big_store)
    assert len(store.list()) == STEPS
    first = backend.take()
    assert first == Counter({"index GET": 2}), first  # the head, one sealed segment
    assert [i.step for i in store.list()][-1] == STEPS * EVERY
    second = backend.take()
    assert second == Counter({"index GET": 1}), second  # sealed segments never change


def test_latest_reads_the_pointer_one_listing_and_one_manifest(big_store: Path) -> None:
    store, backend = open_counted(big_store)
    latest = store.latest()
    assert latest is not None and latest.step == STEPS * EVERY
    calls = backend.take()
    assert calls == Counter({"pointer GET": 1, "index GET": 1, "manifest GET": 1}), calls


def test_prune_with_nothing_to_delete_reads_only_the_newest_manifests(big_store: Path) -> None:
    store, backend = open_counted(big_store, keep_last=5, keep_every=EVERY)
    assert store.prune() == []
    calls = backend.take()
    assert calls["manifest GET"] == 5, calls  # the pointer's step is among the five newest
    assert calls["index GET"] == 2 and calls["LIST"] == 1, calls  # steps, then pins


def test_a_step_removed_by_another_process_leaves_the_listing(tmp_path: Path) -> None:
    """The remembered manifests never outlive their step directory; ``reload`` forgets all."""
    uri = str(tmp_path / "store")
    reader = CheckpointStore(uri, lease=False)
    writer = CheckpointStore(uri, lease=False)
    for step in (1, 2, 3):
        writer.save(step, state())
    assert [i.step for i in reader.list()] == [1, 2, 3]
    writer.delete(2)
    assert [i.step for i in reader.list()] == [1, 3]
    writer.delete(3, force=True)
    writer.save(3, {"w": torch.zeros(2)}, {"again": True})
    reader.reload()
    assert reader.list()[-1].metadata == {"again": True}
    assert reader.info(3).metadata == {"again": True}  # one step's info is always fresh


def test_load_reads_the_pointer_one_manifest_and_its_files(big_store: Path) -> None:
    writer, _ = open_counted(big_store)
    step = (STEPS + 1) * EVERY
    info = writer.save(step, state())
    try:
        store, backend = open_counted(big_store)
        assert torch.equal(store.load()["w"], torch.ones(4))
        calls = backend.take()
        files = len(info.files)
        expected = {"pointer GET": 1, "index GET": 1, "manifest GET": 1, "LIST": 1}
        assert calls == Counter({**expected, "other GET": files}), calls
    finally:
        writer.delete(step, force=True)


# -- staging in a multi-process save: what one stager reads ---------------------------------


def staged_files(tag: bytes) -> list[SourceFile]:
    return [
        SourceFile(f"rank_00001/{n}.bin", lambda n=n: [tag + n.encode()], len(tag) + 1)
        for n in "ab"
    ]


def test_a_stager_handed_the_previous_step_reads_neither_pointer_nor_manifest(
    tmp_path: Path,
) -> None:
    """The coordinator reads ``latest`` and the previous manifest once; a rank handed its
    entries reads neither, and still copies its unchanged files."""
    store, backend = open_counted(tmp_path / "store")
    first = store.stage_files(1, staged_files(b"same"), kind=KIND_STATE)
    store.commit_files(1, first, kind=KIND_STATE)
    backend.take()
    save = store.begin_save(2, kind=KIND_STATE)
    begun = backend.take()
    assert begun["pointer GET"] == 1 and begun["manifest GET"] == 1, begun
    mine = save.plan.among(["rank_00001/a.bin"])
    second = store.stage_files(2, staged_files(b"same"), plan=mine)
    assert backend.take() == Counter(), "a rank given its plan reads nothing"
    assert {e.path: e.copied_from for e in second} == {
        "rank_00001/a.bin": 1,  # handed to it: copied
        "rank_00001/b.bin": None,  # not handed to it: uploaded
    }
    info = save.commit(second)
    assert bytes(store.read_file(info, "rank_00001/a.bin")) == b"samea"


def test_only_the_coordinator_refuses_a_step_behind_latest_and_reads_once(
    tmp_path: Path,
) -> None:
    store, backend = open_counted(tmp_path / "store", incremental=False)
    store.commit_files(5, store.stage_files(5, staged_files(b"x"), kind=KIND_STATE))
    backend.take()
    store.stage_files(6, staged_files(b"y"), kind=KIND_STATE)
    calls = backend.take()
    assert calls["pointer GET"] == calls["manifest GET"] == 0, "a stager reads nothing"
    with pytest.raises(StepBehindLatestError, match="latest is step 5"):
        store.begin_save(4, kind=KIND_STATE)
    calls = backend.take()
    assert calls["pointer GET"] == 1, calls  # not incremental: no manifest of latest's
    assert calls["manifest GET"] == 1, calls  # only to confirm latest is really committed
    store.begin_save(3, kind=KIND_STATE, allow_older=True)
    assert backend.take()["manifest GET"] == 0


def test_a_process_that_only_stages_never_probes_s3(
    s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """The capability probe (5 conditional PUTs and a delete) is for processes that write
    conditionally: the coordinator's commit still probes, and still commits once only."""
    counts: Counter[str] = Counter()

    def count(event_name: str, **_: Any) -> None:
        counts[event_name.rsplit(".", 1)[-1]] += 1

    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as stager:
        stager.backend.client.meta.events.register("before-send.s3", count)  # type: ignore[attr-defined]
        entries = stager.stage_files(1, staged_files(b"x"), kind=KIND_STATE)
        assert counts == Counter({"PutObject": 1 + 2}), counts
        rival = stager.stage_files(1, staged_files(b"y"), kind=KIND_STATE)
        assert counts["DeleteObjects"] == 0, counts
    with CheckpointStore(s3_uri, storage_options=s3_options) as coordinator:
        info = coordinator.commit_files(1, entries, kind=KIND_STATE)
        assert coordinator.backend.capabilities.atomic_create  # moto honours If-None-Match
        with pytest.raises(ConflictError, match="already committed"):
            coordinator.commit_files(1, rival, kind=KIND_STATE)
        assert bytes(coordinator.read_file(info, "rank_00001/b.bin")) == b"xb"


def test_gc_lists_the_store_once_and_reads_no_clean_manifest(big_store: Path) -> None:
    """gc judges clean steps on the listing's word: its requests do not grow with the steps
    beyond the pages of one listing (10 on S3 here; one call on local disk)."""
    store, backend = open_counted(big_store)
    report = store.gc(older_than=0)
    assert report.deleted == () and report.foreign == ()
    calls = backend.take()
    assert calls["manifest GET"] == 0 and calls["LIST dirs"] == 0, calls
    assert calls["LIST"] == 1, calls
    assert calls["index GET"] == 2, calls  # the step index: steps without a manifest?
    assert sum(calls.values()) <= 4, calls  # and the lease, to see whether a save is in flight


# -- what a save writes ---------------------------------------------------------------------


def test_a_steady_save_costs_one_lease_write_and_these_requests(tmp_path: Path) -> None:
    """The README's request-cost table, pinned: a save of N files in a process that holds the
    lease already writes N + 1 (files, attempt marker), the manifest, the pointer and one
    lease renewal (the fence check right before the commit), and reads the step's key, the
    pointer twice (the save's begin, the pointer's compare-and-swap), the previous manifest
    (incremental) and one listing (confirming the files)."""
    backend = CountingBackend(LocalBackend(str(tmp_path / "store"), {}), heads=True, writes=True)
    store = CheckpointStore(str(tmp_path / "store"), backend=backend)
    state = {"a": torch.ones(4), "b": torch.zeros(8)}
    store.save(1, state)  # takes the lease, probes, writes the first step
    backend.take()
    info = store.save(2, {"a": torch.full((4,), 2.0), "b": torch.zeros(8)})
    calls = backend.take()
    files = len(info.files)
    copied = sum(1 for f in info.files if f.copied_from is not None)
    assert calls == Counter(
        {
            "payload write": files - copied,
            "copy": copied,
            "marker write": 1,
            "manifest write": 1,
            "pointer write": 1,
            "lease write": 1,
            "HEAD": 1,
            "pointer GET": 2,
            "manifest GET": 1,
            "LIST": 1,
            "index write": 2,  # the step announced before its manifest, added after
        }
    ), calls
    store.close()
