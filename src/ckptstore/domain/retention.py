"""Which committed steps to keep: pure policies over plain values, no I/O.

A policy answers "which of these steps do I want kept?". Policies compose by union: a step is
kept if any policy keeps it. Safety rules sit outside the policies, in :func:`steps_to_delete`,
so no policy, however written, can select ``latest``, a pinned step, or a step newer than
``latest`` (which may belong to a writer that has not moved ``latest`` yet).
Deleting is the store's job (see store.py); this module only decides.

``keep_last`` and ``keep_every`` judge step numbers alone, so they run on a listing of step
directories (cheap on a store of 10,000 steps). The others judge what each step's manifest says
(its time, its metadata) and get a :class:`StepRecord` per committed step, which the executor
(maintenance.py) builds from the manifests it has read.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from ckptstore.errors import ConfigError

BEST_MODES = ("min", "max")


@dataclass(frozen=True)
class StepRecord:
    """One committed step as a policy sees it: plain values from its manifest."""

    step: int
    time: float
    """When the step was committed: its manifest's ``created``, seconds since the epoch (UTC)."""
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The metadata it was saved with (``save(..., metadata=...)``), read-only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))


class Policy(Protocol):
    """What ``CheckpointStore(retention=...)`` takes: anything with this ``keep`` method."""

    def keep(self, steps: list[StepRecord]) -> set[int]:
        """The steps this policy keeps, given every committed step's record, ascending by
        step. Steps it returns that are not in ``steps`` are ignored."""
        ...


def _numbers(steps: Iterable[int | StepRecord]) -> list[int]:
    return sorted({s if isinstance(s, int) else s.step for s in steps})


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest committed steps."""

    n: int

    def __post_init__(self) -> None:
        _check_positive("keep_last", self.n)

    def keep(self, steps: Sequence[int | StepRecord]) -> set[int]:
        return set(_numbers(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every step that is a multiple of ``k`` (milestones, like ``keep_period`` in orbax)."""

    k: int

    def __post_init__(self) -> None:
        _check_positive("keep_every", self.k)

    def keep(self, steps: Sequence[int | StepRecord]) -> set[int]:
        return {s for s in _numbers(steps) if s % self.k == 0}


