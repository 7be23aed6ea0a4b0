"""What a store tells an onlooker about its saves, whatever the onlooker does with it.

The store depends only on this protocol; reporting faces (Prometheus in
:mod:`ckptstore.integrations.prometheus`, or a user's own logger) implement it, so none of them
is imported to save a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ckptstore.domain.info import SaveStats


class SaveObserver(Protocol):
    """Told about every save a store makes (``save``, ``save_async``, ``push_dir``).

    Called in the saving thread (the background one for async saves); an exception raised
    here is logged and never fails the save.
    """

    def saved(self, uri: str, stats: SaveStats) -> None:
        """A step was committed and ``latest`` moved."""

    def failed(self, uri: str, step: int, error: BaseException) -> None:
        """A save of ``step`` raised ``error`` instead of returning."""


@dataclass(frozen=True)
class PersistStats:
    """How a step of a tiered store reached the durable tier (tiers/local.py)."""

    step: int
    seconds_to_durable: float
    """From its commit in the local tier to its commit in the durable one."""
    lag_steps: int
    """Steps committed locally and not (yet) durable, once this copy landed."""
    lag_seconds: float
    """Age of the oldest of those (0 when none): the work a lost node would lose."""


@runtime_checkable
class TierObserver(Protocol):
    """What a tiered store also tells an observer that has these methods (the Prometheus
    metrics do); a plain :class:`SaveObserver` hears only of local commits."""

    def persisted(self, uri: str, stats: PersistStats) -> None:
        """A step reached the durable tier ``uri``."""

    def persist_failed(self, uri: str, step: int, error: BaseException) -> None:
        """Copying ``step`` to the durable tier failed (it stays local; retried on reopen)."""
