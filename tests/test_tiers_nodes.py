"""Tiers on a cluster as users run one: every node is given the same ``local=`` path, each on
a disk of its own (harness/nodes.py: mount namespaces), two ranks per node, one bucket (moto
over HTTP). A rank's report names its node (``LocalTier.identity.node``), and the coordinator
reads no other node's disk: every save commits, and a resume on the same nodes is
bit-identical."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptstore import CheckpointStore
from ckptstore.core.reports import Staged
from ckptstore.errors import DistributedCheckpointError
from ckptstore.integrations.distributed import load_distributed, save_distributed
from ckptstore.integrations.verl import CkptstoreCallback, commit_step, prepare_resume
from ckptstore.integrations.verl_nodes import NodeAgent
from ckptstore.options import StoreOptions
from harness.nodes import Cluster, this_node

pytestmark = pytest.mark.slow


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 16), rank * 1000.0 + step), "b": torch.arange(rank + step)}


def open_rank(uri: str, options: dict[str, Any], local: str, rank: int, **tier: Any) -> Any:
    return CheckpointStore(uri, storage_options=options, local=local, lease=rank == 0, **tier)


def _save(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> list[int]:
    store = open_rank(uri, options, local, rank, persist_every=2)
    for step in (1, 2, 3):
        save_distributed(store, step, rank_state(rank, step))
    store.close()  # rank 0: the last step goes to the bucket too, from every node's share
    return [i.step for i in CheckpointStore(local, lease=False).list()]


def _load(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> dict[str, Any]:
    store = open_rank(uri, options, local, rank)
    state = load_distributed(store)
    assert store.last_loaded is not None
    step = store.last_loaded.step
    store.close()
    return {"step": step, "state": state}


def bucket_steps(uri: str, options: dict[str, Any]) -> list[int]:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


@pytest.fixture
def bucket_keys(s3_uri: str, s3_bucket: str, s3_client: Any) -> Callable[[str], list[str]]:
    """The keys the bucket holds under a directory of the store at ``s3_uri``."""
    prefix = s3_uri.split(f"{s3_bucket}/", 1)[1]

    def keys(directory: str) -> list[str]:
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/{directory}/")
        return [o["Key"] for o in listed.get("Contents", [])]

    return keys


@pytest.mark.parametrize("nodes", [2, 3])
def test_save_distributed_with_every_node_at_one_path(
    nodes: int, cluster: Callable[..., Cluster], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    c = cluster(nodes)
    held = c.run(_save, s3_uri, s3_options, c.local)
    assert all(h == [2, 3] for h in held), held  # every node committed each step locally
    assert bucket_steps(s3_uri, s3_options) == [2, 3]
    loaded = c.run(_load, s3_uri, s3_options, c.local)
    for rank, r in enumerate(loaded):
        assert r["step"] == 3
        for name, tensor in rank_state(rank, 3).items():
            assert torch.equal(r["state"][name], tensor), (rank, name)


# -- DCP -------------------------------------------------------------------------------------


def full_w(step: int) -> torch.Tensor:
    return torch.arange(96 * 16, dtype=torch.float32).reshape(96, 16) + step * 10_000


def sharded(world: int, step: int) -> dict[str, Any]:
    """Rows split over the ranks (each rank saves its own file); zeros for step 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_w(step) if step else torch.zeros(96, 16)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def _dcp_save(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import CkptStoreWriter

    store = open_rank(uri, options, local, rank, persist_every=2)
    for step in (1, 2, 3):
        dcp.save(sharded(world, step), storage_writer=CkptStoreWriter(store, step))
    store.close()


def _dcp_load(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> Any:
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import CkptStoreReader

    store = open_rank(uri, options, local, rank)
    state = sharded(world, 0)
    reader = CkptStoreReader(store)
    dcp.load(state, storage_reader=reader)
    store.close()
    assert reader.info is not None
    return reader.info.step, state["w"].to_local()


@pytest.mark.parametrize("nodes", [2, 3])
def test_dcp_with_every_node_at_one_path(
    nodes: int, cluster: Callable[..., Cluster], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    c = cluster(nodes)
    c.run(_dcp_save, s3_uri, s3_options, c.local)
    assert bucket_steps(s3_uri, s3_options) == [2, 3]
    loaded = c.run(_dcp_load, s3_uri, s3_options, c.local)
    for rank, (step, w) in enumerate(loaded):
        assert step == 3
        assert torch.equal(w, full_w(3).chunk(c.world_size)[rank])


# -- verl's per-node agents ------------------------------------------------------------------


class GlooFleet:
    """verl's per-node agents (the Fleet of verl_nodes.py) on the first rank of each node, the
    driver on rank 0: each call is broadcast over gloo and the answers gathered, as Ray
    actors on the nodes would answer the driver. Every other rank :meth:`serve`\\ s."""

    driver = "node0"

    def __init__(self, agent: NodeAgent | None, nodes: int) -> None:
        self.agent = agent
        self.names = [f"node{k}" for k in range(nodes)]

    def nodes(self) -> list[str]:
        return list(self.names)

    def call(self, method: str, args: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
        dist.broadcast_object_list([(method, dict(args))], src=0)
        return self._answer(method, dict(args))

    def serve(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            self._answer(*box[0])

    def stop(self) -> None:
        dist.broadcast_object_list([None], src=0)

    def _answer(self, method: str, args: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
        name = f"node{this_node().index}"
        answer: tuple[str, Any, str | None] = (name, None, None)
        if self.agent is not None and name in args:
            try:
                answer = (name, getattr(self.agent, method)(*args[name]), None)
            except Exception as e:
                answer = (name, None, f"{type(e).__name__}: {e}")
        driver = dist.get_rank() == 0
        gathered: list[Any] | None = [None] * dist.get_world_size() if driver else None
        dist.gather_object(answer, gathered, dst=0)
        if gathered is None:
            return {}
        failed = [f"{n}: {error}" for n, _, error in gathered if error is not None]
        if failed:
            raise AssertionError(f"{method} failed on " + "; ".join(failed))
        first = {n: value for n, value, _ in reversed(gathered)}  # a node's first rank answers
        return {n: first[n] for n in args}


def verl_files(nodes: int, step: int) -> dict[int, dict[str, bytes]]:
    """What verl writes of ``step`` on each node (one rank per node in verl's world)."""
    files: dict[int, dict[str, bytes]] = {}
    for k in range(nodes):
        mine = files.setdefault(k, {})
        for kind in ("model", "optim", "extra_state"):
            body = f"{kind} rank {k} step {step}".encode() * (500 + 37 * k)
            mine[f"actor/{kind}_world_size_{nodes}_rank_{k}.pt"] = body
    files[0]["actor/huggingface/config.json"] = b'{"model_type": "llama"}'
    files[0]["actor/fsdp_config.json"] = b'{"FSDP_version": 1}'
    files[0]["data.pt"] = f"dataloader {step}".encode()
    return files


def verl_config(local: str, uri: str, options: dict[str, Any], nodes: int) -> dict[str, Any]:
    return {
        "trainer": {
            "default_local_dir": f"{local}/verl",
            "resume_mode": "auto",
            "resume_from_path": None,
            "nnodes": nodes,
            "n_gpus_per_node": 1,
            "ckptstore": {"uri": uri, "storage_options": options},
        },
    }


def _verl(
    rank: int, world: int, uri: str, options: dict[str, Any], local: str, nodes: int, job: str
) -> dict[str, bytes]:
    """One job of a verl run on this rank: ``save`` writes steps 1..3 on each node and the
    driver commits them (persist_every=2, then close); ``resume`` puts the newest step back
    on every node. The files of the newest step each node holds."""
    node = this_node()
    verl_dir = Path(local) / "verl"
    tier = {"storage_options": options, "local": f"{local}/tier", "persist_every": 2,
            "save_timeout": 30}  # fmt: skip
    agent = None
    if rank == node.ranks[0]:
        agent = NodeAgent(str(verl_dir), uri, options=StoreOptions(**tier))
        if job == "save":
            for step in (1, 2, 3):
                for rel, body in verl_files(nodes, step)[node.index].items():
                    path = verl_dir / f"global_step_{step}" / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(body)
    dist.barrier()
    fleet = GlooFleet(agent, nodes)
    if rank != 0:
        fleet.serve()
    else:
        store = CheckpointStore(uri, lease=job == "save", **tier)
        config = verl_config(local, uri, options, nodes)
        try:
            if job == "save":  # what verl does with the callback, its agents never closed
                config["trainer"]["resume_mode"] = "disable"
                callback = CkptstoreCallback(config, store=store, fleet=fleet)
                for step in (1, 2, 3):
                    callback.on_save(
                        global_step=step, checkpoint_dir=f"{verl_dir}/global_step_{step}"
                    )
                callback.close()  # step 3 (not due) reaches the bucket from every node
            else:
                resumed = prepare_resume(config, store=store, fleet=fleet)
                assert (resumed.step, resumed.source) == (3, "store"), resumed
                store.close()
        finally:
            fleet.stop()
    if agent is not None:
        agent.store.close()
    if agent is None:
        return {}
    root = verl_dir / "global_step_3"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("nodes", [2, 3])
def test_verl_per_node_tiers_with_every_node_at_one_path(
    nodes: int, cluster: Callable[..., Cluster], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """verl's agents stage each node's share in its node's tier at one path; the driver
    commits each step; a new job on wiped verl directories gets the newest step back on every
    node, bit-identical."""
    c = cluster(nodes)
    c.run(_verl, s3_uri, s3_options, c.local, nodes, "save")
    assert bucket_steps(s3_uri, s3_options) == [2, 3]
    for k in range(nodes):
        shutil.rmtree(c.disk(k) / "verl")  # verl's own directories are gone, the tiers stay
    pulled = c.run(_verl, s3_uri, s3_options, c.local, nodes, "resume")
    whole = {rel: body for files in verl_files(nodes, 3).values() for rel, body in files.items()}
    for k in range(nodes):
        assert pulled[k * c.ranks_per_node] == whole, f"node {k}"


# -- a failed multi-node save ----------------------------------------------------------------


class NotATensor:
    """A value that needs pickle: the rank holding it fails to stage (allow_pickle=False)."""


def _fail_step_2(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> str:
    """Every step is due, so each rank copies its files to the bucket as soon as it staged
    them; step 2 fails on the last rank (its state cannot be encoded)."""
    store = open_rank(uri, options, local, rank, persist_every=1)
    save_distributed(store, 1, rank_state(rank, 1))
    store.wait()
    state: dict[str, Any] = rank_state(rank, 2)
    if rank == world - 1:
        state["x"] = NotATensor()
    with pytest.raises(DistributedCheckpointError) as failed:
        save_distributed(store, 2, state)
    store.close()  # no share of the failed step is reported as a failed persist
    return str(failed.value)


@pytest.mark.parametrize("nodes", [2])
def test_a_failed_multi_node_save_leaves_nothing_in_the_bucket(
    nodes: int,
    cluster: Callable[..., Cluster],
    s3_uri: str,
    s3_options: dict[str, Any],
    bucket_keys: Callable[[str], list[str]],
) -> None:
    """The shares of the step that reached the bucket before the save failed are removed,
    by their node once its copy is done, and no rank is told otherwise."""
    c = cluster(nodes)
    errors = c.run(_fail_step_2, s3_uri, s3_options, c.local)
    assert all("step 2 was not saved" in e for e in errors), errors
    assert all(f"what a node was still copying to {s3_uri} is removed" in e for e in errors)
    assert bucket_steps(s3_uri, s3_options) == [1]
    left = bucket_keys("global_step_2")
    assert left == [], left  # no node's share of the failed step stays
    for k in range(nodes):
        assert not (c.disk(k) / "global_step_2").exists() or not any(
            p.is_file() for p in (c.disk(k) / "global_step_2").rglob("*")
        ), f"node {k} kept files of the failed step"


class BrokenAgent(NodeAgent):
    """A node agent whose disk fails as it stages (its report says so)."""

    def stage(self, plan: Any, paths: Any) -> Staged:
        return Staged.failure("node", OSError(5, "Input/output error", str(self.local_dir)))


def _verl_fail(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> str:
    """Step 1 is due (persist_every=1): every node but the last stages its share and copies
    it to the bucket at once; the last node's disk fails, so the driver's commit fails."""
    node, nodes = this_node(), world // 2
    verl_dir = Path(local) / "verl"
    tier = {"storage_options": options, "local": f"{local}/tier", "persist_every": 1}
    agent = None
    if rank == node.ranks[0]:
        kind = BrokenAgent if node.index == nodes - 1 else NodeAgent
        agent = kind(str(verl_dir), uri, options=StoreOptions(**tier))
        for rel, body in verl_files(nodes, 1)[node.index].items():
            path = verl_dir / "global_step_1" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
    dist.barrier()
    fleet = GlooFleet(agent, nodes)
    error = ""
    if rank != 0:
        fleet.serve()
    else:
        with CheckpointStore(uri, **tier) as store:
            try:
                with pytest.raises(DistributedCheckpointError) as failed:
                    commit_step(store, fleet, 1, world_size=nodes)
                error = str(failed.value)
            finally:
                fleet.stop()
    if agent is not None:
        agent.store.close()  # no failed persist is raised for the step that was not saved
    return error


def test_a_failed_verl_save_leaves_nothing_in_the_bucket(
    cluster: Callable[..., Cluster],
    s3_uri: str,
    s3_options: dict[str, Any],
    bucket_keys: Callable[[str], list[str]],
) -> None:
    c = cluster(3)
    error = c.run(_verl_fail, s3_uri, s3_options, c.local)[0]
    assert "Input/output error" in error and "was not saved" in error, error
    assert bucket_keys("global_step_1") == []
    for k in range(3):  # no node's tier keeps a staged file of the step
        assert not [p for p in (c.disk(k) / "tier").rglob("global_step_1/**/*") if p.is_file()]


def _dcp_fail_step_2(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> str:
    """Step 2 is due; before it, the last node's disk turns read-only, so its ranks cannot
    stage; the other node stages and copies its share to the bucket at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.integrations.dcp import CkptStoreWriter

    node = this_node()
    broken = node.index == world // 2 - 1
    store = open_rank(uri, options, local, rank, persist_every=1)
    dcp.save(sharded(world, 1), storage_writer=CkptStoreWriter(store, 1))
    store.wait()
    dist.barrier()
    if broken and rank == node.ranks[0]:
        subprocess.run(["mount", "-o", "remount,bind,ro", local], check=True)
    dist.barrier()
    with pytest.raises(CheckpointException) as failed:  # on every rank
        dcp.save(sharded(world, 2), storage_writer=CkptStoreWriter(store, 2))
    dist.barrier()
    if broken and rank == node.ranks[0]:
        subprocess.run(["mount", "-o", "remount,bind,rw", local], check=True)
    dist.barrier()
    store.close()
    return str(failed.value)


def test_a_failed_dcp_save_leaves_only_what_gc_removes(
    cluster: Callable[..., Cluster],
    s3_uri: str,
    s3_options: dict[str, Any],
    bucket_keys: Callable[[str], list[str]],
) -> None:
    """DCP tells its participants nothing after ``finish``: the coordinator removes what
    reached the bucket by then, a copy still in flight lands under the save's attempt
    markers, and `gc` removes it, as the error says."""
    c = cluster(2)
    errors = c.run(_dcp_fail_step_2, s3_uri, s3_options, c.local)
    assert "step 2 was not saved" in errors[0] and "ckptstore gc" in errors[0], errors[0]
    assert bucket_steps(s3_uri, s3_options) == [1]
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        store.gc(older_than=0)
    assert bucket_keys("global_step_2") == []
