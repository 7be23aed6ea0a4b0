"""Resume at the limit: every load path of ckptstore beside its limit, measured in the same run,
and beside the peers a user would pick (README "Resume at the limit").

One state (``--size-mb`` of float32 in ``--tensors`` tensors, fixed seed) is saved and loaded
every way below, side by side: each round runs every method once, in an order that turns
each round (rotated, and reversed on odd rounds) so no method always follows the same one;
one untimed warm-up round comes first. Seconds are medians of ``--rounds``; MB/s is the
state's bytes (1 MB = 10^6 bytes) over them. S3 is moto on 127.0.0.1, served by a process of
its own (``python -m ckptstore.testing.s3server``), so the client's threads and the server's
do not share one interpreter.

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
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from bench_tiers import drop_cache

from ckptstore import CheckpointStore
from ckptstore.backends.s3_options import DEFAULT_PART_SIZE
from ckptstore.domain import layout
from ckptstore.integrations import distributed as dist_face
from ckptstore.integrations.distributed import load_distributed, rank_dir, save_distributed
from ckptstore.tiers import peers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ranks import run_ranks  # tests/ranks.py: gloo ranks forked from a server

MiB = 1 << 20
BUCKET = "bench"
REGION, KEY = "us-east-1", "testing"


State = dict[str, dict[str, torch.Tensor]]


def state_of(size_mb: float, tensors: int, seed: int = 0) -> State:
    """``tensors`` float32 tensors of ``size_mb`` MiB in all, from a fixed seed, under one
    top-level key as a model's ``state_dict`` (ckptstore cuts it into shards of 32 MiB)."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, int(size_mb * MiB) // tensors // 4)
    return {"model": {f"t{i:03d}": torch.rand(per, generator=gen) for i in range(tensors)}}


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def flat_bytes(state: State) -> memoryview:
    """The state's tensor bytes, one after another, in one buffer."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state["model"].values()])
    return memoryview(flat.numpy()).cast("B")


def payload(path: str) -> bool:
    """Whether ``path`` is a payload file of a step (not its manifest or attempt marker)."""
    return not path.endswith((layout.MANIFEST_NAME, layout.ATTEMPT_MARKER))


def cuts(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)] or [(0, 0)]


# -- the S3 server and clients ----------------------------------------------------------------


class Server:
    """moto's S3 server in a process of its own, on a free port of 127.0.0.1."""

    def __enter__(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ckptstore.testing.s3server", "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, "--bucket", BUCKET], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # printed once the bucket exists
        if not line:
            raise RuntimeError(f"the S3 server did not start (exit {self.proc.wait()})")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "key": KEY, "secret": KEY, "region": REGION}

    def client(self, pool: int = 64) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            max_pool_connections=pool,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=KEY,
            aws_secret_access_key=KEY,
            config=config,
        )


def fsspec_options(server: Server) -> dict[str, Any]:
    return {
        "endpoint_url": server.url,
        "key": KEY,
        "secret": KEY,
        "client_kwargs": {"region_name": REGION},
    }


# -- rows -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One method: ``run()`` is timed, ``prep()`` (untimed) runs just before it."""

    group: str
    name: str
    role: str  # "ckptstore", "limit", "peer", or "line" (a bound that is not the limit)
    run: Callable[[], Any]
    prep: Callable[[], None] = lambda: None
    seconds: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def raw_get_rows(client: Any, keys: dict[str, int], part: int, conc: int) -> list[Row]:
    """Parallel GetObjects of ``keys`` (key -> size), whole and in ranges of ``part``."""

    def download(span: int | None) -> None:
        buffers = {key: torch.empty(size, dtype=torch.uint8) for key, size in keys.items()}
        tasks = [(k, a, b) for k, size in keys.items() for a, b in cuts(size, span or size)]

        def one(task: tuple[str, int, int]) -> None:
            key, a, b = task
            extra = {} if span is None else {"Range": f"bytes={a}-{b - 1}"}
            body = client.get_object(Bucket=BUCKET, Key=key, **extra)["Body"]
            view = memoryview(buffers[key].numpy())[a:b]
            while len(view):  # readinto in 4 MiB calls, as boto3's fastest path
                n = body.readinto(view[: 4 * MiB])
                if not n:
                    raise AssertionError(f"{key}: body ended early")
                view = view[n:]

        with ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, tasks))

    whole = f"raw GET of the store's {len(keys)} objects, whole, x{conc}"
    ranged = f"raw GET of the store's objects, {part // MiB} MiB ranges, x{conc}"
    return [
        Row("S3 load", whole, "limit", lambda: download(None)),
        Row("S3 load", ranged, "limit", lambda: download(part)),
    ]


