"""What each operation costs in backend calls on a store of 10,000 committed steps.

The formulas are the README's ("Request costs"); a counting backend measures them here, so a
change that makes a save or a listing read every manifest again fails a test rather than a
cluster's bill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, layout
from ckptstore.backends.base import Backend, BackendProxy, ObjectInfo
from ckptstore.backends.local import LocalBackend
from ckptstore.commit import Committer
from ckptstore.manifest import KIND_STATE, Manifest

STEPS = 10_000
EVERY = 10
"""The stored steps are 10, 20, ... 100000, so ``keep_every=10`` keeps all of them."""


class Counting(BackendProxy):
    """Counts reads by what they read (manifest, pointer, other) and listings."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()

    def _count_read(self, path: str) -> None:
        if path.endswith("/" + layout.MANIFEST_NAME):
            self.calls["manifest GET"] += 1
        elif path == layout.LATEST_NAME:
            self.calls["pointer GET"] += 1
        else:
            self.calls["other GET"] += 1

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._count_read(path)
        return super().read(path, start, end)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        self._count_read(path)
        return super().read_versioned(path)

    def read_into(self, path: str, out: memoryview) -> int:
        self._count_read(path)
        return super().read_into(path, out)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.calls["LIST"] += 1
        return super().list(prefix)

    def list_dirs(self, prefix: str) -> list[str]:
        self.calls["LIST dirs"] += 1
        return super().list_dirs(prefix)

    def take(self) -> Counter[str]:
        calls, self.calls = self.calls, Counter()
        return calls


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 committed steps (manifests without payload files) and ``latest`` at the last."""
    root = tmp_path_factory.mktemp("cost") / "store"
    seed = CheckpointStore(str(root), lease=False)
    environment = seed._env()
    for n in range(1, STEPS + 1):
        manifest = Manifest(n * EVERY, float(n), KIND_STATE, (), environment, "seed")
        target = root / layout.manifest_path(n * EVERY)
        target.parent.mkdir(parents=True)
        target.write_bytes(manifest.encode())
    Committer(seed.backend, writer="seed").advance_latest(STEPS * EVERY)
    return root


def open_counted(root: Path, **options: int) -> tuple[CheckpointStore, Counting]:
    backend = Counting(LocalBackend(str(root), {}))
    return CheckpointStore(str(root), backend=backend, lease=False, **options), backend


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(4)}


def test_a_save_with_retention_reads_a_bounded_number_of_manifests(big_store: Path) -> None:
    """keep_last=3 confirms the three newest steps by reading their manifests; the 9,997 older
    ones are judged on the listing's word (keep_every keeps them all): nothing else is read."""
    store, backend = open_counted(big_store, keep_last=3, keep_every=EVERY)
    step = (STEPS + 1) * EVERY
    try:
        store.save(step, state())
        calls = backend.take()
        # the previous manifest (incremental), then the three newest, read afresh
        assert calls["manifest GET"] == 1 + 3, calls
        assert calls["LIST dirs"] == 1, calls
        assert len(store.list()) == STEPS + 1
    finally:
        store.delete(step, force=True)


def test_a_save_without_retention_reads_one_manifest(big_store: Path) -> None:
    store, backend = open_counted(big_store)
    step = (STEPS + 1) * EVERY
    try:
        store.save(step, state())
        calls = backend.take()
        assert calls["manifest GET"] == 1, calls  # the previous step, for incremental copies
        assert calls["LIST dirs"] == 0, calls
    finally:
        store.delete(step, force=True)


def test_a_second_listing_reads_no_manifest(big_store: Path) -> None:
    store, backend = open_counted(big_store)
    assert len(store.list()) == STEPS
    first = backend.take()
    assert first["manifest GET"] == STEPS and first["LIST dirs"] == 1, first
    assert [i.step for i in store.list()][-1] == STEPS * EVERY
    second = backend.take()
    assert second == Counter({"LIST dirs": 1}), second


def test_latest_reads_the_pointer_one_listing_and_one_manifest(big_store: Path) -> None:
    store, backend = open_counted(big_store)
    latest = store.latest()
    assert latest is not None and latest.step == STEPS * EVERY
    calls = backend.take()
    assert calls == Counter({"pointer GET": 1, "LIST dirs": 1, "manifest GET": 1}), calls


def test_prune_with_nothing_to_delete_reads_only_the_newest_manifests(big_store: Path) -> None:
    store, backend = open_counted(big_store, keep_last=5, keep_every=EVERY)
    assert store.prune() == []
    calls = backend.take()
    assert calls["manifest GET"] == 5, calls  # the pointer's step is among the five newest
    assert calls["LIST dirs"] == 1 and calls["LIST"] == 1, calls  # steps, then pins


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
        expected = {"pointer GET": 1, "LIST dirs": 1, "manifest GET": 1, "LIST": 1}
        assert calls == Counter({**expected, "other GET": files}), calls
    finally:
        writer.delete(step, force=True)
