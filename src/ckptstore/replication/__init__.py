"""Replication: committed steps mirrored into other stores (buckets, regions, clouds).

replicator.py copies the steps a destination lacks, resumably; destination.py is the write side
a destination commits through under its own rules; follow.py waits for a newer step
(``replicate --follow``, ``ckptstore wait``) (docs/replication.md).
"""

from ckptstore.replication.replicator import (
    Replicable,
    ReplicationReport,
    Replicator,
    follow,
    replicate,
)

__all__ = ["Replicable", "ReplicationReport", "Replicator", "follow", "replicate"]
