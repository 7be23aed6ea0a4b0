"""How one store's engines are built and connected: each gets what it uses, nothing builds its
siblings, and the store (store.py) only holds them.

::

    backend ── Catalog (reads) ── Resolver (which step to load)
           └── Remover (tombstone-first deletes) ── Committer (the commit protocol)
           └── WriterLease (one writer at a time; fences latest on takeover)
    Pins, Pruner (retention carried out), Maintenance (verify, pins, delete)
    Replica (the store as a replication's destination: its committer, remover, pruner, lease)
    AsyncSaver (the save in flight) ── Saver (the coordinated save's store side) ── Adopter

With ``local=``, a LocalTier (the same engines over a local directory, no lease of its own) and
a second Saver that commits there; the first one becomes the durable tier's, which the
Persister commits due steps through (tiers/local.py). Saves go to the front saver; the
Resolver and every many-step operation (Maintenance: one Tier per tier) see both.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from ckptstore.backends.base import Backend
from ckptstore.backends.registry import open_backend
from ckptstore.config import key_bytes, signing_key_from_env
from ckptstore.core.adoption import Adopter
from ckptstore.core.async_saving import AsyncSaver
from ckptstore.core.maintenance import Maintenance, Tier
from ckptstore.core.observer import SaveObserver
from ckptstore.core.resolver import DURABLE, LOCAL, Resolver
from ckptstore.core.saving import Saver
from ckptstore.domain.manifest import Environment
from ckptstore.domain.retention import RetentionPolicy
from ckptstore.domain.signing import Signer
from ckptstore.options import StoreOptions
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.lease import WriterLease
from ckptstore.protocol.pruning import Pins, Pruner
from ckptstore.protocol.removal import Remover
from ckptstore.replication.destination import Replica
from ckptstore.tiers.identity import claim
from ckptstore.tiers.local import DEFAULT_LOCAL_KEEP_LAST, LocalTier, TierPins
from ckptstore.tiers.persister import Persister


@dataclass(frozen=True)
class Parts:
    """The engines of one store."""

    writer: str
    """This writer's id, ``host:pid:random``: in manifests, the lease and tombstones."""
    signer: Signer | None
    catalog: Catalog
    remover: Remover
    committer: Committer
    resolver: Resolver
    lease: WriterLease | None
    pruner: Pruner
    maintenance: Maintenance
    replica: Replica
    """This store as a replication's destination (replication/destination.py)."""
    in_flight: AsyncSaver
    saver: Saver
    """Where saves commit: the local tier's saver in a tiered store, else the store's."""
    adopter: Adopter
    local: LocalTier | None = None
    persister: Persister | None = None


def assemble(
    backend: Backend,
    options: StoreOptions,
    *,
    clock: Callable[[], float],
    environment: Callable[[], Environment],
    observer: SaveObserver | None,
    writer: str | None = None,
) -> Parts:
    """Build and connect the engines of a store over ``backend``, writing as ``writer`` (a
    new id unless given: a tiered store's local tier shares its store's, pointer.py)."""
    writer = writer or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    signer = _signer(options)
    catalog = Catalog(backend, signer=signer)
    local = _local_tier(options, writer, signer, clock, catalog)
    remover = Remover(backend, writer=writer, catalog=catalog, clock=clock)
    faster = (local.catalog,) if local is not None else ()
    committer = Committer(catalog, remover, writer=writer, clock=clock, faster_tiers=faster)
    lease = _lease(backend, writer, options, clock, committer) if options.lease else None
    hold = lease.hold if lease is not None else _no_lease
    pins = Pins(backend)
    pruner = Pruner(catalog, remover, options.policy, pins)
    resolver = Resolver(catalog, faster=faster, load_timeout=options.load_timeout)
    replica = Replica(catalog, committer, remover, pruner, hold, options.save_timeout)
    in_flight = AsyncSaver()
    saver = Saver(
        catalog,
        committer,
        remover,
        lease,
        pruner.after_save,
        environment,
        clock,
        options.incremental,
        options.shard_size,
        in_flight.drain if local is None else _nothing,
        observer if local is None else None,
        options.save_timeout,
    )
    front, persister = _front(local, saver, options, environment, clock, lease, in_flight, observer)
    durable = Tier(DURABLE, catalog, committer, remover, pins, pruner)
    maintenance = _maintenance(resolver, durable, local, persister, clock)
    return Parts(
        writer,
        signer,
        catalog,
        remover,
        committer,
        resolver,
        lease,
        pruner,
        maintenance,
        replica,
        in_flight,
        front,
        Adopter(saver),
        local,
        persister,
    )


