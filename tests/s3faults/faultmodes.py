"""Deterministic fault modes for the fault proxy: what a hung, slow or failing server does.

The proxy's ``rate`` draws faults at random; these are switched on and off by the test, so a
test says exactly which request misbehaves and when the server is healthy again ("the next save
after the fault clears"). Each mode applies to the requests whose S3 operation is in
``operations`` (``None``: all) and whose key starts with ``prefix`` or matches ``glob`` (so one
rank's files can be targeted: ``glob="*/rank_00001/*"``); a listing's key is its ``prefix``
parameter. ``fired`` counts the requests it took; with ``times``, it takes no more than that
many (those it took keep stalling or trickling until it is switched off or the client gives up).

* ``stall``: the server accepts and never answers. ``after=None``: it reads the request and
  sends nothing; with ``after=N`` it stops after N bytes of the body, of the request
  (``direction="request"``: it stops reading) or of the response (it stops sending). The
  connection stays open, silent, until the client gives up or the fault is switched off. A
  body of N bytes or fewer passes whole (``after=0`` on a response without a body, such as a
  HEAD's, cuts its head instead); use ``glob`` to aim at the objects that matter.
* ``trickle``: the body moves at ``rate`` bytes a second (after ``after`` bytes at full speed),
  in either direction; switched off, it finishes at full speed.
* ``reset``: the connection is reset (RST) after ``after`` bytes of the body, in either
  direction (a response reset happens after the request reached the server).
* ``brownout``: every matching request is answered 503 SlowDown (``status=500``:
  InternalError) without reaching the server, for ``seconds`` after it is switched on.
* ``refuse``: the proxy stops listening for ``seconds`` and drops open connections, so the
  client's connects are refused (ECONNREFUSED); ``fired`` counts the windows.

Build them with the class methods (``Fault.stall(...)``), add them with
``FaultProxy.add_fault``; ``fault.off()`` and ``fault.on()`` switch them at runtime.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["stall", "trickle", "reset", "brownout", "refuse"]
Direction = Literal["request", "response"]
KINDS: tuple[Kind, ...] = ("stall", "trickle", "reset", "brownout", "refuse")


@dataclass(eq=False)
class Fault:
    """One fault mode; see the module docstring. Thread-safe: the proxy's handlers and the
    test switch and count it concurrently."""

    kind: Kind
    operations: frozenset[str] | None = None
    prefix: str = ""
    glob: str | None = None
    direction: Direction = "response"
    after: int | None = None
    rate: float = 0.0
    status: int = 503
    seconds: float | None = None
    times: int | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    fired: int = field(default=0, init=False)
    _active: bool = field(default=False, init=False, repr=False)
    _until: float | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _listeners: list[Callable[[Fault], None]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.direction not in ("request", "response"):
            raise ValueError(f"direction must be 'request' or 'response', got {self.direction!r}")
        if self.kind == "trickle" and self.rate <= 0:
            raise ValueError(f"a trickle needs rate > 0 bytes a second, got {self.rate!r}")
        if self.kind == "reset" and self.after is None:
            raise ValueError("a reset needs after=N: the bytes of the body before it")
        if self.kind == "brownout" and self.status not in (500, 503):
            raise ValueError(f"a brownout answers 500 or 503, got {self.status!r}")
        if self.kind == "refuse" and not self.seconds:
            raise ValueError("refuse needs seconds: how long connections are refused")
        if self.kind in ("brownout", "refuse") and self.direction == "request":
            raise ValueError(f"{self.kind} has no direction")

    # -- builders --------------------------------------------------------------------------

    @classmethod
    def stall(
        cls,
        *,
        after: int | None = None,
        direction: Direction = "response",
        operations: Iterable[str] | None = None,
        prefix: str = "",
        glob: str | None = None,
        times: int | None = None,
    ) -> Fault:
        return cls("stall", _ops(operations), prefix, glob, direction, after, times=times)

    @classmethod
    def trickle(
        cls,
        rate: float,
        *,
        after: int = 0,
        direction: Direction = "response",
        operations: Iterable[str] | None = None,
        prefix: str = "",
        glob: str | None = None,
        times: int | None = None,
    ) -> Fault:
        return cls("trickle", _ops(operations), prefix, glob, direction, after, rate, times=times)

    @classmethod
    def reset(
        cls,
        after: int,
        *,
        direction: Direction = "response",
        operations: Iterable[str] | None = None,
        prefix: str = "",
        glob: str | None = None,
        times: int | None = None,
    ) -> Fault:
        return cls("reset", _ops(operations), prefix, glob, direction, after, times=times)

    @classmethod
    def brownout(
        cls,
        seconds: float | None,
        *,
        status: int = 503,
        operations: Iterable[str] | None = None,
        prefix: str = "",
        glob: str | None = None,
    ) -> Fault:
        return cls("brownout", _ops(operations), prefix, glob, status=status, seconds=seconds)

    @classmethod
    def refuse(cls, seconds: float) -> Fault:
        return cls("refuse", seconds=seconds)

    # -- switching -------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        with self._lock:
            return self._live(self.clock())

    def on(self) -> Fault:
        """Switch on (again); a timed fault runs ``seconds`` from now."""
        with self._lock:
            self._active = True
            self._until = None if self.seconds is None else self.clock() + self.seconds
        self._notify()
        return self

    def off(self) -> Fault:
        with self._lock:
            self._active = False
        self._notify()
        return self

    def matches(self, op: str, key: str) -> bool:
        """Whether a request of ``op`` on ``key`` is this fault's (it may not be live)."""
        if self.operations is not None and op not in self.operations:
            return False
        if self.glob is not None:
            return fnmatch.fnmatchcase(key, self.glob)
        return key.startswith(self.prefix)

    def take(self, op: str, key: str) -> bool:
        """Fire on this request if it is live, has firings left and the request is its;
        counts it."""
        if self.kind == "refuse" or not self.matches(op, key):
            return False
        with self._lock:
            if not self._live(self.clock()):
                return False
            if self.times is not None and self.fired >= self.times:
                return False
            self.fired += 1
            return True

    def count(self) -> None:
        with self._lock:
            self.fired += 1

    def listen(self, callback: Callable[[Fault], None]) -> None:
        """Call ``callback(self)`` whenever the fault is switched (the proxy's refuse)."""
        self._listeners.append(callback)

    def _live(self, now: float) -> bool:
        if self._active and self._until is not None and now >= self._until:
            self._active = False
        return self._active

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback(self)


def _ops(operations: Iterable[str] | None) -> frozenset[str] | None:
    return None if operations is None else frozenset(operations)
