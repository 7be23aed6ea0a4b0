"""Where the modules of the flat layout went, so that code written against it still imports.

Until 0.x the package was flat (``ckptstore.commit``, ``ckptstore.distributed``...); its modules
now live in layer folders (docs/design.md). Importing an old name gives the module at its new
place, the very same object (a monkeypatch through either name patches both), with a
DeprecationWarning naming the new one. ``ckptstore.tiers`` and ``ckptstore.replication`` are
packages now that re-export what the modules of those names held.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "ckptstore.adoption": "ckptstore.core.adoption",
    "ckptstore.async_saving": "ckptstore.core.async_saving",
    "ckptstore.background": "ckptstore.data.background",
    "ckptstore.cas": "ckptstore.protocol.cas",
    "ckptstore.catalog": "ckptstore.protocol.catalog",
    "ckptstore.checksum": "ckptstore.domain.checksum",
    "ckptstore.collectives": "ckptstore.core.collectives",
    "ckptstore.commit": "ckptstore.protocol.commit",
    "ckptstore.compat": "ckptstore.domain.compat",
    "ckptstore.coordination": "ckptstore.core.coordination",
    "ckptstore.copying": "ckptstore.data.copying",
    "ckptstore.distributed": "ckptstore.integrations.distributed",
    "ckptstore.environment": "ckptstore.domain.environment",
    "ckptstore.follow": "ckptstore.replication.follow",
    "ckptstore.garbage": "ckptstore.protocol.garbage",
    "ckptstore.info": "ckptstore.domain.info",
    "ckptstore.layout": "ckptstore.domain.layout",
    "ckptstore.lease": "ckptstore.protocol.lease",
    "ckptstore.lease_contest": "ckptstore.protocol.lease_contest",
    "ckptstore.lease_record": "ckptstore.protocol.lease_record",
    "ckptstore.loading": "ckptstore.core.loading",
    "ckptstore.maintenance": "ckptstore.core.maintenance",
    "ckptstore.manifest": "ckptstore.domain.manifest",
    "ckptstore.metrics": "ckptstore.integrations.prometheus",
    "ckptstore.node_tier": "ckptstore.tiers.node_tier",
    "ckptstore.observer": "ckptstore.core.observer",
    "ckptstore.payload": "ckptstore.data.payload",
    "ckptstore.peers": "ckptstore.tiers.peers",
    "ckptstore.persister": "ckptstore.tiers.persister",
    "ckptstore.plan": "ckptstore.domain.plan",
    "ckptstore.pointer": "ckptstore.protocol.pointer",
    "ckptstore.pruning": "ckptstore.protocol.pruning",
    "ckptstore.removal": "ckptstore.protocol.removal",
    "ckptstore.replica": "ckptstore.replication.destination",
    "ckptstore.resolver": "ckptstore.core.resolver",
    "ckptstore.retention": "ckptstore.domain.retention",
    "ckptstore.saving": "ckptstore.core.saving",
    "ckptstore.serialize": "ckptstore.data.serialize",
    "ckptstore.signing": "ckptstore.domain.signing",
    "ckptstore.snapshot": "ckptstore.data.snapshot",
    "ckptstore.state_selection": "ckptstore.domain.state_selection",
    "ckptstore.transfer": "ckptstore.data.transfer",
    "ckptstore.verified": "ckptstore.data.verified",
}
"""Old module name -> where it lives now."""


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name to the module at its new place."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old name goes in 1.0)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the module's __spec__ to the old name's; it keeps its own.
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
