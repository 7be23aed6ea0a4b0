"""The commit protocol's invariants (docs/design.md), checked after every operation of a run.

The checker reads the in-memory backend's own objects and each operation's recorded effects,
never the store's view of them: a bug in the store's reading code must not hide a bug in its
writing code. It knows the layout (manifest keys, ``latest.json``, pins, the lease) and decodes
manifests with the real :class:`~ckptstore.domain.manifest.Manifest`; anything at a manifest
key that does not decode as a manifest (a tombstone, for instance) is *not* a committed step.

Actors have roles, which say what they may delete: a ``writer`` deletes no committed step
(except one that a fenced writer committed, which the protocol removes), a ``pruner`` (also a
writer that applies retention after its save) deletes only steps below ``latest`` and not
pinned, ``gc`` deletes no committed step and none of its files; ``setup`` is not judged.

A store with a local tier (tiers/local.py) has two backends: each has its checker (the local tier
follows the same protocol; there every writer prunes), which judges only its own backend's
calls, and :func:`check_tiers` judges the two together at the end of a run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.domain import layout
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry, Manifest
from ckptstore.errors import CheckpointError
from harness.lease_checks import LeaseWatch
from harness.scheduled_backend import ScheduledBackend
from harness.scheduler import Effect, Event, Stored

INVARIANTS = {
    "committed-step-whole": "every file a committed manifest lists is present, size and CRC32C",
    "committed-manifest-immutable": "a committed manifest's bytes never change while it exists",
    "latest-names-committed": "latest.json names a committed step",
    "latest-moves-forward": "latest only moves forward (and is never deleted)",
    "retention-deletes-safely": "only retention deletes a step: below latest, never pinned",
    "gc-spares-committed": "gc deletes no manifest and no file a committed manifest lists",
    "fenced-writer-never-moves-latest": "no write of latest carries an epoch below the lease's",
    "latest-never-fenced": "latest.json never names a step a fenced writer committed",
    "lease-epoch-never-goes-back": "lease.json is never deleted, and is replaced only by its "
    "holder under the same epoch or by a new holder under a higher one",
    "fenced-writer-never-writes-lease": "a writer whose lease was taken over never writes "
    "lease.json again (release included)",
    "removal-rolled-forward": "once a prune or gc ran after an interrupted removal, neither "
    "its tombstone nor a file of the removed step is left",
    "gc-leaves-only-committed": "after gc(older_than=0) ran last with no live writer, only "
    "committed steps' objects remain",
    "resume-loads-a-saved-state": "a fresh store resumes from the newest unfenced committed "
    "step, and loads exactly a state some writer saved as that step (never a mix)",
    "actors-fail-cleanly": "an actor raises nothing but CheckpointErrors (or dies by a crash)",
    "tier-copies-identical": "a step committed in the local and the durable tier has the same "
    "manifest in both (persisting commits the local manifest verbatim)",
    "persisted-never-fenced": "a step committed in the local tier before a takeover and "
    "persisted (its manifest in the durable tier) is not fenced: fenced_steps() leaves it out",
    "tiered-latest": "a fresh tiered store's latest() is the newest step committed in either "
    "tier that the durable pointer's fences leave, and loads a state some writer saved as it; "
    "no writer resumed from a fenced step",
    "closed-writer-left-its-step-durable": "a writer that closed its tiered store made its last "
    "step durable: the durable tier holds the local tier's newest step, and latest names it",
}
WRITES = frozenset({"write", "create", "swap", "copy", "delete"})
READS = frozenset({"read", "read_into", "read_versioned", "stat", "list", "list_dirs"})
TRACE_TEXT = 160
"""Longer outcomes (error messages) are cut in traces."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    seq: int
    """The event at which it was seen; -1 for checks at the end of a run."""


def payload_key(step: int, entry: FileEntry) -> str:
    """The object key of a listed file: per attempt where the layout has attempts."""
    by_entry: Callable[[int, FileEntry], str] | None = getattr(layout, "payload_key", None)
    if by_entry is not None:
        return by_entry(step, entry)
    key: Callable[[int], str] | None = getattr(entry, "key", None)  # FileEntry.key(step)
    if key is not None:
        return key(step)
    return layout.payload_path(step, entry.path)


def manifest_step(path: str) -> int | None:
    """The step whose manifest key ``path`` is, or None."""
    head, _, name = path.partition("/")
    return layout.parse_step_dir(head) if name == layout.MANIFEST_NAME else None


