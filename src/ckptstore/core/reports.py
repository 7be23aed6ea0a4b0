"""What a participant of a coordinated save reports to its coordinator (coordination.py).

A participant that skips a collective hangs the others, so staging never raises: its report
(:class:`Staged`) carries its entries, or its failure as one line of text (:func:`describe`),
which travels to the coordinator's process; the coordinator names each by :func:`label`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptstore.domain.manifest import FileEntry

log = logging.getLogger("ckptstore.core.coordination")  # the coordinated save's one logger


@dataclass(frozen=True)
class Staged:
    """One participant's report to the coordinator: its entries, or why it failed."""

    participant: int | str
    entries: tuple[FileEntry, ...] = ()
    error: str | None = None
    node: str | None = None
    """The node the participant staged on: its store's local tier's node id (``store.node``,
    tiers/identity.py), or None when it staged in the store itself. Not a path: every node
    of a cluster may be given the same ``local=``, each on a disk of its own."""

    @classmethod
    def of(
        cls,
        participant: int | str,
        stage: Callable[[], Iterable[FileEntry]],
        *,
        node: str | None,
    ) -> Staged:
        """Run ``stage`` (staging on ``node``: ``store.node`` of the participant's store);
        never raises (the failure is logged and reported as text)."""
        try:
            return cls(participant, tuple(stage()), node=node)
        except Exception as e:
            return cls.failure(participant, e)

    @classmethod
    def failure(cls, participant: int | str, error: BaseException) -> Staged:
        """The report of a participant whose staging raised ``error`` (logged here)."""
        log.error("%s could not stage its files", label(participant), exc_info=error)
        return cls(participant, error=describe(error))


def describe(error: BaseException) -> str:
    """An error as one line of text, to send to other processes."""
    return f"{type(error).__name__}: {error}"


def label(participant: int | str) -> str:
    """A participant as the errors name it: ``rank 3``, or its own name (a verl node)."""
    return f"rank {participant}" if isinstance(participant, int) else str(participant)
