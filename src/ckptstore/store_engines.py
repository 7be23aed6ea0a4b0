"""The engines a :class:`~ckptstore.store.CheckpointStore` holds, and what it shows of them.

wiring.py builds and connects them; this base class only keeps them under the names the
facade's methods use (store.py, store_staging.py, store_upkeep.py), and exposes, read-only,
the few a face or a test legitimately needs: the writer lease, the resolver, the store as a
replication's destination, the environment written into manifests.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptstore.backends.base import Backend
from ckptstore.core.adoption import Adopter
from ckptstore.core.async_saving import AsyncSaver
from ckptstore.core.maintenance import Maintenance
from ckptstore.core.resolver import LOCAL, Resolver
from ckptstore.core.saving import Saver
from ckptstore.domain.environment import current_environment, world_size
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import Environment
from ckptstore.options import StoreOptions
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.lease import WriterLease
from ckptstore.protocol.pruning import Pruner
from ckptstore.protocol.removal import Remover
from ckptstore.replication.destination import Replica
from ckptstore.tiers.local import LocalTier, TieredFiles
from ckptstore.tiers.persister import Persister
from ckptstore.wiring import Parts


class StoreEngines:
    """The engines of one store (wiring.py's :class:`~ckptstore.wiring.Parts`), held."""

    uri: str
    backend: Backend
    options: StoreOptions
    clock: Callable[[], float]
    writer: str
    _environment: Environment | None

    def _attach(self, parts: Parts) -> None:
        """Hold the engines ``parts`` names, each under the name the methods use."""
        self.writer, self.signer = parts.writer, parts.signer
        self._catalog: Catalog = parts.catalog
        self._remover: Remover = parts.remover
        self._committer: Committer = parts.committer
        self._resolver: Resolver = parts.resolver
        self._lease: WriterLease | None = parts.lease
        self._pruner: Pruner = parts.pruner
        self._maintenance: Maintenance = parts.maintenance
        self._replica: Replica = parts.replica
        self._async: AsyncSaver = parts.in_flight
        self._saver: Saver = parts.saver
        self._adopter: Adopter = parts.adopter
        self._local: LocalTier | None = parts.local
        self._tiers: Persister | None = parts.persister
        self._files = TieredFiles(self._resolver.tiers)

    @property
    def lease(self) -> WriterLease | None:
        """The writer lease this store takes at its first write (lease.py); ``None`` when
        opened with ``lease=False``. Its ``epoch`` and ``lost`` say where the writer stands."""
        return self._lease

    @property
    def resolver(self) -> Resolver:
        """Which step a load starts from, and the load's deadline (core/resolver.py): a face
        whose load is more than one call runs it all under ``with store.resolver.loading():``."""
        return self._resolver

    @property
    def replica(self) -> Replica:
        """This store as the destination of a replication (replication/destination.py)."""
        return self._replica

    @property
    def environment(self) -> Environment:
        """What this process writes into each manifest (versions, world size, git commit) and
        what a load compares a step's against (compat.py); read once, on first use."""
        if self._environment is None:
            self._environment = current_environment(world_size=world_size())
        return self._environment

    def _env(self) -> Environment:
        """:attr:`environment`, as the engines take it (a callable: read on first save)."""
        return self.environment

    @property
    def tiers(self) -> Persister | None:
        """With a local tier, what multi-rank faces join each step through (tiers/local.py)."""
        return self._tiers

    @property
    def node(self) -> str | None:
        """The node this process stages on: its local tier's node id (tiers/identity.py), the
        same for every process given that directory on this node's disk and different on
        every other node whatever its path; None without a local tier."""
        return self._local.identity.node if self._local is not None else None

    @property
    def shard_size(self) -> int:
        """Tensor bytes per safetensors file; a state's files are written in parallel."""
        return self._saver.shard_size

    @property
    def incremental(self) -> bool:
        """Copy files unchanged since the latest step instead of uploading them again."""
        return self._saver.incremental

    @incremental.setter
    def incremental(self, value: bool) -> None:
        self._saver.incremental = value

    def _writing(self, step: int, persist: bool = False) -> int:
        """Before a save: with a local tier, resume the copies a kill interrupted (once) and
        mark ``step`` due if asked."""
        if self._tiers is not None:
            self._tiers.start()
            if persist:
                self._tiers.force(step)
        return step

    def _catalog_of(self, info: CheckpointInfo) -> Catalog:
        """The catalog of the tier ``info`` was found in."""
        return (
            self._local.catalog
            if self._local is not None and info.tier == LOCAL
            else (self._catalog)
        )

    def _tiers_from(self, info: CheckpointInfo) -> tuple[Catalog, ...]:
        """The tiers to fetch ``info``'s files from: its own and the slower ones (a local
        copy that failed was left for the durable one, which must not lead back to it)."""
        tiers = self._resolver.tiers
        return tiers[tiers.index(self._catalog_of(info)) :]
