"""ckptstore for the verl 0.9.1 trainers that never call ``trainer.checkpoint_callback_class``.

Only the v1 trainer builds the checkpoint callback (verl.py). The legacy trainer
(``RayPPOTrainer``, ``trainer.use_v1=false``), the separation and one-step-off trainers
(``SeparateRayPPOTrainer``, ``OneStepOffRayTrainer``, which inherit its ``_save_checkpoint``
and ``_load_checkpoint``) and the fully-async trainer (``FullyAsyncTrainer``, with its own
``_save_checkpoint`` and ``load_checkpoint``, the rollouter saving the dataloader) save to
``trainer.default_local_dir`` only, and their loads refuse a remote directory. verl has no
extension point there, so each gets a thin subclass with :class:`CkptstoreTrainerMixin`:

* at construction, the callback's checks and the writer lease (``trainer.ckptstore.*``, the
  same keys as the v1 trainer's);
* after verl's own save, the same commit as the callback's ``on_save`` (every node's share,
  one manifest, retention, ``persist_every``);
* before verl's own load, once the workers are placed, the callback's resume: on a Ray
  cluster each node pulls only the shared files and its own ranks' shards.

The v1 trainer takes the callback itself; :func:`v1_trainer_cls` gives it the same resume at
load (its callback is built with the resume deferred, and the subclass runs it before verl's
``_load_checkpoint``), so a v1 run through ``verl_main`` pulls each node's share too.

verl's files are not touched: the subclasses call verl's methods and add to them.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from verl.experimental.fully_async_policy.fully_async_trainer import (
    FullyAsyncTrainer as _RemoteFullyAsyncTrainer,
)
from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1 import get_trainer_cls

from ckptstore.domain import layout
from ckptstore.errors import ConfigError
from ckptstore.integrations.verl import CkptstoreCallback, resume_at_load
from ckptstore.integrations.verl_config import config_get
from ckptstore.integrations.verl_resume import Resume


class CkptstoreTrainerMixin:
    """Commit verl's saves to the store and resume from it, for a verl trainer class that
    comes after it in the bases (``class T(CkptstoreTrainerMixin, RayPPOTrainer)``)."""

    config: Any
    ckptstore: CkptstoreCallback

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckptstore_start()

    def ckptstore_start(self, callback: CkptstoreCallback | None = None) -> None:
        """Check the config and take the store's writer lease now, not at the first save;
        the resume waits for the placed workers (:meth:`ckptstore_resume`)."""
        hdfs = config_get(self.config, "trainer.default_hdfs_dir")
        if hdfs is not None:
            raise ConfigError(
                f"trainer.default_hdfs_dir is {hdfs!r}: verl 0.9.1's trainers refuse to load "
                "from it, and trainer.ckptstore.uri replaces it; set it to null"
            )
        self.ckptstore = callback or CkptstoreCallback(self.config, resume_at_load=True)

    def ckptstore_step(self) -> int:
        """The step number verl names the directory it just saved after."""
        return int(self.global_steps)  # type: ignore[attr-defined]

    def ckptstore_groups(self) -> dict[str, Any]:
        """Role folder -> the worker group that loads it (where verl placed each rank)."""
        groups = {"actor": self.actor_rollout_wg}  # type: ignore[attr-defined]
        if getattr(self, "use_critic", False):
            groups["critic"] = self.critic_wg  # type: ignore[attr-defined]
        return groups

    def ckptstore_resume(self) -> Resume:
        """Put the step verl will load on every node (only its ranks' share on each)."""
        return self.ckptstore.resume_workers(self.ckptstore_groups())

    def ckptstore_commit(self) -> None:
        """Commit the step verl just saved: the callback's ``on_save``."""
        step = self.ckptstore_step()
        folder = os.path.join(self.config.trainer.default_local_dir, layout.step_dir(step))
        self.ckptstore.on_save(trainer=self, global_step=step, checkpoint_dir=folder)

    def _save_checkpoint(self) -> Any:
        saved = super()._save_checkpoint()  # type: ignore[misc]
        self.ckptstore_commit()
        return saved

    def _load_checkpoint(self) -> Any:
        self.ckptstore_resume()
        return super()._load_checkpoint()  # type: ignore[misc]


class CkptstoreRayPPOTrainer(CkptstoreTrainerMixin, RayPPOTrainer):
    """verl's legacy trainer (``trainer.use_v1=false``) with the store."""


class CkptstoreSeparateRayPPOTrainer(CkptstoreTrainerMixin, SeparateRayPPOTrainer):
    """verl's separation trainer with the store."""


class CkptstoreOneStepOffRayTrainer(CkptstoreTrainerMixin, OneStepOffRayTrainer):
    """verl's one-step-off-policy trainer with the store."""


# verl's FullyAsyncTrainer is a Ray actor class; the class it wraps is the one to extend.
_FullyAsyncTrainer: Any = getattr(_RemoteFullyAsyncTrainer, "__ray_actor_class__")  # noqa: B009


class CkptstoreFullyAsyncTrainerClass(CkptstoreTrainerMixin, _FullyAsyncTrainer):  # type: ignore[misc]
    """verl's fully-async trainer with the store (the class; :data:`CkptstoreFullyAsyncTrainer`
    is the Ray actor, as verl's ``FullyAsyncTrainer`` is). Its steps are
    ``current_param_version``; its ``load_checkpoint`` runs before the rollouter's, which
    reads ``data.pt`` from its own node: every node holds the shared files."""

    def ckptstore_step(self) -> int:
        return int(self.current_param_version)

    async def load_checkpoint(self) -> Any:
        self.ckptstore_resume()
        return await super().load_checkpoint()


CkptstoreFullyAsyncTrainer = ray.remote(num_cpus=10)(CkptstoreFullyAsyncTrainerClass)
"""The Ray actor class, a drop-in for verl's ``FullyAsyncTrainer`` (``.remote(...)``)."""


class CkptstoreV1Mixin:
    """For a v1 trainer class (``PPOTrainerSync`` and the async modes): the callback verl
    builds from ``trainer.checkpoint_callback_class`` leaves its resume to the load, which runs
    it once verl placed the workers. Saves stay verl's and the callback's as they are."""

    config: Any
    checkpoint_callback: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with resume_at_load():  # verl builds the callback in here
            super().__init__(*args, **kwargs)

    def _load_checkpoint(self) -> Any:
        callback = self.checkpoint_callback
        if isinstance(callback, CkptstoreCallback):
            groups = {"actor": self.actor_rollout_wg}  # type: ignore[attr-defined]
            if getattr(self, "use_critic", False):
                groups["critic"] = self.critic_wg  # type: ignore[attr-defined]
            callback.resume_workers(groups)
        return super()._load_checkpoint()  # type: ignore[misc]


_V1_CLASSES: dict[type, type] = {}


def v1_trainer_cls(trainer_mode: str) -> type:
    """verl's ``get_trainer_cls(trainer_mode)`` with :class:`CkptstoreV1Mixin` first (the
    class verl registered, so the mode's behaviour is verl's)."""
    base = get_trainer_cls(trainer_mode)
    if base not in _V1_CLASSES:
        _V1_CLASSES[base] = type(f"Ckptstore{base.__name__}", (CkptstoreV1Mixin, base), {})
    return _V1_CLASSES[base]
