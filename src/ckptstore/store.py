"""CheckpointStore: the one object users hold, a thin facade over the engines.

A save is the coordinated save of one participant (coordination.py, saving.py); a load asks
the resolver (resolver.py) which step, then reads every byte verified (loading.py); many-step
operations are maintenance.py's, pruning.py's and garbage.py's. None of it knows HTTP or file
descriptors; backends do. Options are validated once, by :class:`~ckptstore.options.StoreOptions`.

The facade is split by concern: this module saves and loads one step; store_staging.py is the
multi-process save's face, store_upkeep.py the many-step operations', and store_engines.py
holds the engines wiring.py built.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.core.loading import download_step, load_state
from ckptstore.core.observer import SaveObserver
from ckptstore.core.resolver import Resolved
from ckptstore.data.background import SaveHandle
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import check_target
from ckptstore.deadline import Deadline, bounded
from ckptstore.domain import layout
from ckptstore.domain.compat import check_compat
from ckptstore.domain.info import CheckpointInfo, Loaded
from ckptstore.domain.manifest import Environment
from ckptstore.domain.retention import Policy
from ckptstore.errors import ConfigError
from ckptstore.options import StoreOptions
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.lease import DEFAULT_TTL
from ckptstore.replication.follow import DEFAULT_INTERVAL, wait_for_step
from ckptstore.store_staging import StoreStaging
from ckptstore.store_upkeep import StoreUpkeep
from ckptstore.tiers.local import tier_listing
from ckptstore.wiring import assemble

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger(__name__)
T = TypeVar("T")
RELEASE_WAIT = 2.0
"""Seconds a ``close()`` with ``save_timeout`` waits for the lease's release past its copies:
a storage that does not answer leaves the record to expire after one TTL, as after a kill."""


class CheckpointStore(StoreStaging, StoreUpkeep):
    """Atomic, verified checkpoints under one URI (local path, NFS, ``s3://``, fsspec URL)."""

    def __init__(
        self,
        uri: str,
        *,
        # retention
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str | None = None,
        keep_every_seconds: float | None = None,
        retention: Policy | Sequence[Policy] | None = None,
        # storage and the files of a step
        storage_options: Mapping[str, Any] | None = None,
        compat: str = "warn",
        shard_size: int = layout.DEFAULT_SHARD_SIZE,
        incremental: bool = True,
        # the writer lease, signing, deadlines
        lease: bool = True,
        takeover: bool = False,
        lease_ttl: float = DEFAULT_TTL,
        signing_key: bytes | str | None = None,
        save_timeout: float | None = None,
        load_timeout: float | None = None,
        # a local tier in front of the store
        local: str | None = None,
        local_keep_last: int | None = None,
        persist_every: int | None = None,
        persist_interval_seconds: float | None = None,
        replicas: int = 0,
        # all of the above as one object, or injected parts
        options: StoreOptions | None = None,
        backend: Backend | None = None,
        clock: Callable[[], float] = time.time,
        observer: SaveObserver | None = None,
        writer: str | None = None,
        environment: Environment | None = None,
        **unknown: Any,
    ) -> None:
        """Open the store at ``uri``; nothing is written until the first save.

        The keyword options are :class:`~ckptstore.options.StoreOptions`' fields (see its
        docstrings), each checked here: retention (``keep_last``, ``keep_every``,
        ``keep_best``, ``best_metric``, ``best_mode``, ``keep_every_seconds``,
        ``retention=`` policy objects), ``storage_options`` (the backend's own: S3's
        ``endpoint_url``, ``part_size``, ``stall_timeout``, ...; ``None`` is none),
        ``compat``, ``shard_size``, ``incremental``, ``lease``, ``takeover``, ``lease_ttl``,
        ``signing_key``, ``save_timeout`` and ``load_timeout`` (seconds, ``None``: no
        deadline), and a local tier: ``local``, ``local_keep_last``, ``persist_every``,
        ``persist_interval_seconds``, ``replicas``. Or pass them as one ``options=`` object
        (not both). A bad value raises ConfigError here, not at the first save; so does a
        name that is no option (the closest one named), and a storage option given here
        rather than in ``storage_options``. A URI that is a committed step's directory is
        refused (open its store and name the step).

        Injected parts: ``backend`` (a backend object instead of opening ``uri``), ``clock``
        (time), ``observer`` (told of every save and failure), ``writer`` (the id this store
        writes as; default a new ``host:pid:random``), ``environment`` (what manifests record
        of this process; default read on first use: :attr:`environment`).
        """
        # First, before any other local: every parameter by name, each option forwarded from it.
        self.options = opts = StoreOptions.from_call(CheckpointStore.__init__, locals(), options)
        self.retention, self.compat, self.clock = opts.policy, opts.compat, clock
        self.backend = backend or open_backend(uri, opts.storage_options)
        self.uri, self._environment = self.backend.uri, environment
        self._attach(
            assemble(
                self.backend,
                opts,
                clock=clock,
                environment=self._env,
                observer=observer,
                writer=writer,
            )
        )
        _refuse_step_directory(uri, self._catalog)
        self.last_loaded: CheckpointInfo | None = None
        """The step the last ``load`` returned (it may fall back past a corrupt latest)."""
        if self._lease is not None:
            self._lease.release_when_collected(self)  # a dropped store lets the lease go
            if opts.takeover:
                self._lease.hold()  # fence the old holder now, before this job loads anything

    def __repr__(self) -> str:
        local = f", local={self._local.uri!r}" if self._local is not None else ""
        return f"CheckpointStore({self.uri!r}{local}, retention={self.retention})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush the save in flight (raising its error); with a local tier, make the pinned
        due steps and the newest local step durable and wait for every copy (raising a failure
        no later durable step superseded: tiers/persister.py); release the writer lease (so
        the next job writes without ``takeover``), then the backends. Every part runs, and
        every thread stops, whichever fails; the first failure is raised. With
        ``save_timeout``, it returns by that deadline plus the slack of README "Bounded saves"
        whatever the storage does, naming the steps left in the local tier only."""
        failure: BaseException | None = None
        deadline = Deadline.of(self.options.save_timeout)
        try:
            for part in (self._async.close, self._tiers.close if self._tiers else None):
                try:
                    if part is not None:
                        with bounded(deadline) if deadline else contextlib.nullcontext():
                            part()
                except BaseException as e:
                    if failure is not None:
                        log.error("%s: close() failed again: %r", self.uri, e)
                    failure = failure or e
        finally:
            try:
                if self._lease is not None:
                    release = Deadline.of(RELEASE_WAIT if deadline is not None else None)
                    with bounded(release) if release else contextlib.nullcontext():
                        self._lease.close()
            finally:
                self.backend.close()
                if self._local is not None:
                    self._local.catalog.backend.close()
        if failure is not None:
            raise failure

    # -- writing -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
        allow_older: bool = False,
        persist: bool = False,
    ) -> CheckpointInfo:
        """Write ``state`` as ``step``, commit it, move ``latest``, apply retention. A step
        behind ``latest`` (a rerun that forgot to resume) is refused before any upload, unless
        ``allow_older``. With a local tier the step commits there; ``persist=True`` makes it
        due for the durable tier whatever ``persist_every`` says (a final or preemption
        save)."""
        step = self._writing(layout.check_step(step), persist)
        return self._saver.save(step, state, metadata, allow_pickle, allow_older=allow_older)

    def save_async(
        self,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
        *,
        allow_pickle: bool = False,
        allow_older: bool = False,
        overlap: bool | Optimizer | Iterable[Optimizer] = False,
        persist: bool = False,
    ) -> SaveHandle[CheckpointInfo]:
        """Snapshot ``state`` and save it in the background, one save in flight at a time;
        ``overlap=optimizer`` defers the copy of its tensors to its next ``step()``
        (``overlap=True``: every tensor, until ``before_update()``). README "Saving fast".
        ``persist`` as for :meth:`save`."""
        step = self._writing(layout.check_step(step), persist)
        return self._async.save_async(
            self._saver,
            step,
            state,
            metadata,
            allow_pickle,
            allow_older=allow_older,
            overlap=overlap,
        )

    def before_update(self) -> None:
        """Return once the tensors of an overlapped ``save_async`` may change (optimizer
        steps wait by themselves); copies what is left of the snapshot. Never raises."""
        self._async.before_update()

    def wait(self) -> None:
        """Wait for the async save in flight and, with a local tier, every copy to the
        durable tier; raise an error nobody heard of (tiers/local.py)."""
        self._async.drain()
        if self._tiers is not None:
            self._tiers.wait()

    def push_dir(
        self,
        step: int,
        local_dir: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        progress: Progress | None = None,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Commit every file under ``local_dir`` as ``step`` (a verl ``global_step_N`` dir)."""
        step = self._writing(layout.check_step(step))
        return self._saver.push_dir(step, Path(local_dir), metadata, progress, allow_older)

    # -- reading -------------------------------------------------------------------------

    def info(self, step: int) -> CheckpointInfo:
        """The committed step's info (from the local tier when it holds it); NotFoundError
        if no tier holds it committed."""
        return self._resolver.info(layout.check_step(step))

    def latest(self) -> CheckpointInfo | None:
        """The newest committed step (resolver.py); ``None`` only for an empty store: a
        store whose steps cannot be read raises, saying why."""
        return self._resolver.latest()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every readable committed step, ascending. Broken manifests are logged, not listed.
        With a local tier, of both tiers, each with its ``tier``: ``local``, ``durable``,
        ``local+durable`` or ``local (copying)``."""
        if self._local is None or self._tiers is None:
            return self._catalog.list()
        return tier_listing(self._local.catalog.list(), self._catalog.list(), self._tiers.copying())

    def reload(self) -> None:
        """Forget the manifests this object has read (catalog.py)."""
        for catalog in self._resolver.tiers:
            catalog.forget_all()

    def wait_for_step(
        self,
        newer_than: int | None = None,
        *,
        timeout: float | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> CheckpointInfo:
        """The newest step after ``newer_than`` (default: latest now), once one commits
        (replication/follow.py); WaitTimeoutError after ``timeout`` seconds."""
        return wait_for_step(self, newer_than, timeout=timeout, interval=interval)

    def fenced_steps(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Committed steps a writer committed after it lost the lease: never loaded as latest."""
        return self._resolver.fenced_steps(self.list() if infos is None else infos)

    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[False] = False,
        keys: Sequence[str] | None = None,
    ) -> Any: ...
    @overload
    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: Literal[True],
        keys: Sequence[str] | None = None,
    ) -> Loaded: ...

    def load(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        allow_pickle: bool = False,
        with_info: bool = False,
        keys: Sequence[str] | None = None,
    ) -> Any:
        """The state saved as ``step`` (default: latest, falling back past steps that fail
        verification), every byte verified. ``with_info=True``: a :class:`Loaded` (state and
        step together); ``keys=["model"]``: only those parts, reading only their files."""

        def load(info: CheckpointInfo) -> Any:
            check_compat(
                info.manifest.environment, self.environment, mode=self.compat, where=info.uri
            )
            return load_state(self._catalog_of(info), info, allow_pickle=allow_pickle, keys=keys)

        found = self._resolve(step, fallback, load)
        self.last_loaded = found.info
        return Loaded(found.value, found.info) if with_info else found.value

    def _resolve(
        self, step: int | None, fallback: bool, action: Callable[[CheckpointInfo], T]
    ) -> Resolved[T]:
        """Run ``action(info)`` on the step a load starts from (resolver.py), by the load's
        deadline; ``info.tier`` says which tier's copy it is."""
        return self._resolver.resolve(step, fallback, action)

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of a committed step, verified against its manifest; with a local
        tier, its local copy where it is good, else the durable one (tiers/local.py)."""
        return self._files.read_file(info, path)

    def pull_dir(
        self,
        local_dir: str | os.PathLike[str],
        step: int | None = None,
        *,
        fallback: bool = True,
        progress: Progress | None = None,
        force: bool = False,
        delete: bool = False,
        include: str | Sequence[str] = (),
        exclude: str | Sequence[str] = (),
    ) -> CheckpointInfo:
        """Download a committed step's files into ``local_dir``, verified (loading.py): whole
        or not at all, ``force`` merges, ``delete`` makes an exact copy, ``include`` and
        ``exclude`` select files as the aws CLI does."""
        target = Path(local_dir)
        check_target(target, force=force or delete)  # before any read

        def pull(info: CheckpointInfo) -> None:
            download_step(
                self._tiers_from(info),
                info,
                target,
                progress,
                force=force,
                delete=delete,
                include=include,
                exclude=exclude,
            )

        return self._resolve(step, fallback, pull).info


def _refuse_step_directory(uri: str, catalog: Catalog) -> None:
    """A committed step's directory is not a store: saving there would nest steps inside it
    (one request, for URIs whose last name is ``global_step_N`` only)."""
    inside = layout.split_step_uri(uri)
    if inside is None or catalog.backend.stat(layout.MANIFEST_NAME) is None:
        return
    store, step = inside
    raise ConfigError(
        f"{uri} is the directory of committed step {step}, not a store: open its store, "
        f"{store}, and name the step (store.load({step}), ckptstore show {store} {step})",
        uri=uri,
        step=step,
    )
