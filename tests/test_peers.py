"""Peer copies (``replicas=1``) on nodes as a cluster has them: several ranks per node, every
node at one local path (harness/nodes.py), a moto bucket over HTTP behind. A rank's copies go to
a rank on another node, so a lost node resumes bit-identical without a payload GET from the
bucket; a rank whose read fails keeps the exchange in step; subgroups work; one node says that
no copy is possible; a load gives up by its timeout when a rank never comes; a copy costs a few
chunks of memory. The chunked exchange itself is checked on gloo ranks (tests/ranks.py)."""

from __future__ import annotations

import resource
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.core.collectives import Collectives
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.manifest import FileEntry
from ckptstore.errors import BackendError, DistributedCheckpointError
from ckptstore.integrations.distributed import (
    load_distributed,
    save_distributed,
)
from ckptstore.tiers.peer_stream import CHUNK, DEPTH, Outgoing, exchange
from harness.nodes import Cluster
from ranks import Records, run_ranks
from test_tiers_distributed import bucket_steps, open_node, rank_state

pytestmark = pytest.mark.slow


def _save_three(
    rank: int, world: int, uri: str, options: dict[str, Any], local: str, fail: int | None
) -> list[int]:
    """Steps 1..3, persist_every=2, replicas=1: 2 is durable, 3 only on the nodes. With
    ``fail``, rank ``fail`` cannot read its own staged files of step 2 for its peer copy."""
    store, _ = open_node(uri, options, Path(local), rank, persist_every=2, replicas=1)
    if rank == fail:
        fail_reads(store.tiers.node.local.catalog.backend, "global_step_2/")  # type: ignore[union-attr]
    for step in (1, 2, 3):
        save_distributed(store, step, rank_state(rank, step))
        store.wait()  # step 2 is durable; each step's peer copies are done
    return [i.step for i in CheckpointStore(local, lease=False).list()]


