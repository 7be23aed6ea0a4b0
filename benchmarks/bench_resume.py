"""Resume at the limit: every load path of ckptstore beside its limit, measured in the same run,
and beside the peers a user would pick (README "Resume at the limit").

One state (``--size-mb`` of float32 in ``--tensors`` tensors, fixed seed) is saved and loaded
every way below, side by side: each round runs every method once, in an order that turns
each round (rotated, and reversed on odd rounds) so no method always follows the same one;
one untimed warm-up round comes first. Seconds are medians of ``--rounds`` (of
``--rank-rounds`` for the rows on 2 ranks, whose runs take tenths of a second); MB/s is the
state's bytes (1 MB = 10^6 bytes) over them. A ratio to the limit is paired by round: the
median, over rounds, of the limit row's seconds over the row's in the same round. Each run
starts once the S3 server is quiet (``Server.settle``). S3 is moto on 127.0.0.1, served by
a process of its own (``python -m ckptstore.testing.s3server``), so the client's threads and
the server's do not share one interpreter; its temporary files (every object over 5 MiB) are
kept in /dev/shm where there is one (on disk, writing them slowed whichever row came next).

Limits, each the best of its rows, measured by this benchmark in the same rounds:

* S3 load: parallel GetObjects of ckptstore's own objects (whole, or in ranges of the store's
  part size), ``--concurrency`` at a time, into fresh buffers, with no checksum;
* S3 save: boto3's plain API from a thread pool (no client checksums) for the same bytes as
  one object (a multipart upload, part size and threads tuned by a sweep before the warm-up),
  and as the store's own objects (one PutObject each); and ``upload_fileobj``
  (``TransferConfig``, 16 MiB parts, 8 threads);
* local load: the same files read by parallel ``preadv`` into fresh buffers, page cache dropped
  (``posix_fadvise(DONTNEED)``) before every run of every row;
* on 2 gloo ranks (``tests/ranks.py``), each a node with a local tier of its own in front of
  the bucket: for the recovery of a wiped node from its peer (``recover_from_peer``, timed
  alone), a raw copy of the same files: cold ``preadv`` on node 0, gloo ``send``/``recv``,
  ``write`` + ``fsync`` on node 1 (beside it, gloo alone, memory to memory: the loopback's line
  rate, which a copy from disk to disk cannot reach); for ``load_distributed`` on the same
  files, each rank's own files read raw, on every rank at once (caches dropped).

Peers: s3torchconnector's ``S3Checkpoint`` (AWS CRT; ``torch.save`` / ``torch.load`` through
it) and DCP through s3fs (``FsspecWriter`` / ``FsspecReader``), the same state to the same
server. And the end-to-end resume of a tiered ``replicas=1`` job that lost node 1 (open the
store, agree on the step, take the files from the peer, load), against the same job resuming
with node 1's share from the bucket (``replicas=0``).

``python benchmarks/bench_resume.py --quick`` is a smoke run (a few MiB, one round).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_resume_base import (
    KEY,
    REGION,
    MiB,
    Row,
    Server,
    State,
    nbytes,
    payload,
    raw_read,
    state_of,
)
from bench_resume_ranks import rank_rounds
from bench_resume_s3 import s3_rows
from bench_tiers import drop_cache

from ckptstore import CheckpointStore
from ckptstore.domain import layout

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ranks import run_ranks  # tests/ranks.py: gloo ranks forked from a server

PARTS = ("s3", "local", "ranks")
"""The benchmark's parts: the S3 rows, the local load's, those on 2 gloo ranks."""


def local_rows(root: Path, state: State, conc: int) -> list[Row]:
    """ckptstore's local load beside raw parallel reads of the same files."""
    store = CheckpointStore(str(root / "local"), lease=False)
    store.save(1, state)
    step = root / "local" / layout.step_dir(1)
    files = [p for p in step.rglob("*") if p.is_file() and payload(str(p))]

    def cold() -> None:
        drop_cache(root / "local")

    return [
        Row(
            "local load",
            "ckptstore load (every byte verified)",
            "ckptstore",
            lambda: store.load(1),
            cold,
        ),
        Row(
            "local load",
            f"raw preadv of the same {len(files)} files, one thread each",
            "limit",
            lambda: raw_read(files, None, conc),
            cold,
        ),
        Row(
            "local load",
            f"raw preadv of the same files, 8 MiB pieces x{conc}",
            "limit",
            lambda: raw_read(files, 8 * MiB, conc),
            cold,
        ),
        Row(
            "local load",
            "raw preadv of the same files, 1 MiB pieces in order, one thread each",
            "limit",
            lambda: raw_read(files, MiB, conc, in_order=True),
            cold,
        ),
    ]


