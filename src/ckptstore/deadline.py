"""Deadlines: a save or load finishes by a point in time, or fails saying where it stood.

Why a context variable rather than an argument: a save's deadline must reach every request the
save makes, however deep (a multipart upload's parts, their retries, a ranged re-read), through
layers and backends whose signatures know nothing of time. :func:`bounded` sets it for the
calling context; a thread pool that works for that context runs its jobs in a copy of it
(:func:`submit`, or ``contextvars.copy_context().run``), so their requests see it too. Code that
waits (a backoff, a free slot, a future) waits no longer than :meth:`Deadline.remaining`, and
:meth:`Deadline.check` raises :class:`~ckptstore.errors.SaveTimeoutError` (or
:class:`~ckptstore.errors.LoadTimeoutError`) once it has passed, naming the rank, the file, the
upload, the bytes done and the last error.

Why a monotonic clock: a deadline is a duration from now; the wall clock may jump (NTP, a
suspended VM) and would end a save early or never. The clock is a field, so tests pass a fake.

The engine sets one deadline per save (and per load) and passes the rank::

    with bounded(Deadline.after(save_timeout, operation="save", rank=rank)):
        ...  # every backend request below gives up by then

``bounded`` replaces the deadline in force (``bounded(None)`` lifts it): cleanup after an
expiry, such as aborting a multipart upload, runs under a short deadline of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Literal, ParamSpec, TypeVar

from ckptstore.errors import DeadlineExceededError, LoadTimeoutError, SaveTimeoutError

__all__ = [
    "Deadline",
    "Operation",
    "bounded",
    "check",
    "cleanup_time",
    "clean_up",
    "within",
    "current_deadline",
    "map_in_context",
    "remaining",
    "submit",
]

log = logging.getLogger(__name__)
Operation = Literal["save", "load"]
P = ParamSpec("P")
T = TypeVar("T")
A = TypeVar("A")

_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "ckptstore_deadline", default=None
)


@dataclass(frozen=True)
class Deadline:
    """A point on a monotonic clock by which a save or load must be done.

    ``seconds`` is the budget it was made with (for messages), ``operation`` decides which
    error it raises, ``rank`` whose save it is (``None`` outside a distributed save); ``store``
    and ``step``, where known, what the save or load is of (a load learns its step once the
    resolver has chosen it: :meth:`of_step`), so that the error names them.
    """

    expires: float
    seconds: float
    operation: Operation = "save"
    rank: int | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    store: str | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.operation not in ("save", "load"):
            raise ValueError(f"operation must be 'save' or 'load', got {self.operation!r}")
        if not self.seconds >= 0:  # also refuses NaN
            raise ValueError(f"a deadline needs seconds >= 0, got {self.seconds!r}")

    @classmethod
    def after(
        cls,
        seconds: float,
        *,
        operation: Operation = "save",
        rank: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        store: str | None = None,
    ) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(clock() + seconds, seconds, operation, rank, clock, store)

    def of_step(self, step: int) -> Deadline:
        """The same point in time, known to be ``step``'s."""
        return replace(self, step=step)

    @classmethod
    def of(cls, seconds: float | None, *, operation: Operation = "save") -> Deadline | None:
        """The deadline ``seconds`` from now; None for None (no deadline)."""
        return None if seconds is None else cls.after(seconds, operation=operation)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.expires - self.clock())

    @property
    def expired(self) -> bool:
        return self.clock() >= self.expires

    def cap(self, seconds: float) -> float:
        """``seconds``, or what remains if that is less: how long a wait may last."""
        return min(seconds, self.remaining())

    def check(
        self,
        target: str | None = None,
        *,
        doing: str = "transfer",
        upload_id: str | None = None,
        bytes_done: int | None = None,
        last_error: str | None = None,
    ) -> None:
        """Raise :meth:`error` if the deadline has passed."""
        if self.expired:
            raise self.error(
                target,
                doing=doing,
                upload_id=upload_id,
                bytes_done=bytes_done,
                last_error=last_error,
            )

    def error(
        self,
        target: str | None = None,
        *,
        doing: str = "transfer",
        upload_id: str | None = None,
        bytes_done: int | None = None,
        last_error: str | None = None,
        upload_left: str | None = None,
    ) -> DeadlineExceededError:
        """The error for this deadline having passed while ``doing`` (a verb: ``write``,
        ``read``...) ``target`` (the URI of the file). Its ``uri`` is ``target`` when that is a
        URI; a caller that knows the store-relative path adds it (``add_context``). The
        multipart upload ``upload_id`` was aborted, unless ``upload_left`` says what became of
        it instead (one sentence: it could not be aborted, and what removes it)."""
        cls = SaveTimeoutError if self.operation == "save" else LoadTimeoutError
        who = f"rank {self.rank}'s {self.operation}" if self.rank is not None else self.operation
        if self.step is not None:
            who += f" of step {self.step}"
        if self.store is not None and not (target and target.startswith(self.store)):
            who += f" of {self.store}"
        what = f" while trying to {doing} {target}" if target else ""
        facts = []
        if upload_id and upload_left is None:
            facts.append(f"multipart upload {upload_id} aborted")
        if bytes_done is not None:
            facts.append(f"{bytes_done} bytes done")
        detail = f" ({', '.join(facts)})" if facts else ""
        cause = f"; last error: {last_error}" if last_error else "; no request had failed"
        setting = "save_timeout" if self.operation == "save" else "load_timeout"
        check = (
            "the storage (the last error says what failed)"
            if last_error
            else ("that the storage answers")
        )
        message = (
            f"{who} ran past its {self.seconds:g} s deadline{what}{detail}{cause}. Check {check} "
            f"or raise {setting}"
        )
        if upload_id and upload_left is not None:
            message += f". Its multipart upload {upload_id} {upload_left}"
        return cls(
            message,
            rank=self.rank,
            upload_id=upload_id or None,
            bytes_done=bytes_done,
            last_error=last_error,
            timeout=self.seconds,
            uri=target if target and "://" in target else self.store,
            step=self.step,
        )


