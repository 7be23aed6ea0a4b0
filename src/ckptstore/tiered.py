"""A store with a local tier in front: ``CheckpointStore(uri, local="/nvme/ckpt/run", ...)``.

Saves commit in the local tier and return; due steps reach the store at ``uri`` (the durable
tier) in the background (tiers.py). Reads see one store: ``latest`` and ``load`` take the
newest step either tier holds, read the local copy of a step both hold, and fall back to the
durable copy of the same step before any older one (resolver.py's ``resolve_tiers``);
``list`` says where each step is. Everything else (``prune``, ``pin``, ``gc``, ``verify``,
``delete``) acts on the durable tier, under its own retention and writer lease; ``store.local``
is the local tier, a plain store of its own.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from ckptstore.background import SaveHandle
from ckptstore.deadline import within
from ckptstore.errors import NotFoundError
from ckptstore.info import CheckpointInfo
from ckptstore.options import StoreOptions
from ckptstore.resolver import Resolved, resolve_tiers
from ckptstore.store import CheckpointStore
from ckptstore.tiers import Persister

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_LOCAL_KEEP_LAST = 2


class TieredStore(CheckpointStore):
    """The durable store at ``uri`` with a local tier in front (the module docstring)."""

    def __init__(self, uri: str, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        opts = self.options
        assert opts.local is not None  # CheckpointStore.__new__ sends only such options here
        observer = kwargs.get("observer")
        self.persister = Persister(self, self._durable_holds, opts.persist_policy, observer)
        self.local = CheckpointStore(  # one writer id: a fence here names its steps there
            opts.local, options=local_options(opts), observer=self.persister, writer=self.writer
        )
        self.persister.local = self.local
        self._writing = False
        """Set by the first save: only a writer copies, resumes copies, or persists at close
        (a reader such as ``ckptstore ls --local`` writes nothing, and takes no lease)."""

    def __repr__(self) -> str:
        return f"TieredStore({self.uri!r}, local={self.local.uri!r})"

    # fmt: off
    def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None, *,
             allow_pickle: bool = False, allow_older: bool = False,
             persist: bool = False) -> CheckpointInfo:
        """Commit ``step`` in the local tier; ``persist=True`` also copies it to the store
        (a final or preemption save) whatever ``persist_every`` says."""
        self._start_writing()
        if persist:
            self.persister.force(step)
        return self.local.save(step, state, metadata, allow_pickle=allow_pickle,
                               allow_older=allow_older)

    def save_async(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None, *,
                   allow_pickle: bool = False, allow_older: bool = False,
                   overlap: bool | Optimizer | Iterable[Optimizer] = False,
                   persist: bool = False) -> SaveHandle[CheckpointInfo]:
        """:meth:`save` in the background (``CheckpointStore.save_async``)."""
        self._start_writing()
        if persist:
            self.persister.force(step)
        return self.local.save_async(step, state, metadata, allow_pickle=allow_pickle,
                                     allow_older=allow_older, overlap=overlap)
    # fmt: on

    def _start_writing(self) -> None:
        """The first write: resume the copies a kill interrupted (tiers.py)."""
        if self._writing:
            return
        self._writing = True
        resumed = self.persister.resume()
        if resumed:
            log.warning("%s: copying steps %s from the local tier, where a kill left them",
                        self.uri, resumed)  # fmt: skip

    def before_update(self) -> None:
        self.local.before_update()

    def wait(self) -> None:
        """Wait for the save in flight and every copy to the store (resuming copies a kill
        interrupted); raise their errors."""
        self._start_writing()
        self.local.wait()
        self.persister.wait()

    def close(self) -> None:
        """Finish the save in flight, copy the newest local step to the store if it is not
        there (a writer's last step is always made durable), then close both tiers."""
        try:
            if self._writing:
                self.local.wait()
                newest = self.local.latest()
                if newest is not None and newest.step not in self._durable_steps():
                    self.persister.queue(newest.step)
            self.persister.close()
        finally:
            try:
                self.local.close()
            finally:
                super().close()

    # -- one view of both tiers -------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        try:
            return self._resolve(None, False, lambda info, tier: None).info
        except NotFoundError:
            return None

    def info(self, step: int) -> CheckpointInfo:
        try:
            return self.local.info(step)
        except NotFoundError:
            return super().info(step)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every committed step of either tier, ascending, with ``tier``: ``local``,
        ``durable``, ``local+durable``, or ``local (copying)``."""
        durable = {i.step: i for i in super().list()}
        local = {i.step: i for i in self.local.list()}
        copying = self.persister.copying()
        found = []
        for step in sorted(durable.keys() | local.keys()):
            if step in local and step in durable:
                found.append(replace(local[step], tier="local+durable"))
            elif step in local:
                found.append(replace(local[step], tier="local (copying)" if step in copying
                                     else "local"))  # fmt: skip
            else:
                found.append(replace(durable[step], tier="durable"))
        return found

    def _durable_steps(self) -> set[int]:
        return {i.step for i in super().list()}

    def _durable_holds(self, step: int) -> bool:
        try:
            super().info(step)
        except NotFoundError:
            return False
        return True

    def _resolve(
        self, step: int | None, fallback: bool, action: Callable[[CheckpointInfo, Any], T]
    ) -> Resolved[T]:
        tiers = (self.local, self)
        resolvers = [self.local.resolver, self.resolver]
        with within(self.options.load_timeout, operation="load"):
            return resolve_tiers(resolvers, step, fallback, lambda info, i: action(info, tiers[i]))


CheckpointStore.tiered = TieredStore


def local_options(durable: StoreOptions) -> StoreOptions:
    """The local tier's options: its own retention (``local_keep_last``), the same signing
    key, format and lease rules as the durable tier; no storage options of the store's."""
    keep = durable.local_keep_last or DEFAULT_LOCAL_KEEP_LAST
    return StoreOptions(
        keep_last=keep,
        compat=durable.compat,
        shard_size=durable.shard_size,
        incremental=durable.incremental,
        lease=durable.lease,
        takeover=durable.takeover,
        lease_ttl=durable.lease_ttl,
        signing_key=durable.signing_key,
    )
