"""Replication throughput and memory, against raw boto3, in one run.

    scripts/bench-replicate                       # a step with one 1 GiB file, two moto servers
    python benchmarks/bench_replicate.py --size-mb 128 --rows streamed,boto3-transfer

A committed step holding one file of ``--size-mb`` (random bytes) is replicated from a bucket
on one S3 endpoint (moto on 127.0.0.1, in this process) into a bucket on a second endpoint
(another moto server, in a process of its own, other credentials: every byte streams through
the client), and into a second bucket on the same endpoint (server-side copies). Raw boto3
moves the same object the same ways: ``download_file`` + ``upload_file`` through a local
temporary file (the managed transfer, with the same part size and concurrency), and
``copy_object``, plain and asking for a CRC32C of the copy as ckptstore does (the server then
reads the bytes to compute it).

Each row runs in a fresh process (the S3 servers' memory is not counted): clients are made and
the stores listed before the measurement; the row's wall time, and its extra peak RSS
(``VmHWM`` after a reset, minus ``VmRSS`` just before). The bound is the issue's: what a streamed
copy holds by design, the read-ahead chunks plus the destination's parts in flight and the one
being cut (``ckptstore.data.copying.memory_bound``), plus 10%. The replicated step is then verified
(its manifest equal to the source's, every byte read back and checked), outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench_state import peak, reset_peak, rss

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
ROWS = {
    "streamed": "replicate, two endpoints (streamed)",
    "boto3-transfer": "boto3 download_file + upload_file",
    "server-side": "replicate, same endpoint (server-side, source checked)",
    "trusting": "replicate --trust-server-copies, same endpoint",
    "boto3-copy": "boto3 copy_object, same endpoint",
    "boto3-copy-crc": "boto3 copy_object + CRC32C, same endpoint",
}


# -- one row, in its own process ----------------------------------------------------------------


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec["kind"]
    if kind in ("streamed", "server-side", "trusting"):
        return _replicate_row(spec)
    import boto3
    from boto3.s3.transfer import TransferConfig

    a = boto3.client("s3", **spec["src_client"])
    b = boto3.client("s3", **spec["dst_client"])
    a.head_object(Bucket=spec["src_bucket"], Key=spec["src_key"])  # connections made
    b.list_objects_v2(Bucket=spec["dst_bucket"], MaxKeys=1)
    config = TransferConfig(
        multipart_threshold=spec["part_size"],
        multipart_chunksize=spec["part_size"],
        max_concurrency=spec["concurrency"],
    )
    target = f"raw/{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(dir=spec["tmpdir"]) as tmp:
        before = rss()
        reset_peak()
        started = time.perf_counter()
        if kind == "boto3-transfer":
            path = os.path.join(tmp, "object")
            a.download_file(spec["src_bucket"], spec["src_key"], path, Config=config)
            b.upload_file(path, spec["dst_bucket"], target, Config=config)
        else:
            source = {"Bucket": spec["src_bucket"], "Key": spec["src_key"]}
            extra = {"ChecksumAlgorithm": "CRC32C"} if kind == "boto3-copy-crc" else {}
            b.copy_object(Bucket=spec["dst_bucket"], Key=target, CopySource=source, **extra)
        seconds = time.perf_counter() - started
        extra = peak() - before
    size = b.head_object(Bucket=spec["dst_bucket"], Key=target)["ContentLength"]
    return {"seconds": seconds, "extra_rss": extra, "ok": size == spec["size"]}


def _replicate_row(spec: dict[str, Any]) -> dict[str, Any]:
    from ckptstore import CheckpointStore
    from ckptstore.replication.replicator import replicate

    src = CheckpointStore(spec["src"], storage_options=spec["src_options"], lease=False)
    dst = CheckpointStore(spec["dst"], storage_options=spec["dst_options"])
    src.list(), dst.list(), dst.hold_lease()  # clients, connections, probe: not the copy's
    before = rss()
    reset_peak()
    started = time.perf_counter()
    report = replicate(
        src,
        dst,
        chunk_size=spec["chunk_size"],
        read_ahead=spec["read_ahead"],
        check_server_copies=spec["kind"] != "trusting",
    )
    seconds = time.perf_counter() - started
    extra = peak() - before
    ok = [i.step for i in report.copied] == [1]
    if spec["verify"]:
        ok = ok and dst.info(1).manifest == src.info(1).manifest and dst.verify(1).ok
    dst.close()
    return {
        "seconds": seconds,
        "extra_rss": extra,
        "ok": ok,
        "streamed": report.bytes_streamed,
        "server_side": report.bytes_server_side,
    }


# -- the table --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="the step's one file, default 1024")
    p.add_argument("--part-size-mb", type=int, default=32, help="S3 part size (32, the default)")
    p.add_argument("--concurrency", type=int, default=8, help="S3 parts in flight (8)")
    p.add_argument("--chunk-mb", type=int, default=32, help="replication's ranged reads (32)")
    p.add_argument("--read-ahead", type=int, default=4, help="chunks read ahead (4)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    p.add_argument("--no-verify", action="store_true", help="skip reading the copies back")
    p.add_argument("--json", type=Path, help="write every row here")
    p.add_argument("--tmpdir", type=Path, help="where the source file and boto3's go")
    p.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker[0].read_text())
        args.worker[1].write_text(json.dumps(worker(spec)))
        return 0
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    from ckptstore import CheckpointStore
    from ckptstore.data.copying import memory_bound
    from ckptstore.testing.s3server import LocalS3Server

    size, part = args.size_mb * MiB, args.part_size_mb * MiB
    tuning = {"part_size": part, "max_concurrency": args.concurrency}
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmpdir)))
        one = stack.enter_context(LocalS3Server())
        for bucket in ("bench-src", "bench-same"):
            one.create_bucket(bucket)
        two = _server_process(stack, "bench-other")  # its own process, as another site's is
        a_options = {**one.storage_options(), **tuning}
        b_options = {**a_options, "endpoint_url": two, "key": "other", "secret": "other"}
        folder = base / "step"
        folder.mkdir()
        with open(folder / "optimizer.bin", "wb") as f:
            for _ in range(args.size_mb):
                f.write(os.urandom(MiB))
        with CheckpointStore("s3://bench-src/run", storage_options=a_options) as src:
            info = src.push_dir(1, folder)
        (folder / "optimizer.bin").unlink()
        src_key = f"run/{info.files[0].key(1)}"
        bound = memory_bound(
            part_size=part,
            parts_in_flight=args.concurrency,
            chunk_size=args.chunk_mb * MiB,
            read_ahead=args.read_ahead,
        )
        clients = {
            "one": _client(one),
            "two": {**_client(one), "endpoint_url": two, "aws_access_key_id": "other"},
        }
        for kind in wanted:
            far = kind in ("streamed", "boto3-transfer")
            spec = {
                "kind": kind,
                "src": "s3://bench-src/run",
                "src_options": a_options,
                "dst": f"s3://{'bench-other' if far else 'bench-same'}/{kind}",
                "dst_options": b_options if far else a_options,
                "src_client": clients["one"],
                "dst_client": clients["two" if far else "one"],
                "src_bucket": "bench-src",
                "src_key": src_key,
                "dst_bucket": "bench-other" if far else "bench-same",
                "size": size,
                "part_size": part,
                "concurrency": args.concurrency,
                "chunk_size": args.chunk_mb * MiB,
                "read_ahead": args.read_ahead,
                "verify": not args.no_verify,
                "tmpdir": str(base),
            }
            rows.append({"row": ROWS[kind], "kind": kind} | _run(spec, base))
    print(table(rows, size, bound, args))
    if args.json:
        args.json.write_text(json.dumps({"size": size, "bound": bound, "rows": rows}, indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1


def _client(server: Any) -> dict[str, Any]:
    options = server.storage_options()
    return {
        "endpoint_url": options["endpoint_url"],
        "aws_access_key_id": options["key"],
        "aws_secret_access_key": options["secret"],
        "region_name": options["region"],
    }


def _server_process(stack: ExitStack, bucket: str) -> str:
    """The second endpoint: an S3 server (moto) in a process of its own, with ``bucket``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ckptstore.testing.s3server", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    server = subprocess.Popen(
        [*command, "--bucket", bucket], stdout=subprocess.PIPE, text=True, env=env
    )
    stack.callback(server.wait, 30)
    stack.callback(server.send_signal, signal.SIGINT)
    assert server.stdout is not None
    if not server.stdout.readline().startswith("S3 server"):  # printed once it serves
        raise SystemExit("the second S3 server did not start")
    return f"http://127.0.0.1:{port}"


