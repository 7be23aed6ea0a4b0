"""Trusting the step index only where nobody is changing it, and keeping it whole.

A listing reads the step index (step_index.py), a few objects however many steps there are.
A step the index holds a claim on (a save announced, a removal in flight, either perhaps
killed half-way) is looked up in its manifest instead, and what was found repairs the index,
best effort: a reader that may not write lists all the same. ``rebuild`` replaces every
summary with one read from the manifests now (``ckptstore index --rebuild``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptstore.domain.manifest import Manifest
from ckptstore.domain.step_index import Summary
from ckptstore.errors import BackendError, CheckpointError, ConflictError, CorruptCheckpointError
from ckptstore.protocol.step_index import Snapshot, StepIndex, stale
from ckptstore.protocol.step_state import StepState

log = logging.getLogger(__name__)


@dataclass
class Checked:
    """The index's summaries with each claimed step looked up, and what the index lacks."""

    summaries: list[Summary]
    broken: dict[int, CheckpointError] = field(default_factory=dict)
    added: list[Summary] = field(default_factory=list)
    """Committed steps the index does not hold as they are."""
    gone: list[int] = field(default_factory=list)
    """Claimed steps with no manifest and no writer left to commit them."""
    half_removed: list[int] = field(default_factory=list)
    """Claimed steps whose tombstone stands: a prune finishes their removal (pruning.py)."""


def check_claims(
    snapshot: Snapshot,
    state_of: Callable[[int], StepState],
    summary_of: Callable[[int], Summary],
    now: float,
) -> Checked:
    """Look up every step the index holds a claim on (``state_of`` reads its manifest key
    afresh; ``summary_of`` summarises a committed one)."""
    summaries = dict(snapshot.summaries)
    head = snapshot.head
    pending = {p.step: p for p in head.pending}
    checked = Checked([])
    for step in sorted(set(pending) | set(head.removing)):
        state = state_of(step)
        if state is StepState.COMMITTED:
            summary = summary_of(step)
            if step in pending or summaries.get(step) != summary:
                checked.added.append(summary)
            summaries[step] = summary
            continue
        summaries.pop(step, None)
        if state is StepState.REMOVING:
            checked.half_removed.append(step)
        elif state is StepState.UNREADABLE:
            checked.broken[step] = CorruptCheckpointError(f"step {step}: unreadable manifest")
        elif step not in pending or stale(pending[step], now):
            checked.gone.append(step)
    checked.summaries = sorted(summaries.values(), key=lambda s: s.step)
    return checked


def repair(index: StepIndex, checked: Checked, removals: int, uri: str) -> None:
    """Write what :func:`check_claims` found into the index, unless a removal changed it
    meanwhile (``removals`` counts them); a failure is logged, the next listing repairs."""
    added, gone = checked.added, checked.gone
    try:
        if added:
            index.update(
                lambda h: h.with_summaries(added) if h and h.removals == removals else None,
                "repair",
            )
        if gone:
            index.drop(gone, removals=removals)
    except (BackendError, ConflictError) as e:
        log.info("%s: the step index was not repaired: %s", uri, e)


def rebuild(index: StepIndex, scan: Callable[[], list[Manifest]]) -> int:
    """Replace every summary of the index with one read now by ``scan``; writers' claims
    stay. Returns how many steps it holds. Retried while removals race it (a removal dropped
    steps meanwhile)."""
    for _ in range(3):
        try:
            head, _ = index.read_head()
        except CorruptCheckpointError:
            head = None
        found = [Summary.of(m) for m in scan()]
        removals = head.removals if head is not None else None
        if index.rebuild(found, merge=False, removals=removals):
            return len(found)
    raise BackendError(
        f"{index.uri}: the step index could not be rebuilt (removals or writers kept "
        "changing it); try again",
        retryable=True,
    )
