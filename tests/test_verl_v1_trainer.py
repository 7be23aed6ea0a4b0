"""verl 0.9.1's own v1 trainer builds ckptstore's callback from a config file, and verl's own
save and load code commit to and resume from the store through it.

How far it goes, and why there: the config is composed by Hydra from a file like docs/verl.md's
(``defaults: [ppo_trainer]`` from verl's package), checked by verl's ``validate_config``, and
the trainer is built the way ``main_ppo``'s ``TaskRunnerV1.run`` builds it:
``get_trainer_cls(trainer.v1.trainer_mode)(config=config)``, whose ``__init__`` instantiates
``trainer.checkpoint_callback_class``. The test stops before ``trainer.init()``, which places
the actor's workers on GPUs through Ray resource pools; nothing of the callback happens there.
It then runs verl's own ``_save_checkpoint`` (tracker file, ``data.pt`` of a real stateful
dataloader, then ``on_save`` with verl's arguments) and ``_load_checkpoint``, with one stand-in:
the actor's worker group (the GPU part), which writes and reads the files verl's FSDP checkpoint
manager writes for one rank. test_verl_integration runs that manager itself.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptstore.domain.layout import LEASE_NAME, VERL_TRACKER_NAME
from ckptstore.domain.retention import RetentionPolicy
from ckptstore.errors import ConfigError, LeaseHeldError
from ckptstore.integrations.verl import CkptstoreCallback, Resume, VerlStoreConfig

needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None,
    reason="verl is not installed (pip install 'ckptstore[verl]'; CI installs it)",
)
CALLBACK = "ckptstore.integrations.verl.CkptstoreCallback"


def trainer_yaml(root: Path, uri: str, endpoint: str) -> str:
    """docs/verl.md's config file, sized for one CPU process and a tiny local model."""
    return f"""
hydra:
  searchpath:
    - pkg://verl.trainer.config

defaults:
  - ppo_trainer
  - _self_

algorithm:
  adv_estimator: grpo

critic:
  enable: false

data:
  train_batch_size: 4

trainer:
  project_name: tiny-grpo
  experiment_name: v1-trainer
  nnodes: 1
  n_gpus_per_node: 1
  save_freq: 1
  resume_mode: auto
  default_local_dir: {root}/checkpoints/${{trainer.project_name}}/${{trainer.experiment_name}}
  max_actor_ckpt_to_keep: 1
  max_critic_ckpt_to_keep: 1
  checkpoint_callback_class: {CALLBACK}
  ckptstore:
    uri: {uri}
    keep_last: 2
    lease_ttl: 30
    storage_options:
      endpoint_url: {endpoint}
    takeover: false
    resume: true
    upload: auto
    prune_local: true

actor_rollout_ref:
  model:
    path: {root}/model
  actor:
    ppo_mini_batch_size: 4
    ppo_micro_batch_size_per_gpu: 1
    checkpoint:
      async_save: false
  rollout:
    log_prob_micro_batch_size_per_gpu: 1
  ref:
    log_prob_micro_batch_size_per_gpu: 1
"""


def save_tiny_model(path: Path) -> None:
    """A one-layer Llama config and a word-level tokenizer: what verl's model config reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    ).save_pretrained(path)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(path)


def compose(config_dir: Path) -> Any:
    """What ``python -m verl.trainer.main_ppo --config-path=DIR --config-name=my_ppo`` hands
    its ``main``: Hydra's composition of the file with verl's packaged defaults."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name="my_ppo")


def build_trainer(composed: Any, trainer_for: Any = None) -> Any:
    """verl's ``main`` then ``TaskRunnerV1.run``, up to the trainer's constructor
    (``trainer_for``: what stands for verl's ``get_trainer_cls``)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    config = copy.deepcopy(composed)  # verl mutates the config it is given
    auto_set_device(config)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=need_critic(config),
    )
    trainer_cls = (trainer_for or get_trainer_cls)(config.trainer.v1.trainer_mode)
    config.transfer_queue.enable = True
    OmegaConf.resolve(config)
    return trainer_cls(config=config)


class ActorWorkers:
    """Stands in for the actor's Ray worker group, the one part that needs GPUs: the files
    verl's FSDPCheckpointManager writes for world size 1, and a record of what was loaded."""

    KINDS = ("model", "optim", "extra_state")

    def __init__(self) -> None:
        self.loaded: list[tuple[str, int]] = []

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        import torch

        hf = Path(local_path) / "huggingface"
        hf.mkdir(parents=True, exist_ok=True)
        for kind in self.KINDS:
            state = {"kind": kind, "step": global_step, "w": torch.full((4,), global_step)}
            torch.save(state, Path(local_path) / f"{kind}_world_size_1_rank_0.pt")
        (Path(local_path) / "fsdp_config.json").write_text(json.dumps({"world_size": 1}))
        (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))

    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        import torch

        state = torch.load(Path(local_path) / "model_world_size_1_rank_0.pt", weights_only=True)
        self.loaded.append((local_path, state["step"]))


