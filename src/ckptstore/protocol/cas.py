"""One compare-and-swap loop for every small control object (``latest``, the writer lease).

Read the object with its version, decide the new content from the old, swap against the
version; on a lost race read again, after a jittered exponential backoff so that rivals that
collided do not collide again in lockstep. Deciding is a pure function of what was read, so a
retry always decides afresh.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from ckptstore.backends.base import Backend
from ckptstore.errors import BackendError, NotFoundError, PreconditionFailedError

log = logging.getLogger(__name__)

MAX_SWAP_ATTEMPTS = 20


def backoff(attempt: int, *, base: float = 0.02, cap: float = 1.0) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter over an exponential."""
    return random.uniform(0, min(cap, base * 2**attempt))


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
    for attempt in range(attempts):
        try:
            current, version = backend.read_versioned(path)
        except NotFoundError:
            current, version = None, None
        new = decide(current)
        if new is None:
            return False
        try:
            backend.swap(path, new, version)
            return True
        except PreconditionFailedError:
            log.debug("%s: %s moved under us (attempt %d); re-reading", backend.uri, path, attempt)
            sleep(backoff(attempt))
    raise BackendError(
        f"{backend.uri}: could not {what} after {attempts} attempts (too many concurrent "
        "writers of the same object); try again",
        retryable=True,
    )
