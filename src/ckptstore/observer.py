"""What a store tells an onlooker about its saves, whatever the onlooker does with it.

The store depends only on this protocol; reporting faces (Prometheus in :mod:`ckptstore.metrics`,
or a user's own logger) implement it, so none of them is imported to save a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ckptstore.info import SaveStats


class SaveObserver(Protocol):
    """Told about every save a store makes (``save``, ``save_async``, ``push_dir``).

    Called in the saving thread (the background one for async saves); an exception raised
    here is logged and never fails the save.
    """

    def saved(self, uri: str, stats: SaveStats) -> None:
        """A step was committed and ``latest`` moved."""

    def failed(self, uri: str, step: int, error: BaseException) -> None:
        """A save of ``step`` raised ``error`` instead of returning."""
