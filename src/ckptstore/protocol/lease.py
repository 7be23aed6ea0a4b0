"""The writer lease: one training job commits to a store at a time, and a zombie cannot.

Two clusters may resume the same run by mistake, and a preempted job may go on running after
its replacement started. The rule is a lease with a fencing epoch, like an etcd lease or a
Kubernetes Lease object, kept in ``.ckptstore/lease.json`` (lease_record.py) and only ever
changed by compare-and-swap on the object's version:

* A writer takes the lease at its first write, or when the store is opened with
  ``takeover=True``; taking it bumps the epoch and stamps the epoch into ``latest``, and no
  writer moves a pointer stamped with a newer epoch than its own.
* The holder renews the lease with a heartbeat thread every ``ttl / 4`` seconds, not only when
  it saves: an RL job that saves every half hour keeps it, and its record changes for anyone
  watching (lease_heartbeat.py). Before each commit it renews once more, synchronously; that
  swap is the fence check.
  It gives the lease up on ``close()``, at interpreter exit and when the store is collected, so
  a script run twice just works. A SIGKILL leaves the record to expire after one TTL. While a
  Ctrl-C unwinds, and at interpreter exit, giving it up waits a few seconds at most (a storage
  that does not answer must not keep a Ctrl-C from ending the process): the record then
  expires after one TTL, as after a kill (lease_release.py).
* A contender never compares its clock with the holder's: clocks of two hosts may be minutes
  apart. If the holder ran on this machine and its process is gone, the contender takes over at
  once. Otherwise it asks the storage for its own "now" (it writes a probe object and compares
  modification times), and where the storage cannot tell, it watches: a record that changes
  while watched has a live holder (``LeaseHeldError``, within about one heartbeat); one that
  stays unchanged for a TTL on the watcher's own monotonic clock has expired.
* The holder doubts itself on its own clock too: when no renewal has succeeded for a whole TTL
  (the storage is failing, or the process stalled) it cannot know whether someone took over, so
  it commits nothing in the store (:class:`~ckptstore.errors.FencedError`, saying why) until a
  renewal succeeds again. A renewal is a compare-and-swap on the version of its own last record,
  so it succeeds only if nobody wrote the record since: nobody took over. One that finds another
  holder loses the lease for good.
* A commit in the store's local tier (tiers/local.py) asks only :meth:`WriterLease.vouch`:
  held, and not known lost; no request. The proof of ownership, the renewal, is made when a
  step is persisted to the store, so a local tier commits while the storage is away.

What remains: a zombie whose renewal succeeded just before a takeover can still write one
manifest, never ``latest``, in the round trip that follows; the takeover's fence in ``latest``
names that writer (pointer.py), so such a step is recognisable and never taken for latest.
Maintenance (``prune``, ``rm``, ``gc``, pins) takes no lease, so an operator can run it beside a
training job.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ckptstore.backends.base import Backend, join
from ckptstore.deadline import remaining
from ckptstore.domain import layout
from ckptstore.errors import (
    BackendError,
    ConfigError,
    FencedError,
    PreconditionFailedError,
)
from ckptstore.protocol.lease_contest import lease_context, taken_message
from ckptstore.protocol.lease_heartbeat import Heartbeat
from ckptstore.protocol.lease_record import LeaseRecord, Process, read_lease
from ckptstore.protocol.lease_release import (
    holding,
    hurried,
    let_go,
    release_when_collected,
)
from ckptstore.protocol.lease_take import ATTEMPTS, Taker

log = logging.getLogger(__name__)

DEFAULT_TTL = 60.0
"""Seconds without a renewal after which the lease is gone (the heartbeat renews every 1/4)."""
_STOP_WAIT = 10.0


def check_ttl(ttl: object) -> float:
    """A valid ``lease_ttl`` as a float; ConfigError otherwise."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise ConfigError(
            f"lease_ttl must be a positive number of seconds (math.inf: never expires), got {ttl!r}"
        )
    return float(ttl)


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
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_takeover: Callable[[int, str], None] | None = None,
        heartbeat: bool = True,
        process: Process | None = None,
    ) -> None:
        self.backend = backend
        self.writer = writer
        self.ttl = check_ttl(ttl)
        self.clock = clock
        """Wall clock, only for the record's informational ``acquired``/``renewed``."""
        self.monotonic = monotonic
        self.process = process if process is not None else Process.current()
        self.epoch: int | None = None
        """The epoch held, or None."""
        self.lost: str | None = None
        """Why the lease was lost, once it was: every later ``hold`` raises FencedError."""
        self.abandoned = False
        """Its store was collected: the releaser thread (or a contender first) releases it."""
        self._beats = heartbeat and not math.isinf(self.ttl)
        self._uri = join(backend.uri, layout.LEASE_NAME)
        self._context = lease_context(backend)
        """``uri`` and ``path`` of every error about the lease: its record's."""
        self._taker = Taker(
            backend,
            writer,
            self.process,
            self.ttl,
            takeover=takeover,
            clock=clock,
            monotonic=monotonic,
            sleep=sleep,
            on_takeover=on_takeover,
            context=self._context,
        )
        """Takes the lease (lease_take.py); ``on_takeover`` is called with the new epoch and
        the displaced holder's writer id when it takes the lease from an unreleased one."""
        self._record: LeaseRecord | None = None
        self._version: str | None = None
        self._renewed_at = 0.0  # monotonic start of the last successful write of ours
        self._last_error: str | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None
        self._closed = False

    # -- holding -------------------------------------------------------------------------

    def hold(self) -> int:
        """Take the lease, or renew it; returns the epoch. Call right before each commit."""
        with self._lock:
            if self.lost is not None:
                raise FencedError(self.lost, **self._context)
            if self._closed:
                raise FencedError(
                    f"{self.backend.uri}: this store was closed and gave the writer lease up; "
                    "open a new CheckpointStore to write again",
                    **self._context,
                )
            if self.epoch is not None and os.getpid() != self._owner_pid:
                raise FencedError(
                    f"{self._uri}: held by the parent of this forked process", **self._context
                )
            if self.epoch is None:
                self._acquire()
            else:
                self._renew(raising=True)
            assert self.epoch is not None
            return self.epoch

    def ensure(self) -> int:
        """Take the lease if this writer does not hold it, else only check that it was not
        lost (no write: the renewal right before a commit, ``hold``, is the fence check, so a
        save costs one lease write). Returns the epoch."""
        with self._lock:
            if self.epoch is None or os.getpid() != self._owner_pid:
                pass  # hold() takes it, or refuses a forked child, with its own messages
            elif self.lost is not None:
                raise FencedError(self.lost, **self._context)
            elif self.unconfirmed() is None:
                return self.epoch
        return self.hold()  # silent for a TTL: only a renewal tells whether it is still ours

    def vouch(self) -> int:
        """The epoch a commit in the store's local tier is made under: the lease taken (the
        first write takes it: a request), and not known lost. No request and no lock, so a
        local commit never waits on the storage or on a heartbeat stuck in it; the proof of
        ownership is the renewal made when a step is persisted (module docstring)."""
        epoch, lost = self.epoch, self.lost
        if lost is not None:
            raise FencedError(lost, **self._context)
        if epoch is not None and not self._closed and os.getpid() == self._owner_pid:
            return epoch
        return self.hold()

    def unconfirmed(self) -> str | None:
        """Why the lease is in doubt: no renewal succeeded for a TTL (None: it is not). It
        commits nothing in the store until a renewal succeeds (module docstring)."""
        silent = self.monotonic() - self._renewed_at
        if self.epoch is None or silent < self.ttl:
            return None
        error = self._last_error or "none: this process did not get to try (was it stopped?)"
        return (
            f"{self.backend.uri}: this writer ({self.writer}, epoch {self.epoch}) could not "
            f"renew the writer lease for {silent:.0f} s (lease_ttl {self.ttl:g} s; last error: "
            f"{error}). It cannot know whether another writer has taken the store over since, "
            "so it commits nothing in the store until a renewal succeeds (the record unchanged "
            "since its last one: nobody took over). Check the storage (network, credentials); "
            "steps of a local tier stay there meanwhile"
        )

    def heartbeat(self) -> bool:
        """One renewal (what the heartbeat thread does every ``ttl / 4``); False once the lease
        is lost or not held."""
        with self._lock:
            if self.epoch is None or self.lost is not None:
                return False
            try:
                self._renew(raising=False)
            except FencedError:
                return False
            return True

    def _renew(self, *, raising: bool) -> None:
        """Renew by compare-and-swap. FencedError once lost; a storage error is raised when
        ``raising`` (a commit waits on it), else logged (the heartbeat tries again)."""
        assert self._record is not None
        started = self.monotonic()
        renewed = replace(self._record, renewed=max(self.clock(), self._record.renewed + 1e-6))
        try:
            self._write_ours(renewed)
        except FencedError:
            raise
        except Exception as e:  # a heartbeat must outlive any failure; silence decides
            self._last_error = f"{type(e).__name__}: {e}"
            doubt = self.unconfirmed()
            if raising and doubt is not None:
                raise FencedError(doubt, **self._context) from e
            if raising:
                raise
            log.warning(
                "%s: could not renew the writer lease (%s); %s",
                self._uri,
                self._last_error,
                "it commits nothing in the store until a renewal succeeds"
                if doubt
                else f"it is in doubt after {self.ttl:g} s without one",
            )
            return
        if self.unconfirmed() is not None:
            log.warning(
                "%s: renewed the writer lease after %.0f s without a renewal; nobody took it over",
                self._uri,
                started - self._renewed_at,
            )
        self._renewed_at = started
        self._last_error = None

    def _write_ours(self, record: LeaseRecord) -> None:
        """Swap our record in; a version mismatch is our own retried write, or a takeover.
        ``_version`` only ever holds the version of a record of ours: a fenced writer that
        kept a newer holder's version could swap it out (at release, say)."""
        for _ in range(ATTEMPTS):
            try:
                self._version = self.backend.swap(layout.LEASE_NAME, record.encode(), self._version)
                self._record = record
                return
            except PreconditionFailedError:
                current, version, _ = read_lease(self.backend)
                if current is None or not current.held_by(self.writer, self.epoch):
                    self._lose(taken_message(current))
                self._version = version  # still ours: our own write landed, its answer lost
        raise BackendError(
            f"{self._uri} keeps changing under its holder", retryable=True, **self._context
        )

    def _lose(self, reason: str) -> None:
        self.lost = (
            f"{self.backend.uri}: this writer ({self.writer}, epoch {self.epoch}) lost the "
            f"writer lease: {reason}"
        )
        if self._heartbeat is not None:
            self._heartbeat.stop()
        log.warning("%s", self.lost)
        raise FencedError(self.lost, **self._context)

    # -- the heartbeat and letting go ---------------------------------------------------------

    def _acquire(self) -> None:
        taken = self._taker.take()
        self.epoch, self._record, self._version = taken.epoch, taken.record, taken.version
        self._renewed_at, self._owner_pid = taken.started, os.getpid()
        holding(self)
        if self._beats:
            self._heartbeat = Heartbeat(
                self.heartbeat, self.ttl / 4, self.backend.uri, f"ckpt-lease-{self.writer}"
            )
            self._heartbeat.start()

    def release(self, *, hurry: bool | None = None) -> None:
        """Give the lease up, so the next writer needs no ``takeover``. Idempotent; runs at
        ``close()``, at interpreter exit and when the store is collected, so it never raises.
        ``hurry`` (default: while a Ctrl-C unwinds) waits for the storage
        :data:`~ckptstore.protocol.lease_release.HURRIED_RELEASE` seconds at most.

        The record stays, marked released, so the epoch keeps counting up.
        """
        if hurry is None:
            hurry = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        if self._heartbeat is not None:
            self._heartbeat.join(remaining(_STOP_WAIT))
        if os.getpid() != self._owner_pid:
            return  # a forked child: the lease is its parent's
        if not self._lock.acquire(timeout=remaining(_STOP_WAIT)):
            log.warning("%s: the writer lease is busy; not released", self._uri)
            return
        try:
            if self.epoch is not None and self._record is not None:
                record = self._record
                if hurry:
                    hurried(lambda: self._write_released(record), self._uri, self._context)
                else:
                    self._write_released(record)
        except Exception as e:  # at exit or in a finalizer nobody could catch it
            log.warning(
                "%s: could not release the writer lease (the next writer waits up to %g s, or "
                "takes over): %s",
                self._uri,
                self.ttl,
                e,
            )
        finally:
            let_go(self)
            self.epoch, self._record, self._heartbeat = None, None, None
            self._lock.release()

    def close(self) -> None:
        """Release for good (the store's ``close()``): a thread of the store still running
        (a copy to the store past close's deadline) can never take the lease back."""
        self._closed = True
        self.release()

    def release_when_collected(self, owner: object) -> None:
        """Release when ``owner`` (the store) is garbage-collected, holding no reference to it
        (by the releaser thread, not the finalizer: lease_release.py)."""
        release_when_collected(owner, self)

    def _write_released(self, record: LeaseRecord) -> None:
        """Mark our record released, by compare-and-swap against our own record's version:
        a record that is no longer ours (taken over) is never written again."""
        if self.lost is not None:
            return  # fenced: the record belongs to the writer that took it
        released = replace(record, released=True, renewed=self.clock())
        version = self._version
        for _ in range(ATTEMPTS):
            try:
                self.backend.swap(layout.LEASE_NAME, released.encode(), version)
                return
            except PreconditionFailedError:
                current, version, _ = read_lease(self.backend)
                if current is None or not current.held_by(self.writer, record.epoch):
                    return  # taken over meanwhile: nothing of ours to give up
