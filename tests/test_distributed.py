"""save_distributed / load_distributed over real gloo process groups in spawned processes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import (
    BackendError,
    CheckpointStore,
    CompatibilityError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    NotFoundError,
)
from ckptstore.domain.layout import LEASE_NAME, step_dir
from ckptstore.domain.manifest import FileEntry
from ckptstore.domain.plan import Plan, Previous
from ckptstore.integrations.distributed import (
    load_distributed,
    rank_dir,
    save_distributed,
)
from ckptstore.protocol.commit import Committer
from parts import pointer_step
from ranks import Records, run_ranks

MiB = 1 << 20


def rank_state(rank: int, step: int) -> dict[str, Any]:
    """Every rank holds different shapes and values, so a mix-up cannot go unnoticed."""
    return {
        "model": {"w": torch.full((3, 4), rank + step / 100), "b": torch.arange(rank + 2)},
        "rank": rank,
        "nested": [1.5, "x", (rank, step)],
    }


def assert_state_equal(got: Any, want: Any) -> None:
    assert set(got) == set(want)
    for name in want["model"]:
        assert torch.equal(got["model"][name], want["model"][name])
    assert got["rank"] == want["rank"]
    assert got["nested"] == want["nested"]


def store_on(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if backend == "local":
        return str(tmp_path / "store"), {}
    options = {**request.getfixturevalue("s3_options"), "part_size": 5 * MiB}
    return request.getfixturevalue("s3_uri"), options


# -- in one process (a world of one): the same code path, no spawning ----------------------


def test_a_world_of_one_saves_and_loads_without_a_process_group(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        info = save_distributed(store, 3, rank_state(0, 3), metadata={"loss": 0.5})
        assert {f.path for f in info.files} == {
            f"{rank_dir(0)}/state.json",
            f"{rank_dir(0)}/model-00000.safetensors",
        }
        assert info.manifest.environment.world_size == 1
        assert info.metadata == {"loss": 0.5}
        assert_state_equal(load_distributed(store), rank_state(0, 3))
        assert store.last_loaded == info


def test_the_offer_is_checked_against_the_environment_the_store_was_opened_with(
    tmp_path: Path,
) -> None:
    """Rank 0 compares each offered step's writer with the store's environment (read once,
    not again per load), with the group's world size."""
    with CheckpointStore(str(tmp_path)) as store:
        save_distributed(store, 3, rank_state(0, 3))
        written = store.environment
    other = replace(written, torch="0.0.1")
    with (
        CheckpointStore(str(tmp_path), environment=other, compat="strict") as store,
        pytest.raises(CompatibilityError, match=r"0\.0\.1"),
    ):
        load_distributed(store)
    with CheckpointStore(str(tmp_path), environment=written, compat="strict") as store:
        assert_state_equal(load_distributed(store), rank_state(0, 3))


def test_each_rank_is_handed_only_the_previous_files_of_its_own_folder() -> None:
    def entry(path: str) -> FileEntry:
        return FileEntry(path, 1, "00000000", None, "0123456789abcdef")

    paths = [
        f"{rank_dir(0)}/state.json",
        f"{rank_dir(1)}/state.json",
        f"{rank_dir(1)}/model-00000.safetensors",
        f"{rank_dir(5)}/state.json",  # a rank the world no longer has
        f"{rank_dir(1)}x/state.json",  # a look-alike folder
        "state.json",  # a plain save's file
    ]
    folders = [rank_dir(r) for r in range(3)]
    plan = Plan(9, "state", 3, Previous(7, tuple(entry(p) for p in paths)))
    cut = plan.split(folders)
    assert [[f.path for f in p.previous.files] for p in cut] == [[paths[0]], paths[1:3], []]
    assert {p.previous.step for p in cut} == {7}
    assert {(p.step, p.kind, p.epoch) for p in cut} == {(9, "state", 3)}
    empty = Plan(9, "state", 0, Previous(None))
    assert empty.split(folders[:2]) == [empty, empty]