def _run(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    spec_path, result_path = base / "spec.json", base / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(HERE)]))
    command = [sys.executable, __file__, "--worker", str(spec_path), str(result_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not result_path.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exited {proc.returncode}: {tail[:300]}"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def table(rows: list[dict[str, Any]], size: int, bound: int, args: argparse.Namespace) -> str:
    raw = {r["kind"]: r["seconds"] for r in rows if "seconds" in r}
    lines = [
        f"one file of {size / MiB:.0f} MiB; S3 parts of {args.part_size_mb} MiB, "
        f"{args.concurrency} in flight; replication reads {args.chunk_mb} MiB chunks, "
        f"{args.read_ahead} ahead; bound of a streamed copy: {bound / MiB:.0f} MiB "
        f"(+10%: {1.1 * bound / MiB:.0f} MiB)",
        "",
        "| row | s | MB/s | vs boto3 | extra RSS MiB | RSS / bound | checked |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['row']} | failed: {r.get('error')} | | | | | |")
            continue
        baseline = raw.get(
            "boto3-transfer" if r["kind"] in ("streamed", "boto3-transfer") else "boto3-copy"
        )
        versus = f"{baseline / r['seconds']:.2f}x" if baseline else "-"
        ratio = f"{r['extra_rss'] / bound:.2f}" if r["kind"] == "streamed" else "-"
        checked = "yes" if r.get("ok") else "NO"
        lines.append(
            f"| {r['row']} | {r['seconds']:.2f} | {size / 1e6 / max(r['seconds'], 1e-9):.0f} | "
            f"{versus} | {r['extra_rss'] / MiB:.0f} | {ratio} | {checked} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
