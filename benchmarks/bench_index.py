"""What ``ls``, ``latest()``, a steady save and a mass prune cost on a store of many steps.

The README's "Long runs" table comes from here. A store of ``--steps`` committed steps
(manifests without payload, written straight to moto, ``latest`` at the last) is opened by a
fresh store object for each row, as a new process would; every request goes over HTTP through
the fault proxy, which counts them by S3 operation. With the step index (this version), the
store is indexed once first (``rebuild_index``, what ``ckptstore index --rebuild`` runs, and
what the first listing of an index-less store does by itself); run the same script with
``PYTHONPATH`` at an older ckptstore's ``src`` for the "before" rows (it then skips that).

moto serves from a thread of this process, and its store of ``--steps`` objects would make
every garbage collection during a measured row scan half a million objects that a real
``ckptstore ls`` process does not hold (on a 2-core machine: ``ls`` 2.1 s with them, 1.0 s
without); so the seeded objects are frozen out of the collector (``gc.freeze``) before the
rows, and ``ckptstore ls`` is also timed as a real process (interpreter, imports and all),
beside the start-up of one that only imports the CLI.

``prune`` keeps the newest 5 and deletes the rest; its "listing" requests are those that find
what to delete (LIST pages, index and manifest GETs made to choose), counted apart from the
removal's own per-step requests (each removed step: its manifest read and swapped for a
tombstone, the tombstone dropped).

    python benchmarks/bench_index.py --steps 10000
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from click.testing import CliRunner
from scale import BUCKET, Rig, seed_steps

from ckptstore import CheckpointStore
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.cli.main import cli
from ckptstore.testing.s3server import DUMMY_KEY, DUMMY_SECRET, REGION

EVERY = 10
CLI = "import sys; from ckptstore.cli.main import run; sys.exit(run())"
"""The ``ckptstore`` command, run by this interpreter (the checkout's ``src`` on PYTHONPATH)."""


class ChoosingCounter(BackendProxy):
    """Counts the reads a prune makes to choose what to delete, until ``stop()``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.counting = True

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self._count("GET " + _kind(path))
        return super().read(path, start, end)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        self._count("GET " + _kind(path))
        return super().read_versioned(path)

    def list(self, prefix: str) -> Any:
        self._count("LIST")
        return super().list(prefix)

    def list_dirs(self, prefix: str) -> list[str]:
        self._count("LIST dirs")
        return super().list_dirs(prefix)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        if path.endswith("manifest.json"):
            self.counting = False  # the first uncommit: choosing is over
        return super().swap(path, data, expected)

    def _count(self, kind: str) -> None:
        if self.counting:
            self.calls[kind] += 1


def _kind(path: str) -> str:
    if path.endswith("manifest.json"):
        return "manifest"
    if path == "latest.json":
        return "pointer"
    return "index" if path.startswith(".ckptstore/index/") else "other"


def measure(steps: int, prune_steps: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    with Rig(None) as rig:
        assert rig.proxy is not None
        proxy = rig.proxy
        uri = f"s3://{BUCKET}/steps-{time.monotonic_ns()}"
        seed_steps(rig, uri, steps, EVERY)
        options = rig.options()
        gc.collect()
        gc.freeze()  # moto's objects (module docstring)

        def fresh(**extra: Any) -> CheckpointStore:
            return CheckpointStore(uri, storage_options=options, lease=False, **extra)

        def row(name: str, action: Callable[[], object]) -> None:
            seen = Counter(proxy.seen)
            started = time.perf_counter()
            action()
            seconds = time.perf_counter() - started
            requests = Counter(proxy.seen) - seen
            rows[name] = {"seconds": round(seconds, 2), "requests": sum(requests.values()),
                          "by_kind": dict(requests)}  # fmt: skip
            print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)

        with fresh() as store:
            if hasattr(store, "rebuild_index"):
                row("index --rebuild (once)", store.rebuild_index)
        with fresh() as store:
            row("latest()", store.latest)
        env = {"AWS_ACCESS_KEY_ID": DUMMY_KEY, "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
               "AWS_DEFAULT_REGION": REGION}  # fmt: skip
        endpoint = options["endpoint_url"]

        def ls() -> None:
            args = ["ls", uri, "--endpoint-url", endpoint]
            result = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
            assert result.exit_code == 0, result.output
            assert f"total: {steps} steps" in result.output, result.output[-300:]

        row("ckptstore ls (new store object)", ls)
        process_env = {**os.environ, **env}

        def ls_process() -> None:
            args = [sys.executable, "-c", CLI, "ls", uri, "--endpoint-url", endpoint]
            done = subprocess.run(args, env=process_env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-2000:]
            assert f"total: {steps} steps" in done.stdout, done.stdout[-300:]

        def start_up() -> None:
            args = [sys.executable, "-c", "import ckptstore.cli.main"]
            subprocess.run(args, env=process_env, check=True)

        row("ckptstore ls (a real process)", ls_process)
        row("start-up alone (a process importing the CLI)", start_up)
        with fresh() as store:
            store.save((steps + 1) * EVERY, {"w": torch.ones(4)})  # the first save of a process
            row(
                "save (steady, 2nd of a process)",
                lambda: store.save((steps + 2) * EVERY, {"w": torch.ones(4)}),
            )
        with fresh(keep_last=5) as store:
            row(
                "prune to 5 steps, --dry-run (what it reads to choose)",
                lambda: store.prune(dry_run=True),
            )
        with fresh() as store:
            row("ckptstore ls, again after a save", store.list)
        if prune_steps:
            rows.update(measure_prune(rig, prune_steps))
    return rows


def measure_prune(rig: Rig, steps: int) -> dict[str, Any]:
    """A real prune to 5 steps of a store of ``steps``: every request, and apart those it
    made to choose (before its first uncommit)."""
    uri = f"s3://{BUCKET}/prune-{time.monotonic_ns()}"
    seed_steps(rig, uri, steps, EVERY)
    options = rig.options()
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        if hasattr(store, "rebuild_index"):
            store.rebuild_index()
    assert rig.proxy is not None
    backend = ChoosingCounter(open_backend(uri, options))
    seen = Counter(rig.proxy.seen)
    started = time.perf_counter()
    with CheckpointStore(uri, backend=backend, lease=False, keep_last=5) as store:
        deleted = store.prune()
    seconds = time.perf_counter() - started
    requests = Counter(rig.proxy.seen) - seen
    name = f"prune {steps} steps to 5 (real)"
    row = {"seconds": round(seconds, 2), "requests": sum(requests.values()),
           "by_kind": dict(requests), "deleted": len(deleted),
           "choosing": dict(backend.calls)}  # fmt: skip
    print(f"{name}: {row}", file=sys.stderr, flush=True)
    return {name: row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-index", description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--prune-steps", type=int, default=1000, help="store for a real prune")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = measure(args.steps, args.prune_steps)
    print(f"| operation ({args.steps} steps) | requests | seconds |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['requests']} | {r['seconds']:.2f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"steps": args.steps, "pythonpath": os.environ.get("PYTHONPATH"),
                       "rows": rows}, out, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
