"""The verl integration: config, commit from several nodes, resume from the store.

Most tests lay out a verl checkpoint by hand on two "nodes" (two directories, each with its own
ranks' files, as on a cluster without shared storage) and drive the callback directly; they need
no verl. ``test_real_verl_fsdp_*`` runs verl 0.9.1's own FSDPCheckpointManager on two gloo
ranks on CPU and skips when verl is not installed (CI installs it: ``ckptstore[verl]``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.domain.layout import VERL_TRACKER_NAME
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptstore.integrations.verl import (
    CkptstoreCallback,
    VerlRun,
    VerlStoreConfig,
    prepare_resume,
)
from ckptstore.integrations.verl_nodes import LocalFleet, NodeAgent, assign_files
from ckptstore.integrations.verl_steps import node_shares
from ckptstore.options import StoreOptions

HAVE_VERL = importlib.util.find_spec("verl") is not None
HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_verl = pytest.mark.skipif(
    not HAVE_VERL,
    reason="verl is not installed (pip install 'ckptstore[verl]'; CI installs it)",
)
needs_ray = pytest.mark.skipif(
    not HAVE_RAY, reason="ray is not installed (it comes with 'ckptstore[verl]'; CI installs it)"
)
WORLD = 2


def verl_config(local_dir: Path, uri: str, **ckptstore: Any) -> dict[str, Any]:
    """The parts of verl's ppo_trainer config the integration reads."""
    return {
        "trainer": {
            "default_local_dir": str(local_dir),
            "resume_mode": "auto",
            "resume_from_path": None,
            "max_actor_ckpt_to_keep": None,
            "max_critic_ckpt_to_keep": None,
            "nnodes": WORLD,
            "n_gpus_per_node": 1,
            "project_name": "proj",
            "experiment_name": "exp",
            "checkpoint_callback_class": "ckptstore.integrations.verl.CkptstoreCallback",
            "ckptstore": {"uri": uri, **ckptstore},
        },
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
    }


