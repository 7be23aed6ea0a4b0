"""The rule every training face keeps for saves that fail: each is logged and training goes
on (the next save is due at once); ``max_failed_saves`` in a row raise, so the job stops and
its scheduler sees it. The training loop's callback (training.py), verl's checkpoint callback
(verl.py) and verl's SFT handler (verl_sft.py) count through :class:`FailedSaves`."""

from __future__ import annotations

import logging

from ckptstore.errors import CheckpointError

log = logging.getLogger(__name__)


class FailedSaves:
    """Saves of one store that failed in a row."""

    def __init__(self, uri: str, limit: int, *, headline: str, hint: str) -> None:
        self.uri = uri
        self.limit = limit
        self.headline = headline
        """What the error says after the count: ``saves in a row failed``, ``verl saves in a
        row could not be committed``."""
        self.hint = hint
        """What to check, in the error (the face's own option names)."""
        self.count = 0

    def succeeded(self) -> None:
        self.count = 0

    def failed(self, step: int, error: CheckpointError, *, log_it: bool = True) -> None:
        """Count one; raise once ``limit`` are in a row. ``log_it``: where every rank counts
        the same failure, one says it."""
        self.count += 1
        if log_it:
            log.error(
                "%s: the save of step %d failed (%d in a row; training goes on, and stops "
                "after %d): %s",
                self.uri,
                step,
                self.count,
                self.limit,
                error,
            )
        if self.count >= self.limit:
            raise CheckpointError(
                f"{self.uri}: {self.count} {self.headline}, the last one of step {step}: "
                f"{error}. Stopping, so the scheduler sees it: check the storage ({self.hint})",
                uri=self.uri,
                step=step,
            ) from error
