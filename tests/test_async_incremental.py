"""save_async (snapshot, one in flight, errors never lost) and incremental saves."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.data.serialize import Shard
from ckptstore.domain import layout
from faults import FaultyBackend, InjectedFault
from keys import file_key


def model_state(seed: int, size: int = 256) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(size, size, generator=gen)}, "step": seed}


def test_save_async_snapshots_so_training_can_go_on(store: CheckpointStore) -> None:
    state = model_state(1)
    expected = state["model"]["w"].clone()
    handle = store.save_async(1, state)
    state["model"]["w"].add_(1.0)  # the trainer's next step, before the save finished
    info = handle.wait()
    assert info.step == 1 and handle.done()
    assert handle.blocked_seconds > 0 and info.stats is not None
    assert info.stats.blocked_seconds == handle.blocked_seconds
    assert torch.equal(store.load(1)["model"]["w"], expected)


def test_one_save_in_flight_and_steps_commit_in_order(store: CheckpointStore) -> None:
    handles = [store.save_async(step, model_state(step)) for step in range(1, 6)]
    store.wait()
    assert all(h.done() for h in handles)
    assert [i.step for i in store.list()] == [1, 2, 3, 4, 5]
    assert store.latest().step == 5  # type: ignore[union-attr]


def test_snapshot_buffers_are_reused_across_saves(store: CheckpointStore) -> None:
    store.save_async(1, model_state(1)).wait()
    first = store._async.snapshotter._buffers[0].data_ptr()
    store.save_async(2, model_state(2)).wait()
    assert store._async.snapshotter._buffers[0].data_ptr() == first
    assert torch.equal(store.load(2)["model"]["w"], model_state(2)["model"]["w"])


def test_background_error_is_raised_by_wait(tmp_path: Path) -> None:
    raw = CheckpointStore(str(tmp_path / "s")).backend
    store = CheckpointStore(raw.uri, backend=FaultyBackend(raw, fail_at=1, mode="error"))
    handle = store.save_async(1, model_state(1))
    with pytest.raises(InjectedFault):
        handle.wait()
    store.save(2, model_state(2))  # already reported: the next save goes ahead
    assert [i.step for i in store.list()] == [2]


def test_background_error_nobody_waited_for_is_raised_by_the_next_save(tmp_path: Path) -> None:
    raw = CheckpointStore(str(tmp_path / "s")).backend
    store = CheckpointStore(raw.uri, backend=FaultyBackend(raw, fail_at=1, mode="error"))
    store.save_async(1, model_state(1))
    with pytest.raises(InjectedFault):
        store.save_async(2, model_state(2))
    store.save_async(3, model_state(3)).wait()
    assert [i.step for i in store.list()] == [3]
    store.save_async(4, model_state(4))
    store.close()  # flushes the pending save
    assert [i.step for i in CheckpointStore(raw.uri).list()] == [3, 4]


def test_a_script_that_just_returns_still_commits_its_last_async_save(tmp_path: Path) -> None:
    uri = str(tmp_path / "s")
    script = textwrap.dedent(
        f"""
        import torch
        from ckptstore import CheckpointStore
        store = CheckpointStore({uri!r})
        store.save_async(7, {{"w": torch.ones(512, 512)}})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert CheckpointStore(uri).latest().step == 7  # type: ignore[union-attr]


def test_incremental_save_copies_unchanged_files(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    frozen = {"w": torch.randn(512, 512)}  # a reference model that does not train
    store.save(1, {"ref": frozen, "model": model_state(1)["model"]})
    with caplog.at_level(logging.INFO):
        info = store.save(2, {"ref": frozen, "model": model_state(2)["model"]})
    by_path = {f.path: f for f in info.files}
    assert by_path["ref-00000.safetensors"].copied_from == 1
    assert by_path["model-00000.safetensors"].copied_from is None
    assert info.stats is not None
    reused = by_path["ref-00000.safetensors"].size + by_path["state.json"].size  # same skeleton
    assert info.stats.bytes_reused == reused
    assert info.stats.bytes_uploaded < info.stats.bytes_total / 2
    assert "MB reused" in caplog.text
    store.delete(1)  # the copy stands on its own once its source is gone
    loaded = store.load(2)
    assert torch.equal(loaded["ref"]["w"], frozen["w"])
    assert store.verify(2).ok


def test_incremental_can_be_turned_off(store_uri: tuple[str, dict[str, Any]]) -> None:
    uri, options = store_uri
    store = CheckpointStore(uri, storage_options=options, incremental=False)
    frozen = {"w": torch.ones(64)}
    store.save(1, {"ref": frozen})
    info = store.save(2, {"ref": frozen})
    assert all(f.copied_from is None for f in info.files)


def test_a_changed_file_of_equal_size_is_uploaded(store: CheckpointStore) -> None:
    store.save(1, {"ref": {"w": torch.zeros(64)}})
    info = store.save(2, {"ref": {"w": torch.ones(64)}})
    assert {f.path: f.copied_from for f in info.files} == {
        "ref-00000.safetensors": None,
        "state.json": 1,
    }
    assert store.backend.read(file_key(store, 2, "ref-00000.safetensors")) != (
        store.backend.read(file_key(store, 1, "ref-00000.safetensors"))
    )


@pytest.mark.parametrize("where", ["s3", "dir"])
def test_a_shard_is_compared_with_the_previous_step_on_its_way_into_the_request(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """On S3 a shard goes up in one PUT, held whole before any byte is sent: whether it
    equals the previous step's file is checked as its bytes pass into the request (one pass
    over the tensors), and an unchanged one is still copied server-side with nothing sent and
    nothing left behind. A local store writes as the bytes come, so it compares first (two
    passes over a changed file, one over an unchanged one)."""
    if where == "s3":
        uri, options = request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")
    else:
        uri, options = str(tmp_path / "store"), {}
    passes: list[str] = []
    real = Shard.chunks

    def counting(self: Shard) -> Any:
        passes.append(self.path)
        return real(self)

    monkeypatch.setattr(Shard, "chunks", counting)
    frozen = {"w": torch.randn(256, 256)}
    with CheckpointStore(uri, storage_options=options) as store:
        store.save(1, {"ref": frozen, "model": model_state(1)["model"]})
        passes.clear()
        info = store.save(2, {"ref": frozen, "model": model_state(2)["model"]})
        by_path = {f.path: f for f in info.files}
        assert by_path["ref-00000.safetensors"].copied_from == 1
        assert by_path["model-00000.safetensors"].copied_from is None
        changed = 1 if where == "s3" else 2  # a local store reads it to compare, then to write
        model, ref = "model-00000.safetensors", "ref-00000.safetensors"
        assert sorted(passes) == [model] * changed + [ref]
        loaded = store.load(2)
        assert torch.equal(loaded["ref"]["w"], frozen["w"])
        assert torch.equal(loaded["model"]["w"], model_state(2)["model"]["w"])
        keys = {o.path for o in store.backend.list(layout.step_dir(2) + "/")}
        listed = {f.key(2) for f in info.files}
        assert listed <= keys and all(
            k.endswith((layout.MANIFEST_NAME, layout.ATTEMPT_MARKER)) for k in keys - listed
        )