def fenced(pointer: Mapping[str, Any] | None, step: int, manifest: Manifest) -> bool:
    """Whether ``manifest``'s step belongs to a fenced writer (pointer.py): a fence names the
    displaced writer (schema 3) or, in a schema 2 pointer, an epoch."""
    fences = pointer.get("fences", []) if pointer is not None else []
    epoch = _epoch(manifest)
    return any(
        step > f[1] and (manifest.writer == f[2] if len(f) == 3 else 0 < epoch < f[0])
        for f in fences
    )


@dataclass(frozen=True)
class Failure:
    """A schedule that broke an invariant, with what it takes to read and replay it."""

    scenario: str
    violation: Violation
    choices: tuple[int, ...]
    """Option indices at each choice: ``replay`` (``--replay``) runs the schedule again."""
    bound: tuple[int, int]
    """The preemption and crash bounds it was found under, which give the indices meaning."""
    schedule: tuple[str, ...]
    trace: tuple[str, ...]
    ops: int
    """Operations the schedule ran before the violation (a shorter one is easier to read)."""

    def render(self) -> str:
        v = self.violation
        meaning = INVARIANTS.get(v.invariant, "")
        return "\n".join(
            [
                f"VIOLATION of {v.invariant} ({meaning}) in {self.scenario}:",
                f"  {v.message}",
                f"  schedule ({self.ops} operations): {' '.join(self.schedule)}",
                f"  replay: --scenario {self.scenario} --preemptions {self.bound[0]} "
                f"--crashes {self.bound[1]} --replay {','.join(map(str, self.choices))}",
                "  trace:",
                *(f"    {line}" for line in self.trace),
            ]
        )


_MANIFESTS: dict[bytes, Manifest | None] = {}
_CRCS: dict[bytes, str] = {}
"""What each object's bytes decode to, and their CRC32C: pure functions of the bytes, shared
by every checker (a scenario's thousands of schedules write the same few objects again and
again); :func:`forget_decoded` empties them between explorations."""


def forget_decoded() -> None:
    _MANIFESTS.clear()
    _CRCS.clear()


