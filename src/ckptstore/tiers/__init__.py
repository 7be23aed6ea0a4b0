"""Tiers: a fast local tier in front of the durable store, persistence and peer copies.

local.py is the local tier and the reads that take each file from the fastest tier holding it;
persister.py decides which local steps are due and closes, persist_queue.py commits them in
the durable tier one at a time in the background, waiting out an outage, and durable_commit.py
is the commit of one step there by the same coordinated sequence; node_tier.py is one node's
side of a multi-process save; peers.py copies a node's staged files to a peer (on the node
placement.py picks) so a lost node recovers without the bucket (docs/tiers.md).
"""

from ckptstore.tiers.local import LocalTier, PersistPolicy, TieredFiles, TierPins, tier_listing

__all__ = ["LocalTier", "PersistPolicy", "TierPins", "TieredFiles", "tier_listing"]
