"""One compare-and-swap loop for every small control object (``latest``, the writer lease).

Read the object with its version, decide the new content from the old, swap against the
version; on a lost race read again, after a jittered exponential backoff (:data:`BACKOFF`, the
package's policy: :mod:`ckptstore.retry`) so that rivals that collided do not collide again in
lockstep. Deciding is a pure function of what was read, so a retry always decides afresh. Other
loops that race rivals for one key (a commit over a tombstone, a removal's claim) back off the
same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptstore.backends.base import Backend, join
from ckptstore.errors import BackendError, NotFoundError, PreconditionFailedError
from ckptstore.retry import Backoff, Retry

BACKOFF = Backoff(base=0.02, cap=1.0)
"""The wait after a lost race: up to 20 ms after the first, doubling to 1 s, full jitter."""
MAX_SWAP_ATTEMPTS = 20


def lost_race(e: Exception) -> bool:
    """A compare-and-swap found the object changed since it was read: read it again."""
    return isinstance(e, PreconditionFailedError)


def swap_loop(
    backend: Backend,
    path: str,
    decide: Callable[[bytes | None], bytes | None],
    *,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    attempts: int = MAX_SWAP_ATTEMPTS,
) -> bool:
    """Swap ``path`` to ``decide(current bytes or None)``; returns False if it decided ``None``
    (leave the object as it is). ``decide`` may raise to stop. ``what`` names the change for
    the error raised when every attempt lost its race."""

    def swap() -> bool:
        try:
            current, version = backend.read_versioned(path)
        except NotFoundError:
            current, version = None, None
        new = decide(current)
        if new is None:
            return False
        backend.swap(path, new, version)
        return True

    try:
        return Retry(BACKOFF, attempts=attempts).run(
            swap, retryable=lost_race, target=join(backend.uri, path), doing=what, sleep=sleep
        )
    except PreconditionFailedError as e:
        raise BackendError(
            f"{backend.uri}: could not {what} after {attempts} attempts (too many concurrent "
            "writers of the same object); try again",
            retryable=True,
        ) from e
