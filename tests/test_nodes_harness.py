"""The namespace node harness (harness/nodes.py) itself: each node has its own host name and
sees only its own directory at the common path, its ranks share it, and gloo works across
nodes."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.nodes import Cluster, this_node

pytestmark = pytest.mark.slow


def _look(rank: int, world: int, local: str) -> dict[str, Any]:
    Path(local, f"rank{rank}").write_text(socket.gethostname())
    dist.barrier()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return {
        "host": socket.gethostname(),
        "node": this_node().index,
        "seen": sorted(os.listdir(local)),
        "sum": int(total),
    }


def test_each_node_sees_only_its_own_disk_at_the_common_path(
    cluster: Callable[..., Cluster],
) -> None:
    nodes = cluster(3, ranks_per_node=2)
    seen = nodes.run(_look, nodes.local)
    for rank, r in enumerate(seen):
        node = rank // 2
        assert r["node"] == node
        assert r["host"] == f"ckpt-node{node}"
        assert r["seen"] == [f"rank{2 * node}", f"rank{2 * node + 1}"]  # its node's ranks only
        assert r["sum"] == sum(range(6))  # gloo across the nodes
    assert sorted(p.name for p in nodes.disk(1).iterdir()) == ["rank2", "rank3"]
    assert socket.gethostname() != "ckpt-node0"  # the host's name is untouched
    assert not os.listdir(nodes.local)  # nothing reached the host's common path


def _hang_on_node_1(rank: int, world: int) -> int:
    if this_node().index == 1:
        threading.Event().wait()  # never set
    return rank


def test_a_hung_rank_fails_the_test_with_its_stack(cluster: Callable[..., Cluster]) -> None:
    nodes = cluster(2, ranks_per_node=1)
    with pytest.raises(AssertionError) as failed:
        nodes.run(_hang_on_node_1, timeout=2)
    assert "rank 1 (node 1): no result" in str(failed.value)
    assert "_hang_on_node_1" in str(failed.value)  # where it hung
