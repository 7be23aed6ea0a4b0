"""The tiers of one store: a fast local tier in front of the durable store at its URI.

``CheckpointStore(uri, local="/nvme/ckpt/run")`` is one store with two tiers and one
``latest``; there is no second kind of store. The core knows the tiers:

* **Saving** (saving.py, coordination.py): every face's coordinated save commits in the local
  tier (:class:`LocalTier`: the same protocol over a local directory) under the store's
  writer lease (the local tier has none of its own) and with the store's writer id, so a
  manifest is the store's wherever it lies. A save must not fall behind the newest step of
  *either* tier.
* **Persisting** (persister.py, persist_queue.py, durable_commit.py): a due step
  (:class:`PersistPolicy`) is pinned in the local tier, so local retention never deletes it
  before it is durable, and committed in the durable tier by the coordinated save once more:
  the very same manifest (same digests, same signature), ``latest`` forward, the durable
  retention. A participant of a multi-process save persists its own share of a due step
  (node_tier.py).
* **Resolving** (resolver.py): one resolver over both tiers: the newest step either holds,
  the local copy of a step first, the durable copy of the same step before any older one,
  the durable pointer's fences for both. Reads of a step's files take the local copy of each
  file where it is good and fetch only the rest (:class:`TieredFiles`).
* **Taking the lease over**: the fence a takeover stamps admits every step committed before
  it in any tier the new holder sees (commit.py), so a step its node committed locally and a
  kill kept from the bucket is persisted by the next writer as the store's, not a zombie's.

This module holds the pure and local parts: the policy, the local tier's engines and pins,
the tiered reads and the listing of both tiers.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING

from ckptstore.core.resolver import VERIFY_ERRORS
from ckptstore.errors import (
    ConfigError,
    NotFoundError,
    bad_copy,
)
from ckptstore.protocol.pruning import Pins

if TYPE_CHECKING:
    from ckptstore.domain.info import CheckpointInfo
    from ckptstore.domain.manifest import FileEntry
    from ckptstore.protocol.catalog import Catalog
    from ckptstore.protocol.commit import Committer
    from ckptstore.protocol.pruning import Pruner
    from ckptstore.protocol.removal import Remover
    from ckptstore.tiers.identity import TierIdentity

log = logging.getLogger(__name__)
DEFAULT_LOCAL_KEEP_LAST = 2
"""Steps the local tier keeps besides those not yet durable, unless ``local_keep_last``."""


@dataclass(frozen=True)
class PersistPolicy:
    """When a local step is due for the durable tier (pure; the module docstring)."""

    every: int | None = None
    """Every this many local saves."""
    interval: float | None = None
    """Once this many seconds passed since the last due step."""
    spelling: InitVar[Callable[[str], str] | None] = None
    """How messages name the options (options.py)."""

    def __post_init__(self, spelling: Callable[[str], str] | None) -> None:
        name = spelling or str
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ConfigError(
                f"{name('persist_every')} must be a positive integer (saves), got {self.every!r}"
            )
        interval = self.interval
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ConfigError(
                f"{name('persist_interval_seconds')} must be a positive number of seconds, got "
                f"{interval!r}"
            )

    def due(self, saves_since: int, seconds_since: float | None, *, forced: bool) -> bool:
        """``saves_since``: local saves since the last due step, this one included;
        ``seconds_since``: since that step's commit (None: there was none)."""
        if forced or (self.every is None and self.interval is None):
            return True
        if self.every is not None and saves_since >= self.every:
            return True
        return self.interval is not None and (
            seconds_since is None or seconds_since >= self.interval
        )


@dataclass(frozen=True)
class TierPins(Pins):
    """A local tier's pins: those written (a due step not yet durable, kept across a kill),
    and the steps whose shares this process is copying now (node_tier.py)."""

    _busy: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, step: int) -> None:
        with self._lock:
            self._busy[step] += 1

    def release(self, step: int) -> None:
        with self._lock:
            self._busy[step] -= 1
            if self._busy[step] <= 0:
                del self._busy[step]

    def steps(self) -> list[int]:
        with self._lock:
            busy = set(self._busy)
        return sorted(set(self.written()) | busy)

    def written(self) -> list[int]:
        """The pins written in the local tier (those a kill leaves behind)."""
        return super().steps()


@dataclass(frozen=True)
class LocalTier:
    """The local tier's engines (wiring.py builds them): the catalog, the commit protocol,
    removal, pins and retention of a store, over a local directory."""

    catalog: Catalog
    committer: Committer
    remover: Remover
    pins: TierPins
    pruner: Pruner
    identity: TierIdentity
    """The store this directory serves and the node it is on (identity.py)."""
    retention: threading.Lock = field(default_factory=threading.Lock)
    """Held while the local retention runs (after a commit, a persist, or a ``prune``): two
    prunes of one tier would race on the same manifests."""

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri


@dataclass(frozen=True)
class TieredFiles:
    """Reads a committed step's files from the fastest tier that holds each one good: a rank
    whose node kept its shards reads none of them from the bucket, a wiped node reads all.
    Every tier's copy is checked against the one manifest the resolver chose (the tiers hold
    the same manifest), so a local copy is never trusted for being local."""

    tiers: Sequence[Catalog]
    """Fastest first; the durable tier last."""

    def read_verified(self, step: int, entry: FileEntry) -> memoryview:
        *faster, durable = self.tiers
        for index, catalog in enumerate(faster):
            try:
                return catalog.read_verified(step, entry)
            except NotFoundError:
                pass
            except VERIFY_ERRORS as e:
                log.warning(
                    "step %d: %s; reading the file from %s",
                    step,
                    bad_copy(e),
                    self.tiers[index + 1].backend.uri,
                )
        return durable.read_verified(step, entry)

    def read_file(self, info: CheckpointInfo, path: str) -> memoryview:
        """One payload file of ``info``'s step by its path in the step, verified."""
        return self.read_verified(info.step, self.tiers[-1].entry(info, path))


def tier_listing(
    local: Sequence[CheckpointInfo], durable: Sequence[CheckpointInfo], copying: set[int]
) -> list[CheckpointInfo]:
    """Both tiers' committed steps as one list, ascending, each with where it is:
    ``local+durable``, ``local``, ``local (copying)`` or ``durable`` (the local info first:
    reads of a step both hold go there)."""
    held = {i.step: i for i in durable}
    here = {i.step: i for i in local}
    found = []
    for step in sorted(held.keys() | here.keys()):
        if step in here and step in held:
            found.append(replace(here[step], tier="local+durable"))
        elif step in here:
            tier = "local (copying)" if step in copying else "local"
            found.append(replace(here[step], tier=tier))
        else:
            found.append(replace(held[step], tier="durable"))
    return found