class Checker:
    """Watches one run's events; the first violation stops the run (``violation``)."""

    def __init__(
        self, backend: ScheduledBackend, roles: Mapping[str, str] | None = None, *, tier: str = ""
    ) -> None:
        self.backend = backend
        self.roles: dict[str, str] = dict(roles or {})
        self.tier = tier
        """The tier it watches, named in its messages ("": the store, one tier)."""
        self.faster: tuple[Checker, ...] = ()
        """The checkers of the tiers in front of this one (a local tier), for checks at the
        end of a run that compare tiers."""
        self.fenced_by: Checker | None = None
        """The checker of the tier whose pointer's fences judge this tier's steps (a local
        tier's: the durable tier's; None: this tier's own pointer)."""
        self._removed_fenced: set[int] = set()
        """Steps of a fenced writer removed here. In a local tier (no lease, no fences of its
        own) such a writer may have moved ``latest`` to its step: the pointer names it until
        the new holder commits over it (or a save repairs the pointer)."""
        self.violation: Violation | None = None
        self._manifests = _MANIFESTS
        self._crcs = _CRCS
        self._listed: set[str] | None = None
        """Payload keys of committed steps, as of the last state check (None: none yet)."""
        self.lease = LeaseWatch()

    def observe(self, event: Event) -> None:
        if self.violation is not None or event.op not in WRITES or not event.effects:
            return
        if event.backend and event.backend != self.backend.uri:
            return  # another tier's call: its own checker judges it
        if self.roles.get(event.actor, "setup") == "setup":
            for effect in event.effects:  # who holds the lease: setup may have taken it
                if effect.path == layout.LEASE_NAME:
                    self.lease.judge(effect, event.actor)
            return  # the scenario's own preparation: checked by the first explored operation
        found = self._check_effects(event)
        if found is None and self._may_break_state(event):
            found = self._check_state()
        if found is not None:
            where = f"in the {self.tier} tier: " if self.tier else ""
            self.violation = Violation(found[0], where + found[1], event.seq)
            self.backend.scheduler.stop()

    # -- per operation ---------------------------------------------------------------------

    def _check_effects(self, event: Event) -> tuple[str, str] | None:
        role = self.roles.get(event.actor, "setup")
        before = {e.path: e.before for e in event.effects}

        def then(path: str) -> Stored | None:  # the object as it was before this operation
            return before[path] if path in before else self.backend.objects.get(path)

        pointer = _json(then(layout.LATEST_NAME))
        for effect in event.effects:
            if effect.path == layout.LATEST_NAME:
                found = self._pointer_move(effect, pointer, _json(then(layout.LEASE_NAME)))
            elif effect.path == layout.LEASE_NAME:
                found = self.lease.judge(effect, event.actor)
            elif effect.after is None and role == "gc":
                found = self._gc_deletion(effect.path, {*self.backend.objects, *before}, then)
            else:
                found = None
            step = manifest_step(effect.path)
            manifest = self._manifest(effect.before) if step is not None else None
            if found is None and step is not None and manifest is not None:
                if self._manifest(effect.after) is None:  # deleted, or a tombstone put there
                    found = self._uncommit(event.actor, role, step, manifest, pointer, then)
                elif effect.after.data != effect.before.data:  # type: ignore[union-attr]
                    found = "committed-manifest-immutable", f"{event.actor} overwrote {effect.path}"
            if found is not None:
                return found
        return None

    def _gc_deletion(
        self, path: str, present: set[str], then: Callable[[str], Stored | None]
    ) -> tuple[str, str] | None:
        for other in present:
            manifest = self._manifest(then(other)) if manifest_step(other) is not None else None
            if manifest is not None and other == path:
                return "gc-spares-committed", f"gc deleted the manifest of step {manifest.step}"
            if manifest is not None and path in {
                payload_key(manifest.step, f) for f in manifest.files
            }:
                return "gc-spares-committed", f"gc deleted {path}, listed by step {manifest.step}"
        return None

    def _pointer_move(
        self, effect: Effect, old: dict[str, Any] | None, lease: dict[str, Any] | None
    ) -> tuple[str, str] | None:
        new = _json(effect.after)
        if effect.after is None:
            return "latest-moves-forward", f"{layout.LATEST_NAME} was deleted"
        if new is None:
            return "latest-moves-forward", f"{layout.LATEST_NAME} was replaced by garbage"
        step, was = _step_of(new), _step_of(old)
        if old is not None and step < was:
            return "latest-moves-forward", f"latest moved back from step {was} to step {step}"
        epoch, held = new.get("epoch", 0), (lease or {}).get("epoch", 0)
        if isinstance(epoch, int) and isinstance(held, int) and epoch < held:
            return (
                "fenced-writer-never-moves-latest",
                f"latest was written (step {step}) with lease epoch {epoch} while "
                f"{layout.LEASE_NAME} was at epoch {held}",
            )
        return None

    def _uncommit(
        self,
        actor: str,
        role: str,
        step: int,
        manifest: Manifest,
        pointer: dict[str, Any] | None,
        then: Callable[[str], Stored | None],
    ) -> tuple[str, str] | None:
        latest = _step_of(pointer) if pointer is not None else None
        if role == "gc":
            return "gc-spares-committed", f"gc uncommitted step {step}"
        fences = pointer
        if self.fenced_by is not None:
            fences = _json(self.fenced_by.backend.objects.get(layout.LATEST_NAME))
        if fenced(fences, step, manifest):
            self._removed_fenced.add(step)
            return None  # a fenced writer's late step: never latest, removed by the protocol
        if role != "pruner":
            return "retention-deletes-safely", f"{actor} ({role}) uncommitted step {step}"
        if latest is None or step >= latest:
            return "retention-deletes-safely", f"{actor} pruned step {step}; latest is {latest}"
        if then(layout.pin_path(step)) is not None:
            return "retention-deletes-safely", f"{actor} pruned step {step}, which is pinned"
        return None

    # -- the state after each operation ----------------------------------------------------

    def _may_break_state(self, event: Event) -> bool:
        """Whether the event touched a manifest, a committed step's file or ``latest``: the
        state invariants held before it, so only such an event can break them."""
        if self._listed is None:
            return True
        return any(
            e.path in self._listed
            or e.path == layout.LATEST_NAME
            or manifest_step(e.path) is not None
            for e in event.effects
        )

    def _check_state(self) -> tuple[str, str] | None:
        objects = self.backend.objects
        self._listed = set()
        for path, stored in objects.items():
            step = manifest_step(path)
            manifest = self._manifest(stored) if step is not None else None
            for entry in manifest.files if manifest is not None else ():
                key = payload_key(manifest.step, entry)  # type: ignore[union-attr]
                self._listed.add(key)
                problem = self._file_problem(objects.get(key), entry)
                if problem is not None:
                    return "committed-step-whole", f"step {step}: {key} {problem}"
        pointer = _json(objects.get(layout.LATEST_NAME))
        if layout.LATEST_NAME in objects:
            if pointer is None:
                return "latest-names-committed", f"{layout.LATEST_NAME} is unreadable"
            step = pointer.get("step")
            manifest = self.committed(step) if isinstance(step, int) else None
            if step is not None and manifest is None and step not in self._removed_fenced:
                return "latest-names-committed", f"latest names step {step}, not committed"
            if manifest is not None and fenced(pointer, manifest.step, manifest):
                return (
                    "latest-never-fenced",
                    f"latest names step {step}, committed under lease epoch {_epoch(manifest)} "
                    f"after a takeover fenced it ({pointer.get('fences')})",
                )
        return None

    def _file_problem(self, stored: Stored | None, entry: FileEntry) -> str | None:
        if stored is None:
            return "is missing"
        if len(stored.data) != entry.size:
            return f"holds {len(stored.data)} B, the manifest says {entry.size}"
        crc = self._crcs.get(stored.data)
        if crc is None:
            digest = Crc32c()
            digest.update(stored.data)
            crc = self._crcs[stored.data] = digest.hexdigest()
        if crc != entry.crc32c:
            return f"has CRC32C {crc}, the manifest says {entry.crc32c} (other bytes)"
        return None

    def committed(self, step: int) -> Manifest | None:
        """The step's manifest if the step is committed right now."""
        return self._manifest(self.backend.objects.get(layout.manifest_path(step)))

    def committed_steps(self) -> dict[int, Manifest]:
        found = {manifest_step(p): self._manifest(o) for p, o in self.backend.objects.items()}
        return {s: m for s, m in found.items() if s is not None and m is not None}

    def manifest_of(self, stored: Stored) -> Manifest | None:
        """The manifest an object holds, or None (a tombstone, garbage)."""
        return self._manifest(stored)

    def _manifest(self, stored: Stored | None) -> Manifest | None:
        """The manifest in ``stored``, or None if it is absent or not a committed manifest."""
        if stored is None:
            return None
        if stored.data not in self._manifests:
            body = _json(stored)
            manifest = None
            if body is not None and "tombstone" not in body:
                try:
                    manifest = Manifest.decode(stored.data, where="checker")
                except CheckpointError:
                    manifest = None
            self._manifests[stored.data] = manifest
        return self._manifests[stored.data]

    # -- at the end of a run ---------------------------------------------------------------

    def check_resume(self, store: Any, saved: Mapping[int, Sequence[Any]]) -> Violation | None:
        """A fresh store resumes from the newest unfenced committed step, with a saved state."""
        name = "resume-loads-a-saved-state"
        pointer = _json(self.backend.objects.get(layout.LATEST_NAME))
        steps = [s for s, m in self.committed_steps().items() if not fenced(pointer, s, m)]
        try:
            info = store.latest()
            if info is None:
                return (
                    Violation(name, f"latest() is None; committed: {steps}", -1) if steps else None
                )
            if info.step != max(steps, default=None):
                return Violation(name, f"latest() is step {info.step}; committed: {steps}", -1)
            state = _contents(store, info)
        except CheckpointError as e:
            return Violation(name, f"resuming failed: {type(e).__name__}: {e}", -1)
        candidates = saved.get(info.step, ())
        if not any(same_state(state, c) for c in candidates):
            found = f"step {info.step} loads {state!r}, none of the {len(candidates)} states"
            return Violation(name, f"{found} saved as that step (a mix?)", -1)
        return None