def fake_save(nodes: list[Path], step: int, salt: bytes = b"") -> None:
    """What verl writes for one step with one rank per node: shards where each rank runs,
    huggingface/ and fsdp_config.json from rank 0, data.pt and the tracker from the driver."""
    for rank, node in enumerate(nodes):
        actor = node / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True, exist_ok=True)
        for kind in ("model", "optim", "extra_state"):
            body = f"{kind} rank {rank} step {step}".encode() + salt
            (actor / f"{kind}_world_size_{WORLD}_rank_{rank}.pt").write_bytes(body * 50)
    actor = nodes[0] / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(exist_ok=True)
    (actor / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    (nodes[0] / f"global_step_{step}" / "data.pt").write_bytes(f"dataloader {step}".encode())
    (nodes[0] / VERL_TRACKER_NAME).write_text(str(step))


def two_nodes(tmp_path: Path, uri: str) -> tuple[list[Path], LocalFleet]:
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    agents = {f"n{i}": NodeAgent(str(d), uri, {}) for i, d in enumerate(nodes)}
    return nodes, LocalFleet(agents, driver="n0")


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def callback(config: dict[str, Any], fleet: LocalFleet, **kw: Any) -> CkptstoreCallback:
    store = VerlStoreConfig.from_verl(config).open()
    return CkptstoreCallback(config, store=store, fleet=fleet, **kw)


# -- config ------------------------------------------------------------------------------


def test_config_reads_trainer_ckptstore(tmp_path: Path, uri: str) -> None:
    config = verl_config(
        tmp_path,
        uri,
        keep_last=3,
        keep_every=100,
        storage_options={"endpoint_url": "http://127.0.0.1:9000"},
        takeover=True,
        upload="driver",
    )
    settings = VerlStoreConfig.from_verl(config)
    assert settings.uri == uri
    assert (settings.keep_last, settings.keep_every, settings.takeover) == (3, 100, True)
    assert settings.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert (settings.upload, settings.resume, settings.prune_local) == ("driver", True, True)


def test_config_from_omegaconf_with_interpolation(tmp_path: Path, uri: str) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create(verl_config(tmp_path, uri, keep_last=2))
    config.trainer.max_actor_ckpt_to_keep = 2
    config.trainer.max_critic_ckpt_to_keep = 4
    config.trainer.ckptstore.keep_last = "${trainer.max_actor_ckpt_to_keep}"
    assert VerlStoreConfig.from_verl(config).keep_last == 2
    assert VerlRun.from_verl(config).keep_local == 4  # the larger of actor's and critic's


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "trainer.ckptstore.uri is required"),
        ({"uri": ""}, "trainer.ckptstore.uri must name the store"),
        ({"uri": "/x", "keep-last": 3}, r"unknown key\(s\) in trainer.ckptstore: keep-last"),
        ({"uri": "/x", "keep_last": 0}, "ckptstore.keep_last must be a positive integer"),
        ({"uri": "/x", "keep_last": "3"}, "keep_last must be a positive integer"),
        ({"uri": "/x", "keep_every": True}, "keep_every must be a positive integer"),
        ({"uri": "/x", "takeover": "yes"}, "takeover must be true or false"),
        ({"uri": "/x", "upload": "nodes"}, "upload must be one of auto, driver, per_node"),
        ({"uri": "/x", "storage_options": ["a"]}, "storage_options must be a mapping"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    config = verl_config(tmp_path, "/x")
    config["trainer"]["ckptstore"] = section
    with pytest.raises(ConfigError, match=message):
        VerlStoreConfig.from_verl(config)


def test_missing_section_says_how_to_add_it(tmp_path: Path) -> None:
    config = verl_config(tmp_path, "/x")
    del config["trainer"]["ckptstore"]
    with pytest.raises(ConfigError, match=r"\+trainer.ckptstore.uri=s3://"):
        CkptstoreCallback(config)


def test_async_save_is_refused(tmp_path: Path, uri: str) -> None:
    config = verl_config(tmp_path, uri)
    config["actor_rollout_ref"]["actor"]["checkpoint"]["async_save"] = True
    with pytest.raises(ConfigError, match="async_save=False"):
        CkptstoreCallback(config)


def test_run_reads_verl_keys(tmp_path: Path, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = verl_config(Path("ckpts/relative"), uri)
    config["trainer"]["max_actor_ckpt_to_keep"] = 3
    run = VerlRun.from_verl(config)
    assert run.local_dir == str(tmp_path / "ckpts/relative")  # absolute, as verl resolves it
    assert (run.keep_local, run.world_size, run.resume_mode) == (3, 2, "auto")
    assert dict(run.names) == {"project_name": "proj", "experiment_name": "exp"}


def test_per_node_upload_needs_ray(tmp_path: Path, uri: str) -> None:
    config = verl_config(tmp_path / "local", uri, upload="per_node")
    with pytest.raises(ConfigError, match="upload=per_node needs Ray"):
        CkptstoreCallback(config)


def test_single_node_callback_built_from_config_alone(tmp_path: Path, uri: str) -> None:
    """What verl does: ``cls(config=config)``; no Ray, so the driver uploads everything."""
    local = tmp_path / "local"
    cb = CkptstoreCallback(config=verl_config(local, uri))
    fake_save([local, local], 1)  # both "ranks" on this one node
    cb.on_save(trainer=object(), global_step=1, checkpoint_dir=str(local / "global_step_1"))
    assert type(cb.fleet).__name__ == "LocalFleet"
    assert cb.store.info(1).size > 0
    cb.close()


# -- committing from several nodes ------------------------------------------------------


def test_each_node_uploads_its_files_and_one_step_commits(tmp_path: Path, uri: str) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet)
    assert cb.resume.source == "scratch"
    fake_save(nodes, 1)
    cb.on_save(trainer=None, global_step=1, checkpoint_dir=str(nodes[0] / "global_step_1"))
    with CheckpointStore(uri, lease=False) as store:
        info = store.latest()
        assert info is not None
        assert info.step == 1
        paths = {f.path for f in info.files}
        assert paths == set(files_of(nodes[0] / "global_step_1")) | set(
            files_of(nodes[1] / "global_step_1")
        )
        assert "actor/model_world_size_2_rank_1.pt" in paths  # only on node 1
        assert info.metadata["framework"] == "verl"
        assert info.metadata["global_step"] == 1
        assert info.manifest.environment.world_size == WORLD
    cb.close()


def test_a_node_without_agent_commits_nothing(tmp_path: Path, uri: str) -> None:
    nodes, _ = two_nodes(tmp_path, uri)
    only_driver = LocalFleet({"n0": NodeAgent(str(nodes[0]), uri, {})})
    cb = callback(verl_config(nodes[0], uri, max_failed_saves=1), only_driver)
    fake_save(nodes, 1)
    with pytest.raises(
        CheckpointError, match=r"rank\(s\) 1: no node or rank that reported holds it"
    ) as caught:
        cb.on_save(global_step=1, checkpoint_dir=str(nodes[0] / "global_step_1"))
    assert isinstance(caught.value.__cause__, IncompleteCheckpointError)
    with CheckpointStore(uri, lease=False) as store:
        assert store.list() == []
    cb.close()


def test_a_failing_node_commits_nothing_and_leaves_no_staged_files(
    tmp_path: Path, uri: str
) -> None:
    nodes, _ = two_nodes(tmp_path, uri)
    fake_save(nodes, 1)

    class Broken(NodeAgent):
        def stage(self, step: int, paths: Any, previous: Any = None) -> Any:
            raise BackendError("node 1 lost its network")

    broken = LocalFleet({"n0": NodeAgent(str(nodes[0]), uri, {}), "n1": Broken(str(nodes[1]), uri)})
    cb = callback(verl_config(nodes[0], uri, max_failed_saves=1), broken)
    with pytest.raises(CheckpointError, match="lost its network") as caught:
        cb.on_save(global_step=1, checkpoint_dir=str(nodes[0] / "global_step_1"))
    assert isinstance(caught.value.__cause__, BackendError)
    assert not (Path(uri) / "global_step_1").exists()  # node 0's staged files discarded
    cb.close()


def test_nodes_get_their_share_of_the_previous_step_from_the_driver(
    tmp_path: Path, uri: str
) -> None:
    """The driver reads the previous manifest once; each node copies unchanged files from the
    entries it is handed, so no node reads a manifest that grows with the cluster."""
    handed: dict[str, list[Any]] = {"n0": [], "n1": []}

    class Recording(NodeAgent):
        def __init__(self, name: str, local_dir: str) -> None:
            super().__init__(local_dir, uri, {})
            self.name = name

        def stage(self, plan: Any, paths: Any) -> Any:
            handed[self.name].append((plan.step, sorted(paths), plan.previous))
            return super().stage(plan, paths)

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    agents = {f"n{i}": Recording(f"n{i}", str(d)) for i, d in enumerate(nodes)}
    cb = callback(verl_config(nodes[0], uri), LocalFleet(agents, driver="n0"))
    fake_save(nodes, 1)
    cb.on_save(global_step=1, checkpoint_dir=str(nodes[0] / "global_step_1"))
    for node in nodes:  # the same bytes at step 2: it copies every file
        shutil.copytree(node / "global_step_1", node / "global_step_2")
    cb.on_save(global_step=2, checkpoint_dir=str(nodes[0] / "global_step_2"))
    for name, calls in handed.items():
        (_, _, first), (_, paths, second) = calls
        assert first.step is None and first.files == (), name  # nothing before step 1
        assert second.step == 1, name
        assert sorted(f.path for f in second.files) == paths, name  # only this node's files
    info = cb.store.info(2)
    assert all(f.copied_from == 1 for f in info.manifest.files), info.manifest.files
    cb.close()


def test_assign_files_splits_shared_files_and_refuses_stale_copies() -> None:
    same = [("a", 100), ("b", 90), ("c", 10)]
    plan = assign_files({"x": same, "y": same}, 5)  # shared storage: both see everything
    assert sorted(plan["x"] + plan["y"]) == ["a", "b", "c"]
    assert plan["x"] and plan["y"]  # both upload
    with pytest.raises(ConflictError, match="stale copy"):
        assign_files({"x": [("a", 1)], "y": [("a", 2)]}, 5)
    with pytest.raises(IncompleteCheckpointError, match="no node holds any file"):
        assign_files({"x": []}, 5)


def test_local_step_dirs_follow_max_actor_ckpt_to_keep_on_every_node(
    tmp_path: Path, uri: str
) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    config = verl_config(nodes[0], uri, keep_last=2)
    config["trainer"]["max_actor_ckpt_to_keep"] = 2
    cb = callback(config, fleet)
    for step in (1, 2, 3):
        fake_save(nodes, step)
        cb.on_save(global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}"))
    for node in nodes:
        assert sorted(p.name for p in node.glob("global_step_*")) == [
            "global_step_2",
            "global_step_3",
        ]
    with CheckpointStore(uri, lease=False) as store:
        assert [i.step for i in store.list()] == [2, 3]  # the store's own retention
    cb.close()


# -- resuming --------------------------------------------------------------------------


def save_three(tmp_path: Path, uri: str) -> tuple[list[Path], dict[int, dict[str, bytes]]]:
    """Steps 1-3 committed from two nodes; returns the nodes and each step's files."""
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet)
    saved = {}
    for step in (1, 2, 3):
        fake_save(nodes, step)
        cb.on_save(global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}"))
        saved[step] = {
            **files_of(nodes[0] / f"global_step_{step}"),
            **files_of(nodes[1] / f"global_step_{step}"),
        }
    cb.close()
    for node in nodes:
        shutil.rmtree(node)  # another cluster: empty local disks
    return nodes, saved