class RawUpload:
    """boto3's plain PutObject / multipart API from a thread pool, no client checksums."""

    def __init__(self, client: Any, flat: memoryview) -> None:
        self.client, self.flat = client, flat

    def upload(self, prefix: str, sizes: list[int], part: int, conc: int) -> None:
        """The flat bytes cut into objects of ``sizes``, each put whole or in ``part`` parts."""
        waits: list[Future[Any]] = []
        with ThreadPoolExecutor(conc) as pool, ThreadPoolExecutor(4) as completer:
            start = 0
            for n, size in enumerate(sizes):
                key, end = f"{prefix}/{n:05d}", start + size
                if size <= part:
                    waits.append(pool.submit(self._put, key, start, end))
                else:
                    upload = self.client.create_multipart_upload(Bucket=BUCKET, Key=key)
                    parts = [
                        pool.submit(self._part, key, upload["UploadId"], i, start + a, start + b)
                        for i, (a, b) in enumerate(cuts(size, part), 1)
                    ]
                    waits.append(completer.submit(self._complete, key, upload["UploadId"], parts))
                start = end
            for future in waits:
                future.result()

    def _put(self, key: str, a: int, b: int) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(self.flat[a:b]))

    def _part(self, key: str, upload_id: str, number: int, a: int, b: int) -> dict[str, Any]:
        resp = self.client.upload_part(
            Bucket=BUCKET,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=bytes(self.flat[a:b]),
        )
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _complete(self, key: str, upload_id: str, parts: list[Future[dict[str, Any]]]) -> None:
        done = [f.result() for f in parts]
        self.client.complete_multipart_upload(
            Bucket=BUCKET, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
        )


def tuned_one_object(raw: RawUpload, total: int, quick: bool) -> tuple[int, int, dict[str, float]]:
    """The best (part size, threads) for the bytes as one object: each setting timed once."""
    settings = [(16 * MiB, 8), (32 * MiB, 8), (8 * MiB, 16)]
    if quick:
        settings = [(5 * MiB, 8), (8 * MiB, 4)]
    tried: dict[tuple[int, int], float] = {}
    for part, conc in settings:
        started = time.perf_counter()
        raw.upload("sweep", [total], part, conc)
        tried[(part, conc)] = time.perf_counter() - started
    part, conc = min(tried, key=tried.__getitem__)
    return part, conc, {f"{p // MiB} MiB x{c}": round(s, 3) for (p, c), s in tried.items()}


def peer_rows(server: Server, state: State, bump: Callable[[], None]) -> list[Row]:
    """s3torchconnector's S3Checkpoint and DCP over s3fs: save and load of the same state."""
    rows: list[Row] = []
    try:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        checkpoint = S3Checkpoint(
            REGION, server.url, s3client_config=S3ClientConfig(force_path_style=True)
        )
        uri = f"s3://{BUCKET}/s3tc/state.pt"

        def tc_save() -> None:
            with checkpoint.writer(uri) as writer:
                torch.save(state, writer)

        def tc_load() -> Any:
            with checkpoint.reader(uri) as reader:
                return torch.load(cast(IO[bytes], reader), map_location="cpu")

        tc_save()
        rows += [
            Row("S3 save", "s3torchconnector S3Checkpoint (torch.save)", "peer", tc_save, bump),
            Row("S3 load", "s3torchconnector S3Checkpoint (torch.load)", "peer", tc_load),
        ]
    except ImportError as e:
        rows += [
            Row(g, "s3torchconnector S3Checkpoint", "peer", lambda: None, error=f"{e}")
            for g in ("S3 save", "S3 load")
        ]
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = fsspec_options(server)
    dcp_uri = f"s3://{BUCKET}/dcp"

    def dcp_save() -> None:
        save(state, storage_writer=FsspecWriter(dcp_uri, **opts))

    def dcp_load() -> Any:
        out = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        load(out, storage_reader=FsspecReader(dcp_uri, **opts))
        return out

    dcp_save()
    rows += [
        Row("S3 save", "DCP FsspecWriter (s3fs)", "peer", dcp_save, bump),
        Row("S3 load", "DCP FsspecReader (s3fs)", "peer", dcp_load),
    ]
    return rows


