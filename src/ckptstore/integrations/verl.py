"""verl integration: every checkpoint verl writes becomes one committed step in a store, and a
job on another cluster resumes from the store's ``latest`` with nothing but the URI.

verl 0.9.1's v1 trainer has one checkpoint extension point, ``trainer.checkpoint_callback_class``:
it builds the class named there on the driver in ``PPOTrainer.__init__`` and calls its
``on_save`` after each save. There is no load hook, so this module uses both moments:

* **Construction** (before ``trainer.init()`` and so before verl's ``_load_checkpoint``): check
  the config, take the store's writer lease (failing fast if another live job writes there),
  and prepare the resume: when ``trainer.default_local_dir`` has no checkpoint (or an older one
  than the store) and ``resume_mode=auto``, pull the store's latest step onto every node,
  verified, falling back past corrupt steps with a warning, and write
  ``latest_checkpointed_iteration.txt``; verl's own load then finds it. With
  ``resume_mode=resume_path`` and ``resume_from_path`` naming a step in the store, that step is
  pulled and ``resume_from_path`` rewritten to the local copy. A step saved on another world
  size than ``nnodes x n_gpus_per_node`` is resharded in place on every node before the
  tracker names it (verl_reshard.py); the store's step is left as it was. Only "the store is
  empty" starts from scratch; any other error (unreachable bucket, bad credentials, nothing
  verifies) raises.
* **on_save**: commit ``global_step_N`` as one step. Every node stages the files it holds
  (verl_nodes.py: one Ray actor per node on multi-node Ray clusters, in-process otherwise), and
  the driver commits one manifest after every node reported and the files add up to a whole
  checkpoint. Then local step directories beyond ``max_actor_ckpt_to_keep`` are deleted on
  every node (verl itself deletes only ``actor/`` on rank 0's node); the store applies its own
  retention when committing.

Why not the trainer registry: ``get_trainer_cls`` is keyed by ``trainer.v1.trainer_mode``, and
the trainer branches on that same string (``!= "sync"``), so a subclass registered under a new
name changes training behaviour, and re-registering ``"sync"`` is refused. See docs/verl.md.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from importlib import metadata as importlib_metadata
from typing import Any

from ckptstore.core.coordination import Coordinator
from ckptstore.core.reports import Staged
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_DIRECTORY
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    DistributedCheckpointError,
)
from ckptstore.integrations.failed_saves import FailedSaves
from ckptstore.integrations.verl_config import (
    SECTION,
    UPLOAD_MODES,
    VerlRun,
    VerlStoreConfig,
)
from ckptstore.integrations.verl_nodes import (
    Fleet,
    RayFleet,
    assign_files,
    check_complete,
    make_fleet,
)
from ckptstore.integrations.verl_placement import placement_of
from ckptstore.integrations.verl_resume import Resume, prepare, prepare_resume
from ckptstore.integrations.verl_steps import Placement
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

_RESUME_AT_LOAD: ContextVar[bool] = ContextVar("ckptstore_verl_resume_at_load", default=False)


@contextmanager
def resume_at_load() -> Iterator[None]:
    """Callbacks built inside the block leave the resume to :meth:`CkptstoreCallback.
    resume_workers`: for a trainer subclass that builds verl's trainer (and so the callback)
    here and calls it at its load, once the workers are placed (verl_trainers.py)."""
    token = _RESUME_AT_LOAD.set(True)
    try:
        yield
    finally:
        _RESUME_AT_LOAD.reset(token)


class CkptstoreCallback:
    """verl ``trainer.checkpoint_callback_class``: commit each save, prepare each resume.

    verl builds it with ``config=``; ``store`` and ``fleet`` are for tests and custom setups.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        store: CheckpointStore | None = None,
        fleet: Fleet | None = None,
        resume_at_load: bool = False,
    ) -> None:
        """``resume_at_load``: leave the resume to :meth:`resume_placed`, which a trainer
        calls once its workers are placed (verl_trainers.py)."""
        if config is None:
            raise ConfigError("CkptstoreCallback needs verl's trainer config (verl passes config=)")
        self.config = config
        self.settings = VerlStoreConfig.from_verl(config)
        self.run = VerlRun.from_verl(config)
        if self.run.async_save:
            raise ConfigError(
                "checkpoint.async_save=True: verl calls on_save before the files are written and "
                "skips latest_checkpointed_iteration.txt, so nothing durable could be committed. "
                "Set actor_rollout_ref.actor.checkpoint.async_save=False (and critic's) to use "
                "ckptstore"
            )
        self.store = store if store is not None else self.settings.open()
        if store is None:
            weakref.finalize(self, self.store.close)  # releases the writer lease at exit
        self._fleet = fleet
        self._replace: set[int] = set()
        self._saves_since = 0
        """verl saves since the last one committed to the store (``persist_every``)."""
        self._failures = FailedSaves(
            self.store.uri,
            self.settings.max_failed_saves,
            headline="verl saves in a row could not be committed",
            hint=f"endpoint, credentials, {SECTION}.save_timeout",
        )
        self.store.hold_lease()  # fail now, not at the first save hours later
        self.resume = Resume(None, "disabled")
        if self.settings.resume and not (resume_at_load or _RESUME_AT_LOAD.get()):
            self.resume_placed(None)

    def resume_workers(self, groups: Mapping[str, Any]) -> Resume:
        """Prepare verl's resume once its worker groups are placed (role folder -> group):
        on a Ray fleet each node pulls only what its ranks load (verl_placement.py)."""
        placement = placement_of(groups) if isinstance(self.fleet, RayFleet) else None
        return self.resume_placed(placement)

    def resume_placed(self, placement: Placement | None) -> Resume:
        """Prepare verl's resume (verl_resume.py): with ``placement`` (where verl placed each
        rank), each node pulls only its own ranks' files and the shared ones."""
        if self.settings.resume:
            self.resume = prepare(self.config, self.run, self.store, self.fleet, placement)
            self._replace.update(self.resume.skipped)
        return self.resume

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            self._fleet = make_fleet(self.settings, self.run, self.store)
        return self._fleet

    def on_save(
        self,
        trainer: Any = None,
        global_step: int | None = None,
        checkpoint_dir: str | None = None,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        step = _saved_step(global_step, checkpoint_dir, async_save)
        if step in self._replace:
            log.warning(
                "replacing step %d in %s, which failed verification at resume", step, self.store.uri
            )
            if any(i.step == step for i in self.store.list()):
                self.store.delete(step, force=True)
        self._saves_since += 1
        last = step >= getattr(trainer, "total_training_steps", float("inf"))
        tiered = self.store.tiers is not None  # every save commits locally; the store persists
        if not tiered and not self.settings.persist_policy.due(
            self._saves_since, None, forced=last
        ):
            log.info(
                "ckptstore: step %d stays local (persist_every=%s)",
                step,
                self.settings.persist_every,
            )
            return  # verl's own max_actor_ckpt_to_keep prunes the local copies
        meta = {
            "framework": "verl",
            "verl_version": _verl_version(),
            "global_step": step,
            **self.run.names,
        }
        try:
            info = commit_step(
                self.store,
                self.fleet,
                step,
                metadata=meta,
                world_size=self.run.world_size,
                persist=last,
            )
        except CheckpointError as e:
            self._failures.failed(step, e)
            return  # training goes on; the next save is due at once (persist_every)
        self._failures.succeeded()
        self._saves_since = 0
        self._replace.discard(step)
        log.info("ckptstore: committed %s", info.uri)
        if self.settings.prune_local and self.run.keep_local:
            self._prune_local(step, self.run.keep_local)

    def _prune_local(self, step: int, keep: int) -> None:
        nodes = self.fleet.nodes()
        try:
            pruned = self.fleet.call("prune", {n: (step, keep) for n in nodes})
        except (OSError, CheckpointError) as e:  # the step is committed: report, go on training
            log.error(
                "ckptstore: step %d is committed, but deleting old local steps failed: %s", step, e
            )
            return
        for node, steps in pruned.items():
            if steps:
                log.info("ckptstore: deleted local steps %s on node %s", steps, node)

    def close(self) -> None:
        """Make the newest step durable and release the writer lease (verl has no
        end-of-training hook; exit does this too). With local tiers, every node's agent first
        shares its files of the last step it staged, which the store's close waits for
        (node_tier.py): an agent (a Ray actor) is never closed, so it would not otherwise."""
        if self.store.tiers is not None and self._fleet is not None:
            try:
                self.fleet.call("share_last", {n: () for n in self.fleet.nodes()})
            except (OSError, CheckpointError) as e:  # the store's close says what is missing
                log.error("ckptstore: the nodes could not share their last step: %s", e)
        self.store.close()


def commit_step(
    store: CheckpointStore,
    fleet: Fleet,
    step: int,
    *,
    metadata: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    persist: bool = False,
) -> CheckpointInfo:
    """Commit ``global_step_<step>`` as held by the nodes of ``fleet``: the coordinated save
    (coordination.py) with the driver as coordinator and one participant per node; nothing
    committed on failure. With local tiers (the store's ``local``), each node stages its
    share in its own local tier and every node commits the step there; due steps (or
    ``persist``) reach the store in the background (tiers/local.py)."""
    coordinator = store.begin_save(step, kind=KIND_DIRECTORY, metadata=metadata, persist=persist)
    with coordinator.running():  # the fleet's waits end by the save's deadline
        return _commit_step(store, fleet, coordinator, world_size)


def _commit_step(
    store: CheckpointStore, fleet: Fleet, coordinator: Coordinator, world_size: int | None
) -> CheckpointInfo:
    step = coordinator.step
    nodes = fleet.nodes()
    shares = assign_files(fleet.call("list_step", {n: (step,) for n in nodes}), step)
    check_complete([p for paths in shares.values() for p in paths], step)
    work = {n: (coordinator.plan.among(paths), paths) for n, paths in shares.items() if paths}
    try:
        reports = fleet.call("stage", work)
    except BaseException:  # a node's agent died: the others' files must not stay
        coordinator.discard()
        raise
    named = [replace(report, participant=f"node {node}") for node, report in reports.items()]
    try:
        info = coordinator.conclude(named, world_size=world_size, coordinator="the driver")
    except DistributedCheckpointError as e:
        if store.tiers is not None and e.discarded:  # each node's copies leave the bucket too
            fleet.call("abandon", {n: (step, _attempts(r)) for n, r in reports.items()})
        raise
    if store.tiers is not None:  # every other node commits it in its local tier too
        fleet.call("join", {n: (info.manifest,) for n in nodes if n != fleet.driver})
    return info


def _attempts(report: Staged) -> set[str]:
    return {e.attempt for e in report.entries if e.attempt}


def _saved_step(global_step: int | None, checkpoint_dir: str | None, async_save: bool) -> int:
    """The step verl just saved, once its save is one ckptstore can commit: synchronous, and
    in the ``global_step_N`` directory of that step."""
    if async_save:
        raise ConfigError(
            "ckptstore cannot commit an asynchronous verl save; set checkpoint.async_save=False"
        )
    step = layout.check_step(global_step, where="global_step")
    if checkpoint_dir is not None and os.path.basename(
        os.path.normpath(checkpoint_dir)
    ) != layout.step_dir(step):
        raise ConfigError(
            f"checkpoint_dir {checkpoint_dir!r} is not a {layout.step_dir(step)} directory",
            step=step,
            path=checkpoint_dir,
        )
    return step


def _verl_version() -> str | None:
    try:
        return importlib_metadata.version("verl")
    except importlib_metadata.PackageNotFoundError:
        return None


__all__ = [
    "SECTION",
    "UPLOAD_MODES",
    "CkptstoreCallback",
    "Resume",
    "VerlRun",
    "VerlStoreConfig",
    "commit_step",
    "prepare_resume",
    "resume_at_load",
]
