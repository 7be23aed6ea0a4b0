"""Tiered multi-rank saves against plain ones: W gloo ranks, each a "node" with a local tier of
its own, in front of one bucket (README "Tiers and replication").

Each rank holds a state of ``--size-mb`` (float32 tensors; a fresh one for every save, so
incremental saves copy nothing). Every run opens fresh stores, saves step 1 into each (untimed:
clients, the lease, the first listing), then times step 2, the ranks starting together after a
barrier:

* blocked: until ``save_distributed`` returned on every rank (the slowest rank), into a plain
  local store (a directory all ranks share), a plain S3 store, and tiered stores (``local=`` a
  directory per node, ``persist_every=1``) without and with peer copies (``replicas=1``);
* time to durable: from the call until ``store.wait()`` returns on rank 0, whose background
  copy commits the step in the bucket once every node persisted its share;
* resume of a lost node: node 1's local directory is deleted, the other nodes' page cache
  dropped (``posix_fadvise(DONTNEED)``), and a new job (fresh processes) runs
  ``load_distributed`` (the slowest rank); the bucket is wrapped in a counter of GETs and bytes
  of payload (every file but manifests, pointers, attempt markers and ``.ckptstore/``), summed
  over the ranks. With ``replicas=1`` node 1 takes its files from its peer (rank 0 holds its
  copies); with ``replicas=0`` it reads its share from the bucket (step 2 is durable); a plain
  S3 store reads every rank's share from the bucket.

MB/s is all ranks' bytes (W x ``--size-mb`` MiB, in 10^6 bytes) over the row's seconds, median
of ``--runs`` (their range beside it; GETs and bytes are medians too). S3 is moto on
127.0.0.1 (``ckptstore.testing.s3server``), slower than AWS and sharing the machine's cores
with the ranks: ratios matter more than seconds.
``python benchmarks/bench_tiers_ranks.py --size-mb 16 --runs 1`` is quick.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_tiers import MiB, drop_cache, state_of

from ckptstore import CheckpointStore
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.domain import layout
from ckptstore.integrations.distributed import load_distributed, save_distributed
from ckptstore.testing.s3server import LocalS3Server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ranks import run_ranks  # tests/ranks.py: gloo ranks forked from a server

BUCKET = "bench"
WARMUP, TIMED = 1, 2  # the steps every store saves: an untimed one, then the timed one


class PayloadCounter(BackendProxy):
    """The bucket, counting the GETs of payload files and the bytes they returned."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gets = 0
        self.bytes = 0

    def _count(self, path: str, size: int) -> None:
        meta = (
            path == layout.LATEST_NAME
            or path.startswith(layout.META_DIR + "/")
            or path.endswith(("/" + layout.MANIFEST_NAME, "/" + layout.ATTEMPT_MARKER))
        )
        if not meta:
            self.gets += 1
            self.bytes += size

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = super().read(path, start, end)
        self._count(path, len(data))
        return data

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        data, version = super().read_versioned(path)
        self._count(path, len(data))
        return data, version

    def read_into(self, path: str, out: memoryview) -> int:
        size = super().read_into(path, out)
        self._count(path, size)
        return size

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        size = super().read_into_chunks(path, out, on_chunk)
        self._count(path, size)
        return size


def seed_of(run: int, step: int, rank: int) -> int:
    return run * 1000 + step * 10 + rank


def node_dir(root: Path, name: str, rank: int) -> Path:
    """One node's local tier: a directory of its own, as on a machine of its own."""
    return root / name / f"node{rank}"


def open_store(
    kind: str, rank: int, run: int, root: Path, options: dict[str, Any], **extra: Any
) -> CheckpointStore:
    """A rank's store of ``kind``: ``local`` (a plain store in a shared directory), ``s3`` (a
    plain S3 store), ``tier0`` / ``tier1`` (a local tier per node, ``replicas`` 0 / 1)."""
    lease = rank == 0  # only the coordinator takes the writer lease
    if kind == "local":
        return CheckpointStore(str(root / "plain-local"), lease=lease)
    uri = f"s3://{BUCKET}/run{run}-{kind}"
    if kind == "s3":
        return CheckpointStore(uri, storage_options=options, lease=lease, **extra)
    local = str(node_dir(root, kind, rank))
    replicas = 1 if kind == "tier1" else 0
    return CheckpointStore(uri, storage_options=options, lease=lease, local=local,
                           persist_every=1, replicas=replicas, **extra)  # fmt: skip


def _saves(
    rank: int, world: int, run: int, size_mb: int, root: Path, options: dict[str, Any]
) -> dict[str, float]:
    """In every rank: each kind of store, a warm-up save, then the timed one."""
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    out: dict[str, float] = {}
    for kind in ("local", "s3", "tier0", "tier1"):
        store = open_store(kind, rank, run, root, options)
        save_distributed(store, WARMUP, state_of(size_mb, seed_of(run, WARMUP, rank)))
        store.wait()
        state = state_of(size_mb, seed_of(run, TIMED, rank))
        dist.barrier()
        started = time.perf_counter()
        save_distributed(store, TIMED, state)
        out[f"{kind} blocked"] = time.perf_counter() - started
        store.wait()  # on rank 0: the step is committed in the bucket
        out[f"{kind} durable"] = time.perf_counter() - started
        store.close()
        dist.barrier()  # nothing of this store runs while the next one is timed
    return out


