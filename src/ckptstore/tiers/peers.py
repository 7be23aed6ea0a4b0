"""Peer copies of a node's local tier, over torch.distributed (``replicas=1``).

A local tier (tiers/local.py) makes saves fast, but a node that is lost takes its local steps with
it; only the durable tier, which may lag by ``persist_every`` saves, is left. As Gemini and
NVIDIA's resiliency extension do, each rank of ``save_distributed`` also sends the files it
staged to a rank on another node, which writes them into its own node's local tier under the
same keys. A job that lost one node resumes from the copies its peers hold and reads from the
bucket only what no peer holds.

Peers are chosen by node, not by rank number: with several ranks per node, rank r + 1 is
usually on r's own node, and a lost node would take both copies. Every rank's node id (the
local tier's identity, tiers/identity.py: one per disk, whatever the path) is gathered once per
store; nodes are numbered in the order of their first rank, and the j-th rank of node i sends
to the j-th rank (modulo its count) of node i + 1 (placement.py). On one node no peer copy is
possible: the store says so once and sends nothing.

Both halves are collectives: every rank calls them at the same point, whatever happened
locally, and the files travel in chunks read from and written to disk as they go
(peer_stream.py), in bounded memory. A rank whose read fails still takes part in every
transfer, sending filler that its receiver drops, so the copies of the next step are paired as
before. What arrives is checked twice: the sender checks what it reads against the manifest,
and every later read checks it again (a peer's copy is never trusted for being a peer's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptstore.tiers.peer_stream import Outgoing, exchange
from ckptstore.tiers.placement import PeerLayout

if TYPE_CHECKING:
    from ckptstore.core.collectives import Collectives
    from ckptstore.domain.info import CheckpointInfo
    from ckptstore.domain.manifest import FileEntry
    from ckptstore.tiers.node_tier import NodeTier

log = logging.getLogger(__name__)


def peer_layout(comm: Collectives, node: NodeTier) -> PeerLayout:
    """The group's layout, gathered at the first peer copy of this store (every rank's first
    peer copy is the same collective) and kept."""
    if node.peer_layout is None:
        layout = PeerLayout(tuple(comm.all_gather(node.local.identity.node)))
        if layout.target(comm.rank) is None and comm.rank == 0:
            log.warning(
                "%s: all %d ranks are on one node (node id %s): no peer copy is "
                "possible, and a lost node resumes from the durable tier (replicas=1 "
                "needs ranks on two nodes or more)",
                node.local.uri,
                comm.size,
                layout.nodes[0],
            )
        node.peer_layout = layout
    return node.peer_layout


def send_to_peer(comm: Collectives, node: NodeTier, step: int, staged: Sequence[FileEntry]) -> None:
    """Save side: send the files this rank staged for ``step`` to its peer on another node,
    and write those its peers send into this node's local tier. Every rank calls it."""
    if comm.size == 1:
        return
    target = peer_layout(comm, node).target(comm.rank)
    if target is None:  # every rank knows it: none takes part
        return
    backend = node.local.catalog.backend
    got = exchange(comm, backend, {target: [Outgoing(step, e) for e in staged]})
    for source, keys in got.missed.items():
        log.warning(
            "%s: %d of rank %d's files of step %d did not arrive (%s...): this node "
            "holds no copy of them, and if rank %d's node is lost, they are read from "
            "the durable tier, or an older step is loaded",
            node.local.uri,
            len(keys),
            source,
            step,
            keys[0],
            source,
        )


def recover_from_peer(
    comm: Collectives, node: NodeTier, info: CheckpointInfo, paths: Sequence[str]
) -> int:
    """Load side: the files of ``paths`` (this rank's part of ``info``'s step) that this
    node's local tier lacks or holds with another size (one listing) are asked of the ranks
    whose node holds them, and written into this node's local tier. A holder sends only
    copies that pass their check. Every rank calls it; returns how many files this rank
    recovered."""
    if comm.size == 1:
        return 0
    local = node.local.catalog
    step = info.step
    here = local.payload_sizes(step)

    def held(path: str) -> bool:
        entry = info.manifest.file(path)
        return here.get(entry.key(step)) == entry.size

    wanted = [p for p in paths if not held(p)]
    asks: list[list[str]] = comm.all_gather(wanted)
    if not any(asks):  # every rank knows it: nothing to exchange
        return 0
    asked = sorted({p for paths_of_rank in asks for p in paths_of_rank})
    holders: list[list[str]] = comm.all_gather([p for p in asked if held(p)])
    have = [set(paths_held) for paths_held in holders]
    outgoing: dict[int, list[Outgoing]] = {}
    for asker, paths_asked in enumerate(asks):
        for path in paths_asked:
            can = [r for r, paths_held in enumerate(have) if r != asker and path in paths_held]
            if can and can[asker % len(can)] == comm.rank:  # spread the askers over holders
                outgoing.setdefault(asker, []).append(Outgoing(step, info.manifest.file(path)))
    got = exchange(comm, local.backend, outgoing)
    if wanted:
        log.warning(
            "%s: %d of %d files of step %d were missing here; %d came from the "
            "peers holding their copies; any other is read from the durable tier",
            local.backend.uri,
            len(wanted),
            len(paths),
            step,
            got.count(),
        )
    return got.count()
