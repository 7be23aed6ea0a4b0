"""The part of CheckpointStore that reads: a step's info, the listing, latest, a load, one
file, a step's directory pulled. A base class of the facade, so that store.py stays about
opening, saving and closing. Which step a read starts from, and which tier's copy it reads,
is the resolver's (core/resolver.py); every byte is verified (core/loading.py)."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from ckptstore.core.loading import download_step, load_state
from ckptstore.core.resolver import Resolved
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import check_target
from ckptstore.domain import layout
from ckptstore.domain.compat import check_compat
from ckptstore.domain.info import CheckpointInfo, Loaded
from ckptstore.replication.follow import DEFAULT_INTERVAL, wait_for_step
from ckptstore.store_engines import StoreEngines
from ckptstore.tiers.local import tier_listing

T = TypeVar("T")


class StoreReading(StoreEngines):
    """Reads of :class:`~ckptstore.store.CheckpointStore`."""

    compat: str
    last_loaded: CheckpointInfo | None = None
    """The step the last ``load`` returned (it may fall back past a corrupt latest)."""

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
