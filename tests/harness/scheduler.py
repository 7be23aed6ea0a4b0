"""Runs actors one at a time, handing the turn over at each call of a scheduled backend.

The explorer (explore.py) runs the real committer, lease, retention and gc code as *actors*
over :class:`~harness.scheduled_backend.ScheduledBackend`. Exactly one actor runs at a
time: a backend call parks its actor, a chooser (the explorer) picks which actor goes next, and
only then does the chosen operation run, atomically, under the scheduler's lock. What an actor
does between two calls touches no storage, so the order of calls *is* the interleaving, and the
same choices replay the same run. Why it is built this way:

* A call belongs to the actor that holds the turn, whatever thread makes it. So that an actor
  never has two threads in flight (their order would be the OS's), :func:`inline_thread_pools`
  makes ckptstore's thread pools run each task in the submitting thread during an exploration:
  one actor's parallel requests run in submission order and are not permuted among themselves.
  A store's background thread (a local tier's copies) runs its tasks when the store waits for
  them (:class:`DeferredExecutor`), in that store's actor.
* A crash is a SIGKILL as storage sees it: the crashed actor's pending call raises
  :class:`Crashed` (a ``BaseException``, which ``except Exception`` does not swallow) without
  running, and so does every later call of that actor, so no cleanup code touches storage.
* Time is logical: :meth:`Scheduler.clock` counts the operations run so far; objects take their
  ``mtime`` from it and stores under test get it as their ``clock``. No wall-clock duration can
  change what a run does (a hang guard aside, which only turns a stuck run into an error).
* Every operation is recorded as an :class:`Event` with its effects (each object created,
  replaced or deleted, before and after): what the invariant checker reads.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import ThreadPoolExecutor as _Threads  # a name the patch leaves alone
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from ckptstore.backends.base import ObjectInfo
from ckptstore.errors import CheckpointError

T = TypeVar("T")
P = ParamSpec("P")
HANG_SECONDS = 60.0
"""A run in which nothing happens for this long (twice) is stuck: an error, not a hang."""


class Crashed(BaseException):
    """The actor was killed: this call did not run, and no later call of the actor will."""


class Abandoned(BaseException):
    """The run was stopped (a violation was found): remaining calls do nothing."""


class ExplorerError(Exception):
    """The explorer itself cannot go on: an actor hung, or a replay diverged."""


@dataclass(frozen=True)
class Stored:
    """One object: content, a version token unique across the store's life, and mtime."""

    data: bytes
    version: int
    mtime: float


@dataclass(frozen=True)
class Effect:
    """What one operation did to one path: ``None`` before means created, after deleted."""

    path: str
    before: Stored | None
    after: Stored | None


Effects = list[Effect]


@dataclass(frozen=True)
class Event:
    """One backend call (run, failed or ``"killed"``), or an actor's ``start`` or ``end``."""

    seq: int
    actor: str
    op: str
    paths: tuple[str, ...]
    outcome: str
    effects: tuple[Effect, ...] = ()
    backend: str = ""
    """The URI of the backend called ("" for a start or an end): a world may hold two (a store
    and its local tier), whose paths look alike."""


@dataclass(frozen=True)
class Actor:
    """A named callable run in a thread; ``role`` says what it may delete (invariants.py).

    ``after`` names actors it starts only once they have ended (killed or not): the stages of
    one job (a coordinator's begin, its ranks, its commit) or a cleaner that runs after a
    crash. Until then its start is not offered, so no schedule wastes a choice on it.
    """

    name: str
    run: Callable[[], object]
    role: str = "writer"
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Choice:
    """What runs next: the actor's pending call, or (``crash``) the actor dies instead."""

    actor: str
    crash: bool = False

    def label(self) -> str:
        return f"crash {self.actor}" if self.crash else self.actor


Chooser = Callable[[Mapping[str, str], str | None], Choice]
"""Given the actors that can go on, each with the operation it waits at (``"start"`` before it
runs), in actor order, and the last actor that ran: what runs next."""


