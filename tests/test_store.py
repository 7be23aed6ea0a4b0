"""CheckpointStore's user-facing operations, on every backend."""

from __future__ import annotations

import logging
import os
import socket
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ConflictError, NotFoundError
from ckptstore.data.payload import SourceFile
from ckptstore.domain.layout import LATEST_NAME, manifest_path, payload_path, pin_path, step_dir
from ckptstore.errors import CompatibilityError, ConfigError
from keys import file_key
from parts import committer_for, pointer_step


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((4, 4), float(step)), "step": step}


def test_save_returns_info_that_matches_what_is_stored(store: CheckpointStore) -> None:
    info = store.save(3, state_for(3), metadata={"loss": 0.25, "tags": ["warmup"]})
    assert info.step == 3
    assert info.uri.endswith("/global_step_3")
    assert info.metadata == {"loss": 0.25, "tags": ["warmup"]}
    assert {f.path for f in info.files} == {"state.json", "w-00000.safetensors"}
    assert info.size == sum(f.size for f in info.files) > 64
    assert abs(info.time - store.clock()) < 60
    env = info.manifest.environment
    assert env.torch == metadata.version("torch") and env.hostname == socket.gethostname()
    assert env.world_size == 1 and env.ckptstore
    assert str(os.getpid()) in info.manifest.writer
    assert store.info(3) == info
    assert store.latest() == info


def test_a_fresh_store_on_the_same_uri_resumes(store_uri: tuple[str, dict[str, Any]]) -> None:
    uri, options = store_uri
    CheckpointStore(uri, storage_options=options).save(10, state_for(10))
    other_cluster = CheckpointStore(uri, storage_options=options)
    assert other_cluster.latest().step == 10  # type: ignore[union-attr]
    assert torch.equal(other_cluster.load()["w"], state_for(10)["w"])


def test_list_is_ascending_and_skips_uncommitted(store: CheckpointStore) -> None:
    for step in (30, 10, 20):
        store.save(step, state_for(step), allow_older=True)  # older steps on purpose
    store.backend.write(payload_path(40, "state.json"), [b"{}"])  # a save in flight
    assert [i.step for i in store.list()] == [10, 20, 30]