def s3_rows(
    server: Server, state: State, args: argparse.Namespace, notes: dict[str, Any]
) -> list[Row]:
    """ckptstore's S3 save and load beside their limits and peers."""
    options = server.options()
    client = server.client()
    total = nbytes(state)
    steps = iter(range(10, 10**6))

    def bump() -> None:  # a new step's bytes, as training changes every tensor
        for t in state["model"].values():
            t.view(-1)[0] += 1.0

    saver = CheckpointStore(f"s3://{BUCKET}/save", storage_options=options, keep_last=2)
    loader = CheckpointStore(f"s3://{BUCKET}/load", storage_options=options)
    loader.save(1, state)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"load/{layout.step_dir(1)}/")
    objects = {o["Key"]: o["Size"] for o in listed["Contents"] if payload(o["Key"])}
    notes["store objects"] = sorted(objects.values(), reverse=True)
    part, conc = DEFAULT_PART_SIZE, args.concurrency

    rows = [
        Row("S3 load", "ckptstore load (every byte verified)", "ckptstore", lambda: loader.load(1)),
        *raw_get_rows(client, objects, part, conc),
        Row("S3 save", "ckptstore save", "ckptstore", lambda: saver.save(next(steps), state), bump),
    ]
    raw = RawUpload(client, flat_bytes(state))
    one_part, one_conc, sweep = tuned_one_object(raw, total, args.quick)
    notes["one-object upload sweep (s)"] = sweep
    sizes = sorted(objects.values(), reverse=True)  # with the skeleton: a few bytes more
    sizes = [s for s in sizes if sum(sizes) <= total or s > 64 << 10]
    sizes[-1] += total - sum(sizes)  # the state's bytes exactly, in the store's cuts
    rows += [
        Row(
            "S3 save",
            f"raw multipart upload, one object, {one_part // MiB} MiB parts x{one_conc} (tuned)",
            "limit",
            lambda: raw.upload("raw-one", [total], one_part, one_conc),
        ),
        Row(
            "S3 save",
            f"raw PutObject of the store's {len(sizes)} objects, whole, x{conc}",
            "limit",
            lambda: raw.upload("raw-store", sizes, max(sizes), conc),
        ),
    ]
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_threshold=16 * MiB,
        multipart_chunksize=16 * MiB,
        max_concurrency=8,
        use_threads=True,
    )

    def fileobj() -> None:
        import io

        client.upload_fileobj(io.BytesIO(raw.flat), BUCKET, "raw-fileobj/state", Config=config)

    rows.append(Row("S3 save", "raw upload_fileobj, one object, 16 MiB parts x8", "limit", fileobj))
    return rows + peer_rows(server, state, bump)


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
    ]


def raw_read(files: list[Path], piece: int | None, conc: int) -> list[torch.Tensor]:
    """``files`` read into fresh buffers by ``conc`` threads (whole files, or pieces)."""
    sizes = {p: p.stat().st_size for p in files}
    out = {p: torch.empty(s, dtype=torch.uint8) for p, s in sizes.items()}
    fds = {p: os.open(p, os.O_RDONLY) for p in files}

    def one(task: tuple[Path, int, int]) -> None:
        path, a, b = task
        view = memoryview(out[path].numpy())
        while a < b:
            n = os.preadv(fds[path], [view[a : min(b, a + 64 * MiB)]], a)
            if not n:
                raise AssertionError(f"{path}: ended early")
            a += n

    tasks = [(p, a, b) for p, s in sizes.items() for a, b in cuts(s, piece or max(s, 1))]
    try:
        with ThreadPoolExecutor(min(conc, len(tasks))) as pool:
            list(pool.map(one, tasks))
    finally:
        for fd in fds.values():
            os.close(fd)
    return list(out.values())