def metric_value(metadata: Mapping[str, Any], name: str) -> float | None:
    """``metadata[name]`` as a number to rank by, or ``None`` if it is missing, not a number
    (strings, bools, lists) or NaN. Infinities rank as the worst or best values."""
    value = metadata.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return None if math.isnan(number) else number


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` best steps by ``metric``, a number in each step's metadata.

    ``mode="min"``: lower is better (a loss); ``"max"``: higher is better (an accuracy). Ties go
    to the newer step, as in orbax. A step without a usable value (missing, not a number, NaN)
    is never counted among the best; with ``keep_unscored`` (the default, like orbax's
    ``keep_checkpoints_without_metrics``) this policy keeps it too, so keep_best alone never
    deletes a step it cannot judge. ``keep_unscored=False`` leaves such steps to the other
    policies (``keep_last``...), which then decide alone.
    """

    n: int
    metric: str
    mode: str
    keep_unscored: bool = True

    def __post_init__(self) -> None:
        _check_positive("keep_best", self.n)
        _check_metric("best_metric", self.metric)
        _check_mode("best_mode", self.mode)

    def best(self, steps: Sequence[StepRecord]) -> set[int]:
        """The ``n`` best steps among those with a usable value."""
        sign = 1.0 if self.mode == "min" else -1.0
        scored = []
        for record in steps:
            value = metric_value(record.metadata, self.metric)
            if value is not None:
                scored.append((sign * value, -record.step))  # ties: the newer step first
        return {-negated for _, negated in sorted(scored)[: self.n]}

    def unscored(self, steps: Sequence[StepRecord]) -> set[int]:
        return {r.step for r in steps if metric_value(r.metadata, self.metric) is None}

    def keep(self, steps: list[StepRecord]) -> set[int]:
        kept = self.best(steps)
        return kept | self.unscored(steps) if self.keep_unscored else kept


@dataclass(frozen=True)
class KeepEverySeconds:
    """Keep one step per ``seconds`` of commit time, like orbax's ``keep_time_interval``.

    Walking the steps in order from the oldest (always kept), a step is kept when it was
    committed at least ``seconds`` after the last step kept this way. Deleting the steps it does
    not keep never changes which ones it keeps, so repeated prunes agree.
    """

    seconds: float

    def __post_init__(self) -> None:
        _check_seconds("keep_every_seconds", self.seconds)

    def keep(self, steps: list[StepRecord]) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for record in sorted(steps, key=lambda r: r.step):
            if last is None or record.time >= last + self.seconds:
                kept.add(record.step)
                last = record.time
        return kept


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (or None to disable), got {value!r}")


def _check_mode(name: str, mode: object) -> None:
    if mode not in BEST_MODES:
        raise ConfigError(
            f"{name} must be 'min' (lower is better, e.g. a loss) or 'max' (higher is "
            f"better, e.g. an accuracy), got {mode!r}"
        )


def _check_metric(name: str, metric: object) -> None:
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{name} must be a metadata key (a non-empty string), got {metric!r}")


def _check_seconds(name: str, seconds: object) -> None:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise ConfigError(
            f"{name} must be a positive number of seconds (or None to disable), got {seconds!r}"
        )


def as_policies(retention: Policy | Sequence[Policy] | None) -> tuple[Policy, ...]:
    """``retention=`` as a tuple of policies; ConfigError for anything without ``keep``."""
    if retention is None:
        return ()
    found = [retention] if hasattr(retention, "keep") else retention
    if not isinstance(found, (list, tuple)):
        found = [retention]  # reported below: it has no keep method
    for policy in found:
        _check_policy(policy)
    return tuple(found)


def _check_policy(policy: object) -> None:
    if isinstance(policy, type):
        raise ConfigError(
            f"retention takes policy objects: pass {policy.__name__}(...), not the class"
        )
    if not callable(getattr(policy, "keep", None)):
        raise ConfigError(
            "retention must be a policy, an object with a keep(steps) method returning the "
            f"step numbers to keep (or a list of them), got {policy!r}"
        )


def _run(policy: Policy, records: list[StepRecord]) -> set[int]:
    """A policy's answer, checked: a policy that raises or answers anything but step numbers
    fails the prune (ConfigError), so nothing is deleted on its word."""
    name = type(policy).__name__
    try:
        answer: Any = policy.keep(list(records))
        chosen = list(answer)
    except Exception as e:  # a user's policy may raise anything: never half-decide
        raise ConfigError(
            f"retention policy {name} failed ({type(e).__name__}: {e}); nothing was deleted"
        ) from e
    for step in chosen:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ConfigError(
                f"retention policy {name} returned {step!r}, not a step number; nothing was deleted"
            )
    return {int(step) for step in chosen}


@dataclass(frozen=True)
class RetentionPolicy:
    """Every retention rule of a store, composed by union; no rule at all keeps everything.

    ``keep_last``/``keep_every`` judge step numbers; ``keep_best`` (with ``best_metric`` and
    ``best_mode``), ``keep_every_seconds`` and ``custom`` policies judge :class:`StepRecord`s.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str | None = None
    keep_every_seconds: float | None = None
    custom: tuple[Policy, ...] = ()

    spelling: InitVar[Callable[[str], str] | None] = None
    """How messages name an option: ``keep_best`` here, ``--keep-best`` on the command line,
    ``trainer.ckptstore.keep_best`` in verl's config (options.py)."""

    def __post_init__(self, spelling: Callable[[str], str] | None) -> None:
        # Validate eagerly so a bad config fails when the store opens, not at the first prune.
        name = spelling or str
        for key in ("keep_last", "keep_every", "keep_best"):
            if getattr(self, key) is not None:
                _check_positive(name(key), getattr(self, key))
        if self.keep_every_seconds is not None:
            _check_seconds(name("keep_every_seconds"), self.keep_every_seconds)
        if self.keep_best is not None:
            if self.best_metric is None:
                raise ConfigError(
                    f"{name('keep_best')} needs {name('best_metric')}: the metadata key to rank "
                    "steps by (say val_loss, saved with save(step, state, metadata={'val_loss': "
                    "...}))"
                )
            if self.best_mode is None:
                raise ConfigError(
                    f"{name('keep_best')} needs {name('best_mode')}: 'min' if lower is better (a "
                    "loss), 'max' if higher is better (an accuracy); there is no default, since "
                    "a wrong one would delete the best steps"
                )
            _check_metric(name("best_metric"), self.best_metric)
        elif self.best_metric is not None or self.best_mode is not None:
            raise ConfigError(
                f"{name('best_metric')} and {name('best_mode')} only apply with "
                f"{name('keep_best')} (how many of the best steps to keep)"
            )
        if self.best_mode is not None:
            _check_mode(name("best_mode"), self.best_mode)
        if not isinstance(self.custom, tuple):
            raise ConfigError(f"custom must be a tuple of policies, got {self.custom!r}")
        for policy in self.custom:
            _check_policy(policy)
        self.policies()

    def policies(self) -> list[Policy]:
        found: list[Policy] = []
        if self.keep_last is not None:
            found.append(KeepLast(self.keep_last))
        if self.keep_every is not None:
            found.append(KeepEvery(self.keep_every))
        if self.keep_best is not None:
            assert self.best_metric is not None and self.best_mode is not None  # __post_init__
            found.append(KeepBest(self.keep_best, self.best_metric, self.best_mode))
        if self.keep_every_seconds is not None:
            found.append(KeepEverySeconds(self.keep_every_seconds))
        found.extend(self.custom)
        return found

    @property
    def enabled(self) -> bool:
        return bool(self.policies())

    @property
    def needs_records(self) -> bool:
        """Whether a rule judges more than step numbers: then every committed step's manifest
        must be read (pruning.py), not only the newest ``keep_last``."""
        return any(not isinstance(p, (KeepLast, KeepEvery)) for p in self.policies())

    def keep(self, steps: Iterable[int | StepRecord]) -> set[int]:
        """The steps any rule keeps (so a RetentionPolicy is itself a :class:`Policy`).

        Step numbers suffice for ``keep_last``/``keep_every``; other rules need StepRecords.
        """
        items = list(steps)
        records = _records(items)
        kept: set[int] = set()
        for rule in self.policies():
            if isinstance(rule, (KeepLast, KeepEvery)):
                kept |= rule.keep(items)
            elif records is None:
                raise TypeError(
                    f"retention rule {type(rule).__name__} judges steps by their time or "
                    "metadata: pass StepRecords, not step numbers"
                )
            else:
                kept |= _run(rule, records)
        return kept


def _records(items: list[int | StepRecord]) -> list[StepRecord] | None:
    """The records, ascending by step, one per step; ``None`` if any item is a bare number."""
    if not all(isinstance(i, StepRecord) for i in items):
        return None
    by_step = {i.step: i for i in items if isinstance(i, StepRecord)}
    return [by_step[s] for s in sorted(by_step)]


def steps_to_delete(
    policy: RetentionPolicy,
    committed: Iterable[int | StepRecord],
    *,
    latest: int | None,
    pinned: Collection[int] = (),
) -> list[int]:
    """The committed steps retention removes, ascending.

    ``committed`` is step numbers, or a :class:`StepRecord` per step when the policy
    ``needs_records``. Never ``latest``, a pinned step, or a step newer than ``latest``,
    whatever the policies answer. With no ``latest`` at all nothing is deleted: without a
    pointer we cannot tell which steps a writer still needs.
    """
    items = list(committed)
    if not policy.enabled or latest is None:
        return []
    kept = policy.keep(items)
    protected = {latest, *pinned}
    return [s for s in _numbers(items) if s not in kept and s not in protected and s < latest]
