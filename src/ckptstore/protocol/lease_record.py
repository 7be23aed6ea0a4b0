"""The writer lease's record, ``.ckptstore/lease.json``, and the process that wrote it.

The record says who holds the lease (``holder``, the writer id ``host:pid:random``), under which
fencing ``epoch``, after how long a silence it is gone (``ttl``; ``null`` for never), and
whether its holder gave it up (``released``; the record stays so epochs keep counting up).
``acquired`` and ``renewed`` are the holder's wall clock, for people reading the file: nobody
judges expiry by them, because two hosts' clocks need not agree (lease.py uses the storage's
clock or the observer's own). ``host``, ``pid``, ``pid_started`` (the process start time from
``/proc``, so that a reused PID is not taken for the holder) and ``pid_namespace`` (containers
that share a hostname, like Kubernetes pods on the host network, number their processes apart)
let a contender on the same machine see at once that the holder's process is gone.

Schema 1, written before the heartbeat, had epoch, holder, acquired, renewed and ttl, and marked
a release with ``renewed == 0.0``; it is still read. Anything else is a
:class:`~ckptstore.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptstore.backends.base import Backend, join
from ckptstore.domain import layout
from ckptstore.errors import CorruptCheckpointError, NotFoundError

log = logging.getLogger(__name__)

LEASE_SCHEMA = 2
_V1_FIELDS = frozenset({"epoch", "holder", "acquired", "renewed", "ttl", "schema_version"})
_V2_FIELDS = _V1_FIELDS | {"host", "pid", "pid_started", "pid_namespace", "released"}
_WRITER_ID = re.compile(r"^(?P<host>[^:]+):(?P<pid>[0-9]+):[0-9a-f]+$")


@dataclass(frozen=True)
class Process:
    """A process as another process on the same machine can recognise it."""

    host: str
    pid: int
    started: int | None = None
    """Start time in clock ticks after boot (``/proc/<pid>/stat`` field 22), where known."""
    namespace: str | None = None
    """The PID namespace (``/proc/self/ns/pid``), where known."""

    @classmethod
    def current(cls) -> Process:
        pid = os.getpid()
        stat = _proc_stat(pid)
        try:
            namespace: str | None = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = None
        return cls(socket.gethostname(), pid, stat[1] if stat else None, namespace)

    def same_machine(self, other: Process) -> bool:
        """Whether ``other``'s PID means a process this one can look up."""
        return self.host == other.host and self.namespace == other.namespace

    def gone(self) -> bool:
        """Whether this process has certainly exited (False where that cannot be told)."""
        stat = _proc_stat(self.pid)
        if stat is not None:
            state, started = stat
            return state in ("Z", "X") or (self.started is not None and started != self.started)
        if sys.platform == "win32":
            return False  # os.kill(pid, 0) would terminate the process there
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # PermissionError: alive, owned by another user
        return False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and start time from ``/proc``, or None where unavailable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class LeaseRecord:
    """The content of ``lease.json`` (schema 2)."""

    epoch: int
    holder: str
    host: str | None
    pid: int | None
    pid_started: int | None
    pid_namespace: str | None
    acquired: float
    renewed: float
    ttl: float
    """Seconds; ``math.inf`` (JSON ``null``): never expires."""
    released: bool = False
    schema_version: int = LEASE_SCHEMA

    @classmethod
    def new(cls, epoch: int, holder: str, process: Process, now: float, ttl: float) -> LeaseRecord:
        return cls(
            epoch,
            holder,
            process.host,
            process.pid,
            process.started,
            process.namespace,
            acquired=now,
            renewed=now,
            ttl=ttl,
        )

    def process(self) -> Process | None:
        """The holder's process, where the record names one."""
        if self.host is None or self.pid is None:
            return None
        return Process(self.host, self.pid, self.pid_started, self.pid_namespace)

    def held_by(self, writer: str, epoch: int | None) -> bool:
        return not self.released and self.holder == writer and self.epoch == epoch

    def encode(self) -> bytes:
        body = asdict(self)
        body["ttl"] = None if math.isinf(self.ttl) else self.ttl
        body["schema_version"] = LEASE_SCHEMA
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> LeaseRecord:
        """Decode ``lease.json``; ``where`` names it (its URI) in messages and as ``e.uri``."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            version = body.get("schema_version")
            if isinstance(version, bool) or version not in (1, LEASE_SCHEMA):
                raise ValueError(f"schema_version {version!r}")
            expected = _V1_FIELDS if version == 1 else _V2_FIELDS
            if set(body) != expected:
                raise ValueError(f"fields {sorted(set(body) ^ expected)} (schema {version})")
            return cls._from_v1(body) if version == 1 else cls._from_v2(body)
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where}: unreadable writer lease ({e})", uri=where, path=layout.LEASE_NAME
            ) from e

    @classmethod
    def _from_v2(cls, body: dict[str, Any]) -> LeaseRecord:
        ttl = body["ttl"]
        return cls(
            epoch=_integer(body, "epoch"),
            holder=_text(body, "holder"),
            host=None if body["host"] is None else _text(body, "host"),
            pid=None if body["pid"] is None else _integer(body, "pid"),
            pid_started=None if body["pid_started"] is None else _integer(body, "pid_started"),
            pid_namespace=None if body["pid_namespace"] is None else _text(body, "pid_namespace"),
            acquired=_number(body, "acquired"),
            renewed=_number(body, "renewed"),
            ttl=math.inf if ttl is None else _ttl(body),
            released=_flag(body, "released"),
        )

    @classmethod
    def _from_v1(cls, body: dict[str, Any]) -> LeaseRecord:
        holder = _text(body, "holder")
        renewed = _number(body, "renewed")
        match = _WRITER_ID.match(holder)  # v1 writer ids were host:pid:random too
        return cls(
            epoch=_integer(body, "epoch"),
            holder=holder,
            host=match["host"] if match else None,
            pid=int(match["pid"]) if match else None,
            pid_started=None,
            pid_namespace=None,
            acquired=_number(body, "acquired"),
            renewed=renewed,
            ttl=_ttl(body),
            released=renewed == 0.0,
        )


def read_lease(backend: Backend) -> tuple[LeaseRecord | None, str | None, int]:
    """The record, its version, and the epoch salvaged from an unreadable record (logged: the
    next writer replaces it)."""
    try:
        data, version = backend.read_versioned(layout.LEASE_NAME)
    except NotFoundError:
        return None, None, 0
    try:
        return LeaseRecord.decode(data, join(backend.uri, layout.LEASE_NAME)), version, 0
    except CorruptCheckpointError as e:
        log.warning("%s; replacing it", e)
        return None, version, salvage_epoch(data)


def salvage_epoch(data: bytes) -> int:
    """The epoch of an unreadable record, where it can still be made out (else 0), so that a
    writer replacing it keeps counting up rather than starting again at 1."""
    try:
        epoch = json.loads(data).get("epoch")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return 0
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0 else 0


def _integer(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} {value!r}")
    return value


def _number(body: dict[str, Any], name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} {value!r}")
    return float(value)


def _ttl(body: dict[str, Any]) -> float:
    ttl = _number(body, "ttl")
    if ttl <= 0:
        raise ValueError(f"ttl {ttl!r}")
    return ttl


def _text(body: dict[str, Any], name: str) -> str:
    value = body[name]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} {value!r}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body[name]
    if not isinstance(value, bool):
        raise ValueError(f"{name} {value!r}")
    return value
