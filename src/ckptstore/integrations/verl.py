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
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata as importlib_metadata
from typing import Any

from ckptstore import layout
from ckptstore.deadline import within
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo
from ckptstore.integrations.verl_config import (
    SECTION,
    UPLOAD_MODES,
    VerlRun,
    VerlStoreConfig,
    config_set,
)
from ckptstore.integrations.verl_nodes import (
    Fleet,
    LocalFleet,
    NodeAgent,
    RayFleet,
    assign_files,
    check_complete,
)
from ckptstore.manifest import KIND_DIRECTORY
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """What :func:`prepare_resume` did: the step verl will load (None: from scratch or verl's
    own choice), where it came from, and newer store steps that failed verification."""

    step: int | None
    source: str
    skipped: tuple[int, ...] = ()
    resharded_from: int | None = None
    """The world size the step was saved on, when it was resharded for this job's."""


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
    ) -> None:
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
        self._failures = 0
        """Commits that failed in a row (``max_failed_saves``)."""
        self.store.hold_lease()  # fail now, not at the first save hours later
        self.resume = Resume(None, "disabled")
        if self.settings.resume:
            self.resume = _prepare(config, self.run, self.store, self.fleet)
            self._replace.update(self.resume.skipped)

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            self._fleet = _make_fleet(self.settings, self.run, self.store)
        return self._fleet

    def on_save(
        self,
        trainer: Any = None,
        global_step: int | None = None,
        checkpoint_dir: str | None = None,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
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
        if step in self._replace:
            log.warning(
                "replacing step %d in %s, which failed verification at resume", step, self.store.uri
            )
            if any(i.step == step for i in self.store.list()):
                self.store.delete(step, force=True)
        self._saves_since += 1
        last = step >= getattr(trainer, "total_training_steps", float("inf"))
        if not self.settings.persist_policy.due(self._saves_since, None, forced=last):
            log.info("ckptstore: step %d stays local (persist_every=%s)", step,
                     self.settings.persist_every)  # fmt: skip
            return  # verl's own max_actor_ckpt_to_keep prunes the local copies
        meta = {
            "framework": "verl",
            "verl_version": _verl_version(),
            "global_step": step,
            **self.run.names,
        }
        try:
            info = commit_step(
                self.store, self.fleet, step, metadata=meta, world_size=self.run.world_size
            )
        except CheckpointError as e:
            self._failed(step, e)
            return  # training goes on; the next save is due at once (persist_every)
        self._failures = 0
        self._saves_since = 0
        self._replace.discard(step)
        log.info("ckptstore: committed %s", info.uri)
        if self.settings.prune_local and self.run.keep_local:
            self._prune_local(step, self.run.keep_local)

    def _failed(self, step: int, error: CheckpointError) -> None:
        """A commit failed: log and count it; ``max_failed_saves`` in a row raise."""
        self._failures += 1
        limit = self.settings.max_failed_saves
        log.error("ckptstore: step %d was not committed to %s (%d failure(s) in a row; training "
                  "goes on, and stops after %d): %s", step, self.store.uri, self._failures,
                  limit, error)  # fmt: skip
        if self._failures >= limit:
            raise CheckpointError(
                f"{self.store.uri}: {self._failures} verl saves in a row could not be committed, "
                f"the last one step {step}: {error}. Stopping, so the scheduler sees it: check "
                "the storage (endpoint, credentials, trainer.ckptstore.save_timeout)",
                uri=self.store.uri,
                step=step,
            ) from error

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
        """Release the writer lease (verl has no end-of-training hook; exit does this too)."""
        self.store.close()


def commit_step(
    store: CheckpointStore,
    fleet: Fleet,
    step: int,
    *,
    metadata: Mapping[str, Any] | None = None,
    world_size: int | None = None,
) -> CheckpointInfo:
    """Commit ``global_step_<step>`` as held by the nodes of ``fleet``: the coordinated save
    (coordination.py) with the driver as coordinator and one participant per node; nothing
    committed on failure."""
    with within(store.options.save_timeout):
        return _commit_step(store, fleet, step, metadata, world_size)


def _commit_step(
    store: CheckpointStore,
    fleet: Fleet,
    step: int,
    metadata: Mapping[str, Any] | None,
    world_size: int | None,
) -> CheckpointInfo:
    coordinator = store.begin_save(step, kind=KIND_DIRECTORY, metadata=metadata)
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
    return coordinator.conclude(named, world_size=world_size, coordinator="the driver")


def prepare_resume(
    config: Any, *, store: CheckpointStore | None = None, fleet: Fleet | None = None
) -> Resume:
    """The resume half alone, for entry points that do not use :class:`CkptstoreCallback`
    (call it before the trainer loads). Reads only; the store is opened without the lease."""
    settings = VerlStoreConfig.from_verl(config)
    run = VerlRun.from_verl(config)
    own = store is None
    opened = (
        store
        if store is not None
        else CheckpointStore(settings.uri, storage_options=settings.storage_options, lease=False)
    )
    try:
        return _prepare(config, run, opened, fleet or _make_fleet(settings, run, opened))
    finally:
        if own:
            opened.close()


def _prepare(config: Any, run: VerlRun, store: CheckpointStore, fleet: Fleet) -> Resume:
    if run.resume_mode == "disable":
        return Resume(None, "disabled")
    if run.resume_mode == "resume_path":
        return _resume_path(config, run, store, fleet)
    if run.resume_mode != "auto":
        raise ConfigError(
            f"trainer.resume_mode must be auto, disable or resume_path, got {run.resume_mode!r}"
        )
    step, skipped, source = _choose(run, store, fleet)
    if step is None:
        log.info("%s holds no checkpoint and %s none: training starts from step 0", store.uri,
                 run.local_dir)  # fmt: skip
        return Resume(None, "scratch")
    others = [n for n in fleet.nodes() if n != fleet.driver]
    pulled = source == "store" or _committed(store, step)
    if pulled:
        fleet.call("sync", {n: (step,) for n in others})
    resharded = _reshard(fleet, run, step)
    if pulled:
        _everywhere(fleet, "write_tracker", (step,))
    if skipped:
        log.warning(
            "resuming from step %s: newer step(s) %s of %s failed verification and will be "
            "replaced when training saves them again",
            step,
            ", ".join(map(str, skipped)),
            store.uri,
        )
    log.info("ckptstore: verl resumes from step %s (%s)", step, source)
    return Resume(step, source, skipped, resharded)


def _resume_path(config: Any, run: VerlRun, store: CheckpointStore, fleet: Fleet) -> Resume:
    step = _store_step(run.resume_from_path, store.uri)
    if step is None:
        return Resume(None, "local")  # a local path: verl loads it as usual
    _everywhere(fleet, "sync", (step,))  # an explicit step: no fallback
    resharded = _reshard(fleet, run, step)
    _everywhere(fleet, "write_tracker", (step,))
    local_copy = os.path.join(run.local_dir, layout.step_dir(step))
    config_set(config, "trainer.resume_from_path", local_copy)
    return Resume(step, "store", resharded_from=resharded)


def _choose(
    run: VerlRun, store: CheckpointStore, fleet: Fleet
) -> tuple[int | None, tuple[int, ...], str]:
    """The step to resume from, the store's newer steps skipped, and where it comes from:
    the store's newest step that verifies (the resolver, on the driver's node), unless the
    local disks hold a newer one, whole on every node (a local tier: steps saved between
    ``persist_every`` uploads); never nothing when the store holds steps."""
    driver = fleet.driver
    local = fleet.call("tracked_step", {driver: ()})[driver]
    if (
        local is not None
        and not _committed(store, local)
        and not _whole_on_every_node(fleet, local)
    ):
        local = None  # a node lost its part, and the store has no copy to sync it from
    try:
        latest = store.latest()  # the resolver (resolver.py): None only for an empty store
    except (CorruptCheckpointError, CompatibilityError) as e:
        if local is None:
            raise  # never a silent start from step 0
        log.warning("%s; resuming from local step %d", e, local)
        return local, (), "local"
    if latest is None:
        return local, (), "local"
    try:  # the driver's node pulls the step the resolver picks, newer than the local one
        step, skipped = fleet.call("pull_newest", {driver: (local,)})[driver]
        return step, skipped, "store"
    except NotFoundError:
        log.info("%s holds no step newer than local step %s; resuming from it", store.uri, local)
    except (CorruptCheckpointError, CompatibilityError) as e:
        if local is None:
            raise  # never a silent start from step 0
        log.warning("no step of %s newer than local step %d loads (%s); resuming from it",
                    store.uri, local, e)  # fmt: skip
    return local, (), "local"


def _whole_on_every_node(fleet: Fleet, step: int) -> bool:
    """Whether the nodes together hold every file of local step ``step`` (decided from every
    node's listing: a step only some ranks can load is no step to resume from)."""
    listings = fleet.call("list_step", {n: (step,) for n in fleet.nodes()})
    try:
        check_complete([path for held in listings.values() for path, _ in held], step)
    except IncompleteCheckpointError as e:
        log.warning("local step %d cannot be resumed on this cluster: %s", step, e)
        return False
    return True


def _committed(store: CheckpointStore, step: int) -> bool:
    try:
        store.info(step)
    except NotFoundError:
        return False
    return True


def _reshard(fleet: Fleet, run: VerlRun, step: int) -> int | None:
    """Reshard ``global_step_<step>`` on every node for this job's ``nnodes x
    n_gpus_per_node`` ranks if it was saved on another number (before the tracker names it,
    so an interrupted reshard never looks like a checkpoint); the world size it had, or None."""
    if run.world_size is None:
        return None
    found = {w for w in _everywhere(fleet, "reshard", (step, run.world_size)).values() if w}
    if found:
        log.warning(
            "step %d was saved on %s ranks; resharded for %d ranks (trainer.nnodes x "
            "trainer.n_gpus_per_node). Model and optimizer state are exact; RNG states are "
            "those of rank r mod %s, so sampling differs from a run on the old world size",
            step,
            ", ".join(map(str, sorted(found))),
            run.world_size,
            min(found),
        )
    return min(found) if found else None


def _everywhere(fleet: Fleet, method: str, args: tuple[Any, ...]) -> dict[str, Any]:
    """Run on the driver's node first, then on all others."""
    first = fleet.call(method, {fleet.driver: args})
    return first | fleet.call(method, {n: args for n in fleet.nodes() if n != fleet.driver})


def _make_fleet(settings: VerlStoreConfig, run: VerlRun, store: CheckpointStore) -> Fleet:
    ray: Any = sys.modules.get("ray")  # only a job that already runs Ray can have nodes
    ray_up = ray is not None and bool(ray.is_initialized())
    if settings.upload == "per_node" and not ray_up:
        raise ConfigError(
            f"{SECTION}.upload=per_node needs Ray to be initialized (verl's trainer does it)"
        )
    if ray_up and settings.upload != "driver":
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if settings.upload == "per_node" or len(alive) > 1:
            return RayFleet(run.local_dir, settings.uri, settings.storage_options)
    return LocalFleet({"local": NodeAgent(run.local_dir, store.uri, store=store)})


def _store_step(path: str | None, uri: str) -> int | None:
    """The step of a ``resume_from_path`` inside the store, or None for any other path."""
    if not path:
        return None
    root = uri.rstrip("/") + "/"
    if not path.startswith(root):
        if "://" in path:
            raise ConfigError(
                f"trainer.resume_from_path {path!r} is a URL outside the store {uri}", uri=path
            )
        return None
    step = layout.parse_step_dir(path[len(root) :])
    if step is None:
        raise ConfigError(
            f"trainer.resume_from_path {path!r} must name a step: {root}global_step_N",
            uri=path,
            path=path[len(root) :],
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
]
