"""Which store a local directory belongs to, and which node's disk it is.

On a real cluster every node is given the same ``local="/nvme/ckpt/run"``, each on its own
disk, and a node runs one job after another. A path therefore names neither a node nor a run.
The first store that opens a local directory writes ``.ckptstore/tier.json`` there, create-only:

* ``store``: the durable store's URI. A store with another URI refuses the directory
  (:class:`ForeignTierError`, naming both), so one run's steps never leak into the next.
* ``node``: a random id, made once per directory. Two nodes at the same path get different
  ids (each wrote its own disk), so the node id, not the path, tells whether another process's
  files are on this disk: the coordinator reads only what its own node staged, and peer copies
  go to a rank whose node id differs.
* ``host``: the host name when the directory was claimed, for messages only.

A directory written before identities (committed steps, no ``tier.json``) is claimed only
where the store shows that it is its own: one of its steps is committed in the store as the
same commit (same writer and time: the persist copies the manifest as it is). Claiming it
blindly would let a run resume from another run's steps, the very leak identities stop;
refusing every such directory would strand each run's local tier at the upgrade. A
directory whose steps never reached the store is refused with the way to adopt them (copy
them into the store first); one without committed steps is claimed.
"""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass

from ckptstore.domain.layout import META_DIR
from ckptstore.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ForeignTierError,
    ObjectExistsError,
)
from ckptstore.protocol.catalog import Catalog

IDENTITY_NAME = f"{META_DIR}/tier.json"
_SCHEMA = 1


@dataclass(frozen=True)
class TierIdentity:
    """A local tier's identity (the module docstring)."""

    store: str
    """The URI of the durable store this directory serves."""
    node: str
    """This directory's id: the node (its disk), as the coordinator and peers know it."""
    host: str
    """The host that claimed the directory (for messages)."""

    def to_json(self) -> bytes:
        body = {"schema": _SCHEMA, "store": self.store, "node": self.node, "host": self.host}
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> TierIdentity:
        try:
            body = json.loads(data)
            if body.get("schema") != _SCHEMA:
                raise ValueError(f"schema {body.get('schema')!r}, expected {_SCHEMA}")
            return cls(str(body["store"]), str(body["node"]), str(body["host"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{where}: not a local tier identity ({e}); remove it if the directory holds "
                "nothing you need, and the next store to open it claims it anew"
            ) from e


def claim(local: Catalog, durable: Catalog) -> TierIdentity:
    """The identity of the local tier ``local`` in front of ``durable``: made for it if the
    directory has none yet (create-only: of two processes of one node claiming at once, one
    writes and both read the same; a directory from before identities only as the module
    docstring says), refused with :class:`ForeignTierError` if it serves another store."""
    backend, store = local.backend, durable.backend.uri
    where = f"{backend.uri.rstrip('/')}/{IDENTITY_NAME}"
    mine = TierIdentity(store, uuid.uuid4().hex[:16], socket.gethostname())
    try:
        if backend.stat(IDENTITY_NAME) is None:
            _check_unclaimed(local, durable)
            backend.create(IDENTITY_NAME, mine.to_json())
            return mine
    except ObjectExistsError:
        pass  # another process of this node claimed it first
    found = TierIdentity.from_json(backend.read(IDENTITY_NAME), where)
    if found.store != store:
        raise ForeignTierError(
            f"local tier {backend.uri} belongs to the store {found.store} (claimed by host "
            f"{found.host}), not to {store}: one local directory serves one store. Give this "
            f"run a directory of its own (for example local=.../<run name>), or, if every step "
            f"of {found.store} you need is in that store, remove {backend.uri}",
            uri=backend.uri,
        )
    return found


def _check_unclaimed(local: Catalog, durable: Catalog) -> None:
    """Refuse a directory from before identities whose committed steps the store does not
    hold as the same commit (the module docstring): they may be another run's."""
    held, _ = local.scan()
    if not held:
        return
    for manifest in sorted(held, key=lambda m: m.step, reverse=True):
        try:
            theirs = durable.read_manifest(manifest.step)
        except CheckpointError:
            continue  # not in the store (or unreadable there): no proof either way
        if (theirs.writer, theirs.created) == (manifest.writer, manifest.created):
            return
    steps = ", ".join(str(m.step) for m in sorted(held, key=lambda m: m.step))
    raise ForeignTierError(
        f"local tier {local.backend.uri} holds committed steps {steps} but records no store "
        f"(it was written before local tiers recorded theirs), and {durable.backend.uri} holds "
        "none of them: they may be another run's, which this store would resume from. Give "
        "this run a directory of its own (for example local=.../<run name>); if they are "
        f"this store's steps that never reached it, copy them there first (`ckptstore "
        f"replicate {local.backend.uri} {durable.backend.uri}`) and open it again; if nothing "
        f"there is needed, remove {local.backend.uri}",
        uri=local.backend.uri,
    )
