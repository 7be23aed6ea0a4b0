"""CheckpointStore: the one object users hold, a thin facade over the engines.

A save is the coordinated save of one participant (coordination.py, saving.py); a load asks
the resolver (resolver.py) which step, then reads every byte verified (loading.py); many-step
operations are maintenance.py's, pruning.py's and garbage.py's. None of it knows HTTP or file
descriptors; backends do. Options are validated once, by :class:`~ckptstore.options.StoreOptions`.

The facade is split by concern: this module opens, saves and closes; store_reading.py loads
and lists, store_staging.py is the multi-process save's face, store_upkeep.py the many-step
operations', and store_engines.py holds the engines wiring.py built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.core.observer import SaveObserver
from ckptstore.data.background import SaveHandle
from ckptstore.data.payload import Progress
from ckptstore.deadline import Deadline, bounded
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import Environment
from ckptstore.domain.retention import Policy
from ckptstore.errors import ConfigError
from ckptstore.options import StoreOptions
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.lease import DEFAULT_TTL
from ckptstore.store_reading import StoreReading
from ckptstore.store_staging import StoreStaging
from ckptstore.store_upkeep import StoreUpkeep
from ckptstore.wiring import assemble

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger(__name__)
T = TypeVar("T")
RELEASE_WAIT = 2.0
"""Seconds a ``close()`` with ``save_timeout`` waits for the lease's release past its copies:
a storage that does not answer leaves the record to expire after one TTL, as after a kill."""


class CheckpointStore(StoreReading, StoreStaging, StoreUpkeep):
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

        The keyword options, grouped as above, are :class:`~ckptstore.options.StoreOptions`'
        fields (see its docstrings), each checked here; ``storage_options`` are the backend's
        own (S3's ``endpoint_url``, ``part_size``, ``stall_timeout``, ...), and a timeout of
        ``None`` is no deadline. Or pass them as one ``options=`` object (not both). A bad
        value raises ConfigError here, not at the first save; so does a name that is no
        option (the closest one named), and a storage option given here rather than in
        ``storage_options``. A URI that is a committed step's directory is refused (open its
        store and name the step).

        Injected parts: ``backend`` (a backend object instead of opening ``uri``), ``clock``
        (time), ``observer`` (told of every save and failure), ``writer`` (the id this store
        writes as; default a new ``host:pid:random``), ``environment`` (what manifests record
        of this process; default read on first use: :attr:`environment`).
        """
        # First, before any other local: every parameter by name, each option forwarded from it.
        self.options = opts = StoreOptions.from_call(CheckpointStore.__init__, locals(), options)
        self.retention, self.compat, self.clock = opts.policy, opts.compat, clock
        self._open(uri, backend, environment, observer, writer)

    def _open(
        self,
        uri: str,
        backend: Backend | None,
        environment: Environment | None,
        observer: SaveObserver | None,
        writer: str | None,
    ) -> None:
        """Open the backend, build the engines (wiring.py), refuse a step's directory, and
        tie the writer lease to this object: given up when it is collected, taken now with
        ``takeover``."""
        self.backend = backend or open_backend(uri, self.options.storage_options)
        self.uri, self._environment = self.backend.uri, environment
        self._attach(
            assemble(
                self.backend,
                self.options,
                clock=self.clock,
                environment=self._env,
                observer=observer,
                writer=writer,
            )
        )
        _refuse_step_directory(uri, self._catalog)
        if self._lease is not None:
            self._lease.release_when_collected(self)  # a dropped store lets the lease go
            if self.options.takeover:
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
