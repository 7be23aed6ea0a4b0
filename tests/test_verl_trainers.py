"""The verl 0.9.1 trainers that never call ``checkpoint_callback_class`` (legacy, one-step-off,
fully-async), through ckptstore's thin subclasses (verl_trainers.py): verl's own save code
writes each step, the subclass commits it to S3 (moto), the job is killed (its local disk
wiped, its writer lease left behind) and a new trainer built from the same config resumes from
the URI alone through verl's own load code.

How far it goes, and why there: the legacy trainer is built with its real constructor (config
composed by Hydra from verl's defaults, its real dataloader); the one-step-off and fully-async
trainers' constructors need their rollout replicas and message queue (GPU servers), so they are
made without them and their own ``_save_checkpoint`` / ``load_checkpoint`` run. In every case
the actor's worker group is the stand-in of test_verl_v1_trainer (the GPU part; the files verl's
FSDP checkpoint manager writes). The fully-async rollouter is verl's class with its own
``save_checkpoint``/``load_checkpoint``, built without its replicas, called through a Ray
handle's surface in this process (``ray.get`` of what it returns).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptstore.domain.layout import VERL_TRACKER_NAME
from ckptstore.errors import ConfigError

needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None,
    reason="verl is not installed (pip install 'ckptstore[verl]'; CI installs it)",
)
pytestmark = [needs_verl, pytest.mark.slow, pytest.mark.timeout(240)]

KINDS = {
    "data.pt",
    "actor/fsdp_config.json",
    "actor/huggingface/config.json",
    *(f"actor/{k}_world_size_1_rank_0.pt" for k in ("model", "optim", "extra_state")),
}


def composed_config(tmp_path: Path, uri: str, endpoint: str) -> Any:
    from test_verl_v1_trainer import compose, save_tiny_model, trainer_yaml

    save_tiny_model(tmp_path / "model")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_ppo.yaml").write_text(trainer_yaml(tmp_path, uri, endpoint))
    return compose(conf)


def resolved(composed: Any, **ckptstore: Any) -> Any:
    from omegaconf import OmegaConf

    config = copy.deepcopy(composed)
    OmegaConf.set_struct(config, False)
    config.trainer.use_v1 = False
    config.data.dataloader_num_workers = 0  # no loader processes: the state is the sampler's
    config.trainer.ckptstore.update(ckptstore)
    OmegaConf.resolve(config)
    return config


def legacy_trainer(config: Any) -> Any:
    """What ``main_ppo_v0``'s TaskRunner builds, with ckptstore's subclass."""
    import torch
    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.trainer.ppo.utils import Role

    from ckptstore.integrations.verl_trainers import CkptstoreRayPPOTrainer

    data = list(range(40))
    pools = ResourcePoolManager({"global_pool": [1]}, {Role.ActorRollout: "global_pool"})
    return CkptstoreRayPPOTrainer(
        config=config,
        tokenizer=None,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=pools,
        train_dataset=data,
        val_dataset=data[:4],
        collate_fn=torch.utils.data.default_collate,
        train_sampler=torch.utils.data.RandomSampler(
            data, generator=torch.Generator().manual_seed(11)
        ),
    )


def made_without_init(cls: type, config: Any, **attrs: Any) -> Any:
    """A trainer whose constructor needs GPU servers: its state, then ckptstore's start."""
    from test_verl_v1_trainer import ActorWorkers

    trainer = cls.__new__(cls)
    trainer.config = config
    trainer.actor_rollout_wg = ActorWorkers()
    trainer.use_critic = False
    for name, value in attrs.items():
        setattr(trainer, name, value)
    trainer.ckptstore_start()
    return trainer


def test_legacy_trainer_commits_each_save_and_resumes_from_the_uri(
    tmp_path: Path, s3_uri: str, s3_endpoint: str
) -> None:
    from test_verl_v1_trainer import ActorWorkers

    composed = composed_config(tmp_path, s3_uri, s3_endpoint)
    trainer = legacy_trainer(resolved(composed))
    assert trainer.ckptstore.resume.source == "disabled"  # waits for the placed workers
    trainer.actor_rollout_wg = ActorWorkers()
    batches = iter(trainer.train_dataloader)
    for step in (1, 2, 3):
        next(batches)
        trainer.global_steps = step
        trainer._save_checkpoint()  # verl's own, then the commit
    after_step_3 = next(batches).tolist()
    store = trainer.ckptstore.store
    assert [i.step for i in store.list()] == [2, 3]  # keep_last=2
    assert {f.path for f in store.info(3).files} == KINDS
    assert store.info(3).metadata["framework"] == "verl"

    local_dir = Path(trainer.config.trainer.default_local_dir)
    shutil.rmtree(local_dir)  # killed: another machine, the lease left behind
    resumed = legacy_trainer(resolved(composed, takeover=True))
    resumed.actor_rollout_wg = workers = ActorWorkers()
    resumed._load_checkpoint()  # ckptstore's resume, then verl's own load
    assert resumed.ckptstore.resume.step == 3
    assert resumed.global_steps == 3
    assert workers.loaded == [(str(local_dir / "global_step_3" / "actor"), 3)]
    assert next(iter(resumed.train_dataloader)).tolist() == after_step_3
    assert (local_dir / VERL_TRACKER_NAME).read_text() == "3"
    resumed.ckptstore.close()
    trainer.ckptstore.store.backend.close()


