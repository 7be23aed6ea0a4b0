"""Elastic resume for verl: FSDP2 steps resharded from W to W' ranks, bit-exact.

Most tests use steps laid out by verl_reshard_steps (DTensor files as verl's FSDP2 save writes
them, without a process group). ``test_real_verl_*`` saves with verl 0.9.1's own
FSDPCheckpointManager on 3 gloo ranks and resumes on 3, 2 and 4 (verl_reshard_ranks.py).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

from ckptstore import CheckpointStore
from ckptstore.cli.main import run
from ckptstore.domain.layout import VERL_TRACKER_NAME
from ckptstore.errors import (
    CompatibilityError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeLoadError,
)
from ckptstore.integrations.verl import CkptstoreCallback
from ckptstore.integrations.verl_nodes import LocalFleet, NodeAgent
from ckptstore.integrations.verl_reshard import (
    reshard_dir,
    reshard_from_store,
    reshard_in_place,
    world_size_of,
)
from ckptstore.integrations.verl_reshard_tensors import chunk_range
from verl_reshard_steps import (
    assert_same,
    fsdp2_step,
    full_state,
    gather,
    load,
    mesh,
)


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 13, 64, 65])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_range_is_torch_chunk(rows: int, world: int) -> None:
    chunks = torch.chunk(torch.arange(rows), world) if rows else ()
    for rank in range(world):
        start, end = chunk_range(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


@pytest.mark.parametrize(("old", "new"), [(4, 2), (4, 3), (4, 8), (3, 5), (4, 1), (4, 4)])
def test_reshard_keeps_every_tensor_bit_identical(tmp_path: Path, old: int, new: int) -> None:
    params = full_state()
    src = fsdp2_step(tmp_path / "src", old, params)
    done = reshard_dir(src, tmp_path / "out", new)
    assert (done.source_world_size, done.world_size, done.folders) == (old, new, ("actor",))
    out = tmp_path / "out" / "actor"
    assert_same(gather(out, new), gather(src / "actor", old))
    assert_same(gather(out, new)["model"], params)
    for rank in range(new):  # each file is what FSDP2 on `new` ranks holds: torch.chunk's rows
        model = load(out / f"model_world_size_{new}_rank_{rank}.pt")
        for name, full in params.items():
            shard = model[name]
            assert isinstance(shard, DTensor)
            start, end = chunk_range(full.shape[0], new, rank)
            assert torch.equal(shard._local_tensor, full[start:end])
            assert shard._local_tensor.untyped_storage().nbytes() == full[start:end].nbytes
            assert shard.device_mesh.mesh.tolist() == list(range(new))
            assert tuple(shard.device_mesh.get_coordinate() or ()) == (rank,)
            assert shard.device_mesh._dim_group_names == ["0"]
        extra = (out / f"extra_state_world_size_{new}_rank_{rank}.pt").read_bytes()
        assert (
            extra
            == (src / "actor" / f"extra_state_world_size_{old}_rank_{rank % old}.pt").read_bytes()
        )
    assert json.loads((out / "fsdp_config.json").read_text()) == {
        "FSDP_version": 2,
        "world_size": new,
    }
    assert sorted(files_of(tmp_path / "out")) == sorted(
        [
            f"actor/{k}_world_size_{new}_rank_{r}.pt"
            for k in ("model", "optim", "extra_state")
            for r in range(new)
        ]
        + ["actor/fsdp_config.json", "actor/huggingface/config.json", "data.pt"]
    )
    assert (tmp_path / "out" / "data.pt").read_bytes() == b"dataloader state"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_there_and_back_gives_the_same_shards(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 4, full_state(1))
    reshard_dir(src, tmp_path / "three", 3)
    reshard_dir(tmp_path / "three", tmp_path / "back", 4)
    for rank in range(4):
        for kind in ("model", "optim"):
            name = f"actor/{kind}_world_size_4_rank_{rank}.pt"
            assert_same(_locals(load(src / name)), _locals(load(tmp_path / "back" / name)), name)


def _locals(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return tree._local_tensor
    if isinstance(tree, dict):
        return {k: _locals(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_locals(v) for v in tree]
    return tree


def test_in_place_is_a_no_op_on_the_same_world_size(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "global_step_1", 2, full_state())
    before = files_of(src)
    assert reshard_in_place(src, 2) is None
    assert reshard_in_place(tmp_path / "absent", 2) is None
    assert files_of(src) == before
    done = reshard_in_place(src, 3)
    assert done is not None
    assert world_size_of(files_of(src)) == 3
    assert_same(gather(src / "actor", 3)["model"], full_state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


def test_critic_and_actor_are_both_resharded(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state(0))
    fsdp2_step(src, 2, full_state(5), role="critic")
    done = reshard_dir(src, tmp_path / "out", 3)
    assert done.folders == ("actor", "critic")
    assert_same(gather(tmp_path / "out" / "critic", 3)["model"], full_state(5))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use() -> Any:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2): what the process
    allocated, whether or not the pages were resident already."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


@pytest.mark.skipif(_malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_memory_stays_far_below_the_largest_tensor(tmp_path: Path) -> None:
    """Inputs are memory-mapped and outputs built in scratch files: the memory the process
    allocates does not grow by even a quarter of the largest tensor (64 MiB here) while the
    converter runs (sampled every 0.5 ms). The instrument is checked on a real allocation."""
    in_use = _malloc_in_use()
    largest = torch.randn(16384, 1024)  # 64 MiB
    src = fsdp2_step(tmp_path / "src", 4, {"big": largest, "small": torch.randn(33, 7)})
    del largest
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(0.0005)

    def peak_extra(work: Any) -> int:
        base = peak[0] = in_use()
        stop.clear()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            work()
        finally:
            stop.set()
            sampler.join()
        return int(peak[0] - base)

    assert peak_extra(lambda: reshard_dir(src, tmp_path / "out", 3)) < 16 << 20
    held: list[torch.Tensor] = []
    assert peak_extra(lambda: (held.append(torch.ones(16384, 1024)), time.sleep(0.05))) > 60 << 20


# -- refusals: nothing is written -------------------------------------------------------------


def refused(tmp_path: Path, error: type[Exception], match: str, world: int = 3) -> None:
    with pytest.raises(error, match=match):
        reshard_dir(tmp_path / "src", tmp_path / "out", world)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_fsdp1_is_refused_with_the_fix(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    (src / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    refused(tmp_path, CompatibilityError, r"only FSDP2 .* Resume on 2 ranks, or .*strategy=fsdp2")


def test_a_missing_rank_is_refused(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 4, full_state())
    (src / "actor" / "optim_world_size_4_rank_2.pt").unlink()
    refused(
        tmp_path,
        IncompleteCheckpointError,
        r"optim_world_size_4_rank_R.pt is missing rank\(s\) \[2\]",
    )


def test_missing_fsdp_config_is_refused(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    (src / "actor" / "fsdp_config.json").unlink()
    refused(tmp_path, IncompleteCheckpointError, "fsdp_config.json is missing")


def test_an_unknown_rank_file_kind_is_refused(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    for r in range(2):
        (src / "actor" / f"lora_world_size_2_rank_{r}.pt").write_bytes(b"x")
    refused(tmp_path, CompatibilityError, "of kind lora")


class Payload:
    """A pickle that would run code on load (``os.system`` stands for any callable)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path("/nonexistent-dir/pwned"),))


