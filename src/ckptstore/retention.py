"""Which committed steps to keep: pure policies over plain values, no I/O.

A policy answers "which of these steps do I want kept?". Policies compose by union: a step is
kept if any policy keeps it. Safety rules sit outside the policies, in :func:`steps_to_delete`,
so no policy, however written, can select ``latest``, a pinned step, or a step newer than
``latest`` (which may belong to a writer that has not moved ``latest`` yet).
Deleting is the store's job (see store.py); this module only decides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from ckptstore.errors import ConfigError


class Policy(Protocol):
    def keep(self, steps: list[int]) -> set[int]:
        """The steps this policy keeps, given all committed steps in ascending order."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest committed steps."""

    n: int

    def __post_init__(self) -> None:
        _check_positive("keep_last", self.n)

    def keep(self, steps: list[int]) -> set[int]:
        return set(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every step that is a multiple of ``k`` (milestones, like ``keep_period`` in orbax)."""

    k: int

    def __post_init__(self) -> None:
        _check_positive("keep_every", self.k)

    def keep(self, steps: list[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (or None to disable), got {value!r}")


@dataclass(frozen=True)
class RetentionPolicy:
    """``keep_last`` and ``keep_every`` together; no policy at all keeps everything."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        # Validate eagerly so a bad config fails when the store opens, not at the first prune.
        self.policies()

    def policies(self) -> list[Policy]:
        found: list[Policy] = []
        if self.keep_last is not None:
            found.append(KeepLast(self.keep_last))
        if self.keep_every is not None:
            found.append(KeepEvery(self.keep_every))
        return found

    @property
    def enabled(self) -> bool:
        return bool(self.policies())


def steps_to_delete(
    policy: RetentionPolicy,
    committed: Iterable[int],
    *,
    latest: int | None,
    pinned: Collection[int] = (),
) -> list[int]:
    """The committed steps retention removes, ascending.

    Never ``latest``, a pinned step, or a step newer than ``latest``. With no ``latest`` at all
    nothing is deleted: without a pointer we cannot tell which steps a writer still needs.
    """
    steps = sorted(set(committed))
    if not policy.enabled or latest is None:
        return []
    kept: set[int] = set()
    for rule in policy.policies():
        kept |= rule.keep(steps)
    protected = {latest, *pinned}
    return [s for s in steps if s not in kept and s not in protected and s < latest]
