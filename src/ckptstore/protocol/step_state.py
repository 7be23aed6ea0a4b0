"""What a step's manifest key holds, as one reader sees it (catalog.py asks, the index check
and the writers act on the answer)."""

from __future__ import annotations

import enum


class StepState(enum.Enum):
    """What a step's manifest key holds, as far as this reader can tell."""

    ABSENT = "absent"
    """No manifest (nothing saved, or a save in flight)."""
    REMOVING = "removing"
    """A tombstone: the step's files are being removed (removal.py)."""
    COMMITTED = "committed"
    UNREADABLE = "unreadable"
    """A manifest this reader cannot use: corrupt, signed with another key, newer schema."""

    @property
    def committed(self) -> bool:
        """A manifest stands there, readable by this reader or not."""
        return self in (StepState.COMMITTED, StepState.UNREADABLE)
