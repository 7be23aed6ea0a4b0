"""Where verl placed each rank: read from its worker groups once they exist.

verl 0.9.1 decides which node runs which rank when it creates its worker groups, inside the
trainer's ``init_workers()``/``init()``, after any checkpoint callback was built. Its own
ordering rule (``sort_placement_group_by_node_ip``) is not what its first worker group gets:
``RayResourcePool.get_placement_groups`` stores the sorted list but returns the unsorted one on
its first call, so the rank -> node map cannot be predicted before placement. It is read
after: each worker group holds its Ray actors in rank order, and Ray's actor table names the
node of each. A resume that knows it pulls on each node only what that node's ranks load
(verl_resume.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckptstore.integrations.verl_steps import Placement

log = logging.getLogger(__name__)


def placement_of(groups: Mapping[str, Any]) -> Placement | None:
    """Role folder (``actor``, ``critic``) -> the Ray node id of rank 0, 1, ... of that
    role's worker group (a verl ``RayWorkerGroup``); None, with a warning, where it cannot
    be read (every node then pulls the whole step, as before)."""
    import ray

    placement: dict[str, list[str]] = {}
    for role, group in groups.items():
        workers = getattr(group, "workers", None) or getattr(group, "_workers", None)
        if not workers:
            log.warning(
                "ckptstore: verl's %s worker group lists no workers; every node pulls "
                "the whole step",
                role,
            )
            return None
        nodes = []
        for worker in workers:
            node = _node_of(ray, worker)
            if node is None:
                log.warning(
                    "ckptstore: Ray does not say where a %s worker runs; every node "
                    "pulls the whole step",
                    role,
                )
                return None
            nodes.append(node)
        placement[role] = nodes
    return placement


def _node_of(ray: Any, worker: Any) -> str | None:
    """The node id of a Ray actor, from the GCS's actor table (no dashboard needed)."""
    try:
        entry = ray._private.state.actors(actor_id=worker._actor_id.hex())
    except Exception as e:  # an API that moved: fall back to whole pulls
        log.warning("ckptstore: reading Ray's actor table failed: %s", e)
        return None
    address = entry.get("Address") if isinstance(entry, Mapping) else None
    node = address.get("NodeID") if isinstance(address, Mapping) else None
    return str(node) if node else None
