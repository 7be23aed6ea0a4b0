"""The commit protocol under hostile interleavings and forged bytes (the defects of issue 9).

Each test replays one schedule deterministically, by calling the store's own stages in the
order of the schedule or by hooking one backend call; each ran against the code before the fix
and failed there. Every test runs on local disk, memory:// and S3 on a moto server over HTTP.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from ckptstore import CheckpointStore, Loaded
from ckptstore.backends.base import Backend
from ckptstore.data.payload import SourceFile
from ckptstore.data.serialize import encode_state
from ckptstore.domain.layout import LATEST_NAME, manifest_path, step_dir
from ckptstore.domain.manifest import KIND_STATE, Manifest
from ckptstore.errors import ConflictError, CorruptCheckpointError, NotFoundError
from ckptstore.protocol.pointer import Pointer
from keys import file_key
from parts import committer_for, pointer_step

FIXTURES = Path(__file__).parent / "fixtures"
KEY = b"integrity-test-signing-key-0123456789"


@pytest.fixture
def make_store(backend_uri: tuple[str, dict[str, Any]]) -> Iterator[Callable[..., CheckpointStore]]:
    uri, options = backend_uri
    opened: list[CheckpointStore] = []

    def make(**kwargs: Any) -> CheckpointStore:
        store = CheckpointStore(uri, storage_options=options, **kwargs)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def state_for(step: int, salt: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step * 1000 + salt)
    return {"w": torch.randn(256, 64, generator=gen), "step": step, "salt": salt}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and a["salt"] == b["salt"] and torch.equal(a["w"], b["w"])


def staged(store: CheckpointStore, step: int, state: dict[str, Any]) -> list[Any]:
    files = [SourceFile(f.path, f.chunks, f.size) for f in encode_state(state).files()]
    return store.stage_files(step, files, kind=KIND_STATE)


class Hooked:
    """Delegates to a backend and runs ``before(name, args)`` ahead of every call."""

    def __init__(self, inner: Backend, before: Callable[[str, tuple[Any, ...]], None]) -> None:
        self._inner = inner
        self._before = before

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self._before(name, args)
            return target(*args, **kwargs)

        return call


# -- 1. rival writers of one step never share a payload key ---------------------------------


def test_two_lease_free_writers_of_one_step_commit_exactly_the_winners_bytes(
    make_store: Callable[..., CheckpointStore],
) -> None:
    a, b = make_store(lease=False), make_store(lease=False)
    a_entries = staged(a, 5, state_for(5, salt=1))
    b_entries = staged(b, 5, state_for(5, salt=2))  # used to overwrite a's files in place
    a.commit_files(5, a_entries, kind=KIND_STATE)
    with pytest.raises(ConflictError, match="already committed"):
        b.commit_files(5, b_entries, kind=KIND_STATE)
    assert a.verify(5).ok
    assert same(b.load(5), state_for(5, salt=1))
    assert {e.attempt for e in a_entries}.isdisjoint({e.attempt for e in b_entries})
    assert not any(b.backend.stat(e.key(5)) for e in b_entries)  # the loser cleaned up


def test_gc_removes_the_attempt_that_lost_the_race(
    make_store: Callable[..., CheckpointStore],
) -> None:
    a, b = make_store(lease=False), make_store(lease=False)
    a_entries, b_entries = staged(a, 5, state_for(5, 1)), staged(b, 5, state_for(5, 2))
    a.commit_files(5, a_entries, kind=KIND_STATE)  # b crashes before it even tries
    report = a.gc(older_than=3600)  # a lost attempt is dead whatever its age
    assert {e.key(5) for e in b_entries} <= set(report.deleted)
    assert a.verify(5).ok and a.gc(older_than=0).deleted == ()


# -- 2. gc against commits --------------------------------------------------------------------


def test_gc_beside_a_lease_holder_keeps_its_attempt_in_flight(
    make_store: Callable[..., CheckpointStore],
) -> None:
    writer, janitor = make_store(), make_store(lease=False)
    writer.save(1, state_for(1))
    entries = staged(writer, 2, state_for(2))  # staged, not yet committed
    report = janitor.gc(older_than=0)
    assert report.deleted == () and len(report.kept) == 1
    writer.commit_files(2, entries, kind=KIND_STATE)
    assert writer.verify(2).ok and same(janitor.load(), state_for(2))


def test_gc_that_finds_no_manifest_cannot_delete_a_step_committed_meanwhile(
    make_store: Callable[..., CheckpointStore],
) -> None:
    writer = make_store(lease=False)
    entries = staged(writer, 3, state_for(3))
    raced = []

    def commit_first(name: str, args: tuple[Any, ...]) -> None:
        # gc decided step 3 is garbage; the writer commits just before gc acts on it
        if name == "create" and args[0] == manifest_path(3) and not raced:
            raced.append(writer.commit_files(3, entries, kind=KIND_STATE))

    janitor = make_store(lease=False, backend=Hooked(writer.backend, commit_first))
    report = janitor.gc(older_than=0)
    assert raced and report.deleted == ()
    assert writer.verify(3).ok and same(writer.load(3), state_for(3))


def test_a_commit_racing_gc_fails_cleanly_and_loses_nothing_committed(
    make_store: Callable[..., CheckpointStore],
) -> None:
    writer = make_store(lease=False)
    writer.save(1, state_for(1))
    entries = staged(writer, 2, state_for(2))
    refused: list[Exception] = []

    def commit_during_gc(name: str, args: tuple[Any, ...]) -> None:
        # gc's tombstone stands; the writer tries to commit while gc deletes the files
        if name == "delete" and any("/.attempt-" in p for p in args[0]) and not refused:
            with pytest.raises(ConflictError, match="was removed while this save staged") as caught:
                writer.commit_files(2, entries, kind=KIND_STATE)
            refused.append(caught.value)

    janitor = make_store(lease=False, backend=Hooked(writer.backend, commit_during_gc))
    janitor.gc(older_than=0)
    assert refused
    assert [i.step for i in writer.list()] == [1] and writer.verify(1).ok
    assert writer.latest().step == 1  # type: ignore[union-attr]
    # a store without leases cannot prove the writer dead: gc's tombstone stays a day
    assert [o.path for o in writer.backend.list(step_dir(2) + "/")] == [manifest_path(2)]
    writer.save(2, state_for(2))  # a save that starts after the tombstone commits over it
    assert writer.verify(2).ok


def test_gc_never_deletes_a_manifest_or_a_listed_file(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store()
    for step in (1, 2, 3):
        store.save(step, state_for(step))
    before = {o.path for o in store.backend.list("global_step_")}
    report = store.gc(older_than=0)
    assert report.deleted == () and {o.path for o in store.backend.list("global_step_")} == before


# -- 3. a forged payload in a signed store ----------------------------------------------------


def forge_keeping_crc32c(data: bytes, offset: int) -> bytes:
    """``data`` with bytes changed at ``offset`` and 4 bytes after them chosen so that the
    length and CRC32C stay the same (CRC is affine over GF(2): solve 32 linear equations)."""
    forged = bytearray(data)
    forged[offset] ^= 0xFF
    patch = offset + 8
    target = crc32c.crc32c(bytes(forged)) ^ crc32c.crc32c(data)
    columns = []
    for bit in range(32):
        flipped = bytearray(forged)
        flipped[patch + bit // 8] ^= 1 << (bit % 8)
        columns.append(crc32c.crc32c(bytes(flipped)) ^ crc32c.crc32c(bytes(forged)))
    rows = [(columns[i], 1 << i) for i in range(32)]  # Gaussian elimination over GF(2)
    basis: dict[int, tuple[int, int]] = {}
    for value, combo in rows:
        for high in sorted(basis, reverse=True):
            if value >> high & 1:
                value, combo = value ^ basis[high][0], combo ^ basis[high][1]
        if value:
            basis[value.bit_length() - 1] = (value, combo)
    chosen = 0
    for high in sorted(basis, reverse=True):
        if target >> high & 1:
            target ^= basis[high][0]
            chosen ^= basis[high][1]
    assert target == 0, "the forgery needs another patch position"
    for bit in range(32):
        if chosen >> bit & 1:
            forged[patch + bit // 8] ^= 1 << (bit % 8)
    assert crc32c.crc32c(bytes(forged)) == crc32c.crc32c(data) and bytes(forged) != data
    return bytes(forged)


def test_a_signed_store_refuses_bytes_forged_to_keep_the_crc(
    make_store: Callable[..., CheckpointStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(signing_key=KEY, incremental=False)
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    key = file_key(store, 2, "w-00000.safetensors")
    original = store.backend.read(key)
    store.backend.write(key, [forge_keeping_crc32c(original, len(original) // 2)])
    assert all(len(f.sha256 or "") == 64 for f in store.info(2).files)
    with pytest.raises(CorruptCheckpointError, match="SHA-256 mismatch") as caught:
        store.load(2)
    assert key in str(caught.value) and "step 2" in str(caught.value)
    with caplog.at_level(logging.WARNING):
        assert same(store.load(), state_for(1))  # resume falls back to the good step
    assert not store.verify(2).ok


def test_incremental_signed_saves_reuse_files_by_digest(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store(signing_key=KEY)
    state = state_for(1)
    store.save(1, state)
    info = store.save(2, {**state, "step": 2})
    reused = [f for f in info.files if f.copied_from == 1]
    assert reused and all(f.sha256 for f in reused) and store.verify(2).ok


# -- 5. sizes that cannot be true --------------------------------------------------------------


def test_a_manifest_promising_a_huge_file_reads_as_corruption(
    make_store: Callable[..., CheckpointStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    manifest = json.loads(store.backend.read(manifest_path(2)))
    manifest["files"][0]["size"] = 2**45
    store.backend.delete([manifest_path(2)])
    store.backend.create(manifest_path(2), json.dumps(manifest).encode())
    with pytest.raises(CorruptCheckpointError, match=str(2**45)):
        store.load(2)
    with caplog.at_level(logging.WARNING):
        assert same(store.load(), state_for(1))
    assert "trying an older step" in caplog.text


# -- 6. a pointer ahead of every committed step ------------------------------------------------


def test_the_next_commit_repairs_a_pointer_ahead_of_every_step(
    make_store: Callable[..., CheckpointStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(keep_last=1)
    store.save(1, state_for(1))
    _, version = store.backend.read_versioned(LATEST_NAME)
    store.backend.swap(LATEST_NAME, Pointer(100, "forger", 0.0).encode(), version)
    with caplog.at_level(logging.WARNING):
        store.save(2, state_for(2))
    assert "step 100, which is not committed" in caplog.text
    assert pointer_step(store.backend) == 2
    assert [i.step for i in store.list()] == [2]  # retention works again


# -- 7. torn reads of the pointer ----------------------------------------------------------------


def test_a_torn_read_of_latest_is_read_again(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store()
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    torn: list[str] = []

    class Torn:
        """Returns half of latest.json on the first read, as a PUT in progress may."""

        def __init__(self, inner: Backend) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def read_versioned(self, path: str) -> tuple[bytes, str]:
            data, version = self._inner.read_versioned(path)
            if path == LATEST_NAME and not torn:
                torn.append(path)
                return data[: len(data) // 2], version
            return data, version

    pruner = make_store(keep_last=1, backend=Torn(store.backend), lease=False)
    assert pruner.prune() == [1]
    assert torn and pruner.latest().step == 2  # type: ignore[union-attr]


# -- 8. one call returns the state and the step it came from -----------------------------------


def test_load_with_info_names_the_step_it_loaded(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store()
    store.save(1, state_for(1), metadata={"loss": 0.5})
    store.save(2, state_for(2), metadata={"loss": 0.25})
    loaded = store.load(with_info=True)
    assert isinstance(loaded, Loaded)
    assert loaded.step == 2 and loaded.metadata == {"loss": 0.25}
    assert same(loaded.state, state_for(2))
    assert store.load(1, with_info=True).step == 1


# -- 11. a fenced writer's late step is never latest ---------------------------------------------


def test_a_step_committed_after_losing_the_lease_is_never_latest(
    make_store: Callable[..., CheckpointStore], caplog: pytest.LogCaptureFixture
) -> None:
    zombie = make_store()
    zombie.save(1, state_for(1))
    entries = staged(zombie, 2, state_for(2, salt=9))
    epoch = zombie.hold_lease()  # its last renewal: the commit is one round trip away
    replacement = make_store(takeover=True)
    late = Manifest(
        step=2,
        created=0.0,
        kind=KIND_STATE,
        files=tuple(entries),
        environment=zombie.environment,
        writer=zombie.writer,
        lease_epoch=epoch,
    )
    # the zombie's own commit protocol, past its lease check: the manifest lands after the takeover
    committer_for(zombie.backend, writer=zombie.writer).commit(late)
    with caplog.at_level(logging.WARNING):
        assert replacement.latest().step == 1  # type: ignore[union-attr]
        assert same(replacement.load(), state_for(1))
    assert "lost the writer lease" in caplog.text
    assert replacement.fenced_steps() == [2]
    replacement.save(2, state_for(2))  # replaces the fenced step instead of conflicting
    assert same(replacement.load(), state_for(2)) and replacement.fenced_steps() == []


# -- schema migration: frozen stores written by schema 1 always load ---------------------------


@pytest.fixture
def v1_store(tmp_path: Path) -> Path:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURES / "store_v1", root)
    return root


V1_W = {
    10: [
        [1.5409960746765137, -0.293428897857666, -2.1787893772125244, 0.5684312582015991],
        [-1.0845223665237427, -1.3985954523086548, 0.40334683656692505, 0.8380263447761536],
        [-0.7192575931549072, -0.40334352850914, -0.5966353416442871, 0.18203648924827576],
    ],
    20: [
        [-0.8566746115684509, 1.1006041765213013, -1.0711873769760132, 0.1227012425661087],
        [-0.5663174986839294, 0.3731146454811096, -0.8919953107833862, -1.5091077089309692],
        [0.3703935444355011, 1.4565025568008423, 0.9398099184036255, 0.7748488187789917],
    ],
}


def test_a_schema_1_store_loads_and_takes_new_saves(v1_store: Path, tmp_path: Path) -> None:
    with CheckpointStore(str(v1_store), keep_last=2) as store:
        assert [i.step for i in store.list()] == [10, 20, 30]
        assert all(i.manifest.schema_version == 1 for i in store.list())
        assert store.latest().step == 30  # type: ignore[union-attr]
        for step, rows in V1_W.items():
            state = store.load(step)
            assert torch.equal(state["model"]["w"], torch.tensor(rows))
            assert torch.equal(state["model"]["b"], torch.arange(4))
            assert state["step"] == step and store.info(step).metadata["loss"] in (1.25, 0.75)
        pulled = store.pull_dir(tmp_path / "pulled", 30)
        assert pulled.step == 30
        assert (tmp_path / "pulled/actor/model_world_size_1_rank_0.pt").read_bytes() == (
            b"not really a pickle\n"
        )
        assert all(r.ok for r in store.verify_all())
        assert store.gc(older_than=0).deleted == ()
        store.save(40, {"w": torch.ones(2)}, metadata={"after": "upgrade"})
        assert [i.manifest.schema_version for i in store.list()] == [1, 3]  # kept last 2
        assert store.load(with_info=True).step == 40


def test_a_schema_1_signed_store_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "signed"
    shutil.copytree(FIXTURES / "store_v1_signed", root)
    with (
        caplog.at_level(logging.WARNING),
        CheckpointStore(str(root), signing_key=b"fixture-signing-key-0123456789") as store,
    ):
        assert torch.equal(store.load()["w"], torch.ones(2, 2))
    assert "CRC32C only" in caplog.text
    with CheckpointStore(str(root), signing_key=KEY) as other, pytest.raises(NotFoundError):
        other.info(6)
