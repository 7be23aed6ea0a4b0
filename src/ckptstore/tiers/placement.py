"""Where each rank's peer copies go (peers.py): the node of every rank of a group.

A layout is plain data, gathered once per store and kept by the node's tier
(node_tier.py); the peer copies (peers.py) read it. It lives below both, so that neither
imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerLayout:
    """Which node each rank of a group is on, and so where its copies go."""

    nodes: tuple[str, ...]
    """The node id of each group rank."""

    def groups(self) -> list[list[int]]:
        """The ranks of each node, nodes in the order of their first rank."""
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(rank)
        return list(by_node.values())

    def target(self, rank: int) -> int | None:
        """The rank that holds ``rank``'s copies: on the next node, the rank at the same
        position (modulo that node's count); None if every rank is on one node."""
        groups = self.groups()
        if len(groups) < 2:
            return None
        here = next(i for i, ranks in enumerate(groups) if rank in ranks)
        there = groups[(here + 1) % len(groups)]
        return there[groups[here].index(rank) % len(there)]