def test_push_and_pull_a_directory_byte_identical(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "global_step_5"
    files = {
        "actor/model_world_size_2_rank_0.pt": os.urandom(3000),
        "actor/model_world_size_2_rank_1.pt": os.urandom(10),
        "actor/huggingface/config.json": b'{"a": 1}',
        "data.pt": b"",
        "ünïcode name.bin": b"x",
    }
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    progress: list[int] = []
    info = store.push_dir(5, src, metadata={"source": "verl"}, progress=progress.append)
    assert sum(progress) == sum(len(d) for d in files.values())
    assert info.manifest.kind == "directory"
    out = tmp_path / "pulled"
    assert store.pull_dir(out).step == 5
    pulled = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert pulled == files
    with pytest.raises(ConfigError, match="pushed as a directory"):
        store.load(5)


def test_push_refuses_symlinks_that_leave_the_directory(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "step"
    src.mkdir()
    (src / "ok.bin").write_bytes(b"1")
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key=...")
    (src / "creds").symlink_to(secret)
    with pytest.raises(ConfigError, match="outside"):
        store.push_dir(1, src)
    assert store.list() == []
    (src / "creds").unlink()
    (src / "inside").symlink_to(src / "ok.bin")
    info = store.push_dir(1, src)
    assert {f.path for f in info.files} == {"inside", "ok.bin"}


def test_copy_to_replicates_steps_and_latest(store: CheckpointStore, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        store.save(step, state_for(step), metadata={"loss": step})
    dest = CheckpointStore(str(tmp_path / "replica"), keep_last=2)
    copied = dest and store.copy_to(dest)
    # the destination's own retention: step 1 would be deleted at once, so it is not copied
    assert [i.step for i in copied] == [2, 3]
    assert [i.step for i in dest.list()] == [2, 3]
    assert dest.latest().step == 3  # type: ignore[union-attr]
    assert dest.info(3).manifest == store.info(3).manifest
    assert torch.equal(dest.load()["w"], state_for(3)["w"])
    assert store.copy_to(dest, steps=[3]) == []  # identical steps are skipped
    store.save(4, state_for(4))
    dest.save(4, state_for(99))
    with pytest.raises(ConflictError, match=r"exists in .* with other contents"):
        store.copy_to(dest, steps=[4])


def test_pins_protect_from_retention_until_unpinned(store_uri: tuple[str, dict[str, Any]]) -> None:
    uri, options = store_uri
    store = CheckpointStore(uri, storage_options=options, keep_last=1)
    store.save(1, state_for(1))
    store.pin(1)
    store.save(2, state_for(2))
    assert [i.step for i in store.list()] == [1, 2]
    assert store.pins() == [1]
    with pytest.raises(NotFoundError):
        store.pin(7)
    assert store.unpin(1) is True
    assert store.unpin(1) is False
    assert store.prune(dry_run=True) == [1]
    assert [i.step for i in store.list()] == [1, 2]
    assert store.prune() == [1]
    assert [i.step for i in store.list()] == [2]


def test_delete_protects_latest_and_pins_unless_forced(store: CheckpointStore) -> None:
    for step in (1, 2, 3):
        store.save(step, state_for(step))
    store.pin(1)
    with pytest.raises(ConflictError, match="pinned"):
        store.delete(1)
    store.delete(2)
    assert [i.step for i in store.list()] == [1, 3]
    store.delete(3, force=True)  # latest goes back to the newest step left
    assert store.latest().step == 1  # type: ignore[union-attr]
    assert pointer_step(store.backend) == 1
    store.delete(1, force=True)
    assert store.backend.stat(pin_path(1)) is None
    assert store.backend.stat(LATEST_NAME) is None and store.latest() is None
    with pytest.raises(NotFoundError):
        store.delete(1)


def test_gc_removes_garbage_only_once_it_is_old(store: CheckpointStore) -> None:
    store.save(1, state_for(1))
    committer = committer_for(store.backend, writer="crashed", clock=store.clock)
    committer.write_payload(2, [SourceFile("state.json", lambda: [b"{}"])])  # never committed
    staged = [o.path for o in store.backend.list(step_dir(2) + "/")]
    store.backend.write(pin_path(9), [b"pinned\n"])  # pin of a step that is gone
    store.backend.write(step_dir(1) + "/synced-by-hand.bin", [b"x"])  # not ckptstore's
    young = store.gc()
    assert young.deleted == ()  # too young: could be a save in flight elsewhere
    assert young.kept == (staged[0].rsplit("/", 1)[0],)
    report = store.gc(dry_run=True, older_than=0)
    assert set(report.deleted) == {*staged, pin_path(9)}
    assert report.foreign == (step_dir(1) + "/synced-by-hand.bin",)
    assert store.backend.stat(staged[0]) is not None
    assert store.gc(older_than=0).deleted == report.deleted
    left = [o.path for o in store.backend.list(step_dir(2) + "/")]
    assert left == [manifest_path(2)]  # a tombstone, which gc removes a day later
    assert store.latest().step == 1  # type: ignore[union-attr]
    assert store.backend.read(step_dir(1) + "/synced-by-hand.bin") == b"x"  # reported, kept
    assert store.verify(1).ok and store.gc(older_than=0).deleted == ()


def test_verify_all_reports_every_bad_step(store: CheckpointStore) -> None:
    for step in (1, 2, 3):
        store.save(step, state_for(step))
    store.backend.write(file_key(store, 1, "state.json"), [b"{}"])
    store.backend.delete([file_key(store, 3, "w-00000.safetensors")])
    reports = {r.step: r for r in store.verify_all()}
    assert reports[2].ok
    assert "checksum" in reports[1].problems[0] or "bytes" in reports[1].problems[0]
    assert "is missing" in reports[3].problems[0]


@pytest.mark.parametrize("mode", ["strict", "warn", "ignore"])
def test_version_mismatch_follows_compat(
    store: CheckpointStore, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dataclasses import replace

    written = replace(store.environment, torch="1.13.1", ckptstore="0.0.1")
    with CheckpointStore(store.uri, backend=store.backend, environment=written) as writer:
        writer.save(1, state_for(1))
    reader = CheckpointStore(store.uri, backend=store.backend, compat=mode)
    if mode == "strict":
        with pytest.raises(CompatibilityError) as caught:
            reader.load(1)
        message = str(caught.value)
        assert "torch 1.13.1 (written)" in message and metadata.version("torch") in message
        assert "compat='warn'" in message
        return
    with caplog.at_level(logging.WARNING):
        assert reader.load(1)["step"] == 1
    assert ("torch 1.13.1" in caplog.text) == (mode == "warn")
