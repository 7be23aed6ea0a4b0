"""The writer lease: one training job commits to a store at a time, and a zombie cannot.

Two clusters may resume the same run by mistake, and a preempted job may keep running after its
replacement started. Without a rule both would commit, and the zombie's steps would interleave
with the replacement's. The rule here is a lease with a fencing epoch, kept in
``.ckptstore/lease.json`` and changed only by compare-and-swap:

* A writer takes the lease at its first commit. It may take it when nobody holds it, when the
  holder has not renewed it for ``ttl`` seconds, or, with ``takeover=True``, always (for an
  operator or a scheduler that knows the old job is dead). Taking it bumps the epoch and
  stamps the epoch into ``latest``, so a pending ``latest`` move of the old holder fails.
* Before each commit the holder renews the lease by compare-and-swap: if anyone took it over
  in the meantime, the swap fails and the holder learns it has been fenced: it gets
  :class:`~ckptstore.errors.FencedError` naming the new holder and commits nothing more.
* ``latest`` carries the epoch of the writer that moved it, and no writer moves a pointer
  stamped with a newer epoch than its own, so a fenced writer cannot move ``latest`` even in
  the instant between its last check and its swap.

What remains: a fenced writer whose renewal happened just before the takeover can still write
one manifest (never ``latest``) in the round trip that follows; such a step is newer than
``latest`` and shows up in ``ls``; ``ckptstore rm`` removes it. Maintenance (``prune``, ``rm``,
``gc``, pins) never takes the lease, so an operator can run it beside a training job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ckptstore import layout
from ckptstore.backends.base import Backend, join
from ckptstore.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FencedError,
    LeaseHeldError,
    NotFoundError,
    PreconditionFailedError,
)

log = logging.getLogger(__name__)

LEASE_SCHEMA = 1
DEFAULT_TTL = 900.0
"""Seconds without a renewal after which another writer may take the lease unasked."""
_ATTEMPTS = 10


@dataclass(frozen=True)
class LeaseRecord:
    """The content of ``lease.json``."""

    epoch: int
    holder: str
    acquired: float
    renewed: float
    ttl: float
    schema_version: int = LEASE_SCHEMA

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> LeaseRecord:
        try:
            record = cls(**json.loads(data))
            if record.schema_version != LEASE_SCHEMA or not isinstance(record.epoch, int):
                raise ValueError(f"schema_version {record.schema_version!r}")
            return record
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: unreadable writer lease ({e})") from e

    def expired(self, now: float) -> bool:
        return now - self.renewed > self.ttl


class WriterLease:
    """This writer's hold on a store's lease."""

    def __init__(
        self,
        backend: Backend,
        writer: str,
        *,
        ttl: float = DEFAULT_TTL,
        takeover: bool = False,
        clock: Callable[[], float] = time.time,
        on_takeover: Callable[[int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.writer = writer
        self.ttl = ttl
        self.takeover = takeover
        self.clock = clock
        self.on_takeover = on_takeover
        """Called with the new epoch after this writer took the lease from another."""
        self.epoch: int | None = None
        self._uri = join(backend.uri, layout.LEASE_NAME)

    def _read(self) -> tuple[LeaseRecord | None, str | None]:
        try:
            data, version = self.backend.read_versioned(layout.LEASE_NAME)
        except NotFoundError:
            return None, None
        try:
            return LeaseRecord.decode(data, self._uri), version
        except CorruptCheckpointError as e:
            log.warning("%s; replacing it", e)
            return None, version

    def hold(self) -> int:
        """Take the lease, or renew it; returns the epoch. Call right before each commit."""
        for _ in range(_ATTEMPTS):
            record, version = self._read()
            now = self.clock()
            if self.epoch is not None and (
                record is None or record.holder != self.writer or record.epoch != self.epoch
            ):
                raise FencedError(self._fenced_message(record))
            if (
                self.epoch is None
                and record is not None
                and record.holder != self.writer
                and not (record.expired(now) or self.takeover)
            ):
                raise LeaseHeldError(self._held_message(record, now))
            epoch = self.epoch if self.epoch is not None else (record.epoch + 1 if record else 1)
            taken_from = record.holder if record and record.holder != self.writer else None
            renewed = LeaseRecord(
                epoch=epoch,
                holder=self.writer,
                acquired=record.acquired if taken_from is None and record else now,
                renewed=now,
                ttl=self.ttl,
            )
            try:
                self.backend.swap(layout.LEASE_NAME, renewed.encode(), version)
            except PreconditionFailedError:
                continue  # someone renewed or took it meanwhile: look again
            if self.epoch is None:
                self.epoch = epoch
                if taken_from is not None:  # loud only when the old holder may be alive
                    log.log(
                        logging.INFO
                        if record is not None and record.expired(now)
                        else logging.WARNING,
                        "%s: took the writer lease from %s (epoch %d); it can no longer commit",
                        self._uri,
                        taken_from,
                        epoch,
                    )
                    if self.on_takeover is not None:
                        self.on_takeover(epoch)
            return epoch
        raise FencedError(f"{self._uri}: could not renew the writer lease (too much contention)")

    def release(self) -> None:
        """Give the lease up (a clean exit), so the next writer needs no ``takeover``.

        The record stays, expired, so the epoch keeps counting up; a failure here only
        means the next writer waits for the TTL or takes over, so it is logged, not raised.
        """
        if self.epoch is None:
            return
        try:
            record, version = self._read()
            if record is not None and record.holder == self.writer and record.epoch == self.epoch:
                expired = LeaseRecord(record.epoch, self.writer, record.acquired, 0.0, record.ttl)
                self.backend.swap(layout.LEASE_NAME, expired.encode(), version)
        except CheckpointError as e:
            log.warning("%s: could not release the writer lease: %s", self._uri, e)
        self.epoch = None

    def _held_message(self, record: LeaseRecord, now: float) -> str:
        idle = now - record.renewed
        return (
            f"{self.backend.uri} is being written by {record.holder} (lease epoch "
            f"{record.epoch}, renewed {idle:.0f} s ago, expires after {record.ttl:.0f} s "
            "without a save). If that job is dead, take over with takeover=True (CLI: "
            "--takeover); otherwise point this job at another URI"
        )

    def _fenced_message(self, record: LeaseRecord | None) -> str:
        holder = f"{record.holder} (epoch {record.epoch})" if record else "nobody (released)"
        return (
            f"{self.backend.uri}: this writer ({self.writer}, epoch {self.epoch}) lost the writer "
            f"lease to {holder} and can no longer commit. Stop this job; if it should go on "
            "writing, reopen the store with takeover=True"
        )
