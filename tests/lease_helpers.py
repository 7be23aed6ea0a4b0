"""Helpers for test_lease.py: fake time, a backend that fails the lease, records written by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.domain.layout import LEASE_NAME
from ckptstore.errors import BackendError
from ckptstore.protocol.lease import WriterLease
from ckptstore.protocol.lease_record import Process

THERE = Process("there", 99)
"""The contender's process, by default: on another host than the records' ``elsewhere``."""


class FakeTime:
    """A monotonic clock that only ``sleep`` moves; ``on_sleep`` runs after each sleep."""

    def __init__(self, on_sleep: Callable[[], None] | None = None) -> None:
        self.now = 1000.0
        self.slept: list[float] = []
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep()


class LeaseTroubles:
    """A backend that fails swaps of the lease while ``failing``, and can shift or hide the
    lease object's modification time (``lease_age``: seconds added to its age; ``mtimes``)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.failing = False
        self.lease_age = 0.0
        self.mtimes = True
        self.lease_swaps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        if path == LEASE_NAME:
            self.lease_swaps += 1
            if self.failing:
                raise BackendError("injected: the storage is unreachable", retryable=True)
        return self.inner.swap(path, data, expected)

    def stat(self, path: str) -> ObjectInfo | None:
        info = self.inner.stat(path)
        if info is None or info.mtime is None:
            return info
        if not self.mtimes:
            return replace(info, mtime=None)
        return replace(info, mtime=info.mtime - self.lease_age) if path == LEASE_NAME else info


def contender(
    backend: Backend, time: FakeTime | None = None, *, process: Process = THERE, **kw: Any
) -> WriterLease:
    """A writer on a third host (by default), on fake time if given, without a heartbeat."""
    clocks: dict[str, Any] = {"monotonic": time.monotonic, "sleep": time.sleep} if time else {}
    writer = f"{process.host}:{process.pid}:c0ffee"
    return WriterLease(backend, writer, process=process, heartbeat=False, **clocks, **kw)


def write_record(backend: Backend, **fields: Any) -> None:
    """A schema-2 lease record held by a process on host ``elsewhere``, ``fields`` changed."""
    body: dict[str, Any] = {
        "schema_version": 2,
        "epoch": 5,
        "holder": "elsewhere:4242:0123abcd",
        "host": "elsewhere",
        "pid": 4242,
        "pid_started": None,
        "pid_namespace": None,
        "acquired": 1.7e9,
        "renewed": 1.7e9,
        "ttl": 1.0,
        "released": False,
    }
    body.update(fields)
    backend.write(LEASE_NAME, [json.dumps(body).encode()])


def read_record(backend: Backend) -> dict[str, Any]:
    return dict(json.loads(backend.read(LEASE_NAME)))


SCRIPT = """
import json, sys
from ckptstore import CheckpointStore
uri, options, how, ttl = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])
store = CheckpointStore(uri, storage_options=options, lease_ttl=ttl)
if how == "hold":
    store.hold_lease()
else:
    latest = store.latest()
    step = latest.step + 1 if latest is not None else 1
    getattr(store, how)(step, {"step": step})
print("ready", flush=True)
if "wait" in sys.argv:
    sys.stdin.readline()
"""
"""Opens a store, holds its lease or saves the next step (``save`` or ``save_async``), and
exits without ``close()`` (or first waits for a line on stdin, with ``wait``)."""


def script(uri: str, options: dict[str, Any], how: str, ttl: float = 60.0) -> list[str]:
    return [sys.executable, "-c", SCRIPT, uri, json.dumps(options), how, str(ttl)]


def start(uri: str, options: dict[str, Any], how: str, ttl: float = 60.0) -> subprocess.Popen[str]:
    """The script in the background, once it is ready (held the lease or saved)."""
    return ready([*script(uri, options, how, ttl), "wait"])


def ready(command: list[str]) -> subprocess.Popen[str]:
    """A lease holder's ``command`` in the background, once it printed ``ready``; an
    AssertionError with its output if it did not."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the holder did not start: {line}{out}{err}")
    return proc
