"""ckptstore against the usual ways of checkpointing a state_dict, on a local disk and on S3.

    scripts/bench                       # 1 GiB state, 3 runs, local dir + moto on 127.0.0.1
    python benchmarks/bench.py --size-mb 64 --runs 1 --targets s3 --only ckptstore

Every row is measured in a fresh process (bench_worker.py, forked from a server that imported
it) that builds the same state from a fixed seed; the S3 server (moto, unless
``--endpoint-url``) runs in this process, so its memory is not counted against any row. Each
row's speed is the median of ``--runs`` runs, compared with the raw limit of its target measured
in the same run: the same bytes written with one write + fsync (or read back with the page cache
dropped), and uploaded (downloaded) through boto3's plain API at the best settings of a short
sweep (bench_s3_limits.py). The table is followed by the issue's targets, each with PASS or
MISS. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bench_report
from bench_methods import Row, S3Target, Spec, catalog

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20
REGION = "us-east-1"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--runs", type=int, default=3, help="runs per row; the median is shown")
    p.add_argument("--targets", default="local,s3", help="comma-separated: local, s3")
    p.add_argument("--endpoint-url", help="an S3 endpoint to use instead of starting moto")
    p.add_argument("--bucket", default="ckptstore-bench", help="bucket (created on moto)")
    p.add_argument("--part-size-mb", type=int, default=32, help="ckptstore and tuned boto3 rows")
    p.add_argument("--concurrency", type=int, default=8, help="ckptstore and tuned boto3 rows")
    p.add_argument("--shard-size-mb", type=int, help="ckptstore shard_size (default: library's)")
    p.add_argument("--only", help="comma-separated method-name prefixes (raw limits always run)")
    p.add_argument("--json", type=Path, help="write every row's measurements here")
    p.add_argument("--tmpdir", type=Path, help="where local rows write (default: system temp)")
    p.add_argument("--row-timeout", type=float, default=1800, help="seconds per row")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: each raw limit times one setting"
    )
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.targets or set(args.targets) - {"local", "s3"}:
        p.error("--targets takes local, s3 or both")
    if args.size_mb < 1 or args.runs < 1:
        p.error("--size-mb and --runs must be positive")
    return args


def select(rows: list[Row], targets: list[str], only: str | None) -> list[Row]:
    prefixes = [p.strip().lower() for p in (only or "").split(",") if p.strip()]
    chosen = [r for r in rows if r.target in targets]
    if prefixes:
        chosen = [r for r in chosen if r.limit or r.name.lower().startswith(tuple(prefixes))]
    return chosen


def child_env(s3: S3Target | None, moto: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    if s3 is not None and moto:  # dummy credentials; the caller's AWS settings stay out
        for name in [n for n in env if n.startswith("AWS_")]:
            del env[name]
        nowhere = str(Path(tempfile.gettempdir()) / "ckptstore-bench-no-aws-config")
        env |= {
            "AWS_ACCESS_KEY_ID": s3.key or "testing",
            "AWS_SECRET_ACCESS_KEY": s3.secret or "testing",
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": nowhere,
            "AWS_SHARED_CREDENTIALS_FILE": nowhere,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    return env


ROWS = multiprocessing.get_context("forkserver")
"""Rows run in processes forked from a server that imported bench_worker (torch, ckptstore, the
methods) once: each row starts with no state, allocation or thread of another row, as in a new
interpreter, without paying torch's import per row."""
ROWS.set_forkserver_preload(["bench_worker"])


