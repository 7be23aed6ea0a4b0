"""Tiers: a fast local tier in front of the durable store, persistence and peer copies.

local.py is the local tier and the reads that take each file from the fastest tier holding it;
persister.py commits a local step in the durable tier by the same coordinated sequence;
node_tier.py is one node's side of a multi-process save; peers.py copies a node's staged files
to a peer so a lost node recovers without the bucket (docs/tiers.md).
"""

from ckptstore.tiers.local import LocalTier, PersistPolicy, TieredFiles, TierPins, tier_listing

__all__ = ["LocalTier", "PersistPolicy", "TierPins", "TieredFiles", "tier_listing"]
