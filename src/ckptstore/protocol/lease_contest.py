"""How a contender tells a live writer-lease holder from a gone one, trusting no other clock.

The holder's record carries its wall-clock ``renewed`` time, but a contender on another host
cannot use it: two hosts' clocks may be minutes apart, so a live holder would look dead to one
and a dead one alive to another. The contender decides by what it can see itself, cheapest
first:

1. The holder ran on this machine (same hostname and PID namespace): if its process is gone
   (or its PID now belongs to a process started later), it is gone.
2. The storage keeps modification times: write a probe object, and the storage's own "now" is
   its mtime; the lease object older than its TTL by that clock has expired.
3. Otherwise, or while the lease is younger than that, watch: the holder's heartbeat changes the
   record every ``ttl / 4``, so a change while watched means it is alive, and no change for the
   (rest of the) TTL on the contender's own monotonic clock means it is gone. A contender facing
   a live holder fails within about one heartbeat; a dead holder's replacement waits at most
   one TTL.

A save that cannot take the lease within its deadline (``save_timeout``) fails at once, naming
the holder (writer id, host, pid, since when, how long until its lease expires) and what to do
(``takeover=True``, or save again once it expired): it neither watches past the deadline nor
sleeps past it. Without a deadline it watches for as long as the judgement takes (one TTL).

The holder gives up by its own monotonic clock after the same TTL without a renewal (lease.py),
so whoever judges it gone by watching cannot be earlier than the holder itself.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptstore.backends.base import Backend, error_context
from ckptstore.deadline import Deadline, current_deadline
from ckptstore.domain import layout
from ckptstore.errors import CheckpointError, ErrorContext, LeaseHeldError
from ckptstore.protocol.lease_record import LeaseRecord, Process, read_lease

log = logging.getLogger(__name__)

CLOCK_DIR = f"{layout.META_DIR}/clock"
"""Probe objects whose modification time tells a contender the storage's clock."""


@dataclass(frozen=True)
class Contender:
    """A writer that found another writer's unreleased record."""

    backend: Backend
    writer: str
    process: Process
    monotonic: Callable[[], float]
    sleep: Callable[[float], None]

    def judge(self, record: LeaseRecord, version: str | None) -> str | None:
        """Why the record's holder is gone; raises LeaseHeldError while it lives, or while it
        may live past the deadline in force; None if the record changed hands or was released
        meanwhile (look again)."""
        holder = record.process()
        if holder is not None and self.process.same_machine(holder) and holder.gone():
            return f"its process {holder.pid} on this host is gone"
        if math.isinf(record.ttl):
            raise LeaseHeldError(
                held_message(self.backend.uri, record, "lease_ttl=inf"),
                **lease_context(self.backend),
            )
        age = self._storage_age()
        if age is not None and age[0] > record.ttl + age[1]:
            return f"not renewed for {age[0]:.0f} s by the storage's clock (ttl {record.ttl:g} s)"
        wait = record.ttl if age is None else record.ttl - age[0] + age[1]
        deadline = current_deadline()
        if deadline is not None and wait > deadline.remaining():
            seen = (
                f"last renewed {age[0]:.0f} s ago by the storage's clock"
                if age is not None
                else "the storage keeps no modification times, so only watching its record "
                "for a whole TTL can tell that it is gone"
            )
            raise LeaseHeldError(
                held_message(self.backend.uri, record, seen, expires_in=wait, deadline=deadline),
                **lease_context(self.backend),
            )
        return self._watch(record, version, wait)

    def _storage_age(self) -> tuple[float, float] | None:
        """Seconds since the lease object was written, by the storage's own clock, and that
        clock's grain; None where the storage keeps no modification times."""
        probe = f"{CLOCK_DIR}/{self.writer.replace(':', '-')}"
        try:
            self.backend.write(probe, [self.writer.encode()])
            try:
                now, then = self.backend.stat(probe), self.backend.stat(layout.LEASE_NAME)
            finally:
                self.backend.delete([probe])
        except CheckpointError as e:
            log.debug("%s: no storage clock (%s); watching the lease instead", self.backend.uri, e)
            return None
        if now is None or then is None or now.mtime is None or then.mtime is None:
            return None
        grain = 1.0 if now.mtime.is_integer() and then.mtime.is_integer() else 0.0  # S3: 1 s
        return now.mtime - then.mtime, grain

    def _watch(self, record: LeaseRecord, version: str | None, wait: float) -> str | None:
        """Poll the record: a change means a live holder; none for ``wait`` s, a gone one."""
        interval = min(record.ttl / 8, 1.0)
        started = self.monotonic()
        while (watched := self.monotonic() - started) < wait:
            self.sleep(min(interval, wait - watched))
            current, now_version, _ = read_lease(self.backend)
            if now_version != version:
                if current is None or current.released:
                    return None
                watched = self.monotonic() - started
                evidence = f"it renewed the lease while watched for {watched:.1f} s"
                raise LeaseHeldError(
                    held_message(self.backend.uri, current, evidence),
                    **lease_context(self.backend),
                )
        return f"its record stayed unchanged for {watched:.1f} s (ttl {record.ttl:g} s)"


def lease_context(backend: Backend) -> ErrorContext:
    """The ``uri`` and ``path`` of an error about the store's writer lease: its record's."""
    return error_context(backend.uri, layout.LEASE_NAME)


def held_message(
    uri: str,
    record: LeaseRecord,
    evidence: str,
    *,
    expires_in: float | None = None,
    deadline: Deadline | None = None,
) -> str:
    """Who holds the lease (writer id, host, pid, since when by its clock), the evidence, when
    it expires (``expires_in``: at most that many seconds unless renewed) and the options."""
    where = f"host {record.host}" if record.host else "an unknown host"
    where += f", pid {record.pid}" if record.pid is not None else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.acquired))
    if math.isinf(record.ttl):
        expiry = "it never expires"
    elif expires_in is not None:
        expiry = f"expires in at most {max(expires_in, 0.0):.0f} s unless renewed"
    else:
        expiry = (
            f"renewed every {record.ttl / 4:g} s; it expires {record.ttl:g} s after the last "
            "renewal"
        )
    late = ""
    if deadline is not None:
        late = (
            f"; this save's {deadline.seconds:g} s deadline (save_timeout) ends before the "
            "lease can expire"
        )
    wait = "" if math.isinf(record.ttl) else ", or save again once its lease expired"
    return (
        f"{uri} is being written by writer {record.holder} ({where}, writer lease epoch "
        f"{record.epoch} held since {since} by its clock; {evidence}; {expiry}){late}. If that "
        f"job is dead, take over with takeover=True (CLI: --takeover){wait}; otherwise point "
        "this job at another URI"
    )


def taken_message(record: LeaseRecord | None) -> str:
    """Why a holder lost the lease, having found ``record`` in place of its own."""
    if record is None:
        return "its record was removed or replaced. Stop this job"
    return (
        f"taken by {record.holder} (epoch {record.epoch}); it can no longer commit. Stop this "
        "job; if it should go on writing, reopen the store with takeover=True"
    )