def test_a_pickle_naming_other_globals_is_refused_unexecuted(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    model = src / "actor" / "model_world_size_2_rank_1.pt"
    good = model.read_bytes()
    torch.save({"x": Payload()}, model)
    refused(
        tmp_path,
        UnsafeLoadError,
        r"model_world_size_2_rank_1.pt names builtins.getattr, pathlib.Path",
    )
    model.write_bytes(good)
    torch.save({"rng": Payload()}, src / "actor" / "extra_state_world_size_2_rank_0.pt")
    refused(tmp_path, UnsafeLoadError, "extra_state_world_size_2_rank_0.pt names builtins.getattr")


def test_a_garbled_rank_file_is_corrupt(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    (src / "actor" / "model_world_size_2_rank_0.pt").write_bytes(pickle.dumps([1]) * 3)
    refused(tmp_path, CorruptCheckpointError, "not a readable torch.save file")


def test_replicated_placements_are_refused(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    for rank in range(2):
        path = src / "actor" / f"model_world_size_2_rank_{rank}.pt"
        model = load(path)
        model["layer.tiny"] = DTensor.from_local(
            torch.ones(2, 4), mesh(2, rank), [Replicate()], run_check=False
        )
        torch.save(model, path)
    refused(
        tmp_path, CompatibilityError, r"placements \(Replicate\(\),\) .* only FSDP2's Shard\(0\)"
    )


def test_shards_that_do_not_add_up_are_corrupt(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    params = full_state() | {"embed.weight": torch.zeros(66, 16)}
    other = fsdp2_step(tmp_path / "other", 2, params)  # rank 1 of another model's save
    (other / "actor" / "model_world_size_2_rank_1.pt").replace(
        src / "actor" / "model_world_size_2_rank_1.pt"
    )
    shutil.rmtree(other)
    refused(tmp_path, CorruptCheckpointError, r"rank 1 holds a shard of shape \(33, 16\)")


def test_replicated_values_must_agree(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    path = src / "actor" / "optim_world_size_2_rank_1.pt"
    optim = load(path)
    optim["state"][0]["step"] = torch.tensor(4.0)
    torch.save(optim, path)
    refused(
        tmp_path,
        CorruptCheckpointError,
        r"\['state'\]\[0\]\['step'\] is a plain tensor that differs",
    )


def test_output_must_be_new_or_empty(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(ConflictError, match="not an empty directory"):
        reshard_dir(src, tmp_path / "out", 3)
    assert (tmp_path / "out" / "keep").read_text() == "mine"


def test_a_plain_directory_is_not_a_verl_step(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "data.pt").write_bytes(b"x")
    refused(tmp_path, IncompleteCheckpointError, "not a verl FSDP checkpoint")


# -- through a store --------------------------------------------------------------------------


def test_reshard_from_store_reads_verified_bytes(
    tmp_path: Path, store_uri: tuple[str, dict[str, Any]]
) -> None:
    uri, options = store_uri
    src = fsdp2_step(tmp_path / "src", 4, full_state())
    with CheckpointStore(uri, storage_options=options) as store:
        store.push_dir(7, src)
        before = [(f.path, f.crc32c) for f in store.info(7).files]
        done = reshard_from_store(store, 7, tmp_path / "out", 3)
        assert done.source_world_size == 4
        assert [(f.path, f.crc32c) for f in store.info(7).files] == before  # the store's step stays
    assert_same(gather(tmp_path / "out" / "actor", 3), gather(src / "actor", 4))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the pull is removed


# -- the callback's resume: automatic when the world size changed -----------------------------


def two_node_fleet(tmp_path: Path, uri: str) -> tuple[list[Path], LocalFleet]:
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    agents = {f"n{i}": NodeAgent(str(d), uri, {}) for i, d in enumerate(nodes)}
    return nodes, LocalFleet(agents, driver="n0")


def committed_step(tmp_path: Path, uri: str, world: int, step: int = 1) -> dict[str, bytes]:
    """A verl FSDP2 step saved on ``world`` ranks, committed by the callback; local copy wiped."""
    local = tmp_path / "saved"
    fsdp2_step(local / f"global_step_{step}", world, full_state())
    (local / VERL_TRACKER_NAME).write_text(str(step))
    config = verl_config(local, uri, world)
    callback = CkptstoreCallback(config, fleet=LocalFleet({"n": NodeAgent(str(local), uri)}))
    callback.on_save(global_step=step, checkpoint_dir=str(local / f"global_step_{step}"))
    callback.close()
    files = files_of(local / f"global_step_{step}")
    shutil.rmtree(local)
    return files


def test_resume_on_another_world_size_reshards_on_every_node(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    saved = committed_step(tmp_path, uri, 4)
    nodes, fleet = two_node_fleet(tmp_path, uri)
    callback = CkptstoreCallback(verl_config(nodes[0], uri, 3), fleet=fleet)
    callback.close()
    assert (callback.resume.step, callback.resume.source) == (1, "store")
    assert callback.resume.resharded_from == 4
    for node in nodes:
        step_dir = node / "global_step_1"
        assert world_size_of(files_of(step_dir)) == 3
        assert_same(gather(step_dir / "actor", 3)["model"], full_state())
        assert files_of(step_dir)["data.pt"] == saved["data.pt"]
        assert (node / VERL_TRACKER_NAME).read_text() == "1"
        assert [p.name for p in node.iterdir() if p.name.startswith(".")] == []
    with CheckpointStore(uri, lease=False) as store:
        assert world_size_of(f.path for f in store.info(1).files) == 4  # the store's step stays


def test_resume_on_the_same_world_size_is_unchanged(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    saved = committed_step(tmp_path, uri, 4)
    nodes, fleet = two_node_fleet(tmp_path, uri)
    callback = CkptstoreCallback(verl_config(nodes[0], uri, 4), fleet=fleet)
    callback.close()
    assert callback.resume.resharded_from is None
    for node in nodes:
        assert files_of(node / "global_step_1") == saved


def test_a_local_step_of_another_world_size_is_resharded_too(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    committed_step(tmp_path, uri, 2)
    local = tmp_path / "local"  # the same step, still on this machine's disk
    fsdp2_step(local / "global_step_1", 2, full_state())
    (local / VERL_TRACKER_NAME).write_text("1")
    fleet = LocalFleet({"n": NodeAgent(str(local), uri)})
    callback = CkptstoreCallback(verl_config(local, uri, 5), fleet=fleet)
    callback.close()
    assert (callback.resume.source, callback.resume.resharded_from) == ("local", 2)
    assert world_size_of(files_of(local / "global_step_1")) == 5


def test_resume_path_into_the_store_is_resharded(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    committed_step(tmp_path, uri, 4, step=3)
    local = tmp_path / "local"
    config = verl_config(local, uri, 2)
    config["trainer"] |= {"resume_mode": "resume_path", "resume_from_path": f"{uri}/global_step_3"}
    callback = CkptstoreCallback(config, fleet=LocalFleet({"n": NodeAgent(str(local), uri)}))
    callback.close()
    assert (callback.resume.step, callback.resume.resharded_from) == (3, 4)
    assert config["trainer"]["resume_from_path"] == str(local / "global_step_3")
    assert world_size_of(files_of(local / "global_step_3")) == 2


def test_an_fsdp1_step_on_another_world_size_fails_at_start(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    local = tmp_path / "saved"
    fsdp2_step(local / "global_step_1", 2, full_state())
    (local / "global_step_1" / "actor" / "fsdp_config.json").write_text(
        '{"FSDP_version": 1, "world_size": 2}'
    )
    with CheckpointStore(uri) as store:
        store.push_dir(1, local / "global_step_1")
    fresh = tmp_path / "fresh"
    fleet = LocalFleet({"n": NodeAgent(str(fresh), uri)})
    with pytest.raises(CompatibilityError, match="Resume on 2 ranks"):
        CkptstoreCallback(verl_config(fresh, uri, 4), fleet=fleet)
    assert not (fresh / VERL_TRACKER_NAME).exists()  # verl is not pointed at files it cannot load


# -- the command line -------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_reshards_into_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = str(tmp_path / "store")
    src = fsdp2_step(tmp_path / "src", 4, full_state())
    with CheckpointStore(uri) as store:
        store.push_dir(7, src)
    out = tmp_path / "on3"
    code, text, err = cli(capsys, "reshard", uri, "latest", str(out), "--world-size", "3", "--json")
    assert code == 0, err
    assert json.loads(text) | {"seconds": 0} == {
        "uri": uri,
        "step": 7,
        "world_size": 3,
        "source_world_size": 4,
        "out": str(out),
        "folders": ["actor"],
        "seconds": 0,
    }
    assert_same(gather(out / "actor", 3), gather(src / "actor", 4))


def test_cli_commits_as_a_new_step_recording_its_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    src = fsdp2_step(tmp_path / "src", 4, full_state())
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        store.push_dir(7, src, {"framework": "verl", "global_step": 7})
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    code, text, err = cli(
        capsys, *endpoint, "reshard", s3_uri, "7", "-w", "8", "--commit-as", "1007"
    )
    assert code == 0, err
    assert "from 4 to 8 ranks into step 1007" in text
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        info = store.info(1007)
        assert info.metadata == {
            "framework": "verl",
            "global_step": 7,
            "resharded_from": {"step": 7, "world_size": 4},
        }
        assert world_size_of(f.path for f in info.files) == 8
        assert world_size_of(f.path for f in store.info(7).files) == 4  # the source stays
        store.pull_dir(tmp_path / "pulled", 1007)
    assert_same(gather(tmp_path / "pulled" / "actor", 8), gather(src / "actor", 4))


def test_cli_refusals_exit_with_their_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    (src / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    with CheckpointStore(uri) as store:
        store.push_dir(1, src)
    code, _, err = cli(capsys, "reshard", uri, "1", "-w", "3")
    assert code == 2
    assert "give either OUT or --commit-as" in err
    code, _, err = cli(
        capsys, "reshard", uri, "1", str(tmp_path / "o"), "-w", "3", "--commit-as", "2"
    )
    assert code == 2
    code, _, err = cli(capsys, "reshard", uri, "1", str(tmp_path / "out"), "-w", "3")
    assert code == 7
    assert "only FSDP2 checkpoints can be resharded" in err
    code, _, err = cli(capsys, "reshard", uri, "5", str(tmp_path / "out"), "-w", "3")
    assert code == 3
    assert not (tmp_path / "out").exists()


# -- the real verl 0.9.1, FSDP2 on gloo ranks ----------------------------------------------------

HAVE_VERL = importlib.util.find_spec("verl") is not None


def verl_config(local_dir: Path, uri: str, world: int, **ckptstore: Any) -> dict[str, Any]:
    """The parts of verl's ppo_trainer config the callback reads: one node of ``world`` GPUs."""
    return {
        "trainer": {
            "default_local_dir": str(local_dir),
            "resume_mode": "auto",
            "nnodes": 1,
            "n_gpus_per_node": world,
            "project_name": "tiny",
            "experiment_name": "elastic",
            "ckptstore": {"uri": uri, **ckptstore},
        },
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
    }


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (CI installs ckptstore[verl])")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_verl_fsdp2_saved_on_3_ranks_resumes_on_3_down_on_2_and_up_unevenly_on_4(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """verl saves on 3 gloo ranks; the callback commits to S3 (moto over HTTP); the local disk
    is wiped; a job of 3 ranks pulls the step as saved, jobs of 2 (down) and 4 (up) ranks
    resume through the callback: verl's own load accepts the resharded files, the gathered
    full state is bit-identical, one more step trains.

    Every resharding has uneven chunks on one side (66 rows on 3 ranks are 22 each, on 4 are
    17, 17, 17 and 15; 16 rows on 3 are 6, 6 and 4), so no shard maps onto one other shard;
    more ranks (8) would show nothing new and cost a process each."""
    import verl_reshard_ranks as ranks
    from verl_launch import launch

    started = time.perf_counter()
    saved = tmp_path / "saved"
    step_dir = saved / "global_step_1"
    launch(ranks.save_rank, 3, str(tmp_path), str(step_dir))
    phases = [("save on 3", time.perf_counter() - started)]
    print(phases[-1], flush=True)
    (step_dir / "data.pt").write_bytes(b"the driver's dataloader state")
    (saved / VERL_TRACKER_NAME).write_text("1")
    config = verl_config(saved, s3_uri, 3, storage_options=s3_options)
    callback = CkptstoreCallback(config)
    callback.on_save(global_step=1, checkpoint_dir=str(step_dir))
    callback.close()
    original = files_of(step_dir)
    shutil.rmtree(saved)  # another cluster: nothing local

    for world in (3, 2, 4):
        local = tmp_path / f"on{world}"
        config = verl_config(local, s3_uri, world, storage_options=s3_options, takeover=True)
        callback = CkptstoreCallback(config)
        callback.close()
        resume = callback.resume
        assert (resume.step, resume.source) == (1, "store")
        pulled = files_of(local / "global_step_1")
        assert (local / VERL_TRACKER_NAME).read_text() == "1"
        if world == 3:  # the same world size: the step as saved, nothing rewritten
            assert resume.resharded_from is None
            assert pulled == original
            continue
        assert resume.resharded_from == 3
        assert world_size_of(pulled) == world
        assert pulled["data.pt"] == original["data.pt"]
        assert pulled["actor/huggingface/config.json"] == original["actor/huggingface/config.json"]
        phases.append((f"pull+reshard {world}", time.perf_counter() - started))
        launch(ranks.resume_rank, world, str(tmp_path), str(local))
        phases.append((f"resume on {world}", time.perf_counter() - started))
        print(phases[-2:], flush=True)
        assert sorted(p.name for p in tmp_path.glob(f"resumed-{world}-*")) == [
            f"resumed-{world}-{r}" for r in range(world)
        ]
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        assert [i.step for i in store.list()] == [1]  # the store's step stays as saved
        assert world_size_of(f.path for f in store.info(1).files) == 3
    print("elapsed:", ", ".join(f"{name} {t:.1f} s" for name, t in phases))


def test_reshard_from_a_signed_store_refuses_tampered_bytes(tmp_path: Path) -> None:
    from keys import file_key

    uri = str(tmp_path / "store")
    src = fsdp2_step(tmp_path / "src", 2, full_state())
    with CheckpointStore(uri, signing_key="9f2c" * 8) as store:
        store.push_dir(1, src)
        stored = Path(uri) / file_key(store, 1, "actor/model_world_size_2_rank_1.pt")
        torch.save({"x": Payload()}, stored)  # a bucket writer without the key swaps a shard
        with pytest.raises(CorruptCheckpointError, match=r"model_world_size_2_rank_1\.pt"):
            reshard_from_store(store, 1, tmp_path / "out", 3)
    assert not (tmp_path / "out").exists()
    assert not (Path("/nonexistent-dir") / "pwned").exists()


def test_rank_files_of_two_world_sizes_are_a_conflict(tmp_path: Path) -> None:
    src = fsdp2_step(tmp_path / "global_step_1", 2, full_state())
    (src / "actor" / "model_world_size_3_rank_0.pt").write_bytes(b"stale")
    with pytest.raises(
        ConflictError, match=r"global_step_1 holds rank files of world sizes \[2, 3\]"
    ):
        reshard_in_place(src, 4)
    with pytest.raises(ConflictError, match="world sizes 2 and 3"):
        reshard_dir(src, tmp_path / "out", 4)
    assert not (tmp_path / "out").exists()
