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
"""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.domain.layout import META_DIR
from ckptstore.errors import CorruptCheckpointError, ForeignTierError, ObjectExistsError

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


def claim(backend: Backend, store: str) -> TierIdentity:
    """The identity of the local tier at ``backend``: made for ``store`` if the directory has
    none yet (create-only: of two processes of one node claiming at once, one writes and both
    read the same), refused with :class:`ForeignTierError` if it serves another store."""
    where = f"{backend.uri.rstrip('/')}/{IDENTITY_NAME}"
    mine = TierIdentity(store, uuid.uuid4().hex[:16], socket.gethostname())
    try:
        backend.create(IDENTITY_NAME, mine.to_json())
        return mine
    except ObjectExistsError:
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