def run_rounds(
    rows: list[Row],
    rounds: int,
    warmup: bool,
    log: Callable[[str], None],
    settle: Callable[[], None] = lambda: None,
) -> None:
    """An untimed warm-up round (``warmup``), then ``rounds``, each in a turned order; each
    run starts once ``settle`` returns (the S3 server quiet again)."""
    if not rows:  # --only ranks: the ranks run their own rounds
        return
    for r in range(-1 if warmup else 0, rounds):
        order = rows[r % len(rows) :] + rows[: r % len(rows)] if r >= 0 else list(rows)
        if r % 2:
            order.reverse()
        for row in order:
            if row.error:
                continue
            row.prep()
            settle()
            started = time.perf_counter()
            try:
                row.run()
            except Exception as e:  # a peer that cannot run here says why
                row.error = f"{type(e).__name__}: {e}"[:200]
                continue
            if r >= 0:
                row.seconds.append(time.perf_counter() - started)
        log(f"round {r + 1}/{rounds} done" if r >= 0 else "warm-up done")


# -- report -----------------------------------------------------------------------------------


def mbs(total: int, seconds: float) -> float:
    return total / seconds / 1e6 if seconds > 0 else float("nan")


def paired_ratio(row: Row, limit: Row | None) -> float:
    """``row``'s speed over ``limit``'s, paired by round: the median over rounds of the
    limit's seconds over the row's in the same round. A slow minute on a shared machine slows
    both rows of its round, so it moves their ratio less than it moves either median."""
    if limit is None or not row.seconds or len(limit.seconds) != len(row.seconds):
        return float("nan")
    return statistics.median(a / b for a, b in zip(limit.seconds, row.seconds, strict=True))