def _preload_path() -> None:
    """Put this folder and the source tree on the forkserver's import path. Python 3.11's
    forkserver does not apply the parent's sys.path before its preload, whose ImportError it
    swallows: without this every row imported torch and ckptstore again, seconds per row."""
    paths = [str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def _row_process(spec_path: str, result_path: str, env: dict[str, str], log_path: str) -> None:
    """One row (bench_worker.py), with ``env`` as its environment and its output in a log."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import bench_worker

    sys.exit(bench_worker.main(spec_path, result_path))


def run_row(spec: Spec, env: dict[str, str], scratch: Path, timeout: float) -> dict[str, Any]:
    spec_path, result_path = scratch / "spec.json", scratch / "result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    result_path.unlink(missing_ok=True)
    log_path = scratch / f"{_slug(spec.target + '-' + spec.row)}.log"
    args = (str(spec_path), str(result_path), env, str(log_path))
    proc = ROWS.Process(target=_row_process, args=args, name=f"bench-{spec.row}")
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    if proc.exitcode != 0 or not result_path.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "error": f"worker exited {proc.exitcode}: {tail[0][:200]}"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def clear_prefix(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ())
    for up in uploads:
        client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def start_s3(args: argparse.Namespace, stack: ExitStack) -> tuple[S3Target, Any]:
    import boto3

    run = f"bench-{uuid.uuid4().hex[:8]}"
    if args.endpoint_url:
        target = S3Target(args.endpoint_url, args.bucket, run, os.environ.get("AWS_REGION", REGION))
        client = boto3.client("s3", endpoint_url=args.endpoint_url, region_name=target.region)
        client.head_bucket(Bucket=args.bucket)  # fail early, with boto3's own message
        return target, client
    from ckptstore.testing.s3server import LocalS3Server

    server = stack.enter_context(LocalS3Server())
    server.create_bucket(args.bucket)
    opts = server.storage_options()
    target = S3Target(server.endpoint_url, args.bucket, run, REGION, opts["key"], opts["secret"])
    return target, server.client()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = select(catalog(), args.targets, args.only)
    base = Path(args.tmpdir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ckptstore-bench-", dir=base))
    results: list[dict[str, Any]] = []
    _preload_path()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        s3, client = start_s3(args, stack) if "s3" in args.targets else (None, None)
        started = time.perf_counter()
        for n, row in enumerate(rows, 1):
            slug = _slug(f"{row.target}-{row.name}")
            workdir = scratch / slug
            workdir.mkdir()
            row_s3 = None
            if row.target == "s3" and s3 is not None:
                row_s3 = S3Target(**{**asdict(s3), "prefix": f"{s3.prefix}/{slug}"})
            spec = Spec(
                row=row.name,
                target=row.target,
                size_bytes=args.size_mb * MiB,
                runs=args.runs,
                workdir=str(workdir),
                part_size=args.part_size_mb * MiB,
                concurrency=args.concurrency,
                s3=row_s3,
                shard_size=args.shard_size_mb * MiB if args.shard_size_mb else None,
                quick=args.quick,
            )
            print(f"[{n}/{len(rows)}] {row.target} {row.name} ...", file=sys.stderr, flush=True)
            env = child_env(row_s3, moto=not args.endpoint_url)
            result = run_row(spec, env, scratch, args.row_timeout)
            result |= {"row": row.name, "target": row.target, "kind": row.kind}
            results.append(result)
            shutil.rmtree(workdir, ignore_errors=True)
            if row_s3 is not None and client is not None:
                clear_prefix(client, row_s3.bucket, row_s3.prefix + "/")
            shown = f"{result['mb_s']:.0f} MB/s" if result.get("ok") else result.get("error")
            print(f"    {shown}", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
    size = results[0]["state_bytes"] if results and results[0].get("ok") else args.size_mb * MiB
    shard = f"{args.shard_size_mb} MiB" if args.shard_size_mb else "default"
    print(
        f"\nckptstore benchmark: {size / MiB:.0f} MiB state (model + Adam), "
        f"median of {args.runs} run(s), {os.cpu_count()} CPUs, {elapsed / 60:.1f} min; "
        f"S3: {'moto on 127.0.0.1' if not args.endpoint_url else args.endpoint_url}; "
        f"ckptstore: {args.part_size_mb} MiB parts x {args.concurrency}, shard_size {shard}; "
        "MB = 1e6 bytes\n"
    )
    print(bench_report.table(results))
    print("\ntargets (ratios from this run):")
    print(bench_report.verdicts(results, args.part_size_mb * MiB, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps({"args": _jsonable(vars(args)), "rows": results}, indent=1))
    return 0


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


if __name__ == "__main__":
    sys.exit(main())