def test_a_remote_verl_dir_is_refused_at_start(
    tmp_path: Path, s3_uri: str, s3_endpoint: str
) -> None:
    config = resolved(composed_config(tmp_path, s3_uri, s3_endpoint))
    config.trainer.default_hdfs_dir = "hdfs://nn/ckpt"
    with pytest.raises(ConfigError, match=r"trainer\.default_hdfs_dir is 'hdfs://nn/ckpt'"):
        legacy_trainer(config)


def test_one_step_off_trainer_commits_and_resumes_through_its_inherited_save_and_load(
    tmp_path: Path, s3_uri: str, s3_endpoint: str
) -> None:
    from ckptstore.integrations.verl_trainers import CkptstoreOneStepOffRayTrainer as cls
    from test_verl_v1_trainer import dataloader

    composed = composed_config(tmp_path, s3_uri, s3_endpoint)
    trainer = made_without_init(cls, resolved(composed), train_dataloader=dataloader())
    batches = iter(trainer.train_dataloader)
    for step in (1, 2):
        next(batches)
        trainer.global_steps = step
        trainer._save_checkpoint()
    after = next(batches).tolist()
    assert [i.step for i in trainer.ckptstore.store.list()] == [1, 2]
    shutil.rmtree(trainer.config.trainer.default_local_dir)
    resumed = made_without_init(
        cls, resolved(composed, takeover=True), train_dataloader=dataloader()
    )
    resumed._load_checkpoint()
    assert (resumed.global_steps, resumed.actor_rollout_wg.loaded[0][1]) == (2, 2)
    assert next(iter(resumed.train_dataloader)).tolist() == after
    resumed.ckptstore.close()
    trainer.ckptstore.store.backend.close()


@pytest.fixture
def ray_local() -> Any:
    import ray

    # address="local": a cluster of its own, even while another test's cluster runs on this host
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class InProcess:
    """A Ray actor handle's surface (``handle.method.remote(...)`` for ``ray.get``) over an
    object in this process: the method runs at once (a coroutine to its end). The rollouter
    runs here, not in a Ray worker that would import verl again."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self._target, name)

        class Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                result = method(*args)
                if asyncio.iscoroutine(result):
                    result = asyncio.run(result)
                return ray.put(result)

        return Call


def rollouter_class() -> type:
    """verl's FullyAsyncRollouter with its own save_checkpoint and load_checkpoint, built
    without its rollout replicas (GPU servers): the dataloader they save and restore."""
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

    class Rollouter(FullyAsyncRollouter.__ray_actor_class__):  # type: ignore[name-defined,misc]
        def __init__(self, config: Any) -> None:
            import torch
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.config = config
            self.required_samples = 4
            self.dataloader_lock = asyncio.Lock()
            generator = torch.Generator().manual_seed(11)
            self.train_dataloader = StatefulDataLoader(
                list(range(40)), batch_size=4, shuffle=True, generator=generator
            )
            self._batches: Any = None

        def next_batch(self) -> list[int]:
            if self._batches is None:
                self._batches = iter(self.train_dataloader)
            return list(next(self._batches).tolist())

        def steps(self) -> int:
            return int(self.global_steps)

    return Rollouter


def test_fully_async_trainer_commits_the_rollouters_state_and_resumes_it(
    tmp_path: Path, s3_uri: str, s3_endpoint: str, ray_local: Any
) -> None:
    """verl's FullyAsyncTrainer saves under ``current_param_version`` and has the rollouter
    write ``data.pt``; both come back from the URI, the rollouter's dataloader
    position included, in the order verl's fully_async_main loads them."""
    from ckptstore.integrations.verl_trainers import CkptstoreFullyAsyncTrainerClass as cls

    ray = ray_local
    rollouter_cls = rollouter_class()
    composed = composed_config(tmp_path, s3_uri, s3_endpoint)
    config = resolved(composed)
    config.async_training = {"trigger_parameter_sync_step": 1}
    rollouter = InProcess(rollouter_cls(config))
    trainer = made_without_init(cls, config, rollouter=rollouter, trigger_parameter_sync_step=1)
    for version in (1, 2):
        ray.get(rollouter.next_batch.remote())
        trainer.current_param_version = version
        trainer._save_checkpoint()  # verl's: actor, the rollouter's data.pt, the tracker
    after = ray.get(rollouter.next_batch.remote())
    store = trainer.ckptstore.store
    assert [i.step for i in store.list()] == [1, 2]
    assert {f.path for f in store.info(2).files} == KINDS

    shutil.rmtree(config.trainer.default_local_dir)
    config = resolved(composed, takeover=True)
    config.async_training = {"trigger_parameter_sync_step": 1}
    rollouter = InProcess(rollouter_cls(config))
    resumed = made_without_init(cls, config, rollouter=rollouter, trigger_parameter_sync_step=1)
    assert asyncio.run(resumed.load_checkpoint()) == 2  # ckptstore's resume, then verl's
    ray.get(rollouter.load_checkpoint.remote())  # verl's rollouter, after the trainer
    assert resumed.actor_rollout_wg.loaded[0][1] == 2
    assert ray.get(rollouter.steps.remote()) == 2 * 4 * 1 + 1  # verl's own arithmetic
    assert ray.get(rollouter.next_batch.remote()) == after
    resumed.ckptstore.close()
    trainer.ckptstore.store.backend.close()


