"""Retention carried out: pins, and deleting the steps a retention policy does not keep.

The policy itself is pure (retention.py); this module gathers what it judges and deletes what
it chose, uncommitting first (removal.py). It never deletes ``latest``, a pinned step, a step
newer than ``latest``, or a step whose manifest it cannot read.

What a prune reads does not grow with the number of steps kept. Committed manifests never
change, so the catalog remembers every one it has read (catalog.py) and a directory that one
listing still shows is taken as still committed; only directories not seen before are read.
A process's first prune reads the manifests of the newest ``keep_last`` directories (or, for
rules that judge time or metadata, of every step) once; each later save reads its own new
step's (remembered at commit) and the one it deletes. With no more step directories than
``keep_last`` (and no other rule), nothing can be deleted and nothing is read. A step that
another process is removing at that very moment still counts as kept until its directory is
gone, so a prune running beside an ``rm`` may keep one step fewer until the next save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ckptstore.backends.base import Backend
from ckptstore.domain import layout
from ckptstore.domain.manifest import Manifest
from ckptstore.domain.retention import RetentionPolicy, StepRecord, metric_value, steps_to_delete
from ckptstore.domain.step_index import Summary
from ckptstore.errors import CheckpointError, ConfigError
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.removal import Remover
from ckptstore.protocol.step_state import StepState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pins:
    """One object per pin under ``.ckptstore/pins/`` (no shared file to race on)."""

    backend: Backend

    def add(self, step: int) -> None:
        self.backend.write(layout.pin_path(step), [b"pinned\n"])

    def remove(self, step: int) -> bool:
        """Remove a pin; False if the step was not pinned."""
        if self.backend.stat(layout.pin_path(step)) is None:
            return False
        self.backend.delete([layout.pin_path(step)])
        return True

    def steps(self) -> list[int]:
        """The pinned steps, ascending (one listing)."""
        names = (o.path.rsplit("/", 1)[-1] for o in self.backend.list(layout.PINS_DIR + "/"))
        return sorted(s for s in map(layout.parse_step_dir, names) if s is not None)


@dataclass(frozen=True)
class Pruner:
    """Applies one store's retention policy."""

    catalog: Catalog
    remover: Remover
    policy: RetentionPolicy
    pins: Pins

    def prune(self, dry_run: bool = False) -> list[int]:
        """Delete the committed steps the policy does not keep; returns them, ascending."""
        if not self.policy.enabled:
            uri = self.catalog.backend.uri
            raise ConfigError(
                f"{uri}: no retention policy to prune by; open the store with keep_last, "
                "keep_every, keep_best, keep_every_seconds and/or retention (CLI: --keep-last "
                "N, --keep-every K, --keep-best K --best-metric NAME --best-mode min|max, "
                "--keep-every-seconds T)",
                uri=uri,
            )
        pointer, _ = self.catalog.read_pointer()
        latest = pointer.step if pointer is not None else None
        if latest is None or not self.catalog.is_committed(latest):
            return []  # without a committed latest, nobody can tell what a writer still needs
        steps = self._records() if self.policy.needs_records else self._numbers(dry_run)
        chosen = steps_to_delete(self.policy, steps, latest=latest, pinned=self.pins.steps())
        if dry_run:
            return chosen
        for step in sorted(self.catalog.half_removed):  # a removal killed half-way
            self.remover.roll_forward(step)
            self.catalog.half_removed.discard(step)
        doomed = self.remover.uncommit_all(chosen)
        if doomed:
            log.info(
                "retention deleted %d steps from %s: %s",
                len(doomed),
                self.catalog.backend.uri,
                _spans(doomed),
            )
        return doomed

    def would_delete(
        self, manifests: Iterable[Manifest | Summary], *, latest: int | None
    ) -> list[int]:
        """The steps of ``manifests`` (committed here, or about to be: a replication asks
        before copying) that retention would delete once ``latest`` is the pointer's step;
        ascending. Nothing is read but the pins (one listing, only with a policy)."""
        if not self.policy.enabled:
            return []
        chosen = sorted(manifests, key=lambda m: m.step)
        items = [record_of(m) for m in chosen] if self.policy.needs_records else None
        steps = items if items is not None else [m.step for m in chosen]
        return steps_to_delete(self.policy, steps, latest=latest, pinned=self.pins.steps())

    def after_save(self) -> None:
        """Apply retention after a commit; a failure is logged, never undoes the commit."""
        if not self.policy.enabled:
            return
        try:
            self.prune()
        except CheckpointError as e:
            log.error("retention after save failed (committed steps are intact): %s", e)

    def _numbers(self, dry_run: bool) -> list[int]:
        """Step numbers to judge by ``keep_last``/``keep_every`` (module docstring): the
        newest ``keep_last`` committed steps confirmed, older ones on the step index's word
        (only they can be chosen, and each is confirmed by its uncommit)."""
        older = [s.step for s in self.catalog.summaries()[0]]
        keep_last = self.policy.keep_last or 0
        if self.policy.keep_every is None and len(older) <= keep_last:
            return []  # every committed step is among the newest keep_last
        confirmed: list[int] = []
        while older and len(confirmed) < keep_last:
            step = older.pop()
            if self._committed(step, dry_run):
                confirmed.append(step)
        return older + confirmed[::-1]

    def _committed(self, step: int, dry_run: bool) -> bool:
        """Whether ``step`` is committed and readable; a removal found unfinished there (its
        tombstone) is finished on the way, unless ``dry_run``."""
        state = self.catalog.state_of(step)
        if state is StepState.REMOVING and not dry_run:
            self.remover.roll_forward(step)
        return state is StepState.COMMITTED

    def _records(self) -> list[StepRecord]:
        """A record of every readable committed step (remembered manifests, a GET for each
        one not read before); a step whose manifest cannot be read gets none, so it stays."""
        committed, broken = self.catalog.summaries()
        for step in broken:
            log.debug("retention leaves step %d alone: its manifest is unreadable", step)
        records = [record_of(m) for m in committed]
        metric = self.policy.best_metric
        if metric is not None and all(metric_value(r.metadata, metric) is None for r in records):
            keys = sorted({k for r in records for k in r.metadata})
            log.warning(
                "%s: keep_best ranks steps by %r, but no step has a number for it in its "
                "metadata (keys found: %s), so it keeps every step as unscored; check the "
                "metric's name",
                self.catalog.backend.uri,
                metric,
                ", ".join(keys) or "none",
            )
        return records


def record_of(manifest: Manifest | Summary) -> StepRecord:
    """What a retention policy sees of a committed step (retention.py stays free of I/O)."""
    return StepRecord(manifest.step, manifest.created, manifest.metadata)


def _spans(steps: list[int]) -> str:
    """``1-3, 7`` for [1, 2, 3, 7]: a mass prune logs one line, not one per step."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