def report(
    rows: list[Row], rank_rows: list[Row], total: int, rank_total: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Print the tables; returns what ``--json`` writes."""
    out: dict[str, Any] = {"rows": [], "ratios": {}}
    warm = "" if args.quick else " after a warm-up"
    print(
        f"\n{total / 1e6:.0f} MB state ({args.tensors} float32 tensors), medians of "
        f"{args.rounds} rounds{warm} (the rows on 2 ranks: {args.rank_rounds}), ratios paired "
        "by round, S3 = moto on 127.0.0.1\n"
    )
    print("| path | method | MB/s | runs (s) | limit MB/s | ratio to limit |")
    print("|---|---|---:|---:|---:|---:|")
    for group in dict.fromkeys(r.group for r in rows + rank_rows):
        members = [r for r in rows + rank_rows if r.group == group]
        size = rank_total if any(r in rank_rows for r in members) else total
        limits = [r for r in members if r.role == "limit" and r.seconds]
        limit = max(limits, key=lambda r: mbs(size, r.median), default=None)
        best = mbs(size, limit.median) if limit is not None else float("nan")
        for r in members:
            speed = mbs(size, r.median)
            if r.error:
                print(f"| {group} | {r.name} | did not run: {r.error} | | | |")
            else:
                spread = f"{min(r.seconds):.3f}-{max(r.seconds):.3f}"
                paired = f"{paired_ratio(r, limit):.2f}x" if r.role in ("ckptstore", "peer") else ""
                print(f"| {group} | {r.name} | {speed:.0f} | {spread} | {best:.0f} | {paired} |")
            out["rows"].append(
                {
                    "group": group,
                    "name": r.name,
                    "role": r.role,
                    "seconds": r.seconds,
                    "mb_s": speed,
                    "limit_mb_s": best,
                    "error": r.error,
                }
            )
        mine = next((r for r in members if r.role == "ckptstore"), None)
        for r in members:  # the first ckptstore row is the group's; others are named
            if r.role == "ckptstore":
                label = group if r is mine else f"{group}, {r.name}"
                out["ratios"][f"{label}: to limit"] = paired_ratio(r, limit)
        for r in members:
            if r.role in ("peer", "line") and mine is not None and r.seconds and mine.seconds:
                out["ratios"][f"{group}: to {r.name}"] = paired_ratio(mine, r)
    print("\nratios from this run (ckptstore's speed over the other's):")
    for name, value in out["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256, help="the state, MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--rank-rounds",
        type=int,
        default=11,
        help="rounds of the rows on 2 ranks (each run a few tenths of a second, so more)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="threads of the raw rows")
    parser.add_argument("--quick", action="store_true", help="4 MiB, 16 tensors, one round")
    parser.add_argument("--json", type=Path, help="write every run of every row here")
    parser.add_argument("--rank-timeout", type=float, default=600.0)
    parser.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only this part's rows (repeat for several; default: all), for A/B runs",
    )
    args = parser.parse_args()
    only = set(args.only or PARTS)
    if args.quick:
        args.size_mb, args.tensors, args.rounds, args.rank_rounds = 4, 16, 1, 1
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")  # one process
    # moto's dummy credentials for every client, s3torchconnector's (which reads only these)
    # included; the caller's AWS settings stay out
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    nowhere = str(Path(tempfile.gettempdir()) / "ckptstore-bench-no-aws-config")
    os.environ |= {
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": KEY,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",
    }

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    state = state_of(args.size_mb, args.tensors)
    total = nbytes(state)
    notes: dict[str, Any] = {}
    world = 2
    per_rank = args.size_mb / world
    ranks: list[dict[str, list[float]]] = []
    # the bucket holds up to about 16 copies of the state at once (the rows' objects, the
    # stores' kept steps); the server spills them to memory only where that fits
    with Server(room=16 * total) as server, tempfile.TemporaryDirectory() as tmp:
        rows = s3_rows(server, state, args, notes) if "s3" in only else []
        rows += local_rows(Path(tmp), state, args.concurrency) if "local" in only else []
        log(f"setup done: {len(rows)} rows")
        run_rounds(rows, args.rounds, not args.quick, log, server.settle)
        if "ranks" in only:
            ranks = run_ranks(
                rank_rounds,
                world,
                Path(tmp) / "launch",
                per_rank,
                args.tensors // world,
                args.rank_rounds,
                Path(tmp) / "tiers",
                server.options(),
                args.concurrency,
                not args.quick,
                timeout=args.rank_timeout,
            )
    rank_total = nbytes(state_of(per_rank, args.tensors // world))  # one node's share

    def slowest(name: str) -> list[float]:
        return [max(r[name][i] for r in ranks) for i in range(args.rank_rounds)] if ranks else []

    rank_rows = [
        Row(
            "peer recovery (node 1 wiped)",
            "ckptstore recovery from the peer (disk to disk)",
            "ckptstore",
            lambda: None,
            seconds=slowest("peer recovery"),
        ),
        Row(
            "peer recovery (node 1 wiped)",
            "raw gloo send/recv of the same bytes (memory)",
            "line",
            lambda: None,
            seconds=slowest("raw gloo send"),
        ),
        Row(
            "peer recovery (node 1 wiped)",
            "raw copy: cold read, gloo send/recv, write + fsync of the same files",
            "limit",
            lambda: None,
            seconds=slowest("raw disk-to-disk copy"),
        ),
        Row(
            f"load_distributed, {world} ranks",
            "ckptstore load_distributed (verified)",
            "ckptstore",
            lambda: None,
            seconds=slowest("load_distributed"),
        ),
        Row(
            f"load_distributed, {world} ranks",
            f"{world} raw readers of the same files at once",
            "limit",
            lambda: None,
            seconds=slowest("raw readers"),
        ),
        Row(
            f"load_distributed, {world} ranks",
            f"{world} raw readers of the same files at once, 1 MiB pieces in order",
            "limit",
            lambda: None,
            seconds=slowest("raw readers, 1 MiB pieces"),
        ),
    ]
    rank_rows = [r for r in rank_rows if r.seconds]  # none without the ranks (--only)
    out = report(rows, rank_rows, total, rank_total, args)
    if not ranks:
        print(f"notes: {json.dumps(notes)}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    peer, bucket = (
        statistics.median(slowest("resume from peer")),
        statistics.median(slowest("resume from bucket")),
    )
    print(
        f"\nresume of a tiered replicas=1 job that lost node 1 ({world} ranks x "
        f"{rank_total / 1e6:.0f} MB; open the store, agree on the step, take the files, load; "
        f"the slowest rank): from the peer {peer:.3f} s, from the bucket (replicas=0) "
        f"{bucket:.3f} s: the peer's path takes {peer / bucket:.2f}x the bucket's"
    )
    print(f"notes: {json.dumps(notes)}")
    out |= {
        "resume_peer_s": slowest("resume from peer"),
        "resume_bucket_s": slowest("resume from bucket"),
        "notes": notes,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