def test_resume_pulls_latest_onto_every_node(tmp_path: Path, uri: str) -> None:
    nodes, saved = save_three(tmp_path, uri)
    _, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet)
    assert (cb.resume.step, cb.resume.source, cb.resume.skipped) == (3, "store", ())
    for node in nodes:
        assert files_of(node / "global_step_3") == saved[3]  # byte-identical, whole step
        assert (node / VERL_TRACKER_NAME).read_text() == "3"
        assert not list(node.glob(".ckptstore-*"))
    cb.close()


def test_corrupt_latest_falls_back_with_a_warning_and_is_replaced_on_save(
    tmp_path: Path, uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    nodes, saved = save_three(tmp_path, uri)
    shard = next((Path(uri) / "global_step_3").rglob("actor/model_world_size_2_rank_1.pt"))
    shard.write_bytes(b"X" + shard.read_bytes()[1:])  # bit rot in the store
    _, fleet = two_nodes(tmp_path, uri)
    with caplog.at_level(logging.WARNING):
        cb = callback(verl_config(nodes[0], uri), fleet)
    assert (cb.resume.step, cb.resume.skipped) == (2, (3,))
    assert "step 3 failed verification" in caplog.text
    assert "model_world_size_2_rank_1.pt" in caplog.text
    for node in nodes:
        assert files_of(node / "global_step_2") == saved[2]
        assert (node / VERL_TRACKER_NAME).read_text() == "2"
        assert not (node / "global_step_3").exists()
    # training goes on from step 2 and saves step 3 again: the corrupt one is replaced
    fake_save(nodes, 3, salt=b"again")
    cb.on_save(global_step=3, checkpoint_dir=str(nodes[0] / "global_step_3"))
    with CheckpointStore(uri, lease=False) as store:
        assert store.verify(3).ok
        assert store.latest() is not None
    cb.close()


def test_nothing_verifies_and_no_local_copy_raises(tmp_path: Path, uri: str) -> None:
    nodes, _ = save_three(tmp_path, uri)
    for step in (1, 2, 3):
        next((Path(uri) / f"global_step_{step}").rglob("data.pt")).write_bytes(b"garbage")
    _, fleet = two_nodes(tmp_path, uri)
    with pytest.raises(CorruptCheckpointError, match="no committed step passed verification"):
        callback(verl_config(nodes[0], uri, keep_last=None), fleet)


def test_unreachable_store_raises_instead_of_starting_from_scratch(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    options = {"endpoint_url": endpoint, "max_attempts": 1, "key": "k", "secret": "s"}
    config = verl_config(tmp_path / "local", "s3://ckpt-bucket/run", storage_options=options)
    with pytest.raises(BackendError, match="cannot reach the S3 endpoint"):
        prepare_resume(config, fleet=LocalFleet({"n": NodeAgent(str(tmp_path), "/unused")}))


def test_local_checkpoint_as_new_as_the_store_is_kept(tmp_path: Path, uri: str) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet)
    fake_save(nodes, 1)
    cb.on_save(global_step=1, checkpoint_dir=str(nodes[0] / "global_step_1"))
    cb.close()
    shutil.rmtree(nodes[1])  # node 1 was replaced: its shards are gone
    before = (nodes[0] / "global_step_1" / "data.pt").stat().st_mtime_ns
    cb = callback(verl_config(nodes[0], uri), fleet)
    assert (cb.resume.step, cb.resume.source) == (1, "local")
    assert (nodes[0] / "global_step_1" / "data.pt").stat().st_mtime_ns == before  # not pulled
    assert (nodes[1] / "global_step_1" / "actor" / "model_world_size_2_rank_1.pt").exists()
    cb.close()


def test_node_shares_give_each_node_its_ranks_and_every_shared_file() -> None:
    paths = ["data.pt", "actor/huggingface/config.json", "actor/fsdp_config.json",
             *(f"{role}/{kind}_world_size_2_rank_{r}.pt" for role in ("actor", "critic")
               for kind in ("model", "optim") for r in (0, 1))]  # fmt: skip
    shared = ["actor/fsdp_config.json", "actor/huggingface/config.json", "data.pt"]
    shares = node_shares(paths, {"actor": ["b", "a"], "critic": ["a", "a"]}, ["a", "b"])
    assert shares == {
        "a": [*shared[:2], "actor/model_world_size_2_rank_1.pt",
              "actor/optim_world_size_2_rank_1.pt", *sorted(p for p in paths if "critic" in p),
              "data.pt"],
        "b": [*shared[:2], "actor/model_world_size_2_rank_0.pt",
              "actor/optim_world_size_2_rank_0.pt", "data.pt"],
    }  # fmt: skip
    assert node_shares(paths, {"actor": ["a", "b"]}, ["a", "b"]) == {  # critic: not placed
        "a": sorted(p for p in paths if "actor" not in p or "rank_1" not in p),
        "b": sorted(p for p in paths if "actor" not in p or "rank_0" not in p),
    }
    assert node_shares(paths, {"actor": ["a", "b", "a"]}, ["a", "b"]) is None  # resharded
    with pytest.raises(ConfigError, match="node c, which has no ckptstore agent"):
        node_shares(paths, {"actor": ["a", "c"]}, ["a", "b"])


@needs_ray
def test_a_placement_that_cannot_be_read_means_whole_step_pulls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ckptstore.integrations.verl_placement import placement_of

    class NoWorkers:
        workers = ()

    with caplog.at_level(logging.WARNING):
        assert placement_of({"actor": NoWorkers()}) is None
    assert "every node pulls the whole step" in caplog.text


def test_a_placed_resume_pulls_each_share_and_falls_back_past_a_corrupt_shard(
    tmp_path: Path, uri: str
) -> None:
    """With verl's placement, each node pulls its ranks' files and the shared ones; a shard
    that fails verification on one node makes the whole cluster fall back to the step before,
    and no node keeps a part of the corrupt step."""
    nodes, saved = save_three(tmp_path, uri)
    shard = next((Path(uri) / "global_step_3").rglob("actor/model_world_size_2_rank_1.pt"))
    shard.write_bytes(b"X" + shard.read_bytes()[1:])
    _, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet, resume_at_load=True)
    assert cb.resume.source == "disabled" and not nodes[0].exists()  # nothing before placement
    resume = cb.resume_placed({"actor": ["n1", "n0"]})  # rank 0 on node 1
    assert (resume.step, resume.skipped, resume.source) == (2, (3,), "store")
    for node, rank in ((nodes[0], 1), (nodes[1], 0)):
        assert not (node / "global_step_3").exists()
        held = files_of(node / "global_step_2")
        mine = {p: b for p, b in saved[2].items() if "_rank_" not in p or f"_{rank}.pt" in p}
        assert held == mine
        assert (node / VERL_TRACKER_NAME).read_text() == "2"
    cb.close()