def dataloader() -> Any:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(11)
    return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=generator)


def local_steps(local_dir: Path) -> list[str]:
    return sorted(p.name for p in local_dir.iterdir() if p.name.startswith("global_step_"))


@needs_verl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_verl_v1_trainer_builds_the_callback_and_commits_and_resumes_through_it(
    tmp_path: Path, s3_uri: str, s3_endpoint: str, s3_bucket: str, s3_client: Any
) -> None:
    from verl.trainer.ppo.v1 import PPOTrainerSync

    save_tiny_model(tmp_path / "model")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_ppo.yaml").write_text(trainer_yaml(tmp_path, s3_uri, s3_endpoint))
    composed = compose(conf)
    trainer = build_trainer(composed)

    # verl built the trainer of trainer_mode "sync", and in it our callback, from the config
    assert type(trainer) is PPOTrainerSync
    callback = trainer.checkpoint_callback
    assert type(callback) is CkptstoreCallback
    assert callback.config is trainer.config
    local_dir = tmp_path / "checkpoints" / "tiny-grpo" / "v1-trainer"
    assert callback.run.local_dir == str(local_dir)  # verl's interpolation, resolved
    assert callback.store.uri == s3_uri
    assert callback.store.retention == RetentionPolicy(keep_last=2)
    assert callback.resume == Resume(None, "scratch")  # an empty store: step 0
    lease = s3_client.get_object(Bucket=s3_bucket, Key=f"run/{LEASE_NAME}")["Body"].read()
    assert json.loads(lease)["ttl"] == 30  # taken at construction, with the configured TTL

    # verl's own _save_checkpoint, three steps: each becomes one committed step
    trainer.actor_rollout_wg = ActorWorkers()
    trainer.train_dataloader = dataloader()
    batches = iter(trainer.train_dataloader)
    for step in (1, 2, 3):
        next(batches)
        trainer.global_steps = step
        trainer._save_checkpoint()
    after_step_3 = next(batches).tolist()  # what the run would have trained on next
    store = callback.store
    assert [i.step for i in store.list()] == [2, 3]  # keep_last=2, applied after each commit
    info = store.info(3)
    assert {f.path for f in info.files} == {
        "data.pt",
        "actor/fsdp_config.json",
        "actor/huggingface/config.json",
        *(f"actor/{kind}_world_size_1_rank_0.pt" for kind in ActorWorkers.KINDS),
    }
    assert info.metadata["framework"] == "verl"
    assert info.metadata["global_step"] == 3
    assert info.metadata["experiment_name"] == "v1-trainer"
    assert store.verify(3).ok
    assert local_steps(local_dir) == ["global_step_3"]  # max_actor_ckpt_to_keep=1
    assert (local_dir / VERL_TRACKER_NAME).read_text() == "3"

    # a second job on the same store fails at construction, not at its first save, and
    # leaves the first job's lease alone
    with pytest.raises(LeaseHeldError):
        build_trainer(composed)
    gc.collect()  # the failed callback's store is closed when collected
    lease = s3_client.get_object(Bucket=s3_bucket, Key=f"run/{LEASE_NAME}")["Body"].read()
    assert json.loads(lease)["holder"] == store.writer
    store.hold_lease()  # still ours: the first job goes on committing

    # the job ends; a fresh machine (no local checkpoints) resumes from the store
    callback.close()
    shutil.rmtree(local_dir)
    resumed = build_trainer(composed)
    assert resumed.checkpoint_callback.resume == Resume(3, "store")
    resumed.actor_rollout_wg = workers = ActorWorkers()
    resumed.train_dataloader = dataloader()
    resumed._load_checkpoint()  # verl's own: the tracker, the actor, data.pt
    assert resumed.global_steps == 3
    assert workers.loaded == [(str(local_dir / "global_step_3" / "actor"), 3)]
    assert next(iter(resumed.train_dataloader)).tolist() == after_step_3
    resumed.checkpoint_callback.close()


@needs_verl
def test_the_v1_trainer_imports_with_the_verl_extra() -> None:
    """Plain ``verl`` lacks what the v1 trainer imports (TransferQueue, cachetools...); the
    ``ckptstore[verl]`` extra must bring it."""
    try:
        from verl.trainer.ppo.v1 import get_trainer_cls
    except ImportError as e:
        pytest.fail(f"verl's v1 trainer does not import ({e}): pip install 'ckptstore[verl]'")
    assert get_trainer_cls("sync").__name__ == "PPOTrainerSync"


# -- every retention rule and the lease TTL reach the store ---------------------------------


def section(uri: str, **keys: Any) -> dict[str, Any]:
    return {"trainer": {"ckptstore": {"uri": uri, **keys}}}


