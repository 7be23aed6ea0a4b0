"""Taking the writer lease: a free or released record at once, another writer's once judged gone.

Taking it is one compare-and-swap on the version of the record read, so of two contenders one
wins and the other looks again. How a holder elsewhere is judged gone is lease_contest.py's; a
holder in this very process is asked directly (lease_release.py keeps who holds what here).
Before the record changes hands, ``latest`` is stamped with the new epoch: a holder that is
not fenced yet may still move latest, one that is can no longer do it (pointer.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ckptstore.backends.base import Backend, join
from ckptstore.domain import layout
from ckptstore.errors import (
    BackendError,
    CheckpointError,
    CompatibilityError,
    ErrorContext,
    LeaseHeldError,
    PreconditionFailedError,
)
from ckptstore.protocol.lease_contest import Contender, held_message
from ckptstore.protocol.lease_record import LeaseRecord, Process, read_lease
from ckptstore.protocol.lease_release import held_here

log = logging.getLogger(__name__)

ATTEMPTS = 10
"""Reads and swaps a contended record gets before the lease gives up (too much contention)."""


@dataclass(frozen=True)
class Taken:
    """The record this writer swapped in, and the version the storage gave it."""

    epoch: int
    record: LeaseRecord
    version: str
    started: float
    """Monotonic start of the swap that took it: its first TTL counts from there."""


@dataclass(frozen=True)
class Taker:
    """Takes a store's lease for one writer (:class:`~ckptstore.protocol.lease.WriterLease`)."""

    backend: Backend
    writer: str
    process: Process
    ttl: float
    takeover: bool
    clock: Callable[[], float]
    monotonic: Callable[[], float]
    sleep: Callable[[float], None]
    on_takeover: Callable[[int, str], None] | None
    context: ErrorContext

    def take(self) -> Taken:
        """Swap in a record of this writer with the next epoch; LeaseHeldError while another
        writer holds it, BackendError when the record keeps changing."""
        uri = join(self.backend.uri, layout.LEASE_NAME)
        for _ in range(ATTEMPTS):
            record, version, salvaged = read_lease(self.backend)
            reason = None
            if record is not None and not record.released and record.holder != self.writer:
                reason = self._judge(record, version)
                if reason is None:
                    continue  # it changed hands or was released while judged: look again
            epoch = (record.epoch if record is not None else salvaged) + 1
            mine = LeaseRecord.new(epoch, self.writer, self.process, self.clock(), self.ttl)
            if record is not None and reason is not None:
                self._fence_latest(epoch, record.holder)
            started = self.monotonic()
            try:
                new_version = self.backend.swap(layout.LEASE_NAME, mine.encode(), version)
            except PreconditionFailedError:
                continue  # someone renewed or took it meanwhile: look again
            if record is not None and reason is not None:
                log.warning(
                    "%s: took the writer lease (epoch %d) from %s: %s; it can no longer commit",
                    uri,
                    epoch,
                    record.holder,
                    reason,
                )
            return Taken(epoch, mine, new_version, started)
        raise BackendError(
            f"{uri}: could not take the writer lease (too much contention)", **self.context
        )

    def _judge(self, record: LeaseRecord, version: str | None) -> str | None:
        """Why an unreleased record of another writer may be taken; None: look again."""
        if self.takeover:
            return "takeover=True"
        holder = record.process()
        if holder and holder.pid == self.process.pid and self.process.same_machine(holder):
            live = held_here(self.backend.uri, record.holder)
            if live is not None and live.abandoned:
                live.release()  # its store was collected: finish that release now, look again
                return None
            if live is not None and live.epoch == record.epoch and live.lost is None:
                message = held_message(self.backend.uri, record, "it is open in this process")
                raise LeaseHeldError(message, **self.context)
            return "its store in this process no longer holds it"
        return Contender(self.backend, self.writer, self.process, self.monotonic, self.sleep).judge(
            record, version
        )

    def _fence_latest(self, epoch: int, displaced: str) -> None:
        if self.on_takeover is None:
            return
        try:
            self.on_takeover(epoch, displaced)
        except CompatibilityError:
            raise  # a pointer of a newer ckptstore: this one must not write the store at all
        except CheckpointError as e:  # the lease itself fences: the zombie's next renewal fails
            log.warning(
                "%s: could not stamp the new lease epoch into latest: %s",
                join(self.backend.uri, layout.LEASE_NAME),
                e,
            )