def test_resume_path_naming_a_store_step_is_pulled_and_rewritten(tmp_path: Path, uri: str) -> None:
    nodes, saved = save_three(tmp_path, uri)
    config = verl_config(nodes[0], uri)
    config["trainer"]["resume_mode"] = "resume_path"
    config["trainer"]["resume_from_path"] = f"{uri}/global_step_2"
    _, fleet = two_nodes(tmp_path, uri)
    cb = callback(config, fleet)
    assert cb.resume.step == 2
    assert config["trainer"]["resume_from_path"] == str(nodes[0] / "global_step_2")
    assert files_of(nodes[1] / "global_step_2") == saved[2]
    cb.close()


def test_takeover_is_needed_while_another_job_holds_the_lease(tmp_path: Path, uri: str) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    first = callback(verl_config(nodes[0], uri), fleet)
    with pytest.raises(ConflictError, match="takeover"):
        callback(verl_config(nodes[0], uri), fleet)  # fails at start, not at the first save
    second = callback(verl_config(nodes[0], uri, takeover=True), fleet)
    second.close()
    first.store.backend.close()


# -- the real verl 0.9.1 on CPU -----------------------------------------------------------


@needs_verl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_verl_fsdp_save_wipe_resume(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """Two gloo ranks run verl's FSDPCheckpointManager on a tiny Llama and save three steps
    through the callback into a moto S3 store, one node directory per rank; the nodes are wiped
    and a fresh job resumes: files byte-identical, verl's load succeeds, trainer state matches."""
    from verl_launch import launch
    from verl_ranks import run_rank

    launch(run_rank, WORLD, str(tmp_path), s3_uri, s3_options)
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as store:
        assert [i.step for i in store.list()] == [2, 3]  # keep_last=2
        assert all(store.verify(i.step).ok for i in store.list())
    assert (tmp_path / "done-0").read_text() == "ok"
    assert (tmp_path / "done-1").read_text() == "ok"
    assert os.listdir(tmp_path / "node1")  # node 1 got its copy of step 3


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_nodes_without_shared_storage_upload_and_pull_their_own_files(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Ray nodes (raylets on 127.0.0.1), each agent on its own directory: each node stages
    the shards it holds, the driver commits one step; a resume pulls it onto both; after
    verl's placement each node pulls only its ranks' share.

    One cluster and one agent per node serve every part (an agent is a Ray worker process
    that imports the store: seconds each); the store is reached through a byte-counting
    proxy from the start, which forwards every request unchanged."""
    # Every Ray process on 127.0.0.1, not on the machine's network address (Ray's switch for
    # single-machine clusters, read by the raylets and workers it starts, and by this process).
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import ray._private.ray_constants
    from ray.cluster_utils import Cluster

    import verl_ranks
    from s3faults.faultproxy import FaultProxy

    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)

    from ckptstore.errors import NotFoundError
    from ckptstore.integrations.verl_nodes import RayFleet, make_fleet

    ray.cloudpickle.register_pickle_by_value(verl_ranks)  # workers cannot import tests/
    proxy = FaultProxy(s3_options["endpoint_url"]).start()
    options = {"endpoint_url": proxy.endpoint_url}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "no_monitor": True},
    )  # no autoscaler monitor: the cluster's nodes are the two added here
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        root = tmp_path / "disks"
        fleet = RayFleet(str(root), s3_uri, options, agent=verl_ranks.PerNodeDirAgent)
        names = fleet.nodes()
        assert len(names) == 2
        other = next(n for n in names if n != fleet.driver)
        disks = [root / fleet.driver[:12], root / other[:12]]
        config = verl_config(disks[0], s3_uri, storage_options=options)
        settings, run = VerlStoreConfig.from_verl(config), VerlRun.from_verl(config)
        with CheckpointStore(s3_uri, storage_options=options, lease=False) as store:
            assert isinstance(make_fleet(settings, run, store), RayFleet)  # auto: 2 nodes

        cb = CkptstoreCallback(config, store=settings.open(), fleet=fleet)
        fake_save(disks, 1)
        saved = {**files_of(disks[0] / "global_step_1"), **files_of(disks[1] / "global_step_1")}
        cb.on_save(global_step=1, checkpoint_dir=str(disks[0] / "global_step_1"))
        info = cb.store.info(1)
        assert {f.path for f in info.files} == set(saved)
        with pytest.raises(NotFoundError, match="step 99 is not committed"):
            fleet.call("sync", {other: (99,)})  # errors cross the actor boundary as they are

        for disk in disks:
            shutil.rmtree(disk)
        config["trainer"]["ckptstore"]["takeover"] = True
        resumed = CkptstoreCallback(
            config, store=VerlStoreConfig.from_verl(config).open(), fleet=fleet
        )
        assert resumed.resume.step == 1
        for disk in disks:
            assert files_of(disk / "global_step_1") == saved
            assert (disk / VERL_TRACKER_NAME).read_text() == "1"
        resumed.close()
        each_node_downloads_only_its_ranks(disks, [fleet.driver, other], config, fleet, proxy)
    finally:
        ray.shutdown()
        cluster.shutdown()
        proxy.stop()


def each_node_downloads_only_its_ranks(
    disks: list[Path], nodes: list[str], config: dict[str, Any], fleet: Any, proxy: Any
) -> None:
    """After verl placed its workers (here rank 0 on the second node, rank 1 on the driver's:
    read from Ray, never assumed), each node pulls the shared files and its own ranks' shards,
    so the bytes the server sends add up to the step's size once; every node pulling the
    whole step (the callback, built before placement) is the baseline."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import verl_ranks
    from ckptstore.integrations.verl_placement import placement_of

    worker = ray.remote(num_cpus=0)(verl_ranks.PlacedWorker)
    workers = [
        worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in (nodes[1], nodes[0])
    ]
    ray.get([w.ready.remote() for w in workers])
    groups = {"actor": type("Group", (), {"workers": workers})()}  # verl's RayWorkerGroup's
    assert placement_of(groups) == {"actor": [nodes[1], nodes[0]]}

    shard = b"\x5a" * (5 << 10)  # rank files (50 times this) dominate the step, as in real runs
    cb = CkptstoreCallback(
        config, store=VerlStoreConfig.from_verl(config).open(), fleet=fleet, resume_at_load=True
    )
    fake_save(disks, 2, salt=shard)
    cb.on_save(global_step=2, checkpoint_dir=str(disks[0] / "global_step_2"))
    size = cb.store.info(2).size
    downloads = {}
    for name in ("per node", "whole step"):
        for disk in disks:
            shutil.rmtree(disk)
        before = proxy.body_bytes["GetObject"]
        placed = name == "per node"
        resume = cb.resume_workers(groups) if placed else cb.resume_placed(None)
        assert resume.step == 2
        downloads[name] = proxy.body_bytes["GetObject"] - before
        if placed:  # rank r's shards on the node verl placed it on
            for disk, rank in ((disks[0], 1), (disks[1], 0)):
                held = set(files_of(disk / "global_step_2"))
                assert {p for p in held if "_rank_" in p} == {
                    f"actor/{k}_world_size_{WORLD}_rank_{rank}.pt"
                    for k in ("model", "optim", "extra_state")
                }, held
                assert {"data.pt", "actor/huggingface/config.json"} <= held
    cb.close()
    ratios = {name: got / size for name, got in downloads.items()}
    shown = "; ".join(f"{n} {downloads[n]:,} ({r:.3f}x the step)" for n, r in ratios.items())
    print(f"\nresume on 2 raylets of a {size:,}-byte step, bytes the server sent: {shown}")
    assert ratios["per node"] <= 1.05, ratios
    assert ratios["whole step"] >= 1.9, ratios  # the baseline: each node pulled it all


# -- a local tier: trainer.ckptstore.persist_every -------------------------------------------


class Trainer:
    total_training_steps = 5


def test_persist_every_commits_every_kth_save_and_the_last_step(tmp_path: Path, uri: str) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri, persist_every=2), fleet)
    for step in range(1, 6):
        fake_save(nodes, step)
        cb.on_save(
            Trainer(), global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}")
        )
    assert [i.step for i in cb.store.list()] == [2, 4, 5]  # 5 is the last step of training
    cb.close()


