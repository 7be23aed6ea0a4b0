"""The scale harness: many ranks saving one step against a throttling S3, measured.

What is real: every request. Each simulated rank stages its files through the public multi-process
API (``CheckpointStore.stage_files``) with a store and an S3 client of its own, as a rank process
would; one coordinator begins the coordinated save (``begin_save``: the writer lease, one read of
``latest`` and the previous manifest) and hands each rank its cut of the plan
(``stage_files(plan=...)``, as ``save_distributed`` does), commits every rank's entries, then
each rank reads its own files back verified (``read_file``). Requests go over HTTP through the
fault proxy's throttle (tests/s3faults/throttle.py) to moto.

What is modelled: the ranks are played by a pool of ``workers`` threads, each holding one store
and playing one rank after another, so at most ``workers`` ranks are in flight (a real job has
all of them in flight: more pressure on the limit, the same requests); the gather of the entries
and the scatter of the previous step's entries are Python lists (``torch.distributed`` in a
real job: ``tests/test_scale.py`` runs one with gloo and checks that a rank's requests are the
ones counted here); S3's limit is the throttle's model, at S3's rates divided by a stated scale.

Each phase reports its wall time, its requests by S3 operation and the SlowDown answers among
them, and the lower bound the limit puts on it (requests / rate, past the first burst).
``python benchmarks/scale.py --help`` (``scripts/bench-scale``) runs it and prints tables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import pickle
import struct
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore.data.payload import SourceFile
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_STATE, FileEntry, Manifest
from ckptstore.domain.plan import Plan
from ckptstore.errors import CheckpointError
from ckptstore.integrations.distributed import rank_dir
from ckptstore.testing.s3server import LocalS3Server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3faults.faultproxy import FaultProxy  # tests/s3faults: S3 as it misbehaves
from s3faults.throttle import DEFAULT_SCALE, WRITES, Throttle

BUCKET = "scale"


@dataclass(frozen=True)
class SaveConfig:
    """One simulated multi-rank save (and load) of ``ranks`` x ``files`` files."""

    ranks: int = 1024
    files: int = 8
    file_size: int = 4096
    workers: int = 16
    """Threads playing the ranks; each holds its own store (and S3 client)."""
    steps: int = 2
    """Saves in a row, of steps 1, 2, ...: the second shows the steady state (no probe, a
    previous manifest for the incremental check)."""
    incremental: bool = True
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra S3 storage options for every store (``max_attempts``, ``max_concurrency``...)."""

    def __post_init__(self) -> None:
        if min(self.ranks, self.files, self.workers, self.steps) < 1 or self.file_size < 16:
            raise ValueError(f"ranks, files, workers, steps >= 1 and file_size >= 16: {self}")


@dataclass
class Phase:
    """What one phase cost: seconds, requests by operation, SlowDown answers by operation."""

    name: str
    seconds: float
    requests: Counter[str]
    slowdowns: Counter[str]
    lower_bound: float

    @property
    def writes(self) -> int:
        return sum(n for op, n in self.requests.items() if op in WRITES)

    @property
    def reads(self) -> int:
        return sum(n for op, n in self.requests.items() if op not in WRITES)


@dataclass
class SaveReport:
    config: SaveConfig
    step: int
    phases: list[Phase]
    manifest_bytes: int
    manifest_parse_seconds: float
    commit_peak_bytes: int
    """The coordinator's peak Python heap (tracemalloc) for what grows with ranks in a commit:
    the gathered entries, the manifest built, encoded and parsed again. Measured apart from the
    commit, whose time tracemalloc would distort."""
    failed_ranks: int
    error: str | None = None
    """The first failed rank's error, when the save failed."""


PROBE = Counter({"PutObject": 5, "DeleteObjects": 1})
"""The capability probe (s3_probe.py: 5 PUTs with checksums on, then its object deleted): once
per process that writes conditionally (the coordinator: the lease, the commit marker, ``latest``),
never on a process that only stages payload."""