def run_rounds(rows: list[Row], rounds: int, warmup: bool, log: Callable[[str], None]) -> None:
    """An untimed warm-up round (``warmup``), then ``rounds``, each in a turned order."""
    for r in range(-1 if warmup else 0, rounds):
        order = rows[r % len(rows) :] + rows[: r % len(rows)] if r >= 0 else list(rows)
        if r % 2:
            order.reverse()
        for row in order:
            if row.error:
                continue
            row.prep()
            started = time.perf_counter()
            try:
                row.run()
            except Exception as e:  # a peer that cannot run here says why
                row.error = f"{type(e).__name__}: {e}"[:200]
                continue
            if r >= 0:
                row.seconds.append(time.perf_counter() - started)
        log(f"round {r + 1}/{rounds} done" if r >= 0 else "warm-up done")


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


def _ranks(
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

    dist_face.recover_from_peer = timed_recovery  # the face's reference: the recovery alone

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


# -- report -----------------------------------------------------------------------------------


def mbs(total: int, seconds: float) -> float:
    return total / seconds / 1e6 if seconds > 0 else float("nan")


def report(
    rows: list[Row], rank_rows: list[Row], total: int, rank_total: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Print the tables; returns what ``--json`` writes."""
    out: dict[str, Any] = {"rows": [], "ratios": {}}
    warm = "" if args.quick else " after a warm-up"
    print(
        f"\n{total / 1e6:.0f} MB state ({args.tensors} float32 tensors), medians of "
        f"{args.rounds} rounds{warm}, S3 = moto on 127.0.0.1\n"
    )
    print("| path | method | MB/s | runs (s) | limit MB/s | ratio to limit |")
    print("|---|---|---:|---:|---:|---:|")
    for group in dict.fromkeys(r.group for r in rows + rank_rows):
        members = [r for r in rows + rank_rows if r.group == group]
        size = rank_total if any(r in rank_rows for r in members) else total
        limits = [r for r in members if r.role == "limit" and r.seconds]
        best = max((mbs(size, r.median) for r in limits), default=float("nan"))
        for r in members:
            speed = mbs(size, r.median)
            if r.error:
                print(f"| {group} | {r.name} | did not run: {r.error} | | | |")
            else:
                spread = f"{min(r.seconds):.3f}-{max(r.seconds):.3f}"
                ratio = f"{speed / best:.2f}x" if r.role in ("ckptstore", "peer") else ""
                print(f"| {group} | {r.name} | {speed:.0f} | {spread} | {best:.0f} | {ratio} |")
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
            if r.role == "ckptstore":
                out["ratios"][f"{group}: to limit"] = speed / best
        mine = next((r for r in members if r.role == "ckptstore"), None)
        for r in members:
            if r.role in ("peer", "line") and mine is not None and r.seconds and mine.seconds:
                out["ratios"][f"{group}: to {r.name}"] = r.median / mine.median
    print("\nratios from this run (ckptstore's speed over the other's):")
    for name, value in out["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256, help="the state, MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="threads of the raw rows")
    parser.add_argument("--quick", action="store_true", help="4 MiB, 16 tensors, one round")
    parser.add_argument("--json", type=Path, help="write every run of every row here")
    parser.add_argument("--rank-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.tensors, args.rounds = 4, 16, 1
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
    with Server() as server, tempfile.TemporaryDirectory() as tmp:
        rows = s3_rows(server, state, args, notes) + local_rows(Path(tmp), state, args.concurrency)
        log(f"setup done: {len(rows)} rows")
        run_rounds(rows, args.rounds, not args.quick, log)
        world = 2
        per_rank = args.size_mb / world
        ranks = run_ranks(
            _ranks,
            world,
            Path(tmp) / "launch",
            per_rank,
            args.tensors // world,
            args.rounds,
            Path(tmp) / "tiers",
            server.options(),
            args.concurrency,
            not args.quick,
            timeout=args.rank_timeout,
        )
    rank_total = nbytes(state_of(per_rank, args.tensors // world))  # one node's share

    def slowest(name: str) -> list[float]:
        return [max(r[name][i] for r in ranks) for i in range(args.rounds)]

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
    ]
    out = report(rows, rank_rows, total, rank_total, args)
    peer, bucket = (
        statistics.median(slowest("resume from peer")),
        statistics.median(slowest("resume from bucket")),
    )
    print(
        f"\nresume of a tiered replicas=1 job that lost node 1 ({world} ranks x "
        f"{rank_total / 1e6:.0f} MB; open the store, agree on the step, take the files, load; "
        f"the slowest rank): from the peer {peer:.3f} s, from the bucket (replicas=0) "
        f"{bucket:.3f} s: {bucket / peer:.2f}x faster from the peer"
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