class Scheduler:
    """Runs actors one at a time, handing the turn over at each scheduling point.

    The thread that reaches a point (a call, or its actor's end) asks the chooser who goes next
    and hands the turn over itself, so an actor that keeps the turn runs on without a switch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        """What the run waits on; each actor waits on a condition of its own over the same
        lock, so a hand-over wakes only the thread that takes the turn (waking every thread at
        every call, to find the one whose turn it is, cost more than the runs themselves)."""
        self._wakers: dict[str, threading.Condition] = {}
        self.time = 0
        self.phase = "setup"
        """Who calls made outside :meth:`run` are recorded as."""
        self.events: list[Event] = []
        self.observers: list[Callable[[Event], None]] = []
        """Called under the lock after each event; may call :meth:`stop`."""
        self.failures: dict[str, BaseException] = {}
        """Actors that raised something other than a CheckpointError (or died, or were let go)."""
        self.stopped = False
        self.internal_error: Exception | None = None
        """A failure of the chooser or an observer: the explorer raises it."""
        self._running = False
        self._turn: str | None = None
        self._unstarted: dict[str, Actor] = {}
        self._pending: dict[str, str] = {}
        self._choose: Chooser | None = None
        self._crashed: set[str] = set()
        self._done: set[str] = set()

    def clock(self) -> float:
        """The logical time: how many operations have run."""
        return float(self.time)

    def stop(self) -> None:
        """Abandon the run: every call from now on raises :class:`Abandoned`."""
        self.stopped = True

    def run(self, actors: Sequence[Actor], choose: Chooser) -> None:
        """Run every actor to its end, asking ``choose`` at each point: before each backend
        call, and before each actor starts (so what it does before its first call, such as
        reading the clock, happens when it is picked)."""
        _check_order(actors)
        with self._cv:
            self._choose, self._running = choose, True
            self._unstarted = {a.name: a for a in actors}
            self._pending = {a.name: "start" for a in actors}
            self._wakers = {a.name: threading.Condition(self._lock) for a in actors}
            self._hand_over(None)
        try:
            self._wait(lambda: self.stopped or len(self._done) == len(self._pending))
        finally:
            with self._cv:
                self.stopped = self.stopped or len(self._done) < len(self._pending)
                self._turn = None
                self._done.update(self._unstarted)
                self._wake_all()
            self._wait(lambda: len(self._done) == len(self._pending))
            self._running = False
            self.phase = "after"

    def call(
        self,
        op: str,
        paths: tuple[str, ...],
        apply: Callable[[], tuple[T, Effects]],
        backend: str = "",
    ) -> T:
        """Park the calling actor until it is chosen, then run ``apply`` atomically
        (``backend``: the URI of the backend called, recorded in its event)."""
        with self._cv:
            if not self._running:
                return self._execute(self.phase, op, paths, apply, backend)
            self.ensure_alive()
            actor = self._turn
            if actor is None:
                raise ExplorerError(f"{op} {paths} was called while no actor held the turn")
            self._pending[actor] = op
            self._hand_over(actor)
            self._wakers[actor].wait_for(lambda: self._turn == actor or self.stopped)
            if actor in self._crashed and not self.stopped:
                self._record(Event(len(self.events), actor, op, paths, "killed", (), backend))
            self.ensure_alive()
            return self._execute(actor, op, paths, apply, backend)

    def ensure_alive(self) -> None:
        """Raise Abandoned or Crashed if the actor holding the turn may not touch storage."""
        if self._running and self.stopped:
            raise Abandoned()
        if self._running and self._turn in self._crashed:
            raise Crashed(self._turn)

    def _hand_over(self, last: str | None) -> None:
        """Ask the chooser and give the turn; an actor picked for the first time starts."""
        enabled = {n: op for n, op in self._pending.items() if self._enabled(n)}
        self._turn = None
        if enabled and not self.stopped and self._choose is not None:
            try:
                choice = self._choose(enabled, last)
            except Exception as e:  # a diverged replay
                self.internal_error = e
                self.stop()
            else:
                if choice.crash:
                    self._crashed.add(choice.actor)
                self._turn = choice.actor
                actor = self._unstarted.pop(choice.actor, None)
                if actor is not None:
                    self._record(Event(len(self.events), actor.name, "start", (), ""), tick=False)
                    _runners().submit(self._body, actor)
        if self._turn != last:
            if self._turn is None:  # the run ended or stopped: everyone looks
                self._wake_all()
            else:
                self._wakers[self._turn].notify()

    def _wake_all(self) -> None:
        """Wake the run and every actor (under the lock)."""
        self._cv.notify_all()
        for waker in self._wakers.values():
            waker.notify_all()

    def _enabled(self, name: str) -> bool:
        """Not ended, and (if not started) every actor it runs after has ended."""
        waiting = self._unstarted.get(name)
        if waiting is not None:
            return all(other in self._done for other in waiting.after)
        return name not in self._done

    def _execute(
        self,
        actor: str,
        op: str,
        paths: tuple[str, ...],
        apply: Callable[[], tuple[T, Effects]],
        backend: str = "",
    ) -> T:
        try:
            result, effects = apply()
        except Exception as e:
            self._record(Event(len(self.events), actor, op, paths, type(e).__name__, (), backend))
            raise
        done = Event(len(self.events), actor, op, paths, _summary(result), tuple(effects), backend)
        self._record(done)
        return result

    def _record(self, event: Event, *, tick: bool = True) -> None:
        self.events.append(event)
        self.time += tick
        for observe in self.observers:
            try:
                observe(event)
            except Exception as e:  # a checker bug must not look like the store's
                self.internal_error = e
                self.stop()

    def _wait(self, until: Callable[[], bool]) -> None:
        seen = -1
        with self._cv:
            while not self._cv.wait_for(until, HANG_SECONDS):
                if self.time == seen:
                    self.stopped = True
                    raise ExplorerError(
                        f"nothing happened for {HANG_SECONDS:.0f} s (turn: {self._turn}): an "
                        "actor is blocked on something other than the backend"
                    )
                seen = self.time

    def _body(self, actor: Actor) -> None:
        failure: BaseException | None = None
        try:
            outcome = f"returned {_summary(actor.run())}"
        except Crashed:
            outcome = "killed"
        except Abandoned:
            outcome = "abandoned"
        except CheckpointError as e:
            outcome = f"raised {type(e).__name__}: {e}"
        except BaseException as e:
            outcome, failure = f"raised {type(e).__name__}: {e}", e
        with self._cv:
            if failure is not None and not self.stopped:
                self.failures[actor.name] = failure
            self._record(Event(len(self.events), actor.name, "end", (), outcome), tick=False)
            self._done.add(actor.name)
            if self._turn == actor.name:
                self._hand_over(actor.name)
            else:
                self._wake_all()


def _check_order(actors: Sequence[Actor]) -> None:
    """Every ``after`` names an actor of the run listed before it (so no cycle can hang)."""
    seen: set[str] = set()
    for actor in actors:
        unknown = [other for other in actor.after if other not in seen]
        if unknown:
            raise ExplorerError(f"{actor.name} runs after {unknown}, not listed before it")
        seen.add(actor.name)


_RUNNERS: list[_Threads] = []


def _runners() -> _Threads:
    """Threads for actors, reused across runs: starting a thread costs more than a run."""
    if not _RUNNERS:
        _RUNNERS.append(_Threads(16, thread_name_prefix="explore-actor"))
    return _RUNNERS[0]


class InlineExecutor(_Threads):
    """A ThreadPoolExecutor that runs each task at submission, in the submitting thread; an
    error (``Crashed`` included) lands in the future, as with a real pool. It starts no thread
    and holds no lock, so building one (a save builds several) costs nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """Nothing to set up (the pool's arguments are ignored)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to shut down: every task ran at submission."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)
        return future


class _DeferredFuture(Future[T]):
    """A future whose task runs when someone waits for it (its pool's earlier tasks first)."""

    def __init__(self, pool: DeferredExecutor, task: Callable[[], T]) -> None:
        super().__init__()
        self.pool, self.task = pool, task

    def run(self) -> None:
        try:
            self.set_result(self.task())
        except BaseException as e:
            self.set_exception(e)

    def result(self, timeout: float | None = None) -> T:
        self.pool.run_until(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.pool.run_until(self)
        return super().exception(timeout)


class DeferredExecutor(_Threads):
    """A one-thread pool whose thread is the waiter's: a task runs, in the thread that waits
    for its future (``result``, ``exception``, ``shutdown(wait=True)``), after every task
    submitted before it. For a store's background thread (a local tier's persister,
    tiers/local.py), which the code submits to while holding a lock the task takes: run at
    submission, as an InlineExecutor would, it would wait for itself. So a copy in the
    background runs while its store waits for it (``wait()``, ``close()``), and belongs to
    that store's actor; a store that never waits (killed) never runs it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        """No thread (the pool's arguments are ignored)."""
        self._queued: list[_DeferredFuture[Any]] = []

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future = _DeferredFuture(self, lambda: fn(*args, **kwargs))
        self._queued.append(future)
        return future

    def run_until(self, future: _DeferredFuture[Any]) -> None:
        while future in self._queued:
            self._queued.pop(0).run()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        queued, self._queued = self._queued, []
        for future in queued:
            if wait and not cancel_futures:
                future.run()
            else:
                future.cancel()


BACKGROUND_THREADS = frozenset({"ckpt-persist", "ckpt-share", "ckpt-peer"})
"""The thread name prefixes of a store's background threads (a local tier's copies to the
durable tier and to its peers), which the code submits to under a lock: DeferredExecutor."""


def explorer_pool(*args: Any, **kwargs: Any) -> _Threads:
    """What ``ThreadPoolExecutor(...)`` builds during an exploration: a DeferredExecutor for
    a store's background thread (:data:`BACKGROUND_THREADS`), else an InlineExecutor."""
    if kwargs.get("thread_name_prefix") in BACKGROUND_THREADS:
        return DeferredExecutor()
    return InlineExecutor()


@contextmanager
def inline_thread_pools() -> Iterator[None]:
    """Make every imported ckptstore module's ``ThreadPoolExecutor`` build InlineExecutors
    (DeferredExecutors for a store's background threads: :func:`explorer_pool`)."""
    patched = [
        module
        for name, module in list(sys.modules.items())
        if (name == "ckptstore" or name.startswith("ckptstore."))
        and getattr(module, "ThreadPoolExecutor", None) is _Threads
    ]
    for module in patched:
        vars(module)["ThreadPoolExecutor"] = explorer_pool
    try:
        yield
    finally:
        for module in patched:
            vars(module)["ThreadPoolExecutor"] = _Threads


def _summary(result: object) -> str:
    """A short rendering of a call's result for traces."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bytes):
        return f"{len(result[0])} B @{result[1]}"  # read_versioned
    if isinstance(result, (bytes, ObjectInfo)):
        return f"{result.size if isinstance(result, ObjectInfo) else len(result)} B"
    if isinstance(result, list):
        return f"{len(result)} entries"
    text = "ok" if result is None else result if isinstance(result, str) else repr(result)
    return text if len(text) <= 60 else text[:57] + "..."