def test_a_local_step_newer_than_the_store_resumes_only_if_every_node_holds_it(
    tmp_path: Path, uri: str
) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri, persist_every=2), fleet)
    for step in (1, 2, 3):
        fake_save(nodes, step)
        cb.on_save(global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}"))
    assert [i.step for i in cb.store.list()] == [2]  # step 3 lives on the nodes' disks only
    cb.close()
    cb = callback(verl_config(nodes[0], uri, persist_every=2), fleet)
    assert (cb.resume.step, cb.resume.source) == (3, "local")  # whole on the two nodes
    cb.close()
    shutil.rmtree(nodes[1] / "global_step_3")  # node 1 was replaced
    cb = callback(verl_config(nodes[0], uri, persist_every=2), fleet)
    assert (cb.resume.step, cb.resume.source) == (2, "store")  # the durable step, not half a step
    assert (nodes[1] / "global_step_2" / "actor" / f"model_world_size_{WORLD}_rank_1.pt").exists()
    cb.close()


def test_persist_every_is_checked_at_start(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.ckptstore\.persist_every must be a positive"):
        VerlStoreConfig.from_verl(verl_config(tmp_path, uri, persist_every=0))


def test_a_failed_commit_lets_training_go_on_and_three_in_a_row_stop_it(
    tmp_path: Path, uri: str
) -> None:
    nodes, fleet = two_nodes(tmp_path, uri)
    cb = callback(verl_config(nodes[0], uri), fleet)
    for step in (1, 2):  # verl wrote nothing there: nothing can be committed
        cb.on_save(global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}"))
    fake_save(nodes, 3)
    cb.on_save(global_step=3, checkpoint_dir=str(nodes[0] / "global_step_3"))
    assert [i.step for i in cb.store.list()] == [3]  # the count starts again from here
    for step in (4, 5):
        cb.on_save(global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}"))
    with pytest.raises(CheckpointError, match="3 verl saves in a row could not be committed"):
        cb.on_save(global_step=6, checkpoint_dir=str(nodes[0] / "global_step_6"))
    cb.close()


def test_with_local_tiers_every_node_commits_locally_and_due_steps_persist_behind(
    tmp_path: Path, uri: str
) -> None:
    """trainer.ckptstore.local: each node stages its share in its own local tier (the core's
    tiers), every node commits each step there, and the store's persist_every decides which
    reach the store, in the background; the last step of training always does."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    tiers = [tmp_path / "tier0", tmp_path / "tier1"]
    config = verl_config(nodes[0], uri, local=str(tiers[0]), persist_every=2)
    store = VerlStoreConfig.from_verl(config).open()
    assert store.tiers is not None and store.options.persist_every == 2
    node1 = NodeAgent(
        str(nodes[1]), uri, options=StoreOptions(local=str(tiers[1]), persist_every=2)
    )
    fleet = LocalFleet({"n0": NodeAgent(str(nodes[0]), uri, store=store), "n1": node1}, "n0")
    cb = CkptstoreCallback(config, store=store, fleet=fleet)
    for step in range(1, 6):
        fake_save(nodes, step)
        cb.on_save(
            Trainer(), global_step=step, checkpoint_dir=str(nodes[0] / f"global_step_{step}")
        )
        for tier in tiers:  # committed on every node's local tier when on_save returns
            with CheckpointStore(str(tier), lease=False) as local:
                assert local.latest() is not None and local.latest().step == step  # type: ignore[union-attr]
    cb.close()
    node1.store.close()
    with CheckpointStore(uri, lease=False) as durable:
        assert [i.step for i in durable.list()] == [2, 4, 5]  # due steps, and the last one
        assert durable.verify(5).ok
        paths = {f.path for f in durable.info(5).files}
    assert "actor/model_world_size_2_rank_1.pt" in paths  # node 1's share reached the store
    with CheckpointStore(str(tiers[1]), lease=False) as local:
        assert [i.step for i in local.list()] == [4, 5]  # local_keep_last (default 2)
