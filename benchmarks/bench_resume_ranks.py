"""bench_resume.py's rows on 2 gloo ranks: the recovery of a wiped node from its peer beside a
raw disk-to-disk copy, ``load_distributed`` beside raw readers, and a lost node's resume from
its peer and from the bucket."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_resume_base import (
    BUCKET,
    MiB,
    cuts,
    nbytes,
    raw_read,
    state_of,
)
from bench_tiers import drop_cache

from ckptstore import CheckpointStore
from ckptstore.integrations.distributed import load_distributed, rank_dir, save_distributed
from ckptstore.tiers import peers

# -- ranks ------------------------------------------------------------------------------------


def _node(root: Path, rank: int) -> Path:
    return root / f"node{rank}"


def _open(root: Path, rank: int, options: dict[str, Any], replicas: int) -> CheckpointStore:
    return CheckpointStore(
        f"s3://{BUCKET}/tiered",
        storage_options=options,
        lease=rank == 0,
        local=str(_node(root, rank)),
        persist_every=1,
        replicas=replicas,
    )


def _own_files(root: Path, rank: int) -> list[Path]:
    """The files of this rank's share in its node's tier (not the peer copies it holds)."""
    return [p for p in _node(root, rank).rglob("*") if p.is_file() and rank_dir(rank) in str(p)]


def rank_rounds(
    rank: int,
    world: int,
    size_mb: float,
    tensors: int,
    rounds: int,
    root: Path,
    options: dict[str, Any],
    conc: int,
    warmup: bool,
) -> dict[str, list[float]]:
    """Every rank: save once (replicas=1, durable in the bucket), then in each round resume a
    job that lost node 1 from the peer and from the bucket, the raw gloo send beside it, and
    load_distributed on intact nodes beside raw readers of the same files."""
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    state = state_of(size_mb, tensors, seed=rank)
    store = _open(root, rank, options, 1)
    save_distributed(store, 1, state)
    store.wait()
    assert store.tiers is not None
    store.tiers.node.drain()
    store.close()
    data = torch.empty(nbytes(state), dtype=torch.uint8)
    times: dict[str, list[float]] = {}
    recovered: list[float] = []
    real = peers.recover_from_peer

    def timed_recovery(*args: Any) -> int:
        started = time.perf_counter()
        count = real(*args)
        recovered.append(time.perf_counter() - started)
        return count

    peers.recover_from_peer = timed_recovery  # the tiers call it there: the recovery alone

    def timed(name: str, fn: Callable[[], Any], wipe: bool = False) -> float:
        if wipe and rank == 1:
            shutil.rmtree(_node(root, 1), ignore_errors=True)  # node 1 is replaced
        drop_cache(_node(root, rank)) if _node(root, rank).exists() else None
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - started
        times.setdefault(name, []).append(seconds)
        return started

    def resume(replicas: int) -> None:
        job = _open(root, rank, options, replicas)
        got = load_distributed(job)
        assert torch.equal(got["model"]["t000"], state["model"]["t000"])
        job.close()

    def gloo() -> None:
        dist.send(data, 1) if rank == 0 else dist.recv(data, 0)

    def peer() -> None:
        recovered.clear()
        timed("resume from peer", lambda: resume(1), wipe=True)
        times.setdefault("peer recovery", []).append(recovered[0])

    def bucket() -> None:
        timed("resume from bucket", lambda: resume(0), wipe=True)

    def intact() -> None:
        job = _open(root, rank, options, 1)
        timed("load_distributed", lambda: load_distributed(job))
        job.close()

    def readers() -> None:
        files = _own_files(root, rank)
        timed("raw readers", lambda: raw_read(files, None, conc))
        timed("raw readers, 1 MiB pieces", lambda: raw_read(files, MiB, conc, in_order=True))

    def copy() -> None:
        # node 0 holds node 1's files as peer copies: read them (cold), send, write and fsync
        sizes = [p.stat().st_size for p in _own_files(root, 1)] if rank == 0 else []
        box = [sizes]
        dist.broadcast_object_list(box, 0)
        scratch = root / "rawcopy"
        timed("raw disk-to-disk copy", lambda: raw_copy(rank, _own_files(root, 1), box[0], scratch))
        shutil.rmtree(scratch, ignore_errors=True)

    for r in range(
        -1 if warmup else 0, rounds
    ):  # node 1 must be whole before the intact loads: peer first
        order = (
            [bucket, peer, copy, gloo, intact, readers]
            if r % 2 == 0
            else [peer, readers, intact, gloo, copy, bucket]
        )
        for step in order:
            if step is gloo:
                timed("raw gloo send", gloo)
            else:
                step()
        if r == -1:  # the warm-up
            times.clear()
    return times


def raw_copy(rank: int, files: list[Path], sizes: list[int], scratch: Path) -> None:
    """Rank 0 reads ``files`` in 8 MiB pieces and sends each; rank 1 receives them into one
    buffer, writes each file and fsyncs it: a disk-to-disk copy over gloo with nothing else."""
    piece = torch.empty(8 * MiB, dtype=torch.uint8)
    view = memoryview(piece.numpy())
    scratch.mkdir(parents=True, exist_ok=True)
    for n, size in enumerate(sizes):
        fd = (
            os.open(files[n], os.O_RDONLY)
            if rank == 0
            else os.open(scratch / f"{n}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        )
        try:
            for a, b in cuts(size, 8 * MiB):
                if rank == 0:
                    os.preadv(fd, [view[: b - a]], a)
                    dist.send(piece[: b - a], 1)
                else:
                    dist.recv(piece[: b - a], 0)
                    os.write(fd, view[: b - a])
            if rank == 1:
                os.fsync(fd)
        finally:
            os.close(fd)