def in_local_tier(role: str) -> str:
    """An actor's role in a local tier: a writer there applies the tier's retention
    (``local_keep_last``) after each save and each persist, a pruner's role."""
    return "pruner" if role == "writer" else role


def local_commits(local: Checker, events: Sequence[Event]) -> list[tuple[int, int, Manifest]]:
    """Every manifest committed in the local tier, in order: its step, the event that
    committed it (-1: before the run, by its setup), the manifest. Local retention may have
    removed it since, and a new lease holder may have committed the step anew over a fenced
    writer's."""
    found: list[tuple[int, int, Manifest]] = []
    for event in events:
        if event.backend != local.backend.uri:
            continue
        for effect in event.effects:
            step = manifest_step(effect.path)
            manifest = local.manifest_of(effect.after) if effect.after is not None else None
            if step is not None and manifest is not None:
                found.append((step, event.seq, manifest))
    during = {step for step, _, _ in found}
    before = [(s, -1, m) for s, m in sorted(local.committed_steps().items()) if s not in during]
    return before + found


def takeover_seq(durable: Checker, events: Sequence[Event]) -> int | None:
    """The event at which a takeover began in the durable tier (the first), or None: its
    stamp of ``latest`` with a new fence (lease.py stamps before the lease changes hands), or
    else the lease taken from a holder that had not released it."""
    for event in events:
        if event.backend != durable.backend.uri:
            continue
        for effect in event.effects:
            old = _json(effect.before) if effect.before is not None else None
            new = _json(effect.after) if effect.after is not None else None
            if new is None:
                continue
            if effect.path == layout.LATEST_NAME:
                if len(new.get("fences", [])) > len((old or {}).get("fences", [])):
                    return event.seq
            elif (
                effect.path == layout.LEASE_NAME
                and old is not None
                and old.get("released") is not True
                and new.get("holder") != old.get("holder")
            ):
                return event.seq
    return None