def fail_reads(backend: Backend, prefix: str) -> None:
    """Make ``backend`` (a real local backend) fail every read of a payload under ``prefix``
    made for a peer copy (in its threads, ``ckpt-peer...``) with a BackendError, as a disk
    error would; the share of a due step to the bucket reads it as before."""
    for name in ("read", "read_into", "read_into_chunks"):
        real = getattr(backend, name)

        def failing(path: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            peer = threading.current_thread().name.startswith("ckpt-peer")
            if peer and path.startswith(prefix) and "/rank_" in path:
                raise BackendError(f"{path}: injected read failure", uri=backend.uri)
            return _real(path, *args, **kwargs)

        setattr(backend, name, failing)


def _resume(rank: int, world: int, uri: str, options: dict[str, Any], local: str) -> dict[str, Any]:
    store, counting = open_node(uri, options, Path(local), rank, persist_every=2, replicas=1)
    counting.take()
    state = load_distributed(store)
    assert store.last_loaded is not None
    return {"step": store.last_loaded.step, "state": state, "gets": counting.take()["other GET"]}


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_lost_node_resumes_from_peers_on_other_nodes_without_a_bucket_get(
    nodes: int, cluster: Callable[..., Cluster], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """Two ranks per node: rank r + 1 is on r's node, so copies by rank number would be lost
    with it; copies by node survive."""
    c = cluster(nodes, ranks_per_node=2)
    saved = c.run(_save_three, s3_uri, s3_options, c.local, None)
    assert all(r == [2, 3] for r in saved), saved
    assert bucket_steps(s3_uri, s3_options) == [2]  # 3 is only on the nodes
    shutil.rmtree(c.disk(1))  # node 1 is replaced
    resumed = c.run(_resume, s3_uri, s3_options, c.local)
    for rank, r in enumerate(resumed):
        assert r["step"] == 3, (rank, r["step"])
        assert all(torch.equal(r["state"][k], v) for k, v in rank_state(rank, 3).items())
        assert r["gets"] == 0, (rank, r["gets"])  # every byte from a node's local tier


def test_two_ranks_per_node_dir_copies_survive_the_loss_of_a_node(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """The same on gloo processes, two ranks sharing each node's directory (node0/, node1/):
    rank 2's copies went to rank 3, on its own node, when peers were chosen by rank."""
    locals_ = [str(tmp_path / f"node{r // 2}") for r in range(4)]
    saved = run_ranks(_save_three_at, 4, tmp_path / "save", s3_uri, s3_options, locals_, None)
    assert all(r["steps"] == [2, 3] for r in saved), saved
    shutil.rmtree(locals_[2])  # node 1 (ranks 2 and 3) is replaced
    resumed = run_ranks(_resume_at, 4, tmp_path / "resume", s3_uri, s3_options, locals_)
    for rank, r in enumerate(resumed):
        assert r["step"] == 3 and r["gets"] == 0, (rank, r["step"], r["gets"])
        assert all(torch.equal(r["state"][k], v) for k, v in rank_state(rank, 3).items())


def test_a_failed_read_keeps_the_peer_copies_in_step(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 1 cannot read its files of step 2 for its peer: it still takes part in that
    exchange (sending nothing usable), its receiver keeps no copy, and the copies of step 3
    are paired as before: a lost node 1 resumes step 3 from its peer, bucket untouched."""
    locals_ = [str(tmp_path / f"node{r}") for r in range(2)]
    saved = run_ranks(
        _save_three_at, 2, tmp_path / "save", s3_uri, s3_options, locals_, 1, timeout=100
    )
    assert saved[0]["steps"] == saved[1]["steps"] == [2, 3]
    assert not any("rank_00001" in k for k in saved[0]["step2"]), saved[0]  # no copy of it
    assert any("rank_00001" in k for k in saved[0]["step3"])
    assert any("did not arrive" in m and "step 2" in m for m in saved[0]["warnings"])
    shutil.rmtree(locals_[1])
    resumed = run_ranks(_resume_at, 2, tmp_path / "resume", s3_uri, s3_options, locals_)
    for rank, r in enumerate(resumed):
        assert r["step"] == 3 and r["gets"] == 0, (rank, r["step"], r["gets"])
        assert all(torch.equal(r["state"][k], v) for k, v in rank_state(rank, 3).items())


def _save_three_at(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[str], fail: int | None
) -> dict[str, Any]:
    records = Records()
    steps = _save_three(rank, world, uri, options, locals_[rank], fail)
    here = Path(locals_[rank])
    held = {s: sorted(str(p) for p in (here / f"global_step_{s}").rglob("*.safetensors"))
            for s in (2, 3)}  # fmt: skip
    return {"steps": steps, "step2": held[2], "step3": held[3], "warnings": records.messages}


def _resume_at(
    rank: int, world: int, uri: str, options: dict[str, Any], locals_: list[str]
) -> dict[str, Any]:
    return _resume(rank, world, uri, options, locals_[rank])


def _subgroup(
    rank: int, world: int, uri: str, options: dict[str, Any], root: Path
) -> dict[str, Any]:
    """Ranks 0 and 1 save through a subgroup with a deadline and peer copies; rank 2 (not a
    member) never calls into ckptstore. Then the job goes on: all three make a group and
    reduce over it (groups the members made alone must not put them out of step)."""
    group = dist.new_group([0, 1])  # every process makes it, as torch requires
    out: dict[str, Any] = {}
    if rank != 2:
        store = CheckpointStore(uri, storage_options=options, lease=rank == 0,
                                local=str(root / f"node{rank}"), persist_every=1, replicas=1,
                                save_timeout=60)  # fmt: skip
        out["step"] = save_distributed(store, 1, rank_state(rank, 1), group=group).step
        store.wait()
        store.close()
        peer = "rank_00001" if rank == 0 else "rank_00000"
        out["peer_copies"] = len(list((root / f"node{rank}" / "global_step_1").rglob(f"{peer}/*")))
    everyone = dist.new_group([0, 1, 2])
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    out["sum"] = int(total)
    return out


def test_a_subgroup_saves_with_a_deadline_and_peer_copies(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    got = run_ranks(_subgroup, 3, tmp_path / "ranks", s3_uri, s3_options, tmp_path, timeout=90)
    assert got[0]["step"] == got[1]["step"] == 1
    assert got[0]["peer_copies"] > 0 and got[1]["peer_copies"] > 0  # each holds the other's
    assert [r["sum"] for r in got] == [3, 3, 3]


def _one_node(
    rank: int, world: int, uri: str, options: dict[str, Any], local: str
) -> dict[str, Any]:
    records = Records()
    store, _ = open_node(uri, options, Path(local), rank, persist_every=1, replicas=1)
    for step in (1, 2):
        save_distributed(store, step, rank_state(rank, step))
        store.wait()
    return {"warnings": records.messages}


def test_ranks_all_on_one_node_say_no_peer_copy_is_possible(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    local = str(tmp_path / "node")  # both ranks on one disk: one node id
    got = run_ranks(_one_node, 2, tmp_path / "ranks", s3_uri, s3_options, local)
    said = [m for r in got for m in r["warnings"] if "no peer copy is possible" in m]
    assert len(said) == 1, got  # once, by rank 0, for the store's life
    assert "all 2 ranks are on one node" in said[0]


MiB = 1 << 20
SHARD_MIB = 128


def _peak_growth(rank: int, world: int, root: Path) -> dict[str, float]:
    """The growth of this rank's peak RSS (MiB) over a save of a ``SHARD_MIB`` shard with
    peer copies, after the same save without them: what the copies cost in memory. Neither
    store persists to its durable tier during the test (a directory, persist_every=100)."""
    state = {"w": torch.randn(SHARD_MIB << 18)}  # float32: SHARD_MIB MiB
    peaks = {}
    for replicas in (0, 1):
        store = CheckpointStore(str(root / f"durable{replicas}"), lease=rank == 0,
                                local=str(root / f"r{replicas}-node{rank}"), persist_every=100,
                                replicas=replicas)  # fmt: skip
        save_distributed(store, 1, state)
        store.tiers.node.drain()  # type: ignore[union-attr]  # the peer copy is done
        dist.barrier()
        peaks[replicas] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    copies = list((root / f"r1-node{rank}" / "global_step_1").rglob(f"rank_0000{1 - rank}/*"))
    return {"growth": peaks[1] - peaks[0], "copied": sum(p.stat().st_size for p in copies)}


def test_peer_copies_stream_in_bounded_memory(tmp_path: Path) -> None:
    """A peer copy holds a few chunks per rank (DEPTH + 1 per direction, and the chunk being
    read), not the shard it sends and the one it receives (which grew the peak by twice the
    shard)."""
    bound = (2 * (DEPTH + 1) + 2) * CHUNK / MiB + 16  # + 16 MiB: threads, gloo, the heap
    assert bound < SHARD_MIB * 0.7
    got = run_ranks(_peak_growth, 2, tmp_path / "ranks", tmp_path)
    for rank, r in enumerate(got):
        assert r["copied"] >= SHARD_MIB * MiB, (rank, r)  # the peer's shard is here
        assert r["growth"] < bound, (rank, r)


def _exchange(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Ranks 0 and 1 both send to rank 2 (files of 0, 1, 3 chunks + 1 byte, and one whose
    bytes fail their manifest entry); rank 2 sends one file to rank 0; 64-byte chunks."""
    backend = open_backend(str(root / f"node{rank}"), {})
    outgoing: dict[int, list[Outgoing]] = {}
    files = {0: [0, 1, 64 * 3 + 1], 1: [64, 5], 2: [300]}[rank]
    entries = []
    for i, size in enumerate(files):
        data = bytes((rank * 7 + i + j) % 251 for j in range(size))
        path = f"rank_0000{rank}/f{i}"
        backend.write(f"global_step_1/{path}", [data])
        entries.append(FileEntry(path, size, crc_of(data)))
    if rank == 1:  # the bytes on disk are not those of the manifest
        entries.append(FileEntry("rank_00001/bad", 4, crc_of(b"good")))
        backend.write("global_step_1/rank_00001/bad", [b"evil"])
    outgoing[2 if rank < 2 else 0] = [Outgoing(1, e) for e in entries]
    placed: list[str] = []  # what the exchange put in place, where any reader would find it
    write = backend.write

    def recording(path: str, chunks: Any) -> int:
        size = write(path, chunks)
        placed.append(path)
        return size

    setattr(backend, "write", recording)  # noqa: B010 (an instance's method, replaced)
    got = exchange(Collectives(timeout=30), backend, outgoing, chunk=64)
    dist.barrier()
    held = {o.path: o.size for o in backend.list("global_step_1/")}
    return {"keys": got.keys, "missed": got.missed, "held": held, "placed": placed}


def crc_of(data: bytes) -> str:
    check = Crc32c()
    check.update(data)
    return check.hexdigest()


def test_the_exchange_streams_many_files_to_one_rank_and_drops_what_fails_its_check(
    tmp_path: Path,
) -> None:
    got = run_ranks(_exchange, 3, tmp_path / "ranks", tmp_path)
    two = got[2]
    assert sorted(two["keys"]) == [0, 1]
    assert len(two["keys"][0]) == 3 and len(two["keys"][1]) == 2
    assert two["missed"] == {1: ["global_step_1/rank_00001/bad"]}
    assert "global_step_1/rank_00001/bad" not in two["held"]  # no copy kept of it
    # nor put in place until the exchange's end: a node's persist reading the step's files
    # meanwhile copied the filler and failed on its checksum
    assert "global_step_1/rank_00001/bad" not in two["placed"]
    assert len(two["placed"]) == 5
    for rank, sizes in ((0, [0, 1, 193]), (1, [64, 5])):
        for i, size in enumerate(sizes):
            key = f"global_step_1/rank_0000{rank}/f{i}"
            assert two["held"][key] == size
            mine = (tmp_path / f"node{rank}" / key).read_bytes()
            assert (tmp_path / "node2" / key).read_bytes() == mine  # byte for byte
    assert got[0]["keys"] == {2: ["global_step_1/rank_00002/f0"]}
    assert (tmp_path / "node0/global_step_1/rank_00002/f0").read_bytes() == (
        tmp_path / "node2/global_step_1/rank_00002/f0"
    ).read_bytes()
    assert got[1]["keys"] == {} and got[1]["missed"] == {}


def _load_with_an_absent_rank(
    rank: int, world: int, uri: str, options: dict[str, Any], root: Path
) -> dict[str, Any]:
    """Rank 1 never calls load_distributed (it is busy elsewhere for 6 s); rank 0 must give
    up by its load_timeout (0.5 s) plus the collectives' margin (2 s here, 30 s by default),
    not the process group's 60 s."""
    Collectives.MARGIN = 2.0  # this rank process only: the test need not wait 30 s
    store = CheckpointStore(uri, storage_options=options, lease=False, load_timeout=0.5,
                            local=str(root / f"node{rank}"))  # fmt: skip
    if rank == 1:
        time.sleep(6)
        return {}
    started = time.monotonic()
    with pytest.raises(DistributedCheckpointError) as caught:
        load_distributed(store)
    return {"seconds": time.monotonic() - started, "message": str(caught.value)}


@pytest.mark.wallclock
def test_load_distributed_collectives_give_up_by_the_load_timeout(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    got = run_ranks(_load_with_an_absent_rank, 2, tmp_path / "ranks", s3_uri, s3_options, tmp_path)
    assert 2.0 <= got[0]["seconds"] < 0.5 + 2.0 + 5, got[0]
    assert "load_timeout 0.5 s + 2 s" in got[0]["message"]
    assert "call load_distributed on every rank" in got[0]["message"]
