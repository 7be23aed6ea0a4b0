"""Keeping a store healthy: verify, pins, delete, retention and gc, over every tier it has.

These are the operations that touch many steps at once, built from the read side (catalog.py,
resolver.py) and the write side (commit.py, removal.py, pruning.py, garbage.py). The store
and the CLI only forward to them. Each follows the commit protocol's rules: deleting
uncommits first, and ``latest`` only moves backwards when someone deletes it explicitly.
Copying steps into another store is replication/replicator.py's.

A store with a local tier (tiers/local.py) is one store to its reads, so it is one store to
these tools too: each acts on every tier (a :class:`Tier`: fastest first, the durable tier
last), or on the one a caller names (``tier="local"`` or ``"durable"``, CLI ``--tier``):

* **delete** checks every step against the store as reads see it (committed in some tier,
  ``latest`` the resolver's, pinned in any tier) before it removes anything; then it tells
  the tiers' copier to forget the step (no copy in flight or queued brings it back, and the
  step's own pin goes), swaps the manifest for a tombstone in every tier that holds it, moves
  each tier's pointer back past it, and only then deletes payload. A delete that dies
  half-way leaves tombstones, which the next prune or gc of either tier finishes.
* **pin** writes the pin in the durable tier (the store's pins, which outlive a node) and in
  every faster tier that holds the step (so its retention keeps it, and a local-only step is
  persisted by the next writer); **unpin** removes them, except a faster tier's pin of a step
  this store is copying (or failed to copy) to the durable tier: that pin guards its copy
  (invariant 17).
* **prune** applies each tier's own retention (the store's policy; ``local_keep_last``), one
  prune of a tier at a time, so it never deletes latest, a pinned step or a step newer than
  latest of that tier (invariant 4).
* **verify** checks each tier's copy of the step; **gc** cleans each tier, a faster tier's
  attempts judged by the durable tier's writer lease (the local tier writes under it) and the
  durable tier's pins of steps a faster tier holds left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptstore.core.resolver import LOCAL, Resolver
from ckptstore.domain import layout
from ckptstore.domain.info import GcReport, VerifyReport, signature_status
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.garbage import GarbageCollector
from ckptstore.protocol.pruning import Pins, Pruner
from ckptstore.protocol.removal import Remover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tier:
    """One tier's engines, as the many-step operations use them."""

    name: str
    """``durable`` (the store at its URI) or ``local`` (resolver.py's names)."""
    catalog: Catalog
    committer: Committer
    remover: Remover
    pins: Pins
    pruner: Pruner
    retention: contextlib.AbstractContextManager[Any] = field(
        default_factory=contextlib.nullcontext
    )
    """Held while this tier's retention runs: two prunes of one tier would race."""

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri

    def holds(self, step: int) -> bool:
        """Whether a manifest stands for ``step`` here (readable or not; fresh read)."""
        return self.catalog.state_of(step, fresh=True).committed

    def label(self) -> str:
        return f"{self.uri} ({self.name} tier)"


def _forget_nothing(step: int) -> None:
    """A store without tiers copies nothing between them."""


def _nothing_pending(step: int) -> bool:
    return False