def test_retention_and_lease_options_reach_the_store(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    """The rules keep by union: keep_last the newest (4), keep_best the lowest val_loss (2),
    keep_every_seconds the oldest of the day (1). A store that dropped keep_best would delete
    step 2; one that dropped keep_every_seconds, step 1."""
    uri, options = store_uri
    settings = VerlStoreConfig.from_verl(
        section(
            uri,
            keep_last=1,
            keep_best=1,
            best_metric="val_loss",
            best_mode="min",
            keep_every_seconds=86400,
            lease_ttl=45,
            storage_options=options,
        )
    )
    with settings.open() as store:
        assert store.retention == RetentionPolicy(
            keep_last=1,
            keep_best=1,
            best_metric="val_loss",
            best_mode="min",
            keep_every_seconds=86400,
        )
        for step, loss in ((1, 0.5), (2, 0.1), (3, 0.9), (4, 0.7)):
            store.save(step, {"step": step}, metadata={"val_loss": loss})
        assert [i.step for i in store.list()] == [1, 2, 4]
        lease = json.loads(store.backend.read(LEASE_NAME))
        assert lease["ttl"] == 45


def test_lease_ttl_defaults_to_the_stores_and_may_be_infinite(tmp_path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    assert VerlStoreConfig.from_verl(section(str(tmp_path))).lease_ttl == 60.0
    yaml = f"trainer:\n  ckptstore:\n    uri: {tmp_path}\n    lease_ttl: .inf\n"
    settings = VerlStoreConfig.from_verl(omegaconf.OmegaConf.create(yaml))
    assert settings.lease_ttl == math.inf
    with settings.open() as store:
        store.save(1, {"x": 1})
        assert json.loads(store.backend.read(LEASE_NAME))["ttl"] is None  # JSON: never expires


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"keep_best": 0}, r"trainer\.ckptstore\.keep_best must be a positive integer"),
        ({"keep_best": 2}, r"trainer\.ckptstore\.keep_best needs trainer\.ckptstore\.best_metric"),
        (
            {"keep_best": 2, "best_metric": "val_loss"},
            r"trainer\.ckptstore\.keep_best needs trainer\.ckptstore\.best_mode",
        ),
        (
            {"best_metric": "val_loss", "best_mode": "min"},
            r"only apply with trainer\.ckptstore\.keep_best",
        ),
        ({"keep_best": 2, "best_metric": "", "best_mode": "min"}, "best_metric must be a"),
        ({"keep_best": 2, "best_metric": 3, "best_mode": "min"}, "best_metric must be a"),
        ({"keep_best": 2, "best_metric": "acc", "best_mode": "high"}, "best_mode must be 'min'"),
        ({"keep_every_seconds": 0}, r"trainer\.ckptstore\.keep_every_seconds must be a positive"),
        ({"keep_every_seconds": "1h"}, "keep_every_seconds must be a positive number"),
        ({"keep_every_seconds": math.inf}, "keep_every_seconds must be a positive number"),
        ({"keep_every_seconds": True}, "keep_every_seconds must be a positive number"),
        ({"lease_ttl": 0}, r"trainer\.ckptstore\.lease_ttl must be a positive number"),
        ({"lease_ttl": -5.0}, "lease_ttl must be a positive number"),
        ({"lease_ttl": "60"}, "lease_ttl must be a positive number"),
        ({"lease_ttl": False}, "lease_ttl must be a positive number"),
        ({"lease_ttl": None}, "lease_ttl must be a positive number"),
    ],
)
def test_bad_retention_and_lease_keys_fail_at_start_naming_the_key(
    tmp_path: Path, keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        VerlStoreConfig.from_verl(section(str(tmp_path / "store"), **keys))
    assert caught.value.uri == str(tmp_path / "store")
    assert not os.path.exists(tmp_path / "store")  # nothing opened, nothing written


def test_keep_best_keeps_every_verl_step_it_cannot_rank(tmp_path: Path) -> None:
    """verl passes on_save no metrics, so the callback's steps carry none: keep_best must keep
    them all (as docs/verl.md says), never let keep_last delete by an absent metric."""
    local = tmp_path / "local"
    config = {
        "trainer": {
            "default_local_dir": str(local),
            "nnodes": 1,
            "n_gpus_per_node": 1,
            "ckptstore": section(
                str(tmp_path / "store"),
                keep_last=1,
                keep_best=1,
                best_metric="val_loss",
                best_mode="min",
            )["trainer"]["ckptstore"],
        }
    }
    callback = CkptstoreCallback(config)
    try:
        for step in (1, 2, 3):
            step_dir = local / f"global_step_{step}"
            ActorWorkers().save_checkpoint(str(step_dir / "actor"), global_step=step)
            (step_dir / "data.pt").write_bytes(b"loader %d" % step)
            (local / VERL_TRACKER_NAME).write_text(str(step))
            callback.on_save(global_step=step, checkpoint_dir=str(step_dir))
        assert [i.step for i in callback.store.list()] == [1, 2, 3]
        assert "val_loss" not in callback.store.info(3).metadata
    finally:
        callback.close()