def check_tiers(
    durable: Checker,
    local: Checker,
    events: Sequence[Event],
    tiered: Any,
    plain: Any,
    saved: Mapping[int, Sequence[Any]],
    resumed: Sequence[Any] = (),
) -> Violation | None:
    """The invariants between a store's two tiers, at the end of a run: ``tiered`` is a fresh
    store over both (no lease), ``plain`` a fresh store over the durable tier alone;
    ``resumed``: the infos of the steps writers resumed from during the run."""
    held = durable.committed_steps()
    pointer = _json(durable.backend.objects.get(layout.LATEST_NAME))
    commits = local_commits(local, events)
    last = {step: manifest for step, _, manifest in commits}  # the copy a persist reads
    for step, manifest in sorted(last.items()):
        there = held.get(step)
        if there is not None and there != manifest:
            return Violation(
                "tier-copies-identical",
                f"step {step}: the durable manifest (writer {there.writer}, {len(there.files)} "
                f"files) is not the one committed locally (writer {manifest.writer}, "
                f"{len(manifest.files)} files)",
                -1,
            )
    took = takeover_seq(durable, events)
    try:
        reported = set(plain.fenced_steps())
    except CheckpointError as e:
        return Violation("persisted-never-fenced", f"fenced_steps() failed: {e!r}", -1)
    for step, seq, manifest in commits:
        before = took is None or seq < took
        if not before or held.get(step) != manifest:
            continue
        if step in reported or fenced(pointer, step, manifest):
            when = "before the run" if seq < 0 else f"at event {seq}"
            return Violation(
                "persisted-never-fenced",
                f"step {step}, committed locally {when} (the takeover: event {took}) by "
                f"{manifest.writer} and persisted, is fenced: fenced_steps() = "
                f"{sorted(reported)}, fences {pointer.get('fences') if pointer else None}",
                -1,
            )
    for info in resumed:  # fences only accumulate: the last pointer's judge every resume
        if fenced(pointer, info.step, info.manifest):
            return Violation(
                "tiered-latest",
                f"a writer resumed from step {info.step} ({info.tier}), committed by "
                f"{info.manifest.writer} after a takeover fenced it "
                f"(fences {pointer.get('fences') if pointer else None})",
                -1,
            )
    candidates = {**local.committed_steps(), **held}
    steps = sorted(s for s, m in candidates.items() if not fenced(pointer, s, m))
    name = "tiered-latest"
    try:
        info = tiered.latest()
        newest = max(steps, default=None)
        if (info.step if info is not None else None) != newest:
            found = info.step if info is not None else None
            return Violation(
                name,
                f"latest() is step {found}; unfenced steps committed: durable "
                f"{sorted(s for s in steps if s in held)}, local "
                f"{sorted(s for s in steps if s in local.committed_steps())}",
                -1,
            )
        if info is None:
            return None
        state = _contents(tiered, info)
    except CheckpointError as e:
        return Violation(name, f"resuming failed: {type(e).__name__}: {e}", -1)
    candidates_saved = saved.get(info.step, ())
    if not any(same_state(state, c) for c in candidates_saved):
        found = f"step {info.step} ({info.tier}) loads {state!r}, none of the "
        return Violation(name, f"{found}{len(candidates_saved)} states saved as that step", -1)
    return None