def _resume(
    rank: int, world: int, run: int, kind: str, size_mb: int, root: Path, options: dict[str, Any]
) -> dict[str, Any]:
    """In every rank of a new job: load the newest step, counting what came from the bucket."""
    logging.getLogger("ckptstore").setLevel(logging.ERROR)  # "files were missing here"
    uri = f"s3://{BUCKET}/run{run}-{kind}"
    counter = PayloadCounter(open_backend(uri, options))
    store = open_store(kind, rank, run, root, options, backend=counter)
    dist.barrier()
    started = time.perf_counter()
    state = load_distributed(store)
    seconds = time.perf_counter() - started
    assert store.last_loaded is not None
    step = store.last_loaded.step
    expected = state_of(size_mb, seed_of(run, step, rank))
    assert all(torch.equal(state[k], expected[k]) for k in expected), (kind, rank)
    store.close()
    return {"seconds": seconds, "step": step, "gets": counter.gets, "bytes": counter.bytes}


def empty_bucket(server: LocalS3Server) -> None:
    """Delete every object of the bucket, so moto's memory holds one run at a time."""
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


SAVE_ROWS = {
    "blocked: plain local save (shared dir)": "local blocked",
    "blocked: plain S3 save": "s3 blocked",
    "blocked: tiered save, replicas=0": "tier0 blocked",
    "blocked: tiered save, replicas=1": "tier1 blocked",
    "time to durable: plain S3 save": "s3 durable",
    "time to durable: tiered save, replicas=0 (wait() on rank 0)": "tier0 durable",
    "time to durable: tiered save, replicas=1 (wait() on rank 0)": "tier1 durable",
}
RESUME_ROWS = {
    "resume, node 1 wiped: replicas=1 (from its peer)": "tier1",
    "resume, node 1 wiped: replicas=0 (node 1 from the bucket)": "tier0",
    "resume: plain S3 store (every rank from the bucket)": "s3",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64, help="state per rank, MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world", type=int, default=2, help="gloo ranks, one node each")
    parser.add_argument("--rank-timeout", type=float, default=600.0, help="per launch, seconds")
    args = parser.parse_args()
    if args.world < 2:
        parser.error("--world must be at least 2 (node 1 is the one lost)")
    world, size = args.world, args.size_mb
    seconds: dict[str, list[float]] = {}
    reads: dict[str, list[tuple[int, int]]] = {}

    with LocalS3Server() as server, tempfile.TemporaryDirectory() as tmp:
        server.create_bucket(BUCKET)
        options = server.storage_options()
        for run in range(args.runs):
            root = Path(tmp) / f"run{run}"
            launch = Path(tmp) / f"launch{run}"
            saved = run_ranks(
                _saves, world, launch / "save", run, size, root, options, timeout=args.rank_timeout
            )
            for row, key in SAVE_ROWS.items():
                # durable: rank 0's wait() (the bucket's commit); blocked: the slowest rank
                durable = key.endswith("durable")
                value = saved[0][key] if durable else max(r[key] for r in saved)
                seconds.setdefault(row, []).append(value)
            for kind in ("tier0", "tier1"):
                shutil.rmtree(node_dir(root, kind, 1))  # node 1 is replaced
                for rank in range(world):
                    if rank != 1:
                        drop_cache(node_dir(root, kind, rank))
            for row, kind in RESUME_ROWS.items():
                resumed = run_ranks(
                    _resume, world, launch / kind, run, kind, size, root, options,
                    timeout=args.rank_timeout,
                )  # fmt: skip
                steps = {r["step"] for r in resumed}
                assert steps == {TIMED}, (row, steps)
                seconds.setdefault(row, []).append(max(r["seconds"] for r in resumed))
                got = (sum(r["gets"] for r in resumed), sum(r["bytes"] for r in resumed))
                reads.setdefault(row, []).append(got)
            empty_bucket(server)
            shutil.rmtree(root)
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)

    total = world * size * MiB / 1e6
    print(f"\n{world} ranks x {size} MiB state ({total:.0f} MB in all), median of {args.runs} "
          "runs, S3 = moto on 127.0.0.1\n")  # fmt: skip
    print("| row | seconds | runs (s) | MB/s | bucket payload GETs | MB from bucket |")
    print("|---|---:|---:|---:|---:|---:|")
    for row, values in seconds.items():
        median = statistics.median(values)
        gets = mb = ""
        if row in reads:
            gets = f"{statistics.median(g for g, _ in reads[row]):g}"
            mb = f"{statistics.median(b for _, b in reads[row]) / 1e6:.1f}"
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"| {row} | {median:.3f} | {spread} | {total / median:.0f} | {gets} | {mb} |")

    def med(row: str) -> float:
        return statistics.median(seconds[row])

    s3 = med("blocked: plain S3 save")
    peer = med("resume, node 1 wiped: replicas=1 (from its peer)")
    bucket = med("resume, node 1 wiped: replicas=0 (node 1 from the bucket)")
    plain = med("resume: plain S3 store (every rank from the bucket)")
    tier0 = med("blocked: tiered save, replicas=0")
    tier1 = med("blocked: tiered save, replicas=1")
    print(
        f"\na tiered save blocks the ranks for {tier0 / s3:.2f}x the time of a plain S3 save "
        f"with replicas=0, {tier1 / s3:.2f}x with replicas=1; a lost node's resume from its "
        f"peer takes {peer / bucket:.2f}x the time of a resume from the bucket (replicas=0) "
        f"and {peer / plain:.2f}x that of a plain S3 store",
        flush=True,
    )


if __name__ == "__main__":
    main()
