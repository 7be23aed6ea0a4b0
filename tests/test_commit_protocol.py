"""The commit protocol's invariants (docs/design.md), each with a test that fails if it breaks.

Every test runs against each real backend (local disk, memory://, S3 on a moto server over
HTTP); the fault-injection tests wrap a real backend in :class:`faults.FaultyBackend`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.data.payload import SourceFile
from ckptstore.domain.layout import (
    ATTEMPT_MARKER,
    LATEST_NAME,
    LEASE_NAME,
    MANIFEST_NAME,
    META_DIR,
    manifest_path,
    step_dir,
)
from ckptstore.errors import (
    CheckpointError,
    ConflictError,
    CorruptCheckpointError,
    NotFoundError,
    PreconditionFailedError,
    UnsafeLoadError,
)
from faults import FaultyBackend, InjectedFault
from keys import file_key
from parts import committer_for, pointer_step

StoreFactory = Callable[..., CheckpointStore]


@pytest.fixture
def make_store(backend_uri: tuple[str, dict[str, Any]]) -> StoreFactory:
    uri, options = backend_uri

    def make(**kwargs: Any) -> CheckpointStore:
        return CheckpointStore(uri, storage_options=options, **kwargs)

    return make


def state_for(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.randn(32, generator=gen),
        "step": step,
    }


def assert_state_is(state: dict[str, Any], step: int) -> None:
    expected = state_for(step)
    assert state["step"] == step
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])


# -- 1. a step is committed iff its manifest exists; the manifest is written last, once -------


def test_payload_without_manifest_is_not_a_step(make_store: StoreFactory) -> None:
    store = make_store()
    store.save(1, state_for(1))
    committer = committer_for(store.backend, writer="test")
    committer.write_payload(2, [SourceFile("state.json", lambda: [b"{}"])])
    assert [i.step for i in store.list()] == [1]
    assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]
    with pytest.raises(NotFoundError, match="step 2 is not committed"):
        store.load(2)


def test_manifest_is_written_after_every_payload_file(make_store: StoreFactory) -> None:
    store = make_store()
    order: list[str] = []
    real_write, real_create = store.backend.write, store.backend.create

    def write(path: str, chunks: Any) -> int:
        size = real_write(path, chunks)
        order.append(path)
        return size

    def create(path: str, data: bytes) -> None:
        order.append(path)
        real_create(path, data)

    store.backend.write, store.backend.create = write, create  # type: ignore[method-assign]
    store.save(5, state_for(5))
    payload = [p for p in order if p.startswith(step_dir(5) + "/") and p != manifest_path(5)]
    assert len(payload) >= 2
    assert order.index(manifest_path(5)) > max(order.index(p) for p in payload)


def test_concurrent_commits_of_one_step_let_exactly_one_win(make_store: StoreFactory) -> None:
    if not make_store().backend.capabilities.atomic_create:
        pytest.skip("this backend cannot make create-only writes atomic (documented)")
    store = make_store()
    committer = committer_for(store.backend, writer="test")
    entries = committer.write_payload(3, [SourceFile("state.json", lambda: [b"{}"])])
    from ckptstore.domain.manifest import KIND_DIRECTORY, Manifest

    outcomes: list[str] = []

    def commit(writer: str) -> None:
        manifest = Manifest(3, 1.0, KIND_DIRECTORY, tuple(entries), store.environment, writer)
        try:
            committer_for(store.backend, writer=writer).commit(manifest)
            outcomes.append("won")
        except ConflictError:
            outcomes.append("lost")

    threads = [threading.Thread(target=commit, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]


# -- 2. committed steps are immutable ------------------------------------------------------


def test_committing_a_step_twice_is_a_clear_error_and_changes_nothing(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    store.save(7, state_for(7))
    before = store.info(7).files
    with pytest.raises(ConflictError, match="step 7 is already committed") as caught:
        store.save(7, state_for(8))
    assert store.uri in str(caught.value)
    assert store.info(7).files == before
    assert_state_is(store.load(7), 7)


# -- 3. latest: only to committed steps, only forward, by compare-and-swap --------------------


def test_latest_only_moves_forward(make_store: StoreFactory) -> None:
    store = make_store()
    store.save(20, state_for(20))
    store.save(10, state_for(10), allow_older=True)  # a late writer of an older step
    assert store.latest().step == 20  # type: ignore[union-attr]


def test_concurrent_writers_never_lose_the_newest_step(make_store: StoreFactory) -> None:
    if not make_store().backend.capabilities.atomic_swap:
        pytest.skip("this backend cannot make compare-and-swap atomic (documented)")
    errors: list[BaseException] = []

    def writer(steps: list[int]) -> None:
        store = make_store(lease=False)  # deliberately shared: no writer lease
        try:
            for step in steps:
                store.save(step, {"step": step}, allow_older=True)  # interleaved on purpose
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(list(range(i, 24, 4)),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = make_store()
    assert pointer_step(store.backend) == 23  # the pointer itself, not the listing fallback
    assert [i.step for i in store.list()] == list(range(24))


def test_missing_or_broken_latest_falls_back_to_listing(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    for damage in (b"{broken", None):
        if damage is None:
            store.backend.delete([LATEST_NAME])
        else:
            store.backend.write(LATEST_NAME, [damage])
        with caplog.at_level(logging.WARNING):
            assert store.latest().step == 2  # type: ignore[union-attr]
            assert_state_is(store.load(), 2)
        assert "latest" in caplog.text
        caplog.clear()
    store.save(3, state_for(3))  # a broken pointer is repaired by the next save
    assert pointer_step(store.backend) == 3


def test_latest_pointing_at_a_deleted_step_falls_back(make_store: StoreFactory) -> None:
    store = make_store()
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    committer_for(store.backend).remover.uncommit(2)  # behind the store's back: the pointer dangles
    assert store.latest().step == 1  # type: ignore[union-attr]
    assert_state_is(store.load(), 1)


# -- 4. retention: never latest, pinned or newer; manifest first ----------------------------


def test_retention_keeps_latest_pins_and_newer_steps(make_store: StoreFactory) -> None:
    store = make_store(keep_last=2)
    for step in (10, 20, 30):
        store.save(step, state_for(step))
    store.pin(20)
    for step in (40, 50):
        store.save(step, state_for(step))
    assert [i.step for i in store.list()] == [20, 40, 50]
    # a step newer than latest (committed by a writer that has not moved latest yet) survives
    other = committer_for(store.backend, writer="other")
    entries = other.write_payload(60, [SourceFile("x", lambda: [b"x"])])
    from ckptstore.domain.manifest import KIND_DIRECTORY, Manifest

    other.commit(Manifest(60, 1.0, KIND_DIRECTORY, tuple(entries), store.environment, "other"))
    assert store.prune() == [40]  # keep_last=2 keeps 50 and 60; 50 is latest anyway
    assert [i.step for i in store.list()] == [20, 50, 60]
    store.backend.delete([LATEST_NAME])
    assert store.prune() == []  # without a pointer nothing is known to be safe to delete


@pytest.mark.parametrize("finisher", ["gc", "prune"])
def test_an_interrupted_prune_is_finished_by_the_next_gc_or_prune(
    make_store: StoreFactory, finisher: str
) -> None:
    store = make_store()
    for step in (1, 2, 3):
        store.save(step, state_for(step))
    garbage = file_key(store, 1, "state.json")
    store.list()  # completes the step index: the prune's first write is its claim
    faulty = FaultyBackend(store.backend, fail_at=3, mode="crash")  # claim, manifest, dies
    pruner = CheckpointStore(store.uri, keep_last=1, backend=faulty, lease=False)
    with pytest.raises(InjectedFault):
        pruner.prune()
    store.reload()  # another store object removed a step: forget the manifests read before
    assert [i.step for i in store.list()] == [2, 3]  # step 1 is uncommitted, not half-there
    assert store.backend.stat(garbage) is not None  # garbage remains, under a tombstone
    if finisher == "gc":
        report = store.gc(older_than=0)  # even with this store holding the lease
        assert garbage in report.deleted and manifest_path(1) in report.deleted
    else:  # keep_last=2: nothing more to delete, and step 1's removal is finished on the way
        assert make_store(keep_last=2, lease=False).prune() == []
    assert list(store.backend.list(step_dir(1) + "/")) == []  # payload and tombstone gone
    assert [i.step for i in store.list()] == [2, 3]


class SwapAnswerLost(BackendProxy):
    """A compare-and-swap that lands, but whose answer is lost and whose retry then finds the
    object changed (S3 after a connection reset): PreconditionFailedError, yet done."""

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        self.inner.swap(path, data, expected)
        raise PreconditionFailedError(f"{path} changed since it was read (the retry)")


def test_a_delete_whose_swap_answer_was_lost_still_completes(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"), lease=False)
    for step in (1, 2):
        store.save(step, state_for(step))
    lossy = CheckpointStore(store.uri, backend=SwapAnswerLost(store.backend), lease=False)
    lossy.delete(1)
    assert [i.step for i in store.list()] == [2]
    assert list(store.backend.list(step_dir(1) + "/")) == []  # payload and tombstone gone


def test_a_step_directory_left_with_only_a_lock_file_is_garbage(tmp_path: Path) -> None:
    """A writer killed between unlinking a step's last file and removing its directory leaves
    the directory holding only the lock file of a swap; gc must still remove it."""
    store = CheckpointStore(str(tmp_path / "store"), lease=False)
    store.save(1, state_for(1))
    store.backend.swap(manifest_path(2), b"{}", None)  # the swap leaves its lock file
    (tmp_path / "store" / manifest_path(2)).unlink()  # killed before the rmdir
    left = tmp_path / "store" / step_dir(2)
    assert [p.name.startswith(".ckpt-lock-") for p in left.iterdir()] == [True]
    store.gc(older_than=0)
    assert not left.exists()
    assert [i.step for i in store.list()] == [1]


# -- 5. checksums: every byte verified on load; fall back to the previous good step ---------


def corrupt(store: CheckpointStore, step: int, path: str, how: str = "flip") -> None:
    key = file_key(store, step, path)
    data = bytearray(store.backend.read(key))
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    store.backend.write(key, [bytes(data)])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_payload_is_named_and_resume_falls_back(
    make_store: StoreFactory, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    corrupt(store, 2, "w-00000.safetensors", how)
    with pytest.raises(CorruptCheckpointError) as caught:
        store.load(2)
    message = str(caught.value)
    assert "w-00000.safetensors" in message and "step 2" in message
    with caplog.at_level(logging.WARNING):
        assert_state_is(store.load(), 1)
    assert "step 2 failed verification" in caplog.text
    assert store.last_loaded is not None and store.last_loaded.step == 1
    assert not store.verify(2).ok and store.verify(1).ok
    with pytest.raises(CorruptCheckpointError):
        store.load(fallback=False)


def test_when_no_step_verifies_load_fails_loudly_not_from_scratch(make_store: StoreFactory) -> None:
    store = make_store()
    store.save(1, state_for(1))
    corrupt(store, 1, "state.json")
    with pytest.raises(CorruptCheckpointError, match="no committed step passed verification"):
        store.load()


# -- 6. a failed upload leaves no incomplete multipart upload ------------------------------


def test_failed_payload_stream_leaves_nothing_behind(make_store: StoreFactory) -> None:
    store = make_store()

    def exploding() -> Any:
        yield b"x" * (6 << 20)
        yield b"y" * (6 << 20)
        raise RuntimeError("the trainer died mid-stream")

    committer = committer_for(store.backend, writer="test")
    with pytest.raises(RuntimeError, match="mid-stream"):
        committer.write_payload(9, [SourceFile("big.bin", exploding)])
    assert store.backend.partial_writes("") == []
    assert list(store.backend.list(step_dir(9) + "/")) == []  # the attempt removed itself
    assert store.list() == []


# -- 7. loading never executes pickle by default ---------------------------------------------


def test_load_refuses_pickle_unless_asked(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store()
    store.save(1, {"obj": Path("x"), "t": torch.ones(1)}, allow_pickle=True)
    with pytest.raises(UnsafeLoadError, match="allow_pickle=True"):
        store.load(1)
    assert store.load(1, allow_pickle=True)["obj"] == Path("x")


# -- 8. capabilities: where a guarantee is missing the store says so and stays safe ----------


def test_capabilities_are_reported_and_commits_still_refuse_overwrites(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    caps = store.backend.capabilities
    assert isinstance(caps.atomic_create, bool) and isinstance(caps.atomic_swap, bool)
    store.save(1, state_for(1))
    with pytest.raises(ConflictError):  # even without atomic create, a re-commit is refused
        committer_for(store.backend, writer="late").commit(store.info(1).manifest)
    assert_state_is(store.load(1), 1)


# -- the fault sweep: fail the Nth mutating operation, for every N ---------------------------

KEEP_LAST = 2
STEPS = [1, 2, 3, 4]  # two prunes: enough to cross every kind of operation with a failure


def run_saves(store: CheckpointStore) -> list[int]:
    """Save STEPS, carrying on past failures like a trainer that retries later; returns the
    steps whose save returned."""
    done = []
    for step in STEPS:
        try:
            store.save(step, state_for(step), metadata={"loss": 1.0 / step})
            done.append(step)
        except CheckpointError:
            pass
    return done


def check_store(raw: Any, done: list[int]) -> None:
    """The invariants a fresh process must see after any failure."""
    fresh = CheckpointStore(raw.uri, backend=raw)
    present = [i.step for i in fresh.list()]
    for step in present:  # only complete, uncorrupted steps are ever listed
        assert_state_is(fresh.load(step), step)
    for step in done:  # no committed step lost, except by retention (KEEP_LAST newer exist)
        newer = [s for s in present if s > step]
        assert step in present or len(newer) >= KEEP_LAST, (step, present, done)
    latest = fresh.latest()
    if done:
        assert latest is not None and latest.step >= max(done)
    if latest is not None:
        assert latest.step in present
        assert_state_is(fresh.load(), latest.step)


def record_operations(make_store: StoreFactory) -> list[tuple[str, str]]:
    """(operation, path) of every mutating operation of run_saves, in order."""
    store = make_store(keep_last=KEEP_LAST)
    counter = FaultyBackend(store.backend, fail_at=None)
    run_saves(CheckpointStore(store.uri, keep_last=KEEP_LAST, backend=counter))
    return counter.log[: counter.count]


def object_kind(path: str) -> str:
    if path == LEASE_NAME:
        return "lease"
    if path == LATEST_NAME:
        return "pointer"
    if path.startswith(META_DIR + "/"):
        return "index"
    name = path.rsplit("/", 1)[-1]
    return {MANIFEST_NAME: "manifest", ATTEMPT_MARKER: "attempt marker"}.get(name, "payload")


def kinds_of(operations: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Each operation's kind: its name and object kind, after the previous one's (so the index
    swap before a manifest differs from the one after it, a lease's take from its renewal)."""
    kinds = [(op, object_kind(path)) for op, path in operations]
    return [(*kind, *before) for kind, before in zip(kinds, [(), *kinds[:-1]], strict=True)]


