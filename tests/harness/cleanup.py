"""What must be left once removals and gc have run (docs/design.md, invariant 10).

Both checks look at the run's outcome, and only where the claim they check applies:

* ``removal-rolled-forward``: a removal interrupted at any point (its tombstone standing,
  some files gone) is finished by the next prune or gc. So once a finisher ran last and
  returned, no uncommit's tombstone stands and no file of the removed step's attempts is
  left.
* ``gc-leaves-only-committed``: after ``gc(older_than=0)`` that started after every other
  actor ended and returned, with no live writer (the lease record released, in a store that
  uses the lease), the store holds committed steps and nothing else: every object is a
  committed manifest, a file it lists, its attempt's marker, a pin of a committed step, the
  pointer or the lease record.

"Ran last" (started after every other actor ended) is read off the run's start and end
events, so schedules in which the finisher ran first, or beside the others, are explored all
the same but not judged by these.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from ckptstore.backends.base import Backend
from ckptstore.domain import layout
from ckptstore.domain.manifest import Manifest, tombstone_of_commit
from ckptstore.domain.step_index import HEAD_NAME, Head, Summary, decode_segment, segment_path
from ckptstore.protocol.step_index import StepIndex
from harness.invariants import Checker, Violation, payload_key
from harness.scheduler import Event, Stored

Final = Callable[[Checker, Sequence[Event]], Violation | None]
"""A check of a run's outcome: the checker (its backend's objects) and the run's events."""


def ran_after(events: Sequence[Event], actor: str, others: Sequence[str]) -> bool:
    """Whether ``actor`` started after each of ``others`` ended, and returned normally."""
    starts = {e.actor: e.seq for e in events if e.op == "start"}
    ends = {e.actor: e for e in events if e.op == "end"}
    end = ends.get(actor)
    if actor not in starts or end is None or not end.outcome.startswith("returned"):
        return False
    return all(o in ends and ends[o].seq < starts[actor] for o in others)


def committed_objects(committed: Mapping[int, Manifest]) -> set[str]:
    """The objects the committed steps account for (their pins included)."""
    keep = {layout.LATEST_NAME, layout.LEASE_NAME}
    for step, manifest in committed.items():
        keep |= {layout.manifest_path(step), layout.pin_path(step)}
        keep |= {payload_key(step, f) for f in manifest.files}
        keep |= {layout.attempt_marker_path(step, f.attempt) for f in manifest.files if f.attempt}
    return keep


def ran_last(events: Sequence[Event], actors: Sequence[str]) -> str | None:
    """The one of ``actors`` that started after every other actor of the run ended, and
    returned normally; None if none did."""
    everyone = [e.actor for e in events if e.op == "start"]
    for actor in actors:
        if ran_after(events, actor, [a for a in everyone if a != actor]):
            return actor
    return None


def rolled_forward(step: int, finishers: Sequence[str]) -> Final:
    """``removal-rolled-forward`` for a removal of ``step``, judged where one of
    ``finishers`` (a prune or a gc) ran last. It judges the removal only: no uncommit's
    tombstone stands and no file of the removed step's attempts is left. Anything else
    (a gc that read the step before it was removed may claim its key again, and keep that
    tombstone for the next gc) is gc-leaves-only-committed's to judge."""

    def check(checker: Checker, events: Sequence[Event]) -> Violation | None:
        finisher = ran_last(events, finishers)
        removed = _uncommitted(checker, events, step)
        if finisher is None or removed is None:
            return None  # judged only once a finisher ran last, and a removal began
        key = checker.backend.objects.get(layout.manifest_path(step))
        attempts = {layout.attempt_dir(step, f.attempt) + "/" for f in removed.files if f.attempt}
        left = sorted(p for p in checker.backend.objects if p.startswith(tuple(attempts)))
        if key is not None and tombstone_of_commit(key.data):
            left.insert(0, f"{layout.manifest_path(step)} (the removal's tombstone)")
        if not left:
            return None
        return Violation(
            "removal-rolled-forward",
            f"{finisher} ran last, yet the removal of step {step} left {', '.join(left)}",
            -1,
        )

    return check


def _uncommitted(checker: Checker, events: Sequence[Event], step: int) -> Manifest | None:
    """The manifest of ``step`` that an operation of the run replaced or deleted, if any."""
    path = layout.manifest_path(step)
    for event in events:
        for effect in event.effects:
            if effect.path == path and effect.before is not None:
                manifest = checker.manifest_of(effect.before)
                if manifest is not None:
                    return manifest
    return None


def only_committed_left(checker: Checker, events: Sequence[Event]) -> Violation | None:
    """``gc-leaves-only-committed``, where it applies (module docstring)."""
    collectors = [a for a, role in checker.roles.items() if role == "gc"]
    last = ran_last(events, collectors)
    if last is None or not _released(checker.backend.objects.get(layout.LEASE_NAME)):
        return None
    keep = committed_objects(checker.committed_steps()) | index_objects(checker)
    left = sorted(set(checker.backend.objects) - keep)
    if not left:
        return None
    return Violation(
        "gc-leaves-only-committed",
        f"{last} ran last, no writer holds the lease, and these are left: {', '.join(left)}",
        -1,
    )


def index_paths(backend: Backend) -> set[str]:
    """The step index's head and the sealed segments it names, read from ``backend``."""
    head, _ = StepIndex(backend).read_head()
    return {HEAD_NAME, *(segment_path(n) for n in head.segments)} if head else set()


def index_objects(checker: Checker) -> set[str]:
    """The step index's head and the sealed segments it names (step_index.py)."""
    head = _index(checker)
    return {HEAD_NAME, *(segment_path(n) for n in head[0].segments)} if head else set()


def _index(checker: Checker) -> tuple[Head, dict[int, Summary]] | None:
    stored = checker.backend.objects.get(HEAD_NAME)
    if stored is None:
        return None
    head = Head.decode(stored.data, HEAD_NAME)
    summaries: dict[int, Summary] = {}
    for name in head.segments:
        segment = checker.backend.objects[segment_path(name)]  # a named one is never gone
        summaries.update((s.step, s) for s in decode_segment(segment.data, name))
    summaries.update((s.step, s) for s in head.steps)
    return head, summaries


def index_agrees(checker: Checker, events: Sequence[Event]) -> Violation | None:
    """``index-agrees``: what a reader of the step index lists (its summaries, each step it
    holds a claim on looked up in its manifest) is what the manifests say is committed, and
    every summary is that of its step's manifest. Holds after every schedule, crashes
    included: a writer killed between its commit and the index update left a claim."""
    found = _index(checker)
    committed = checker.committed_steps()
    if found is None or not found[0].complete:
        return None  # readers list the manifests (and complete the index)
    head, summaries = found
    claimed = {p.step for p in head.pending} | set(head.removing)
    listed = (set(summaries) - claimed) | {s for s in claimed if s in committed}
    wrong = [s for s in set(summaries) - claimed if s in committed
             and summaries[s] != Summary.of(committed[s])]  # fmt: skip
    if listed == set(committed) and not wrong:
        return None
    return Violation(
        "index-agrees",
        f"a reader of the step index lists {sorted(listed)} (summaries differing from their "
        f"manifest: {wrong}), the manifests say {sorted(committed)}",
        -1,
    )


def _released(stored: Stored | None) -> bool:
    """Whether ``lease.json`` exists and says its holder released it (no live writer)."""
    if stored is None:
        return False
    try:
        body = json.loads(stored.data)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("released") is True
