"""torch.distributed.checkpoint through CkptStoreWriter / CkptStoreReader: resharding, safety."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import CheckpointStore, ConfigError
from ckptstore.core.collectives import Collectives
from ckptstore.domain.layout import step_dir
from ckptstore.errors import DistributedCheckpointError
from ckptstore.integrations.dcp import METADATA_FILE, CkptStoreReader, CkptStoreWriter
from ranks import run_ranks

MiB = 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full() -> dict[str, torch.Tensor]:
    """The global tensors; shapes that do not divide by 4 or 2 make uneven shards."""
    return {
        "a": torch.arange(60, dtype=torch.float32).reshape(10, 6) / 7,
        "b": torch.arange(7, dtype=torch.int64) * 3,
        "rep": torch.eye(3, dtype=torch.bfloat16),
    }


EXTRA = {"step": 7, "lr": 0.1, "names": ["x", "y"]}


def empty_extra() -> dict[str, Any]:
    return {"step": 0, "lr": 0.0, "names": []}


def _save_4(rank: int, world: int, uri: str, options: dict) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    tensors = full()
    state = {
        "a": distribute_tensor(tensors["a"], mesh, [Shard(0)]),
        "b": distribute_tensor(tensors["b"], mesh, [Shard(0)]),
        "rep": tensors["rep"],
        "extra": dict(EXTRA),
    }
    store = CheckpointStore(uri, storage_options=options, lease=rank == 0)
    failed = ""
    if rank == 1:  # the first save fails on rank 1 while staging

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError("injected: disk full on rank 1")

        store.stage_files = broken  # type: ignore[method-assign]
    try:
        dcp.save(state, storage_writer=CkptStoreWriter(store, 1))
    except CheckpointException as e:  # DCP's, a BaseException
        failed = str(e)
    if rank == 1:
        del store.stage_files
    dcp.save(state, storage_writer=CkptStoreWriter(store, 2, metadata={"format": "dcp"}))
    store.close()
    return failed


def _load_2(rank: int, world: int, uri: str, options: dict) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {  # another placement than at save time: a is split by columns now
        "a": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)]),
        "b": distribute_tensor(torch.zeros(7, dtype=torch.int64), mesh, [Shard(0)]),
        "rep": torch.zeros(3, 3, dtype=torch.bfloat16),
        "extra": empty_extra(),
    }
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        reader = CkptStoreReader(store)
        dcp.load(state, storage_reader=reader)
    return {
        "step": reader.info.step if reader.info else None,
        "a_local": state["a"].to_local(),
        "b_local": state["b"].to_local(),
        "rep": state["rep"],
        "extra": state["extra"],
    }


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_save_on_4_ranks_loads_on_2_and_on_1(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "local":
        uri, options = str(tmp_path / "store"), {}
    else:
        uri = request.getfixturevalue("s3_uri")
        options = {**request.getfixturevalue("s3_options"), "part_size": 5 * MiB}
    failures = run_ranks(_save_4, 4, tmp_path / "save", uri, options)
    want = full()

    # the save that failed on rank 1 failed on every rank, and left nothing
    for message in failures:
        assert "step 1 was not saved (nothing committed, staged files discarded)" in message
        assert "rank 1: OSError: injected: disk full on rank 1" in message
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        assert [i.step for i in store.list()] == [2]
        assert list(store.backend.list(step_dir(1) + "/")) == []
        info = store.info(2)
        assert info.manifest.kind == "directory"
        assert info.manifest.environment.world_size == 4
        assert info.metadata == {"format": "dcp"}
        assert {f.path for f in info.files} == {METADATA_FILE} | {
            f"__{r}_0.distcp" for r in range(4)
        }
        assert store.verify(2).ok

    results = run_ranks(_load_2, 2, tmp_path / "load", uri, options)
    for rank, r in enumerate(results):
        assert r["step"] == 2
        assert torch.equal(r["a_local"], want["a"].chunk(2, dim=1)[rank])
        assert torch.equal(r["b_local"], want["b"].chunk(2, dim=0)[rank])
        assert torch.equal(r["rep"], want["rep"])
        assert r["extra"] == EXTRA

    # one process, no process group: every rank's shards assembled into whole tensors
    state: dict[str, Any] = {
        "a": torch.zeros(10, 6),
        "b": torch.zeros(7, dtype=torch.int64),
        "rep": torch.zeros(3, 3, dtype=torch.bfloat16),
        "extra": empty_extra(),
    }
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        dcp.load(state, storage_reader=CkptStoreReader(store, 2))
        pulled = tmp_path / "pulled"
        store.pull_dir(pulled, 2)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    assert state["extra"] == EXTRA

    # a pulled step is a plain DCP directory
    plain: dict[str, Any] = {"a": torch.zeros(10, 6), "extra": empty_extra()}
    dcp.load(plain, storage_reader=FileSystemReader(pulled))
    assert torch.equal(plain["a"], want["a"])


# -- one process: the reader's choices and its refusal to unpickle ---------------------------


class Opaque:
    """A value DCP can only store by pickling it."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_values_that_need_full_unpickling_load_only_when_allowed(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        dcp.save({"t": torch.ones(2), "obj": Opaque(3)}, storage_writer=CkptStoreWriter(store, 1))
        state: dict[str, Any] = {"t": torch.zeros(2), "obj": None}
        with pytest.raises(
            CheckpointException, match=r"Unsupported global: GLOBAL test_dcp.Opaque"
        ):
            dcp.load(state, storage_reader=CkptStoreReader(store))
        dcp.load(state, storage_reader=CkptStoreReader(store, allow_pickle=True))
    assert isinstance(state["obj"], Opaque) and state["obj"].value == 3
    assert torch.equal(state["t"], torch.ones(2))


