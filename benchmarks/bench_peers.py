"""Peer copies (``replicas=1``): a wiped node's recovery from its peer against raw gloo, and
the memory a save with peer copies costs (README "Tiers and replication").

Two gloo ranks on this machine stand for two nodes, each with a local tier of its own (a
directory per node), in front of a durable store that stays out of the way (a directory, with
``persist_every`` high enough that nothing is copied there while timing). Each rank holds
``--size-mb`` of float32 tensors.

* raw gloo send/recv: the same bytes, in memory, from rank 0 to rank 1 (one ``send`` of the
  whole buffer, which gloo moves as fast as it can): the line rate of this machine's loopback;
* disk: one write of the same bytes and its fsync, as a local tier writes a file (the other
  bound of a copy from disk to disk);
* peer recovery: node 1's local tier is wiped and node 0's page cache dropped
  (``posix_fadvise(DONTNEED)``); a new job runs ``load_distributed``, and node 1 takes its
  files from node 0 (peers.py: read from node 0's disk, streamed in chunks, written to node
  1's); the row times that recovery alone (from the ``load_distributed`` call until node 1
  holds its files), and the resume row the whole ``load_distributed`` (reading back, checking
  and decoding the state on both ranks; the slowest rank);
* peak RSS growth: each rank's peak resident memory after a save (``save_distributed``, and
  the peer copies it starts, drained) over its peak before it, in a fresh process pair per
  row, with ``replicas=0`` and ``replicas=1``.

``python benchmarks/bench_peers.py --size-mb 64 --runs 1`` is quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_tiers import MiB, drop_cache, state_of

from ckptstore import CheckpointStore
from ckptstore.integrations.distributed import load_distributed, save_distributed
from ckptstore.tiers import peers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ranks import run_ranks  # tests/ranks.py: gloo ranks forked from a server

STEP = 1


def open_store(root: Path, rank: int, replicas: int) -> CheckpointStore:
    """A rank's store: its node's local tier, a durable directory that nothing reaches."""
    return CheckpointStore(str(root / "durable"), lease=rank == 0, local=str(root / f"node{rank}"),
                           persist_every=1000, replicas=replicas)  # fmt: skip


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _raw(rank: int, world: int, size_mb: int) -> float:
    """Seconds of one gloo send of ``size_mb`` MiB from rank 0 to rank 1."""
    data = torch.empty(size_mb * MiB, dtype=torch.uint8)
    data.fill_(rank)
    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        dist.send(data, 1)
    else:
        dist.recv(data, 0)
    dist.barrier()
    return time.perf_counter() - started


def _save(rank: int, world: int, size_mb: int, root: Path, replicas: int) -> dict[str, float]:
    """Save one step; the growth of the peak RSS over the save and its peer copies."""
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    state = state_of(size_mb, rank)
    store = open_store(root, rank, replicas)
    dist.barrier()
    before = peak_mib()
    started = time.perf_counter()
    save_distributed(store, STEP, state)
    assert store.tiers is not None
    store.tiers.node.drain()  # the peer copies are done
    seconds = time.perf_counter() - started
    growth = peak_mib() - before
    dist.barrier()
    return {"growth": growth, "seconds": seconds}


def _resume(rank: int, world: int, size_mb: int, root: Path) -> dict[str, float]:
    """Load the step with node 1 wiped: the recovery's and the whole load's seconds."""
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    recovered: list[float] = []
    real = peers.recover_from_peer

    def timed(*args: Any) -> int:
        count = real(*args)
        recovered.append(time.perf_counter())
        return count

    peers.recover_from_peer = timed  # the tiers call it there: the recovery alone
    store = open_store(root, rank, 1)
    dist.barrier()
    started = time.perf_counter()
    state = load_distributed(store)
    seconds = time.perf_counter() - started
    assert store.last_loaded is not None and store.last_loaded.step == STEP
    expected = state_of(size_mb, rank)
    assert all(torch.equal(state[k], expected[k]) for k in expected), rank
    return {"recovery": recovered[0] - started, "resume": seconds}


def disk_seconds(root: Path, size_mb: int) -> float:
    """Seconds to write ``size_mb`` MiB into a new file under ``root`` and fsync it."""
    data = memoryview(torch.randint(0, 255, (size_mb * MiB,), dtype=torch.uint8).numpy())
    path = root / "disk.bin"
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="state per rank, MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rank-timeout", type=float, default=600.0, help="per launch, seconds")
    args = parser.parse_args()
    size, timeout = args.size_mb, args.rank_timeout
    seconds: dict[str, list[float]] = {}
    growth: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            base = Path(tmp) / f"run{run}"
            raw = run_ranks(_raw, 2, base / "raw", size, timeout=timeout)
            seconds.setdefault("raw", []).append(max(raw))
            seconds.setdefault("disk", []).append(disk_seconds(base, size))
            for replicas in (0, 1):
                root = base / f"replicas{replicas}"
                saved = run_ranks(_save, 2, base / f"save{replicas}", size, root, replicas,
                                  timeout=timeout)  # fmt: skip
                growth.setdefault(f"replicas={replicas}", []).append(
                    max(r["growth"] for r in saved)
                )
            root = base / "replicas1"
            shutil.rmtree(root / "node1")  # node 1 is replaced
            drop_cache(root / "node0")
            resumed = run_ranks(_resume, 2, base / "resume", size, root, timeout=timeout)
            seconds.setdefault("recovery", []).append(max(r["recovery"] for r in resumed))
            seconds.setdefault("resume", []).append(max(r["resume"] for r in resumed))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)

    mb = size * MiB / 1e6
    print(f"\n2 nodes (gloo ranks) x {size} MiB per rank, median of {args.runs} runs\n")
    print("| row | seconds | runs (s) | MB/s |")
    print("|---|---:|---:|---:|")
    names = {
        "raw": "raw gloo send/recv, the same bytes, memory to memory",
        "disk": "disk: write + fsync of the same bytes",
        "recovery": "peer recovery of node 1, wiped (disk to disk)",
        "resume": "load_distributed, node 1 wiped (recovery, then every rank reads and checks)",
    }
    for key, row in names.items():
        values = seconds[key]
        median = statistics.median(values)
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"| {row} | {median:.3f} | {spread} | {mb / median:.0f} |")
    print("\n| save of one step | peak RSS growth, MiB (the larger rank) | runs (MiB) |")
    print("|---|---:|---:|")
    for key, values in growth.items():
        spread = f"{min(values):.0f}-{max(values):.0f}"
        print(f"| {key} | {statistics.median(values):.0f} | {spread} |")
    raw_s, rec_s = statistics.median(seconds["raw"]), statistics.median(seconds["recovery"])
    disk_s = statistics.median(seconds["disk"])
    extra = statistics.median(growth["replicas=1"]) - statistics.median(growth["replicas=0"])
    print(
        f"\nratios from this run: peer recovery takes {rec_s / raw_s:.2f}x the time of raw gloo "
        f"send/recv of the same bytes ({mb / rec_s:.0f} vs {mb / raw_s:.0f} MB/s), "
        f"{rec_s / disk_s:.2f}x that of writing them to this disk ({mb / disk_s:.0f} MB/s); "
        f"a save with replicas=1 grows the peak RSS by {extra:.0f} MiB more than with replicas=0 "
        f"({extra / size:.2f}x the shard of {size} MiB)",
        flush=True,
    )


if __name__ == "__main__":
    main()