def stage_model(
    ranks: int,
    files: int,
    *,
    unchanged: int = 0,
) -> Counter[str]:
    """The requests ``ranks`` ranks make to stage ``files`` small files each (one PUT apiece):
    per rank, the attempt marker and the files (``unchanged`` of them copied from the previous
    step instead: a HEAD and a CopyObject each instead of a PUT), and nothing else. The
    coordinator checked the step and read ``latest`` and the previous manifest once
    (``begin_save``), and each rank's plan holds its own entries: no rank reads anything."""
    per_rank = Counter({"PutObject": 1 + files - unchanged})
    if unchanged:
        per_rank["HeadObject"] = unchanged
        per_rank["CopyObject"] = unchanged
    return Counter({op: n * ranks for op, n in per_rank.items()})


def list_pages(ranks: int, files: int, page: int = 1000) -> int:
    """LIST pages of the commit's confirmation: every rank's files and attempt marker."""
    return -(-ranks * (files + 1) // page)


class Rig:
    """moto on 127.0.0.1, the throttling proxy in front, and counters read per phase."""

    def __init__(self, throttle: Throttle | None) -> None:
        self.server = LocalS3Server()
        self.throttle = throttle
        self.proxy: FaultProxy | None = None

    def __enter__(self) -> Rig:
        self.server.start()
        self.server.create_bucket(BUCKET)
        self.proxy = FaultProxy(self.server.endpoint_url, throttle=self.throttle).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.server.stop()

    def fresh_uri(self, kind: str) -> str:
        """``s3://<a new bucket>/<kind>``: moto lists (and finds a key in) time proportional to
        every key of the bucket, so a run beside the keys of earlier runs paid for all of them."""
        bucket = f"{BUCKET}-{kind}-{time.monotonic_ns()}"
        self.server.create_bucket(bucket)
        return f"s3://{bucket}/{kind}"

    def options(self, **extra: Any) -> dict[str, Any]:
        assert self.proxy is not None
        return {**self.server.storage_options(), "endpoint_url": self.proxy.endpoint_url, **extra}

    def use(self, throttle: Throttle | None) -> None:
        """Put another throttle (fresh buckets) in front of the server."""
        assert self.proxy is not None
        self.throttle = self.proxy.throttle = throttle

    def counters(self) -> tuple[Counter[str], Counter[str]]:
        assert self.proxy is not None
        throttled = self.throttle.throttled if self.throttle is not None else Counter()
        return Counter(self.proxy.seen), Counter(throttled)

    @contextlib.contextmanager
    def phase(self, name: str, out: list[Phase]) -> Iterator[None]:
        seen, throttled = self.counters()
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            seen_after, throttled_after = self.counters()
            requests, slowdowns = seen_after - seen, throttled_after - throttled
            admitted = requests - slowdowns
            writes = sum(n for op, n in admitted.items() if op in WRITES)
            reads = sum(admitted.values()) - writes
            bound = self.throttle.lower_bound(writes, reads) if self.throttle else 0.0
            out.append(Phase(name, seconds, requests, slowdowns, bound))


def _manifest_costs(entries: list[FileEntry], manifest: Manifest, data: bytes) -> tuple[int, float]:
    """Peak heap of gathering, building, encoding and parsing a manifest; and the parse time."""
    started = time.perf_counter()
    Manifest.decode(data, where="scale")
    parse = time.perf_counter() - started
    tracemalloc.start()
    try:
        gathered = pickle.loads(pickle.dumps(entries))  # as the gather delivers them
        rebuilt = dataclasses.replace(manifest, files=tuple(gathered))
        Manifest.decode(rebuilt.encode(), where="scale")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, parse


def rank_bytes(step: int, rank: int, index: int, size: int) -> bytes:
    """A file's content: unique per (step, rank, file), so a mix-up fails verification."""
    head = struct.pack(">QQQ", step, rank, index)
    return (head * (size // len(head) + 1))[:size]


def _producer(step: int, rank: int, index: int, size: int) -> Callable[[], list[bytes]]:
    return lambda: [rank_bytes(step, rank, index, size)]


def rank_path(rank: int, index: int) -> str:
    """As ``save_distributed`` lays out a rank's files (``rank_dir``)."""
    return f"{rank_dir(rank)}/file_{index}.bin"


class Ranks:
    """``workers`` threads, each with its own store, playing ranks one after another."""

    def __init__(self, open_store: Callable[[], Any], workers: int) -> None:
        self._open = open_store
        self._local = threading.local()
        self._stores: list[Any] = []
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rank")

    def store(self) -> Any:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self._open()
            with self._lock:
                self._stores.append(store)
        return store

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for store in self._stores:
            store.close()


def simulate_save(rig: Rig, config: SaveConfig) -> list[SaveReport]:
    """Save steps 1..``config.steps`` with ``config.ranks`` simulated ranks; load each back."""
    from ckptstore import CheckpointStore

    uri = rig.fresh_uri("run")
    options = rig.options(**config.storage_options)

    def open_rank_store() -> Any:
        return CheckpointStore(
            uri, storage_options=options, lease=False, incremental=config.incremental
        )

    import torch  # noqa: F401  (loaded in any training job; else the first commit imports it)

    coordinator = CheckpointStore(  # a lease heartbeat (ttl / 4) would mix into the ranks' counts
        uri, storage_options=options, incremental=config.incremental, lease_ttl=3600.0
    )
    ranks = Ranks(open_rank_store, config.workers)
    try:
        return [
            _one_save(rig, config, coordinator, ranks, step) for step in range(1, config.steps + 1)
        ]
    finally:
        ranks.close()
        coordinator.close()


def _one_save(
    rig: Rig, config: SaveConfig, coordinator: Any, ranks: Ranks, step: int
) -> SaveReport:
    phases: list[Phase] = []
    failures: list[BaseException] = []

    plans: list[Plan | None] = [None] * config.ranks

    def stage(rank: int) -> list[FileEntry] | None:
        files = [
            SourceFile(
                rank_path(rank, i), _producer(step, rank, i, config.file_size), config.file_size
            )
            for i in range(config.files)
        ]
        try:
            entries: list[FileEntry] = ranks.store().stage_files(
                step, files, kind=KIND_STATE, plan=plans[rank]
            )
        except CheckpointError as e:  # what save_distributed would gather as this rank's error
            failures.append(e)
            return None
        return entries

    with rig.phase("prepare (rank 0)", phases):  # as save_distributed: begin, cut the plan
        save = coordinator.begin_save(step, kind=KIND_STATE)
        plans[:] = save.plan.split([rank_dir(r) for r in range(config.ranks)])
    with rig.phase("stage (all ranks)", phases):
        reports = list(ranks.pool.map(stage, range(config.ranks)))
    if failures:  # as save_distributed does: discard, nothing committed
        with rig.phase("discard (rank 0)", phases):
            save.discard()
        return SaveReport(config, step, phases, 0, 0.0, 0, len(failures), str(failures[0]))
    entries = [entry for report in reports if report is not None for entry in report]
    with rig.phase("commit (rank 0)", phases):
        info: CheckpointInfo = save.commit(entries, world_size=config.ranks)
    data = info.manifest.encode()
    peak, parse = _manifest_costs(entries, info.manifest, data)

    def load(rank: int) -> None:
        for i in range(config.files):
            got = ranks.store().read_file(info, rank_path(rank, i))
            if bytes(got) != rank_bytes(step, rank, i, config.file_size):
                raise AssertionError(f"rank {rank} file {i} of step {step} read back wrong")

    with rig.phase("load (all ranks)", phases):
        latest = coordinator.latest()
        if latest is None or latest.step != step:
            raise AssertionError(f"latest is {latest}, expected step {step}")
        list(ranks.pool.map(load, range(config.ranks)))
    return SaveReport(config, step, phases, len(data), parse, peak, len(failures))


# -- many steps ------------------------------------------------------------------------------


@dataclass
class StepsRow:
    operation: str
    seconds: float
    requests: Counter[str]


def seed_steps(rig: Rig, uri: str, steps: int, every: int) -> None:
    """``steps`` committed steps (manifests without payload, steps ``every``, 2 x ``every``...)
    written straight to the server, and ``latest`` at the last."""
    from ckptstore.domain import layout
    from ckptstore.domain.environment import current_environment
    from ckptstore.protocol.pointer import Pointer

    bucket, root = uri[len("s3://") :].split("/", 1)
    client = rig.server.client()
    environment = current_environment(world_size=1)

    def put(n: int) -> None:
        manifest = Manifest(n * every, float(n), KIND_STATE, (), environment, "seed")
        key = f"{root}/{layout.manifest_path(n * every)}"
        client.put_object(Bucket=bucket, Key=key, Body=manifest.encode())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(1, steps + 1)))
    pointer = Pointer(steps * every, "seed", time.time())
    client.put_object(Bucket=bucket, Key=f"{root}/{layout.LATEST_NAME}", Body=pointer.encode())


def measure_steps(
    rig: Rig, steps: int, every: int = 10, *, gc_max_steps: int = 10_000
) -> list[StepsRow]:
    """What ``latest()``, ``ls``, a save with retention, ``prune`` and ``gc`` cost on a store
    of ``steps`` committed steps (unthrottled: the counts are the point; the README turns
    them into time on S3). gc is left out above ``gc_max_steps``: its one listing of the
    store is paginated, but moto answers each page in time proportional to the bucket."""
    import torch

    from ckptstore import CheckpointStore

    uri = rig.fresh_uri("steps")
    seed_steps(rig, uri, steps, every)
    assert rig.proxy is not None
    throttle, rig.proxy.throttle = rig.proxy.throttle, None
    rows: list[StepsRow] = []
    retention = {"keep_last": 3, "keep_every": every}

    def row(name: str, action: Callable[[], object]) -> None:
        seen = Counter(rig.proxy.seen) if rig.proxy is not None else Counter()
        started = time.perf_counter()
        action()
        seconds = time.perf_counter() - started
        after = Counter(rig.proxy.seen) if rig.proxy is not None else Counter()
        rows.append(StepsRow(name, seconds, after - seen))

    def fresh(**options: Any) -> Any:
        return CheckpointStore(uri, storage_options=rig.options(), lease=False, **options)

    try:
        with fresh() as store:
            row("latest() (new process)", store.latest)
        with fresh() as store:
            row("ls (new process)", store.list)
            row("ls (again)", store.list)
        with fresh(**retention) as store:
            store.list()  # a training job has listed once before (resume)
            new = (steps + 1) * every
            row(
                "save, keep_last=3 (after a listing)", lambda: store.save(new, {"w": torch.ones(4)})
            )
            row("prune, nothing to delete", store.prune)
            if steps <= gc_max_steps:  # one paginated LIST of the store, GETs only for garbage
                row("gc, nothing to collect", lambda: store.gc(older_than=0.0))
    finally:
        rig.proxy.throttle = throttle
    return rows


# -- tables ----------------------------------------------------------------------------------


def _kinds(requests: Counter[str], limit: int = 4) -> str:
    return ", ".join(f"{op} {n}" for op, n in requests.most_common(limit)) or "-"


def save_table(reports: list[SaveReport], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| step | phase | seconds | bound (s) | writes | reads | SlowDown | requests by kind |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for report in reports:
        for p in report.phases:
            lines.append(
                f"| {report.step} | {p.name} | {p.seconds:.2f} | {p.lower_bound:.2f} | "
                f"{p.writes} | {p.reads} | {sum(p.slowdowns.values())} | {_kinds(p.requests)} |"
            )
    lines.append("")
    for report in reports:
        if report.error is not None:
            lines.append(
                f"- step {report.step}: {report.failed_ranks} ranks failed: {report.error}"
            )
        else:
            lines.append(
                f"- step {report.step}: manifest {report.manifest_bytes / 1024:.0f} KiB, parsed in "
                f"{report.manifest_parse_seconds * 1000:.1f} ms; coordinator peak heap for the "
                f"entries and manifest {report.commit_peak_bytes / (1 << 20):.1f} MiB"
            )
    return "\n".join(lines)


def steps_table(rows: list[StepsRow], steps: int) -> str:
    lines = [
        f"### {steps} committed steps",
        "",
        "| operation | seconds | requests | by kind |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        total = sum(r.requests.values())
        lines.append(f"| {r.operation} | {r.seconds:.2f} | {total} | {_kinds(r.requests)} |")
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------

BEFORE = {
    "max_attempts": 1,  # our retries off: botocore's alone, as before the scale work
    "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 5}},
}
"""The retry settings before the scale work: botocore's standard mode, 5 attempts."""
PARTS = ("save", "big", "steps", "compare")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench-scale",
        description="Simulated many-rank saves against a throttling S3 (moto behind the fault "
        "proxy), and the cost of operations on a store of many steps; prints markdown tables.",
    )
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--files", type=int, default=8, help="files per rank")
    parser.add_argument("--file-size", type=int, default=4096, help="bytes per file")
    parser.add_argument("--workers", type=int, default=16, help="threads playing the ranks")
    parser.add_argument("--saves", type=int, default=2, help="saves in a row (steps 1, 2...)")
    parser.add_argument("--big-ranks", type=int, default=16)
    parser.add_argument("--big-files", type=int, default=4)
    parser.add_argument("--big-file-mib", type=int, default=12, help="5 MiB parts: multipart")
    parser.add_argument("--steps", type=int, default=10_000, help="committed steps to measure")
    parser.add_argument("--gc-max-steps", type=int, default=10_000, help="gc on larger stores")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE, help="S3's rates / this")
    parser.add_argument("--prefix-depth", type=int, default=1)
    parser.add_argument("--compare-ranks", type=int, default=32)
    parser.add_argument(
        "--compare-write-rate", type=float, default=10.0, help="writes/s (reads: 1.6x)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    parts = set(args.only or PARTS)
    logging.basicConfig(level=logging.ERROR)  # the probe's per-store warnings are expected

    def throttle(scale: float = args.scale) -> Throttle:
        return Throttle.scaled(scale, prefix_depth=args.prefix_depth)

    limit = throttle()
    print(
        f"S3's limit / {args.scale:g}: {limit.write_rate:g} writes/s and {limit.read_rate:g} "
        f"reads/s per prefix (bucket + {args.prefix_depth} key segment(s)), 1 s of burst\n"
    )
    with Rig(limit) as rig:
        if "save" in parts:
            config = SaveConfig(args.ranks, args.files, args.file_size, args.workers, args.saves)
            title = f"{args.ranks} ranks x {args.files} files of {args.file_size} B"
            print(save_table(simulate_save(rig, config), title) + "\n", flush=True)
        if "big" in parts:
            size = args.big_file_mib << 20
            config = SaveConfig(
                args.big_ranks,
                args.big_files,
                size,
                min(args.workers, args.big_ranks),
                args.saves,
                storage_options={"part_size": 5 << 20},
            )
            title = f"{args.big_ranks} ranks x {args.big_files} files of {args.big_file_mib} MiB"
            print(save_table(simulate_save(rig, config), title) + "\n", flush=True)
        if "compare" in parts:
            variants: tuple[tuple[str, dict[str, Any]], ...] = (
                ("before: botocore standard mode, 5 attempts", BEFORE),
                ("shared backoff, max_attempts=5", {"max_attempts": 5}),
                ("shared backoff, by time: retry_timeout (default)", {}),
            )
            for label, options in variants:
                rig.use(
                    Throttle(
                        write_rate=args.compare_write_rate,
                        read_rate=1.6 * args.compare_write_rate,
                        prefix_depth=args.prefix_depth,
                    )
                )
                config = SaveConfig(
                    args.compare_ranks, args.files, args.file_size, args.workers, 1,
                    storage_options=options,
                )  # fmt: skip
                rate = f"{args.compare_write_rate:g} writes/s"
                title = f"retries {label}: {args.compare_ranks} ranks at {rate}"
                print(save_table(simulate_save(rig, config), title) + "\n", flush=True)
            rig.use(limit)
        if "steps" in parts:
            rows = measure_steps(rig, args.steps, gc_max_steps=args.gc_max_steps)
            print(steps_table(rows, args.steps) + "\n", flush=True)
            if args.steps > args.gc_max_steps:
                gc_rows = measure_steps(rig, args.gc_max_steps)[-1:]
                print(steps_table(gc_rows, args.gc_max_steps) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
