"""Fences name the writer a takeover displaced (pointer.py), so they mark that writer's late
steps and nothing else: not a tiered job's steps persisted from a fresh local tier (whose lease
epochs start again at 1), not steps replicated from another store (test_replicate.py). Older
pointers still read, and a pointer of a newer ckptstore is refused, never overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, CompatibilityError, FencedError
from ckptstore.protocol.pointer import POINTER_SCHEMA, Fence, Pointer


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(n))}


def test_a_fence_names_the_displaced_writer_and_marks_only_its_later_steps() -> None:
    pointer = Pointer(4, "new", 0.0).stamped("new", 1.0, epoch=2, displaced="old")
    assert pointer.fences == (Fence(2, 4, "old"),)
    assert pointer.fenced(5, "old", lease_epoch=1)
    assert not pointer.fenced(4, "old", lease_epoch=1)  # committed before the takeover
    assert not pointer.fenced(5, "other", lease_epoch=1)  # an older epoch of another store
    decoded = Pointer.decode(pointer.encode(), "mem://latest.json")
    assert decoded == pointer
    assert json.loads(pointer.encode())["fences"] == [[2, 4, "old"]]


def test_a_schema_2_pointer_still_fences_by_epoch() -> None:
    body = {"schema_version": 2, "epoch": 3, "step": 7, "writer": "w", "time": 0.0}
    body |= {"manifest": "global_step_7/ckptstore.manifest.json", "fences": [[3, 7]]}
    pointer = Pointer.decode(json.dumps(body).encode(), "mem://latest.json")
    assert pointer.fences == (Fence(3, 7, None),)
    assert pointer.fenced(8, "anyone", lease_epoch=2)
    assert not pointer.fenced(8, "anyone", lease_epoch=3)
    assert not pointer.fenced(8, "anyone", lease_epoch=0)  # written without a lease


def test_a_pointer_of_a_newer_schema_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    with CheckpointStore(uri) as store:
        store.save(1, state(1))
    latest = tmp_path / "run" / "latest.json"
    body = json.loads(latest.read_text())
    body["schema_version"] = POINTER_SCHEMA + 1
    latest.write_text(json.dumps(body))
    before = latest.read_bytes()
    store = CheckpointStore(uri)
    with pytest.raises(CompatibilityError, match="upgrade ckptstore") as caught:
        store.load()
    assert caught.value.uri is not None and caught.value.uri.endswith("latest.json")
    with pytest.raises(CompatibilityError, match=f"schema {POINTER_SCHEMA + 1}"):
        store.save(2, state(2))
    assert latest.read_bytes() == before  # not "repaired" into an older schema
    store.close()


def test_a_tiered_job_that_takes_over_has_its_persisted_steps_resumed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zombie's late step is fenced: its persist is refused before a byte is copied (the
    durable pointer's fences judge a local tier's step too); the successor's steps, persisted
    from a fresh local tier, are not fenced."""
    uri = str(tmp_path / "durable")
    zombie = CheckpointStore(uri, local=str(tmp_path / "node-a"), persist_every=1)
    zombie.save(1, state(1))
    zombie.wait()
    assert zombie.lease is not None
    epoch = zombie.hold_lease()
    successor = CheckpointStore(uri, local=str(tmp_path / "node-b"), takeover=True)
    # the zombie's last renewal landed just before the takeover: it commits step 2 locally,
    # and its persist commits it in the store, in the round trip after that renewal
    monkeypatch.setattr(zombie.lease, "hold", lambda: epoch)
    monkeypatch.setattr(zombie.lease, "ensure", lambda: epoch)
    zombie.save(2, state(2))
    with pytest.raises(FencedError, match=r"step 2 of the local tier was committed by .* after "
                       r"it lost the writer lease; it is not persisted"):  # fmt: skip
        zombie.wait()
    assert zombie.backend.stat("global_step_2/ckptstore.manifest.json") is None
    assert [o.path for o in zombie.backend.list("global_step_2/")] == []  # nothing copied
    assert successor.fenced_steps() == []
    successor.save(3, state(3), persist=True)
    successor.wait()
    assert successor.info(3).manifest.writer == successor.writer  # the local tier's id
    with CheckpointStore(uri, lease=False) as other_cluster:
        assert [i.step for i in other_cluster.list()] == [1, 3]
        assert other_cluster.latest().step == 3  # type: ignore[union-attr]
        assert torch.equal(other_cluster.load()["w"], state(3)["w"])
    successor.close()
