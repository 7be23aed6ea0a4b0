"""Nodes of a cluster on one machine: each node a process in mount and UTS namespaces of its
own, with its own host name and its own directory bind-mounted at one common path.

On a real cluster every node is given the same ``local="/nvme/ckpt/run"``, each on its own
disk. Gloo processes with a directory each (``node0/``, ``node1/``) cannot show what goes
wrong when the path is the same: here every node sees *its* directory at
:attr:`Cluster.local`, and no node sees another's files there. The network namespace is
shared, so gloo over 127.0.0.1 and the moto server work across nodes as they do across
processes.

``Cluster.run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of every node
(``ranks_per_node`` gloo ranks each; node ``k`` holds ranks ``k * ranks_per_node ...``), as
tests/ranks.py's ``run_ranks`` does, and returns the ranks' values in rank order. Inside a
rank, :func:`this_node` says which node it is on. A node is forked from ranks.py's fork
server (torch imported once), enters its namespaces with ``unshare(2)``, mounts, and forks
its ranks, which share its namespaces: a launch costs about what ``run_ranks`` costs.

Where namespaces are refused (not root, no CAP_SYS_ADMIN, a seccomp filter), the
``cluster`` fixture (conftest.py) skips the test and says why (:func:`refused`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranks import PRELOAD, _child

COMMON_ROOT = Path("/tmp/ckpt-node-common")
"""Under it, one directory per cluster: the path every node passes as ``local=``."""

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


@dataclass(frozen=True)
class Node:
    """Where a rank runs: its node's index, host name and ranks."""

    index: int
    host: str
    ranks: tuple[int, ...]
    local: str
    """The common path, at which this node sees its own directory."""


_THIS: Node | None = None


def this_node() -> Node:
    """The node of the calling rank (inside :meth:`Cluster.run`)."""
    if _THIS is None:
        raise RuntimeError("this_node() is only known inside a rank of Cluster.run")
    return _THIS


@functools.cache
def refused() -> str | None:
    """Why this machine cannot run nodes in namespaces, or None if it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--uts", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare --mount --uts` could not run: {e}"
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit code {done.returncode}"
        return f"mount/UTS namespaces are refused here (needs root or CAP_SYS_ADMIN): {why}"
    return None


class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks each, all at :attr:`local` (module doc)."""

    def __init__(self, root: Path, nodes: int, ranks_per_node: int = 2) -> None:
        self.root = root
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.common = COMMON_ROOT / uuid.uuid4().hex[:12]
        self.common.mkdir(parents=True)
        self._runs = 0

    @property
    def local(self) -> str:
        """The one path every node passes as ``local=`` (each sees its own disk there)."""
        return str(self.common)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def disk(self, node: int) -> Path:
        """Node ``node``'s own directory, as this (the host's) process sees it: to look at
        what the node wrote, or to wipe it (a replaced node); it is made again at the next
        run."""
        return self.root / "disks" / f"node{node}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 150.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank of every node; the values in rank
        order. A rank that raises or hangs fails the test with what it said."""
        self._runs += 1
        tmp = self.root / f"run{self._runs}"
        tmp.mkdir(parents=True)
        for k in range(self.nodes):
            self.disk(k).mkdir(parents=True, exist_ok=True)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # host names resolve to nothing
        init = f"file://{tmp / 'rendezvous'}"
        deadline = time.monotonic() + timeout
        procs = [
            ctx.Process(
                target=_node,
                args=(
                    fn,
                    self._node(k),
                    self.disk(k),
                    self.world_size,
                    init,
                    tmp,
                    env,
                    args,
                    deadline,
                ),
                daemon=False,  # a node forks its ranks
            )
            for k in range(self.nodes)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()) + 10)
        hung = [k for k, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results, errors = [], []
        for rank in range(self.world_size):
            out = tmp / f"rank{rank}.pkl"
            if not out.exists():
                stacks = tmp / f"rank{rank}.stacks"
                dump = stacks.read_text()[-4000:] if stacks.exists() else ""
                errors.append(f"rank {rank} (node {self.node_of(rank)}): no result\n{dump}")
                continue
            status, value = pickle.loads(out.read_bytes())
            if status == "error":
                errors.append(f"rank {rank} (node {self.node_of(rank)}) raised:\n{value}")
            results.append(value)
        for k in range(self.nodes):
            failed = tmp / f"node{k}.err"
            if failed.exists():
                errors.append(f"node {k}: {failed.read_text()}")
        if hung or errors:
            raise AssertionError(f"nodes {hung} hung after {timeout} s; " + "\n".join(errors))
        return results

    def close(self) -> None:
        """Remove the common path (empty on the host: each node mounted over it privately)."""
        with_files = list(self.common.iterdir()) if self.common.exists() else []
        if with_files:
            raise AssertionError(f"{self.common}: a node wrote on the host's disk: {with_files}")
        self.common.rmdir()

    def _node(self, k: int) -> Node:
        first = k * self.ranks_per_node
        ranks = tuple(range(first, first + self.ranks_per_node))
        return Node(k, f"ckpt-node{k}", ranks, self.local)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _node(
    fn: Callable[..., Any],
    node: Node,
    disk: Path,
    world_size: int,
    init: str,
    tmp: Path,
    env: dict[str, str],
    args: tuple[Any, ...],
    deadline: float,
) -> None:
    """A node: enter namespaces of its own, mount its disk at the common path, run its
    ranks (forked: they share the namespaces) and wait for them."""
    global _THIS
    try:
        _enter(node, disk)
    except OSError as e:
        (tmp / f"node{node.index}.err").write_text(f"could not enter its namespaces: {e}")
        return
    _THIS = node
    fork = multiprocessing.get_context("fork")
    ranks = [
        fork.Process(target=_child, args=(fn, rank, world_size, init, tmp, env, args), daemon=True)
        for rank in node.ranks
    ]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [proc for proc in ranks if proc.is_alive()]
    for proc in hung:  # where it hangs, for the test's error (rank{r}.stacks)
        if proc.pid is not None:
            os.kill(proc.pid, signal.SIGUSR1)
    if hung:
        time.sleep(1.0)
    for proc in hung:
        proc.kill()
        proc.join()


def _enter(node: Node, disk: Path) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS), "unshare(CLONE_NEWNS | CLONE_NEWUTS)")
    # nothing mounted here propagates to the host or to the other nodes
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    check(
        libc.mount(str(disk).encode(), node.local.encode(), None, _MS_BIND, None),
        f"mount --bind {disk} {node.local}",
    )
    socket.sethostname(node.host)