def test_an_unchanged_rank_copies_its_files_from_the_step_rank_0_read(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        save_distributed(store, 1, rank_state(0, 1))
        again = save_distributed(store, 2, rank_state(0, 1))
        assert {f.copied_from for f in again.files} == {1}  # from the scattered entries
        changed = save_distributed(store, 3, rank_state(0, 3))
        assert {f.path: f.copied_from for f in changed.files}[f"{rank_dir(0)}/state.json"] is None


def test_a_step_behind_latest_is_refused_with_the_step_rank_0_read(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        save_distributed(store, 10, rank_state(0, 10))
        with pytest.raises(DistributedCheckpointError, match="refusing to save step 3"):
            save_distributed(store, 3, rank_state(0, 3))
        assert [i.step for i in store.list()] == [10]
        assert not (tmp_path / step_dir(3)).exists()


def test_an_empty_store_is_not_found(tmp_path: Path) -> None:
    with (
        CheckpointStore(str(tmp_path)) as store,
        pytest.raises(NotFoundError, match="no committed step"),
    ):
        load_distributed(store)


def test_plain_and_distributed_steps_refuse_the_other_loader(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, rank_state(0, 1))
        save_distributed(store, 2, rank_state(0, 2))
        with pytest.raises(ConfigError, match=r"load it on every rank with .*load_distributed"):
            store.load(2)
        with pytest.raises(ConfigError, match="was not saved by save_distributed"):
            load_distributed(store, 1)
        # not a corrupt step: store.load() must not silently fall back to step 1
        with pytest.raises(ConfigError):
            store.load()


def test_a_rank_that_cannot_encode_its_state_fails_the_save(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        with pytest.raises(DistributedCheckpointError, match="rank 0: SerializationError") as e:
            save_distributed(store, 1, {"bad": object()})
        assert e.value.failures.keys() == {0}
        assert store.list() == []
        assert not (tmp_path / step_dir(1)).exists()


def test_a_pointer_that_cannot_move_after_the_commit_leaves_the_step_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest is written: the step is committed and reported so (a warning), never as a
    failed save; readers find it by listing, and the next save moves latest."""
    with CheckpointStore(str(tmp_path)) as store:

        def lost(*args: Any, **kwargs: Any) -> bool:
            raise BackendError("latest could not be moved", retryable=True)

        # the one step between the manifest and the pointer, failed for the store's committer
        monkeypatch.setattr(Committer, "advance_latest", lost)
        info = save_distributed(store, 1, rank_state(0, 1))
        assert info.step == 1 and store.info(1).step == 1
        assert "step 1 is committed, but latest could not be moved" in caplog.text
        assert store.latest().step == 1  # type: ignore[union-attr]  # by listing
        monkeypatch.undo()
        save_distributed(store, 2, rank_state(0, 2))
        assert pointer_step(store.backend) == 2


# -- real process groups --------------------------------------------------------------------


def _save_load_corrupt(rank: int, world: int, uri: str, options: dict) -> dict[str, Any]:
    records = Records()
    store = CheckpointStore(uri, storage_options=options)  # default lease: must stay unused
    first = save_distributed(store, 10, rank_state(rank, 10), metadata={"loss": 1.5})
    info = save_distributed(store, 20, rank_state(rank, 20))
    latest = load_distributed(store)
    earlier = load_distributed(store, 10)
    torch.distributed.barrier()
    if rank == 0:  # same size, other bytes: only rank world-1 reads this file
        entry = info.manifest.file(f"{rank_dir(world - 1)}/model-00000.safetensors")
        store.backend.write(entry.key(20), [b"\0" * entry.size])
    torch.distributed.barrier()
    fell_back = load_distributed(store)
    fell_back_step = store.last_loaded.step  # type: ignore[union-attr]
    try:
        load_distributed(store, 20)
        explicit_error = ""
    except CorruptCheckpointError as e:
        explicit_error = str(e)
    store.close()
    return {
        "writer": store.writer,
        "first": first,
        "info": info,
        "latest": latest,
        "earlier": earlier,
        "fell_back": fell_back,
        "fell_back_step": fell_back_step,
        "explicit_error": explicit_error,
        "warnings": records.messages,
    }


@pytest.mark.parametrize(("world", "backend"), [(2, "local"), (4, "s3")])
def test_every_rank_saves_into_one_manifest_and_loads_its_own_state(
    world: int, backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    uri, options = store_on(backend, tmp_path, request)
    results = run_ranks(_save_load_corrupt, world, tmp_path / "ranks", uri, options)

    info = results[0]["info"]
    assert all(r["info"] == info for r in results)  # every rank returns the same step
    assert info.step == 20 and info.manifest.environment.world_size == world
    assert {f.path.split("/")[0] for f in info.files} == {rank_dir(r) for r in range(world)}
    assert results[0]["first"].metadata == {"loss": 1.5}
    for rank, r in enumerate(results):
        assert_state_equal(r["latest"], rank_state(rank, 20))
        assert_state_equal(r["earlier"], rank_state(rank, 10))
        # a corrupt file of one rank makes every rank fall back, together
        assert_state_equal(r["fell_back"], rank_state(rank, 10))
        assert r["fell_back_step"] == 10
        assert f"rank {world - 1}: " in r["explicit_error"]
        assert "checksum mismatch" in r["explicit_error"]
    assert any("step 20 failed verification" in m for m in results[0]["warnings"])

    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        assert store.verify(10).ok  # one manifest covers every rank's files, checksums match
        lease = json.loads(store.backend.read(LEASE_NAME))
        assert lease["holder"] == results[0]["writer"]  # only rank 0 ever took the lease
        with pytest.raises(ConfigError, match=rf"saved by {world} ranks, but this job has 1"):
            load_distributed(store, 10)
        with pytest.raises(ConfigError, match="CkptStoreWriter"):
            load_distributed(store, 10)


def _fail_on_one_rank(
    rank: int, world: int, uri: str, options: dict, failing: int
) -> dict[str, Any]:
    store = CheckpointStore(uri, storage_options=options, lease=rank == 0)
    save_distributed(store, 1, rank_state(rank, 1))
    big = {"w": torch.randn(3 * MiB)}  # 12 MiB: a multipart upload of 5 MiB parts on S3
    if rank == failing:
        client = store.backend.client  # type: ignore[attr-defined]
        real = client.upload_part

        def flaky(**kwargs: Any) -> Any:
            if kwargs["PartNumber"] == 2:
                raise RuntimeError("injected failure uploading part 2")
            return real(**kwargs)

        client.upload_part = flaky
    outcomes = []
    for step, state in ((2, big), (3, {"w": object()} if rank == failing else big)):
        try:
            save_distributed(store, step, state)
            outcomes.append(None)
        except DistributedCheckpointError as e:
            outcomes.append((str(e), e.failures, type(e.__cause__).__name__))
    store.close()
    return {"outcomes": outcomes}


def test_a_failing_rank_commits_nothing_and_leaves_nothing_on_s3(
    tmp_path: Path,
    s3_uri: str,
    s3_options: dict[str, Any],
    s3_client: Any,
    s3_bucket: str,
) -> None:
    options = {**s3_options, "part_size": 5 * MiB}
    results = run_ranks(_fail_on_one_rank, 2, tmp_path / "ranks", s3_uri, options, 1)

    for rank, r in enumerate(results):
        (upload, upload_failures, upload_cause), (encode, encode_failures, _) = r["outcomes"]
        assert upload_failures.keys() == {1} and encode_failures.keys() == {1}
        assert "step 2 was not saved (nothing committed, staged files discarded)" in upload
        assert "rank 1: " in upload and "injected failure uploading part 2" in upload
        assert "rank 1: SerializationError" in encode
        # the failing rank chains its own error; the others have none to chain
        assert upload_cause == ("RuntimeError" if rank == 1 else "NoneType")
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    for step in (2, 3):
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"run/{step_dir(step)}/")
        assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        assert [i.step for i in store.list()] == [1]
        assert store.latest().step == 1  # type: ignore[union-attr]


def _save_while_leased(rank: int, world: int, uri: str) -> str:
    store = CheckpointStore(uri, lease=rank == 0)
    try:
        save_distributed(store, 5, rank_state(rank, 5))
    except DistributedCheckpointError as e:
        return str(e)
    finally:
        store.close()
    return "saved"


def test_a_lease_held_elsewhere_stops_every_rank_before_any_upload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = str(tmp_path / "store")
    other = CheckpointStore(uri, lease_ttl=2)  # heartbeats every 0.5 s: seen alive at once
    other.hold_lease()  # a live job writes this store
    messages = run_ranks(_save_while_leased, 2, tmp_path / "ranks", uri)
    for message in messages:
        assert message.startswith("step 5 was not saved: rank 0: LeaseHeldError")
        assert "takeover=True" in message
    assert not (tmp_path / "store" / step_dir(5)).exists()
    other.close()


def test_a_group_without_torch_distributed_is_a_config_error(tmp_path: Path) -> None:
    with (
        CheckpointStore(str(tmp_path)) as store,
        pytest.raises(ConfigError, match="not initialized"),
    ):
        save_distributed(store, 1, {}, group=object())  # type: ignore[arg-type]
