"""Tiered saves against plain ones, side by side in one run (README "Tiers and replication").

Rows, each the median of ``--runs`` saves of the same state (float32 tensors, ``--size-mb``):

* blocked: how long the ``save`` call holds the training loop: a plain local save, a plain S3
  save, and a tiered save (local tier + S3), which returns once the local commit is done;
* time to durable: from the call until the step is committed in S3 (the plain S3 save: its own
  time; the tiered save: until the background copy's commit);
* resume: ``load()`` of the newest step from the local tier (its page cache dropped first with
  ``posix_fadvise(DONTNEED)``, so the bytes come from disk) against ``load()`` from S3.

S3 is moto on 127.0.0.1 (``ckptstore.testing.s3server``), which is slower than AWS; ratios
matter more than seconds. ``python benchmarks/bench_tiers.py --size-mb 64 --runs 1`` is quick.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ckptstore import CheckpointStore
from ckptstore.core.observer import PersistStats
from ckptstore.testing.s3server import LocalS3Server

MiB = 1 << 20


def state_of(size_mb: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    per = 16 * MiB // 4
    count = max(1, size_mb // 16)
    return {f"t{i}": torch.rand(per, generator=gen) for i in range(count)}


class Durable:
    """An observer that notes when each step reached the durable tier."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.event = threading.Event()

    def saved(self, uri: str, stats: Any) -> None: ...

    def failed(self, uri: str, step: int, error: BaseException) -> None: ...

    def persisted(self, uri: str, stats: PersistStats) -> None:
        self.at[stats.step] = time.perf_counter()
        self.event.set()

    def persist_failed(self, uri: str, step: int, error: BaseException) -> None:
        self.event.set()


def drop_cache(root: Path) -> None:
    """Evict a directory's files from the page cache, so a load reads the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    with LocalS3Server() as server, tempfile.TemporaryDirectory() as tmp:
        server.create_bucket("bench")
        options = server.storage_options()
        for run in range(args.runs):
            state = state_of(args.size_mb, run)
            step = run + 1
            with CheckpointStore(f"{tmp}/plain-local", lease=False) as plain:
                started = time.perf_counter()
                plain.save(step, state)
                add("blocked: plain local save", time.perf_counter() - started)
            with CheckpointStore(f"s3://bench/plain-{run}", storage_options=options) as s3:
                started = time.perf_counter()
                s3.save(step, state)
                seconds = time.perf_counter() - started
                add("blocked: plain S3 save", seconds)
                add("time to durable: plain S3 save", seconds)
            durable = Durable()
            local = Path(tmp) / f"local-{run}"
            uri = f"s3://bench/tiered-{run}"
            store = CheckpointStore(uri, storage_options=options, local=str(local),
                                    observer=durable)  # fmt: skip
            started = time.perf_counter()
            store.save(step, state)
            add("blocked: tiered save (local + S3)", time.perf_counter() - started)
            store.wait()
            add("time to durable: tiered save", durable.at[step] - started)
            drop_cache(local)
            started = time.perf_counter()
            loaded = store.load()
            add("resume: from the local tier (page cache dropped)", time.perf_counter() - started)
            assert all(torch.equal(loaded[k], state[k]) for k in state)
            store.close()
            with CheckpointStore(uri, storage_options=options) as other:
                started = time.perf_counter()
                loaded = other.load()
                add("resume: from S3", time.perf_counter() - started)
                assert all(torch.equal(loaded[k], state[k]) for k in state)
    size = args.size_mb
    print(f"\n{size} MiB state, median of {args.runs} runs, S3 = moto on 127.0.0.1\n")
    print("| row | seconds | MB/s |")
    print("|---|---:|---:|")
    for name, values in rows.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds:.3f} | {size * MiB / 1e6 / seconds:.0f} |")
    ratio = statistics.median(rows["blocked: plain S3 save"]) / statistics.median(
        rows["blocked: tiered save (local + S3)"]
    )
    resume = statistics.median(rows["resume: from S3"]) / statistics.median(
        rows["resume: from the local tier (page cache dropped)"]
    )
    print(f"\ntiered save blocks {ratio:.1f}x less than a plain S3 save; "
          f"resume from the local tier is {resume:.1f}x faster than from S3")  # fmt: skip


if __name__ == "__main__":
    main()