def test_v1_trainer_through_the_entry_point_resumes_at_its_load(
    tmp_path: Path, s3_uri: str, s3_endpoint: str
) -> None:
    """``verl_main ppo`` with the v1 trainer: verl's registered class with the resume moved to
    its load (after placement); saves are verl's and the callback's as they are."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from ckptstore.integrations.verl import CkptstoreCallback, Resume
    from ckptstore.integrations.verl_trainers import CkptstoreV1Mixin, v1_trainer_cls
    from test_verl_v1_trainer import ActorWorkers, build_trainer, compose, dataloader

    composed_config(tmp_path, s3_uri, s3_endpoint)  # the model and the config file
    composed = compose(tmp_path / "conf")
    trainer = build_trainer(composed, v1_trainer_cls)
    assert type(trainer).__mro__[1:3] == (CkptstoreV1Mixin, get_trainer_cls("sync"))
    callback = trainer.checkpoint_callback
    assert type(callback) is CkptstoreCallback and callback.resume == Resume(None, "disabled")
    trainer.actor_rollout_wg = ActorWorkers()
    trainer.train_dataloader = dataloader()
    batches = iter(trainer.train_dataloader)
    for step in (1, 2):
        next(batches)
        trainer.global_steps = step
        trainer._save_checkpoint()  # verl's, which calls the callback
    after = next(batches).tolist()
    assert [i.step for i in callback.store.list()] == [1, 2]
    callback.close()
    shutil.rmtree(callback.run.local_dir)

    resumed = build_trainer(composed, v1_trainer_cls)
    assert resumed.checkpoint_callback.resume.source == "disabled"  # nothing pulled yet
    assert not Path(callback.run.local_dir).exists()
    resumed.actor_rollout_wg = workers = ActorWorkers()
    resumed.train_dataloader = dataloader()
    resumed._load_checkpoint()
    assert resumed.checkpoint_callback.resume == Resume(2, "store")
    assert (resumed.global_steps, workers.loaded[0][1]) == (2, 2)
    assert next(iter(resumed.train_dataloader)).tolist() == after
    resumed.checkpoint_callback.close()


# -- the entry point: verl's own main, with ckptstore's trainer in verl's TaskRunner ---------


class Trainer:
    """verl's trainer class as its TaskRunner's module names it."""


class Runner:
    """Builds the trainer by the name its module holds, as verl's TaskRunners do."""

    def run(self, config: Any) -> Any:
        return globals()["Trainer"]


def remote_runner() -> Any:
    import ray

    return ray.remote(num_cpus=3)(Runner)


def test_the_entry_points_runner_builds_ckptstores_trainer_and_only_inside_run() -> None:
    import sys

    from ckptstore.integrations.verl_main import ENTRIES, Runner, task_runner

    class Ours(Trainer):
        pass

    module = sys.modules[__name__]
    module.RemoteRunner = remote_runner()  # type: ignore[attr-defined]
    try:
        runner = task_runner(Runner(__name__, "RemoteRunner", ((__name__, "Trainer", Ours),)))
        assert runner._default_options == {"num_cpus": 3}  # verl's options kept
        assert runner.__ray_actor_class__().run(None) is Ours  # the class a Ray actor runs
        assert module.Trainer is Trainer  # nothing outside run() sees it
    finally:
        del module.RemoteRunner  # type: ignore[attr-defined]
    for entry in ENTRIES.values():  # verl 0.9.1's modules hold the names bound here
        for verl_runner in entry.runners:
            verl_class = getattr(importlib.import_module(verl_runner.module), verl_runner.name)
            ours = task_runner(verl_runner)
            assert issubclass(ours.__ray_actor_class__, verl_class.__ray_actor_class__)
            assert ours._default_options == verl_class._default_options
            for module, name, _ in verl_runner.binds:
                assert hasattr(importlib.import_module(module), name), (module, name)


def test_the_entry_point_names_its_choices() -> None:
    from ckptstore.integrations.verl_main import main

    with pytest.raises(ConfigError, match=r"verl_main \{ppo,one_step_off,fully_async\}"):
        main(["sft"])