def sample_points(operations: list[tuple[str, str]], mode: str) -> list[int]:
    """One point of every kind: its first occurrence in "error" mode, its last in "crash"
    mode, so the two modes also fail different steps' operations."""
    firsts: dict[tuple[str, ...], int] = {}
    for n, kind in enumerate(kinds_of(operations), 1):
        if mode == "crash" or kind not in firsts:
            firsts[kind] = n
    return sorted(firsts.values())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["error", "crash"])
@pytest.mark.slow
def test_failing_the_nth_operation_never_exposes_a_bad_step(
    backend_uri: tuple[str, dict[str, Any]], mode: str, tmp_path: Path
) -> None:
    """Memory and local fail every point of the sequence. Over HTTP every point costs a server
    round of saves, so S3 fails one point of every kind of operation (kinds_of: operation x
    object kind - payload, attempt marker, manifest, index, pointer, lease - x the kind before
    it) in each mode, and checks that the fault struck that kind (the sequence is fixed: the
    marker precedes an attempt's payload files, which alone are written in parallel)."""
    uri, options = backend_uri
    operations = record_operations(
        lambda **kw: CheckpointStore(f"{uri}/count", storage_options=options, **kw)
    )
    total = len(operations)
    assert total > 20
    points = list(range(1, total + 1))
    if uri.startswith("s3://"):
        points = sample_points(operations, mode)
        assert len(set(kinds_of(operations))) == len(points) > 15
    for n in points:
        raw = open_backend(f"{uri}/n{n}", options)
        faulty = FaultyBackend(raw, fail_at=n, mode=mode)
        done = run_saves(CheckpointStore(raw.uri, keep_last=KEEP_LAST, backend=faulty))
        assert faulty.fired
        assert kinds_of(faulty.log[:n])[-1] == kinds_of(operations[:n])[-1], n
        check_store(raw, done)
        try:
            CheckpointStore(raw.uri, backend=raw).gc(older_than=0)  # garbage goes, steps stay
        except NotFoundError:  # the fault came before the store's first object: no store
            assert not done and list(raw.list("")) == []
        check_store(raw, done)