@dataclass(frozen=True)
class Maintenance:
    """One store's many-step operations, over its tiers (the module docstring)."""

    resolver: Resolver
    tiers: tuple[Tier, ...]
    """Fastest first; the durable tier last."""
    clock: Callable[[], float]
    forget: Callable[[int], None] = _forget_nothing
    """Tells the tiers' copier a step is being deleted (persist_queue.py's ``drop``)."""
    pending: Callable[[int], bool] = _nothing_pending
    """Whether the tiers' copier is copying a step, or failed to (persist_queue.py)."""

    @property
    def durable(self) -> Tier:
        return self.tiers[-1]

    def chosen(self, tier: str | None) -> tuple[Tier, ...]:
        """Every tier, or the one named; ConfigError naming those there are."""
        if tier is None:
            return self.tiers
        found = tuple(t for t in self.tiers if t.name == tier)
        if not found:
            names = ", ".join(t.name for t in self.tiers)
            fix = "name one of those"
            if tier == LOCAL:
                fix = "open the store with its local tier (local=PATH; CLI: --local PATH)"
            raise ConfigError(
                f"{self.durable.uri} has no {tier!r} tier (it has: {names}); {fix}",
                uri=self.durable.uri,
            )
        return found

    def not_committed(self, step: int, chosen: Sequence[Tier], doing: str) -> NotFoundError:
        """The error for a step no chosen tier holds: where it was looked for, what each
        holds, where else it is, and (a store opened without its local tier) how to reach
        one."""
        looked = " nor in ".join(
            f"{t.label() if len(self.tiers) > 1 else t.uri} (committed there: "
            f"{_steps([i.step for i in t.catalog.list()])})"
            for t in chosen
        )
        elsewhere = [t for t in self.tiers if t not in chosen and t.holds(step)]
        hint = f"; it is in {', '.join(t.label() for t in elsewhere)}" if elsewhere else ""
        if len(self.tiers) == 1:
            hint = (
                "; if a local tier in front of this store holds it, open the store with that "
                "tier (local=PATH; CLI: --local PATH)"
            )
        return NotFoundError(
            f"step {step} is not committed in {looked}{hint}; nothing was {doing}",
            uri=chosen[-1].catalog.uri(layout.step_dir(step)),
            path=layout.step_dir(step),
            step=step,
        )

    # -- verify ----------------------------------------------------------------------------

    def verify(self, step: int | None, tier: str | None = None) -> VerifyReport:
        """Check every file of ``step`` (default: latest) against its manifest, in each
        chosen tier that holds it."""
        chosen = self.chosen(tier)
        if step is None:
            step = self._latest(chosen)
        problems: list[str] = []
        where: list[str] = []
        signature = None
        for t in chosen:
            try:
                info = t.catalog.info(step)
            except NotFoundError:
                continue
            except CheckpointError as e:
                where.append(t.uri)
                problems.append(str(e))
                continue
            where.append(t.uri)
            for entry in info.files:
                try:
                    t.catalog.read_verified(step, entry)
                except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                    problems.append(str(e))
            signature = signature or signature_status(
                info.manifest, checked=t.catalog.signer is not None
            )
        if not where:
            raise self.not_committed(step, chosen, "verified")
        report = VerifyReport(step, tuple(problems), tiers=tuple(where))
        return replace(report, signature=signature) if signature is not None else report

    def _latest(self, chosen: Sequence[Tier]) -> int:
        if chosen == self.tiers:
            latest = self.resolver.latest()
        else:
            latest = self.resolver.latest_in(chosen[0].catalog)
        if latest is None:
            where = " nor ".join(t.label() for t in chosen)
            raise NotFoundError(f"{where} holds no committed step to verify", uri=chosen[-1].uri)
        return latest.step

    def verify_all(self, tier: str | None = None) -> list[VerifyReport]:
        """``verify`` for every committed step, including those with unreadable manifests."""
        chosen = self.chosen(tier)
        steps: set[int] = set()
        for t in chosen:
            committed, broken = t.catalog.scan()
            steps |= {m.step for m in committed} | set(broken)
        return [self.verify(step, tier) for step in sorted(steps)]

    # -- pins --------------------------------------------------------------------------------

    def pin(self, step: int, tier: str | None = None) -> None:
        """Protect a committed step from retention until ``unpin`` (module docstring)."""
        chosen = self.chosen(tier)
        holders = [t for t in chosen if t.holds(step)]
        if not holders:
            raise self.not_committed(step, chosen, "pinned")
        for t in chosen:
            if t in holders or (tier is None and t is self.durable):
                t.pins.add(step)

    def unpin(self, step: int, tier: str | None = None) -> bool:
        """Remove ``step``'s pins; False if none was removed. A faster tier's pin of a step
        this store is copying to the durable tier (or failed to) stays until its copy lands
        (invariant 17); a pin a killed writer left for its copy is the caller's to remove."""
        chosen = self.chosen(tier)
        removed = False
        for t in chosen:
            if t is not self.durable and self.pending(step):
                log.warning(
                    "%s: step %d stays pinned there until its copy is in %s",
                    t.uri,
                    step,
                    self.durable.uri,
                )
                continue
            removed = t.pins.remove(step) or removed
        return removed

    def pinned(self, tier: str | None = None) -> list[int]:
        """The steps pinned in any chosen tier, ascending."""
        return sorted({s for t in self.chosen(tier) for s in t.pins.steps()})

    # -- delete ------------------------------------------------------------------------------

    def delete(
        self, steps: Iterable[int], force: bool, tier: str | None = None, *, dry_run: bool = False
    ) -> list[int]:
        """Delete committed steps from every chosen tier (module docstring); each is checked
        first, and one that no chosen tier holds, or that is latest or pinned without
        ``force``, refuses them all. Returns the steps, ascending."""
        chosen = self.chosen(tier)
        doomed = sorted(set(steps))
        missing = [s for s in doomed if not any(t.holds(s) for t in chosen)]
        if missing:
            raise self.not_committed(missing[0], chosen, "deleted")
        if not force:
            self._refuse_protected(doomed, chosen)
        if dry_run:
            return doomed
        size = min(t.catalog.index.segment_size for t in chosen)
        for batch in (doomed[i : i + size] for i in range(0, len(doomed), size)):
            for t in chosen:  # each tier's step index claims them first (removal.py)
                t.remover.claim_removals(batch)
            gone: dict[str, list[int]] = {t.name: [] for t in chosen}
            for step in batch:  # oldest first: a pointer, if it moves back, moves once
                for t in self._delete(step, chosen):
                    gone[t.name].append(step)
            for t in chosen:
                t.remover.forget_removed(gone[t.name])
        return doomed

    def _refuse_protected(self, steps: Sequence[int], chosen: Sequence[Tier]) -> None:
        """A ConflictError naming every step of ``steps`` that is latest or pinned, and
        where (invariant 4 holds for ``rm`` too, unless forced)."""
        latest = self.resolver.latest()
        protected: list[tuple[int, str]] = []
        for step in steps:
            if latest is not None and latest.step == step:
                protected.append((step, "latest"))
                continue
            pinned = [t for t in self.tiers if step in t.pins.steps()]
            if not pinned:
                continue
            if self.durable in pinned:  # the store's pin: a user's
                protected.append((step, "pinned"))
            elif not self.durable.holds(step):  # a copy's: kept until it lands
                protected.append((step, f"pinned in {pinned[0].uri} until it is durable"))
            else:
                protected.append((step, "pinned in " + ", ".join(t.uri for t in pinned)))
        if not protected:
            return
        listed = ", ".join(f"{step} ({why})" for step, why in protected)
        at = ""
        if latest is not None and len(self.tiers) > 1 and protected[0][1] == "latest":
            at = f" (latest is {latest.uri})"
        first = protected[0][0]
        raise ConflictError(
            f"{chosen[-1].uri}: {'step' if len(protected) == 1 else 'steps'} {listed} cannot "
            f"be deleted without force=True (CLI: --force), or unpin a pinned step first{at}; "
            "nothing was deleted",
            uri=chosen[-1].catalog.uri(layout.step_dir(first)),
            path=layout.step_dir(first),
            step=first,
        )

    def _delete(self, step: int, chosen: Sequence[Tier]) -> list[Tier]:
        """Tombstones in every tier first, then the pointers, then the payload. The pins go
        from the chosen tiers, and a faster tier's too when the durable tier is chosen: it
        kept the step for a copy that is not wanted any more. Returns the tiers left with
        nothing of the step (no tombstone: their step index may forget it)."""
        self.forget(step)
        for t in self.tiers if self.durable in chosen else chosen:
            t.pins.remove(step)
        marked = {t.name: m for t in chosen if (m := t.remover.mark_uncommitted(step)) is not None}
        for t in chosen:
            _move_pointer_back(t, step)
        return [
            t
            for t in chosen
            if (
                t.remover.finish_uncommit(marked[t.name])
                if t.name in marked
                else not t.remover.tombstones.stands(step)
            )
        ]

    # -- retention and gc --------------------------------------------------------------------

    def prune(self, dry_run: bool = False, tier: str | None = None) -> list[int]:
        """Apply each chosen tier's retention; the steps deleted from any, ascending. A
        ConfigError when no chosen tier has a policy (the durable tier's says which
        options set one)."""
        chosen = self.chosen(tier)
        ruled = [t for t in chosen if t.pruner.policy.enabled]
        if not ruled:
            return chosen[-1].pruner.prune(dry_run)  # raises, naming the options
        doomed: set[int] = set()
        for t in ruled:
            with t.retention:
                doomed.update(t.pruner.prune(dry_run))
        return sorted(doomed)

    def rebuild_index(self, tier: str | None = None) -> dict[str, int]:
        """Rebuild each chosen tier's step index from its manifests; each tier's URI and how
        many steps its index holds."""
        return {t.uri: t.catalog.rebuild_index() for t in self.chosen(tier)}

    def gc(self, dry_run: bool, older_than: float, tier: str | None = None) -> GcReport:
        """Collect each chosen tier's garbage (garbage.py). A store with tiers reports each
        path by its full URI (each tier's paths are keys of its own)."""
        chosen = self.chosen(tier)
        reports = []
        for t in chosen:
            faster = self.tiers[:-1] if t is self.durable else ()
            elsewhere = frozenset(i.step for other in faster for i in other.catalog.list())
            collector = GarbageCollector(
                t.catalog,
                t.remover,
                self.clock,
                dry_run=dry_run,
                older_than=older_than,
                lease_of=self.durable.catalog.backend,
                held_elsewhere=elsewhere,
            )
            reports.append((t, collector.run()))
        if len(self.tiers) == 1:
            return reports[0][1]
        return _merged(reports)


def _move_pointer_back(tier: Tier, step: int) -> None:
    """After ``step`` was uncommitted from ``tier``: if its pointer names the step, move it
    back to the newest step left there (explicitly, a rollback), or remove it."""
    pointer = tier.catalog.pointer_or_none()
    if pointer is None or pointer.step != step:
        return
    remaining = [i.step for i in tier.catalog.list() if i.step < step]
    if remaining:
        tier.committer.advance_latest(remaining[-1], rollback=True)
    else:
        tier.catalog.backend.delete([layout.LATEST_NAME])


def _merged(reports: Sequence[tuple[Tier, GcReport]]) -> GcReport:
    def full(t: Tier, paths: Iterable[str]) -> tuple[str, ...]:
        return tuple(t.catalog.uri(p) for p in paths)

    return GcReport(
        tuple(p for t, r in reports for p in full(t, r.deleted)),
        tuple(p for t, r in reports for p in full(t, r.aborted_uploads)),
        foreign=tuple(p for t, r in reports for p in full(t, r.foreign)),
        kept=tuple(p for t, r in reports for p in full(t, r.kept)),
        why={t.catalog.uri(p): why for t, r in reports for p, why in r.why.items()},
    )


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"