def closed_left_durable(
    actor: str,
) -> Callable[[Checker, Sequence[Event]], Violation | None]:
    """A final check (cleanup.py's ``Final``): where ``actor``, a writer of a tiered store
    that closes it, returned normally, the local tier's newest step (but a fenced writer's)
    is committed in the durable tier with the same manifest, and the durable ``latest``
    names it."""

    def check(durable: Checker, events: Sequence[Event]) -> Violation | None:
        end = next((e for e in events if e.actor == actor and e.op == "end"), None)
        if end is None or not end.outcome.startswith("returned") or not durable.faster:
            return None
        pointer = _json(durable.backend.objects.get(layout.LATEST_NAME))
        mine = {
            s: m
            for s, m in durable.faster[0].committed_steps().items()
            if not fenced(pointer, s, m)
        }
        if not mine:
            return None
        newest = max(mine)
        held = durable.committed(newest)
        if held == mine[newest] and _step_of(pointer) == newest:
            return None
        what = "not committed" if held is None else "committed" if held == mine[newest] else (
            "committed with another manifest")  # fmt: skip
        return Violation(
            "closed-writer-left-its-step-durable",
            f"{actor} closed, yet its last step {newest} is {what} in the durable tier, whose "
            f"latest is step {_step_of(pointer)}",
            -1,
        )

    return check


def _contents(store: Any, info: Any) -> Any:
    """What a step holds: the state it loads, or (a directory step, a coordinated save of
    files) its files' bytes by path, each verified."""
    if info.manifest.kind == KIND_DIRECTORY:
        return {f.path: bytes(store.read_file(info, f.path)) for f in info.files}
    return store.load(info.step)


def same_state(a: Any, b: Any) -> bool:
    """Deep equality of two states: tensors by dtype, shape and value; types must agree."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _json(stored: Stored | None) -> dict[str, Any] | None:
    if stored is None:
        return None
    try:
        body = json.loads(stored.data)
    except (UnicodeDecodeError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _epoch(manifest: Manifest) -> int:
    """The lease epoch a manifest was committed under (0 where manifests do not record it)."""
    epoch = getattr(manifest, "lease_epoch", 0)
    return epoch if isinstance(epoch, int) else 0


def _step_of(pointer: Mapping[str, Any] | None) -> int:
    step = pointer.get("step") if pointer is not None else None
    return step if isinstance(step, int) else -1


def trace(events: Sequence[Event], violation: Violation, setup: int) -> tuple[str, ...]:
    """A readable line per operation (attempt ids shortened), the violation marked."""
    names: dict[str, str] = {}

    def attempt(match: re.Match[str]) -> str:
        return names.setdefault(match.group(1), f"<a{len(names) + 1}>")

    lines, count = [f"(setup: {setup} operations, not explored)"], 0
    for e in events:
        if e.outcome == "abandoned" or e.actor == "resume":
            continue
        tier = e.backend.rpartition("://")[2]  # a local tier's paths read local:<path>
        paths = " ".join(f"{tier}:{p}" if tier not in ("", "store") else p for p in e.paths)
        number = "    "
        if e.op in ("start", "end"):
            what = "starts" if e.op == "start" else f"ends: {e.outcome}"
        elif e.outcome == "killed":
            what = f"KILLED before {e.op} {paths}"
        else:
            count += 1
            number, what = f"{count:4d}", f"{e.op} {paths} -> {e.outcome}"
        line = f"{number} {e.actor:<12} {short(what)}"
        if e.seq == violation.seq:
            line += f"   <== {violation.invariant}"
        lines.append(re.sub(r"(?<=\.attempt-)([0-9a-f]{16})", attempt, line))
    if violation.seq < 0:
        lines.append(f"     (after the run) {violation.invariant}")
    return tuple(lines)


def short(text: str) -> str:
    """One line, cut at TRACE_TEXT characters."""
    text = " ".join(text.split())
    return text if len(text) <= TRACE_TEXT else text[: TRACE_TEXT - 3] + "..."