def test_a_corrupt_latest_falls_back_to_the_previous_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        for step in (1, 2):
            dcp.save(
                {"t": torch.full((4,), float(step))}, storage_writer=CkptStoreWriter(store, step)
            )
        entry = store.info(2).manifest.file(METADATA_FILE)
        store.backend.write(entry.key(2), [b"\0" * entry.size])
        state = {"t": torch.zeros(4)}
        reader = CkptStoreReader(store)
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            dcp.load(state, storage_reader=reader)
        assert reader.info is not None and reader.info.step == 1
        assert torch.equal(state["t"], torch.full((4,), 1.0))
        assert "step 2 failed verification" in caplog.text
        with pytest.raises(CheckpointException, match="checksum mismatch"):
            dcp.load(state, storage_reader=CkptStoreReader(store, 2))


def test_a_corrupt_data_file_is_caught_on_read(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        dcp.save({"t": torch.ones(4)}, storage_writer=CkptStoreWriter(store, 1))
        entry = store.info(1).manifest.file("__0_0.distcp")
        store.backend.write(entry.key(1), [b"\1" * entry.size])
        with pytest.raises(CheckpointException, match=r"__0_0.distcp: checksum mismatch"):
            dcp.load({"t": torch.zeros(4)}, storage_reader=CkptStoreReader(store, 1))


def test_committed_steps_are_not_overwritten(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        dcp.save({"t": torch.ones(2)}, storage_writer=CkptStoreWriter(store, 1))
        with pytest.raises(CheckpointException, match="already committed"):
            dcp.save({"t": torch.zeros(2)}, storage_writer=CkptStoreWriter(store, 1))
        state = {"t": torch.zeros(2)}
        dcp.load(state, storage_reader=CkptStoreReader(store, 1))
        assert torch.equal(state["t"], torch.ones(2))


def test_a_step_saved_otherwise_is_refused_by_the_reader(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"t": torch.ones(2)})
        with pytest.raises(CheckpointException, match=r"has no DCP \.metadata"):
            dcp.load({"t": torch.zeros(2)}, storage_reader=CkptStoreReader(store, 1))
        dcp.save({"t": torch.ones(2)}, storage_writer=CkptStoreWriter(store, 2))
        with pytest.raises(ConfigError, match="pushed as a directory"):
            store.load(2)


def test_checkpoint_id_names_the_step(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        writer = CkptStoreWriter(store, 1)
        dcp.save({"t": torch.ones(2)}, storage_writer=writer, checkpoint_id="global_step_5")
        assert [i.step for i in store.list()] == [5]
        state = {"t": torch.zeros(2)}
        dcp.load(state, storage_reader=CkptStoreReader(store), checkpoint_id="5")
        assert torch.equal(state["t"], torch.ones(2))


def _choose_with_an_absent_rank(rank: int, world: int, uri: str) -> dict[str, Any]:
    """Rank 1 never loads (it is busy elsewhere for 6 s): rank 0's reader, agreeing on the
    step with the other ranks (what ``dcp.load`` first asks of it), must give up by its
    load_timeout (0.5 s) plus the collectives' margin (2 s here, 30 s by default), not wait for
    the process group's timeout."""
    Collectives.MARGIN = 2.0  # this rank process only
    if rank == 1:
        time.sleep(6)
        return {}
    started = time.monotonic()
    store = CheckpointStore(uri, lease=False, load_timeout=0.5)
    with pytest.raises(DistributedCheckpointError) as caught:
        CkptStoreReader(store).read_metadata()
    store.close()
    return {"seconds": time.monotonic() - started, "message": str(caught.value)}


@pytest.mark.wallclock
def test_the_reader_gives_up_agreeing_on_the_step_by_the_load_timeout(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        dcp.save({"t": torch.ones(4)}, storage_writer=CkptStoreWriter(store, 1))
    got = run_ranks(_choose_with_an_absent_rank, 2, tmp_path / "ranks", uri)
    assert 2.0 <= got[0]["seconds"] < 0.5 + 2.0 + 5, got[0]
    assert "load_timeout 0.5 s + 2 s" in got[0]["message"], got[0]
    assert "call dcp.load on every rank" in got[0]["message"]
