"""Tiers for multi-rank saves: gloo processes as "nodes", each with a local tier of its own
in front of one bucket (moto over HTTP). Every node commits each step in its local tier, due
steps reach the bucket from every node's share, and a node that lost its local tier resumes
from its peer's copies (``replicas=1``) without reading a payload byte from the bucket, or,
with no peer copy, from the newest durable step (docs/design.md, invariant 17)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.registry import open_backend
from ckptstore.integrations.distributed import load_distributed, save_distributed
from counting import CountingBackend
from ranks import run_ranks

pytestmark = pytest.mark.slow


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 16), rank * 1000.0 + step), "b": torch.arange(rank + step)}


def open_node(
    uri: str, options: dict[str, Any], local: Path, rank: int, **tier: Any
) -> tuple[CheckpointStore, CountingBackend]:
    """A rank's store: its node's local tier, and the bucket behind a call counter."""
    counting = CountingBackend(open_backend(uri, options))
    store = CheckpointStore(uri, backend=counting, local=str(local), lease=rank == 0, **tier)
    return store, counting


def _save_then_lose_the_node(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[Path], tier: dict
) -> dict[str, Any]:
    """Steps 1..3 with persist_every=2: 2 is durable, 3 only in the nodes' local tiers; then
    the job dies (no close)."""
    store, _ = open_node(uri, options, locals_[rank], rank, **tier)
    infos = [save_distributed(store, step, rank_state(rank, step)) for step in (1, 2)]
    store.wait()  # step 2 is durable: every node persisted its share, rank 0 committed it
    infos.append(save_distributed(store, 3, rank_state(rank, 3)))
    store.wait()  # the peer copies, made behind the save, are done; 3 is not due
    local_steps = [i.step for i in CheckpointStore(str(locals_[rank]), lease=False).list()]
    return {"infos": infos, "local": local_steps}


def _resume(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[Path], tier: dict
) -> dict[str, Any]:
    store, counting = open_node(uri, options, locals_[rank], rank, **tier)
    counting.take()
    state = load_distributed(store)
    calls = counting.take()
    assert store.last_loaded is not None
    return {"step": store.last_loaded.step, "state": state, "payload_gets": calls["other GET"]}


def bucket_steps(uri: str, options: dict[str, Any]) -> list[int]:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


@pytest.mark.parametrize("world", [2, 3])
def test_a_lost_node_resumes_from_its_peer_without_reading_the_bucket(
    world: int, s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    locals_ = [tmp_path / f"node{r}" for r in range(world)]
    tier = {"persist_every": 2, "replicas": 1}
    saved = run_ranks(
        _save_then_lose_the_node, world, tmp_path / "save", s3_uri, s3_options, locals_, tier
    )
    assert all(r["local"] == [2, 3] for r in saved), saved  # every node committed each step
    assert bucket_steps(s3_uri, s3_options) == [2]  # 3 was not due: only local, on each node

    shutil.rmtree(locals_[1])  # node 1 is replaced: its local tier is gone
    resumed = run_ranks(_resume, world, tmp_path / "resume", s3_uri, s3_options, locals_, tier)
    for rank, r in enumerate(resumed):
        assert r["step"] == 3, r  # the newest step, which the bucket does not hold
        assert torch.equal(r["state"]["w"], rank_state(rank, 3)["w"])
        assert torch.equal(r["state"]["b"], rank_state(rank, 3)["b"])
        assert r["payload_gets"] == 0, (rank, r)  # every byte came from a node's local tier
    with CheckpointStore(str(locals_[1]), lease=False) as node1:
        assert [i.step for i in node1.list()] == [3]  # node 1's tier holds the step again


def test_without_peer_copies_a_lost_node_resumes_from_the_durable_step(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    locals_ = [tmp_path / f"node{r}" for r in range(2)]
    tier = {"persist_every": 2}
    run_ranks(_save_then_lose_the_node, 2, tmp_path / "save", s3_uri, s3_options, locals_, tier)
    shutil.rmtree(locals_[1])
    resumed = run_ranks(_resume, 2, tmp_path / "resume", s3_uri, s3_options, locals_, tier)
    assert [r["step"] for r in resumed] == [2, 2]  # step 3 cannot be whole: the durable 2
    for rank, r in enumerate(resumed):
        assert torch.equal(r["state"]["w"], rank_state(rank, 2)["w"])
    assert resumed[0]["payload_gets"] == 0  # node 0 still holds step 2 locally
    assert resumed[1]["payload_gets"] > 0  # node 1 reads its share of step 2 from the bucket


def _dcp_save(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[Path]
) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import CkptStoreWriter

    store, _ = open_node(uri, options, locals_[rank], rank, persist_every=2)
    for step in (1, 2, 3):
        dcp.save(sharded(world, step), storage_writer=CkptStoreWriter(store, step))
    store.close()  # rank 0: the last step is made durable, once every node's share is there
    return sorted(p.name for p in locals_[rank].iterdir() if p.name.startswith("global_step"))


def _dcp_load(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[Path]
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import CkptStoreReader

    store, counting = open_node(uri, options, locals_[rank], rank)
    state = sharded(world, 0)
    counting.take()
    reader = CkptStoreReader(store)
    dcp.load(state, storage_reader=reader)
    store.close()
    assert reader.info is not None
    return {
        "step": reader.info.step,
        "w": state["w"].to_local(),
        "payload_gets": counting.take()["other GET"],
    }


def full_w(step: int) -> torch.Tensor:
    return torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) + step * 10_000


def sharded(world: int, step: int) -> dict[str, Any]:
    """Rows split over the ranks (each rank saves its own file); zeros for step 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_w(step) if step else torch.zeros(64, 16)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def test_dcp_saves_through_the_local_tiers_and_a_wiped_node_reads_only_its_share(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """The DCP writer stages each rank's file in its node's local tier; due steps (2, and 3,
    the last) reach the bucket from every node's share; the reader takes each file from the
    node's local tier where it is good, and only node 1, wiped, reads from the bucket."""
    locals_ = [tmp_path / f"node{r}" for r in range(2)]
    held = run_ranks(_dcp_save, 2, tmp_path / "save", s3_uri, s3_options, locals_)
    assert bucket_steps(s3_uri, s3_options) == [2, 3]
    assert held[1] == ["global_step_2", "global_step_3"]  # node 1 keeps local_keep_last steps
    shutil.rmtree(locals_[1])
    loaded = run_ranks(_dcp_load, 2, tmp_path / "load", s3_uri, s3_options, locals_)
    for rank, r in enumerate(loaded):
        assert r["step"] == 3
        assert torch.equal(r["w"], full_w(3).chunk(2)[rank])
    assert loaded[0]["payload_gets"] == 0  # node 0 read its file and .metadata locally
    assert loaded[1]["payload_gets"] > 0  # node 1 fetched only what it lost