def _signer(options: StoreOptions) -> Signer | None:
    """The signer of manifests: the ``signing_key`` option, else the environment's key."""
    key = key_bytes(options.signing_key) if options.signing_key is not None else None
    key = key if key is not None else signing_key_from_env()
    return Signer(key) if key is not None else None


def _lease(
    backend: Backend,
    writer: str,
    options: StoreOptions,
    clock: Callable[[], float],
    committer: Committer,
) -> WriterLease:
    """The writer lease; taking it from another holder stamps its epoch into ``latest``."""
    return WriterLease(
        backend,
        writer,
        ttl=options.lease_ttl,
        takeover=options.takeover,
        clock=clock,
        on_takeover=committer.stamp_latest,
    )


def _front(
    local: LocalTier | None,
    saver: Saver,
    options: StoreOptions,
    environment: Callable[[], Environment],
    clock: Callable[[], float],
    lease: WriterLease | None,
    in_flight: AsyncSaver,
    observer: SaveObserver | None,
) -> tuple[Saver, Persister | None]:
    """Where saves commit: ``saver`` itself, or in a tiered store a saver of the local tier,
    whose steps the persister copies to the store through ``saver`` (tiers/persister.py)."""
    if local is None:
        return saver, None
    persister = Persister(local, saver, options.persist_policy, observer)
    front = Saver(
        local.catalog,
        local.committer,
        local.remover,
        lease,
        persister.retain_local,
        environment,
        clock,
        options.incremental,
        options.shard_size,
        in_flight.drain,
        observer,
        options.save_timeout,
        tiers=persister,
        node=local.identity.node,
    )
    return front, persister


def _maintenance(
    resolver: Resolver,
    durable: Tier,
    local: LocalTier | None,
    persister: Persister | None,
    clock: Callable[[], float],
) -> Maintenance:
    """Many-step operations over the store's tiers, the local one first where there is one;
    a local step not yet copied stays pinned there (core/maintenance.py)."""
    tiers: tuple[Tier, ...] = (durable,)
    if local is not None:
        tiers = (
            Tier(
                LOCAL,
                local.catalog,
                local.committer,
                local.remover,
                local.pins,
                local.pruner,
                local.retention,
            ),
            durable,
        )
    maintenance = Maintenance(resolver, tiers, clock)
    if persister is not None:
        maintenance = replace(maintenance, forget=persister.drop, pending=persister.pending)
    return maintenance


def _local_tier(
    options: StoreOptions,
    writer: str,
    signer: Signer | None,
    clock: Callable[[], float],
    durable: Catalog,
) -> LocalTier | None:
    """The engines of the local tier, when the store has one: its own retention
    (``local_keep_last``), the store's writer id and signing key, no lease of its own, and
    the directory claimed for the ``durable`` store (identity.py: another store's is
    refused)."""
    if options.local is None:
        return None
    backend = open_backend(options.local, {})
    catalog = Catalog(backend, signer=signer)
    identity = claim(catalog, durable)
    remover = Remover(backend, writer=writer, catalog=catalog, clock=clock)
    committer = Committer(catalog, remover, writer=writer, clock=clock)
    pins = TierPins(backend)
    keep = RetentionPolicy(options.local_keep_last or DEFAULT_LOCAL_KEEP_LAST)
    pruner = Pruner(catalog, remover, keep, pins)
    return LocalTier(catalog, committer, remover, pins, pruner, identity)


def _nothing() -> None:
    """The durable tier's saver waits for no save in flight: saves go to the local tier."""


def _no_lease() -> int:
    return 0
