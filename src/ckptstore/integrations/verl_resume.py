"""The resume half of the verl integration: which step verl loads, and where it comes from.

Before verl's own ``_load_checkpoint``, :func:`prepare` decides the step and puts it on every
node's disk where verl looks (``trainer.default_local_dir`` with its tracker file): the store's
newest step that verifies (the store's resolver, on the driver's node), unless the local disks
hold a newer one whole on every node (steps saved between ``persist_every`` uploads). Only an
empty store and no local step start training from scratch. A step saved on another world size
is resharded on every node before the tracker names it (verl_reshard.py).

Given a :data:`~ckptstore.integrations.verl_steps.Placement` (where verl placed each rank,
known once its workers exist: verl_placement.py), each node pulls only the shared files and
its own ranks' shards, all nodes at once, so the cluster reads each byte of the step once;
a file that fails verification on any node falls back to the previous step as before.
Without one (the v1 callback, built before verl places its workers) every node pulls the
whole step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.verl_config import VerlRun, VerlStoreConfig, config_set
from ckptstore.integrations.verl_nodes import Fleet, check_complete, make_fleet
from ckptstore.integrations.verl_steps import Placement, node_shares
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
        else CheckpointStore(
            settings.uri,
            storage_options=settings.storage_options,
            lease=False,
            load_timeout=settings.load_timeout,
        )
    )
    try:
        return prepare(config, run, opened, fleet or make_fleet(settings, run, opened))
    finally:
        if own:
            opened.close()


def prepare(
    config: Any,
    run: VerlRun,
    store: CheckpointStore,
    fleet: Fleet,
    placement: Placement | None = None,
) -> Resume:
    """Choose the step and put it on every node, as one load: by the store's
    ``load_timeout`` (the resolver's deadline, which in-process agents share and a Ray fleet
    waits for; each Ray agent's own store runs its pulls by it too). With ``placement``,
    each node gets only what its ranks load (:func:`node_shares`)."""
    if run.resume_mode == "disable":
        return Resume(None, "disabled")
    if run.resume_mode not in ("auto", "resume_path"):
        raise ConfigError(
            f"trainer.resume_mode must be auto, disable or resume_path, got {run.resume_mode!r}"
        )
    with store.resolver.loading():
        if run.resume_mode == "resume_path":
            return _resume_path(config, run, store, fleet, placement)
        return _resume_latest(run, store, fleet, placement)


def _resume_latest(
    run: VerlRun, store: CheckpointStore, fleet: Fleet, placement: Placement | None
) -> Resume:
    step, skipped, source = _choose(run, store, fleet, placement)
    if step is None:
        log.info(
            "%s holds no checkpoint and %s none: training starts from step 0",
            store.uri,
            run.local_dir,
        )
        return Resume(None, "scratch")
    pulled = source == "store" or _committed(store, step)
    if pulled and placement is not None:  # each node's share (a no-op where _choose pulled)
        _sync_shares(store.info(step), fleet, placement)
    elif pulled:
        fleet.call("sync", {n: (step,) for n in fleet.nodes() if n != fleet.driver})
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


def _resume_path(
    config: Any, run: VerlRun, store: CheckpointStore, fleet: Fleet, placement: Placement | None
) -> Resume:
    step = _store_step(run.resume_from_path, store.uri)
    if step is None:
        return Resume(None, "local")  # a local path: verl loads it as usual
    if placement is None:  # an explicit step: no fallback
        _everywhere(fleet, "sync", (step,))
    else:
        _sync_shares(store.info(step), fleet, placement)
    resharded = _reshard(fleet, run, step)
    _everywhere(fleet, "write_tracker", (step,))
    local_copy = os.path.join(run.local_dir, layout.step_dir(step))
    config_set(config, "trainer.resume_from_path", local_copy)
    return Resume(step, "store", resharded_from=resharded)


def _choose(
    run: VerlRun, store: CheckpointStore, fleet: Fleet, placement: Placement | None
) -> tuple[int | None, tuple[int, ...], str]:
    """The step to resume from, the store's newer steps skipped, and where it comes from:
    the store's newest step that verifies (the resolver, pulling on the driver's node, or
    with ``placement`` each node's share on every node), unless the local disks hold a newer
    one, whole on every node (a local tier: steps saved between ``persist_every`` uploads);
    never nothing when the store holds steps."""
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
    try:  # the step the resolver picks, newer than the local one, pulled where it is loaded
        if placement is None:  # the driver's node first, the others after (_resume_latest)
            step, skipped = fleet.call("pull_newest", {driver: (local,)})[driver]
        else:
            placed: Placement = placement
            found = store.resolver.resolve(
                None, True, lambda i: _sync_shares(i, fleet, placed, True), newer_than=local
            )
            step, skipped = found.info.step, found.skipped
        return step, skipped, "store"
    except NotFoundError:
        log.info("%s holds no step newer than local step %s; resuming from it", store.uri, local)
    except (CorruptCheckpointError, CompatibilityError) as e:
        if local is None:
            raise  # never a silent start from step 0
        log.warning(
            "no step of %s newer than local step %d loads (%s); resuming from it",
            store.uri,
            local,
            e,
        )
    return local, (), "local"


def _sync_shares(
    info: CheckpointInfo, fleet: Fleet, placement: Placement, discard: bool = False
) -> None:
    """Every node pulls its share of ``info``'s step at once: the shared files and its ranks'
    shards, or the whole step when it was saved on another world size (it is resharded).
    With ``discard``, a failure leaves no node with a part of the step (the resolver falls
    back to an older one, which verl must load alone)."""
    nodes = fleet.nodes()
    shares = node_shares([f.path for f in info.files], placement, nodes)
    try:
        fleet.call("sync", {n: (info.step, shares[n] if shares else None) for n in nodes})
    except CheckpointError:
        if discard:
            fleet.call("discard", {n: (info.step,) for n in nodes})
        raise


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
