"""The per-node half of the verl integration: what each machine does with its own disk.

verl writes a checkpoint where its ranks run: every FSDP rank its own shard files on its own
node, rank 0 ``huggingface/`` and ``fsdp_config.json``, the driver ``data.pt``. Without shared
storage no single process can read all of them, so the work is split:

* every node runs a :class:`NodeAgent` (one Ray actor per node, or in-process on one node);
* the driver asks every agent which files of the step it holds, decides who uploads what
  (:func:`assign_files`: each path once, by a node that holds it, large files spread over
  the nodes that share them), checks that the files add up to a whole checkpoint
  (:func:`check_complete`), has every agent stage its share, and commits one manifest only
  after every agent reported. A failing or missing node means no commit.

It is the coordinated save (coordination.py) with the driver as coordinator and one
participant per node. Resuming runs the other way: the driver's node pulls the step the
store's resolver picks (resolver.py: latest, falling back past steps that fail verification),
then every other node pulls that same step, so all ranks load one step.

Pulls land in a temporary directory beside the step directory and are renamed into place, so
an interrupted pull never leaves a ``global_step_N`` that verl would take for a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ckptstore.backends.fsutil import TMP_PREFIX, atomic_write, temp_name
from ckptstore.core.reports import Staged
from ckptstore.data.payload import SourceFile, iter_file
from ckptstore.deadline import current_deadline
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.plan import Plan
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
)
from ckptstore.integrations.verl_config import SECTION, VerlRun, VerlStoreConfig
from ckptstore.integrations.verl_steps import assign_files, check_complete
from ckptstore.options import StoreOptions
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = (TMP_PREFIX, ".ckptstore-")
"""Temporary files and directories (writes and pulls in progress, and pull directories of
earlier versions, named ``.ckptstore-pull-*``): never pushed."""


class NodeAgent:
    """One node's view of ``local_dir`` (verl's ``trainer.default_local_dir``).

    ``store`` is opened lazily from ``uri`` and ``storage_options`` (or the store's
    ``options``: with ``local``, this node's local tier), without the writer lease: agents
    stage and read, only the driver commits.
    """

    def __init__(
        self,
        local_dir: str,
        uri: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        store: CheckpointStore | None = None,
        options: StoreOptions | None = None,
    ) -> None:
        self.local_dir = Path(local_dir)
        self._uri = uri
        self._options = options or StoreOptions(storage_options=dict(storage_options or {}))
        self._store = store

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            options = dataclasses.replace(self._options, lease=False, takeover=False)
            self._store = CheckpointStore(self._uri, options=options)
        return self._store

    def step_dir(self, step: int) -> Path:
        return self.local_dir / layout.step_dir(step)

    def list_step(self, step: int) -> list[tuple[str, int]]:
        """``(relative path, size)`` of every file this node holds of ``step``."""
        root = self.step_dir(step)
        if not root.is_dir():
            return []
        return [(rel, size) for rel, size, _ in _scan(root)]

    def stage(self, plan: Plan, paths: Sequence[str]) -> Staged:
        """Upload this node's share of the step (uncommitted) with the driver's ``plan``
        (cut to ``paths``); the report for the driver (which names the node), never raising."""

        def stage() -> list[FileEntry]:
            root = self.step_dir(plan.step)
            files = []
            for rel in paths:
                path = root / rel
                files.append(SourceFile(rel, _reader(path), path.stat().st_size))
            return self.store.stage_files(plan.step, files, plan=plan)

        return Staged.of("node", stage, node=self.store.node)

    def abandon(self, step: int, attempts: set[str]) -> None:
        """The driver's save of ``step`` failed: what this node staged of it (``attempts``)
        leaves its local tier and the durable one once its copies are done (node_tier.py)."""
        if self.store.tiers is not None:
            self.store.tiers.abandon(step, attempts)

    def share_last(self) -> None:
        """At the job's end: copy this node's files of the last step it staged to the
        durable tier, if that step was not due (the driver's close waits for them)."""
        if self.store.tiers is not None:
            self.store.tiers.share_last()

    def join(self, manifest: Manifest) -> None:
        """The driver committed ``manifest``: commit it in this node's local tier too (the
        store's tiers, tiers/local.py); nothing without one."""
        if self.store.tiers is not None:
            self.store.tiers.join(manifest)

    def pull_newest(self, newer_than: int | None) -> tuple[int, tuple[int, ...]]:
        """Pull the step the store's resolver picks (latest, falling back past steps that
        fail verification; only steps above ``newer_than``) into ``global_step_N``. Returns
        it and the newer steps skipped; NotFoundError when there is none (resolver.py). The
        resolver runs it by the store's ``load_timeout``; a pull that passes it leaves no
        ``global_step_N`` (:meth:`_pull_one`)."""
        found = self.store.resolver.resolve(None, True, self._pull_one, newer_than=newer_than)
        return found.info.step, found.skipped

    def sync(self, step: int, paths: Sequence[str] | None = None) -> bool:
        """Make sure this node holds the committed ``step`` (only ``paths`` of it when given:
        the files of the ranks it hosts and the shared ones, verl_placement.py); pull what is
        missing or has the wrong size. Returns whether it pulled. One load, by the store's
        ``load_timeout`` (resolver.py), as :meth:`pull_newest` is."""
        with self.store.resolver.loading(step):
            info = self.store.info(step)
            wanted = set(paths) if paths is not None else None
            root = self.step_dir(step)
            files = [f for f in info.files if wanted is None or f.path in wanted]
            if all(_size(root / f.path) == f.size for f in files):
                return False
            self._pull_one(step, paths)
            return True

    def discard(self, step: int) -> None:
        """Drop this node's copy of ``step`` (a step another node could not verify: the
        resume falls back to an older one, and verl must not find half of this one)."""
        if self.step_dir(step).exists():
            old = self.local_dir / temp_name(f"old-{step}")
            os.replace(self.step_dir(step), old)
            _discard_dir(old)

    def _pull_one(self, info: CheckpointInfo | int, paths: Sequence[str] | None = None) -> None:
        step = info if isinstance(info, int) else info.step
        self.local_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.local_dir / temp_name(f"pull-{step}")
        include = [_literal(p) for p in paths] if paths is not None else []
        try:  # with paths: every file excluded, then those taken back (the aws CLI's filters)
            self.store.pull_dir(
                tmp,
                step=step,
                fallback=False,
                include=include,
                exclude="*" if paths is not None else (),
            )
            target = self.step_dir(step)
            if target.exists():  # stale or partial: move it aside, then drop it
                old = self.local_dir / temp_name(f"old-{step}")
                os.replace(target, old)
                _discard_dir(old)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                _discard_dir(tmp)
        log.info("pulled step %d from %s into %s", step, self.store.uri, self.step_dir(step))

    def reshard(self, step: int, world_size: int) -> int | None:
        """Rewrite this node's ``global_step_N`` for ``world_size`` ranks if verl saved it on
        another world size (verl_reshard.py). Returns the world size it was saved on, or None
        when nothing changed (already ``world_size``, or this node does not hold the step)."""
        from ckptstore.integrations.verl_reshard import reshard_in_place

        done = reshard_in_place(self.step_dir(step), world_size)
        if done is None:
            return None
        log.info(
            "resharded step %d in %s from %d to %d ranks",
            step,
            self.local_dir,
            done.source_world_size,
            world_size,
        )
        return done.source_world_size

    def tracked_step(self) -> int | None:
        """The step ``latest_checkpointed_iteration.txt`` names, if its directory exists."""
        try:
            text = (self.local_dir / layout.VERL_TRACKER_NAME).read_text().strip()
        except FileNotFoundError:
            return None
        try:
            step = layout.check_step(text, where=str(self.local_dir / layout.VERL_TRACKER_NAME))
        except ConfigError as e:
            log.warning("ignoring an unreadable verl tracker file: %s", e)
            return None
        return step if self.step_dir(step).is_dir() else None

    def write_tracker(self, step: int) -> None:
        """Write verl's ``latest_checkpointed_iteration.txt`` atomically."""
        self.local_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.local_dir / layout.VERL_TRACKER_NAME, [str(step).encode()])

    def prune(self, current: int, keep: int) -> list[int]:
        """Delete local step directories older than ``current`` beyond the newest ``keep``
        (``current`` included), like verl's ``max_actor_ckpt_to_keep``; returns them."""
        if not self.local_dir.is_dir():
            return []
        older = sorted(
            step
            for entry in self.local_dir.iterdir()
            if entry.is_dir()
            and (step := layout.parse_step_dir(entry.name)) is not None
            and step < current
        )
        doomed = older[: max(0, len(older) - (keep - 1))]
        for step in doomed:
            shutil.rmtree(self.step_dir(step))
        return doomed


class Fleet(Protocol):
    """The agents of every node of the job, addressed by node name."""

    @property
    def driver(self) -> str:
        """The node the driver runs on (it holds ``data.pt`` and the tracker)."""
        ...

    def nodes(self) -> list[str]: ...

    def call(self, method: str, args: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
        """``NodeAgent.method(*args[node])`` on each named node, in parallel; the results."""
        ...


class LocalFleet:
    """Agents in this process: one for a single node (or shared storage); several, each with
    its own directory, stand in for the nodes of a cluster in tests."""

    def __init__(self, agents: Mapping[str, NodeAgent], driver: str | None = None) -> None:
        if not agents:
            raise ConfigError("a fleet needs at least one node agent")
        self._agents = dict(agents)
        self._driver = driver if driver is not None else next(iter(self._agents))
        if self._driver not in self._agents:
            raise ConfigError(f"driver node {self._driver!r} has no agent")

    @property
    def driver(self) -> str:
        return self._driver

    def nodes(self) -> list[str]:
        return list(self._agents)

    def call(self, method: str, args: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
        return {node: getattr(self._agents[node], method)(*a) for node, a in args.items()}


class RayFleet:
    """One :class:`NodeAgent` Ray actor on every alive node of the Ray cluster.

    Actors take no CPU (``num_cpus=0``), so they never compete with verl's placement groups.
    The node list is refreshed on every call: nodes that joined get an agent, dead ones are
    dropped, and a dead node's shards then show up as missing in :func:`check_complete`.
    """

    def __init__(
        self,
        local_dir: str,
        uri: str,
        options: Mapping[str, Any] | StoreOptions,
        *,
        agent: type[NodeAgent] = NodeAgent,
    ) -> None:
        """``options``: the store's (a node's local tier included), or its storage options."""
        import ray

        self._ray: Any = ray  # untyped calls (ray.nodes) go through Any
        storage = options.storage_options if isinstance(options, StoreOptions) else options
        self._spec = (local_dir, uri, dict(storage))
        self._kwargs = {"options": options} if isinstance(options, StoreOptions) else {}
        self._agent = agent
        self._actors: dict[str, Any] = {}
        self._driver = str(ray.get_runtime_context().get_node_id())

    @property
    def driver(self) -> str:
        return self._driver

    def nodes(self) -> list[str]:
        alive = sorted(str(n["NodeID"]) for n in self._ray.nodes() if n.get("Alive"))
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote_agent = self._ray.remote(num_cpus=0)(self._agent)
        for node in alive:
            if node not in self._actors:
                strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                self._actors[node] = remote_agent.options(scheduling_strategy=strategy).remote(
                    *self._spec, **self._kwargs
                )
        for node in set(self._actors) - set(alive):
            del self._actors[node]
        return alive

    def call(self, method: str, args: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
        if not self._actors:
            self.nodes()
        futures = {node: getattr(self._actors[node], method).remote(*a) for node, a in args.items()}
        results: dict[str, Any] = {}
        errors: list[CheckpointError] = []
        deadline = current_deadline()
        for node, future in futures.items():  # wait for all: no node still uploads after a raise
            try:  # by the save's deadline, if one is in force
                wait = deadline.remaining() if deadline is not None else None
                results[node] = self._ray.get(future, timeout=wait)
            except self._ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                errors.append(
                    cause
                    if isinstance(cause, CheckpointError)
                    else BackendError(
                        f"the ckptstore agent on node {node} failed: {e}", uri=self._spec[1]
                    )
                )
            except self._ray.exceptions.GetTimeoutError as e:
                assert deadline is not None  # ray.get times out only when given a timeout
                errors.append(
                    deadline.error(f"the agent on node {node}", doing="wait for", last_error=str(e))
                )
            except self._ray.exceptions.RayActorError as e:
                del self._actors[node]
                errors.append(
                    BackendError(
                        f"the ckptstore agent on node {node} died: {e}",
                        retryable=True,
                        uri=self._spec[1],
                    )
                )
        if errors:
            raise errors[0]
        return results


def make_fleet(settings: VerlStoreConfig, run: VerlRun, store: CheckpointStore) -> Fleet:
    """The agents of a verl job: one Ray actor per node on a multi-node Ray cluster (or with
    ``upload=per_node``), else one agent in this process over the driver's store."""
    ray: Any = sys.modules.get("ray")  # only a job that already runs Ray can have nodes
    ray_up = ray is not None and bool(ray.is_initialized())
    if settings.upload == "per_node" and not ray_up:
        raise ConfigError(
            f"{SECTION}.upload=per_node needs Ray to be initialized (verl's trainer does it)"
        )
    if ray_up and settings.upload != "driver":
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if settings.upload == "per_node" or len(alive) > 1:
            return RayFleet(run.local_dir, settings.uri, settings.options)
    return LocalFleet({"local": NodeAgent(run.local_dir, store.uri, store=store)})


def _scan(root: Path) -> Iterator[tuple[str, int, Path]]:
    """Files under ``root`` as ``(posix relative path, size, path)``, sorted, without our
    temporary files; symlinks leaving ``root`` are refused (they could upload secrets)."""
    base = root.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(SKIPPED_PREFIXES)]
        for name in filenames:
            if name.startswith(SKIPPED_PREFIXES):
                continue
            path = Path(dirpath, name)
            if path.is_symlink() and not path.resolve().is_relative_to(base):
                raise ConfigError(
                    f"{path} is a symlink leaving {root}; refusing to upload it", path=str(path)
                )
            found.append((path.relative_to(root).as_posix(), path.stat().st_size, path))
    yield from sorted(found)


def _reader(path: Path) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from iter_file(f.read)

    return chunks


def _literal(path: str) -> str:
    """``path`` as a glob that matches only itself (pull filters are fnmatch globs)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _discard_dir(path: Path) -> None:
    """Remove a temporary directory; a failure is logged (it is garbage, never a step)."""
    try:
        shutil.rmtree(path)
    except OSError as e:
        log.warning("could not remove the temporary directory %s (remove it by hand): %s", path, e)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


__all__ = [
    "Fleet",
    "LocalFleet",
    "NodeAgent",
    "RayFleet",
    "assign_files",
    "make_fleet",
    "check_complete",
]