def current_deadline() -> Deadline | None:
    """The deadline in force in this context (``None``: unbounded)."""
    return _CURRENT.get()


@contextlib.contextmanager
def bounded(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run the block under ``deadline`` (replacing the one in force; ``None`` lifts it)."""
    token = _CURRENT.set(deadline)
    try:
        yield deadline
    finally:
        _CURRENT.reset(token)


CLEANUP_SECONDS = 30.0
"""What removing a failed save's files may take, apart from the save's own (spent) deadline."""
CLEANUP_SLACK = 1.0
"""What a failed save with a deadline waits for its cleanup past that deadline before it
raises: a server that stopped answering must not hold the error back for ``CLEANUP_SECONDS``."""


def cleanup_time() -> contextlib.AbstractContextManager[Deadline | None]:
    """A short deadline of its own for cleaning up after a failed save: under the save's
    (perhaps expired) deadline it would fail at once and hide the save's own error; with no
    deadline in force, none."""
    if _CURRENT.get() is None:
        return contextlib.nullcontext()
    return bounded(Deadline.after(CLEANUP_SECONDS))


def clean_up(
    remove: Callable[[], None], what: str, *, otherwise: str = "`ckptstore gc` removes it"
) -> str | None:
    """Run ``remove`` (a failed save's files) under :func:`cleanup_time`. With a deadline in
    force, wait for it until that deadline plus :data:`CLEANUP_SLACK` at most (however many
    cleanups a failed save runs one after another, they end by then), then let it go on in the
    background (a daemon thread, by its own deadline), so the save's error is raised on time.
    ``otherwise`` says what removes whatever it could not (``gc``, for a store's files). Its own
    failure is logged: the save's error is the one that matters.

    None: removed. Else what became of the removal, for the save's error to say: ``"failed
    (...)"`` or ``"goes on in the background"``."""
    outer = _CURRENT.get()

    done = threading.Event()
    failure: list[str] = []

    def run() -> None:
        try:
            with cleanup_time():
                remove()
        except Exception as e:
            failure.append(f"failed ({e})")
            log.warning("could not remove %s (%s); %s", what, e, otherwise)
        finally:
            done.set()

    if outer is None:
        run()
    else:
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(run,), name="ckpt-cleanup", daemon=True).start()
        if not done.wait(max(0.0, outer.expires + CLEANUP_SLACK - outer.clock())):
            log.warning(
                "removing %s goes on in the background (the server is slow or not "
                "answering); if it cannot finish, %s",
                what,
                otherwise,
            )
            return "goes on in the background"
    return failure[0] if failure else None


def within(
    seconds: float | None,
    *,
    operation: Operation = "save",
    rank: int | None = None,
    store: str | None = None,
) -> contextlib.AbstractContextManager[Deadline | None]:
    """The deadline of a save or load of ``seconds`` (None: none) of ``store``, unless one is
    in force already (a save's stage inside the save keeps the save's, a pull inside a resume
    the resume's)."""
    if seconds is None or _CURRENT.get() is not None:
        return contextlib.nullcontext(_CURRENT.get())
    return bounded(Deadline.after(seconds, operation=operation, rank=rank, store=store))


def check(target: str, *, doing: str, bytes_done: int | None = None) -> None:
    """Raise the error of the deadline in force if it has passed: what a loop that moves a
    file chunk by chunk calls between chunks (local disks and fsspec, whose calls cannot be
    interrupted mid-way)."""
    deadline = _CURRENT.get()
    if deadline is not None:
        deadline.check(target, doing=doing, bytes_done=bytes_done)


def remaining(cap: float) -> float:
    """``cap`` seconds, or less if the deadline in force comes sooner."""
    deadline = _CURRENT.get()
    return cap if deadline is None else deadline.cap(cap)


def map_in_context(pool: Executor, fn: Callable[[A], T], items: Iterable[A]) -> list[T]:
    """``list(pool.map(fn, items))``, each job in a copy of the caller's context
    (:func:`submit`): results in order, the first failure raised."""
    return [future.result() for future in [submit(pool, fn, item) for item in items]]


def submit(pool: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``pool.submit(fn, ...)`` run in a copy of the caller's context, so ``fn`` sees the
    caller's deadline. (One copy per job: a context cannot be entered by two threads at once.)
    """
    context = contextvars.copy_context()

    def run() -> T:
        return context.run(fn, *args, **kwargs)

    return pool.submit(run)
