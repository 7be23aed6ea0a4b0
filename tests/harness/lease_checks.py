"""The writer lease's invariants (docs/design.md, invariant 13), from each write of lease.json.

A record is only ever replaced by its own holder under the same epoch (a renewal, a release),
or by a new holder under a higher epoch (an acquisition, a takeover). A holder whose record was
replaced while it was not released was taken over: it is fenced, and never writes the record
again, not even to release it. The defect this guards against (issue 19): a fenced writer's
``release()`` swapped its own released record back over the new holder's, the epoch went
back, and both jobs were fenced.

The check decodes records with the real
:class:`~ckptstore.protocol.lease_record.LeaseRecord`, and reads
only what the write did (its effect), never the writer's own idea of what it holds.
"""

from __future__ import annotations

from ckptstore.domain import layout
from ckptstore.errors import CheckpointError
from ckptstore.protocol.lease_record import LeaseRecord
from harness.scheduler import Effect, Stored


class LeaseWatch:
    """Follows one run's writes of ``lease.json``; :meth:`judge` says what one broke."""

    def __init__(self) -> None:
        self.fenced: dict[str, int] = {}
        """Holders taken over while holding the lease, with the epoch they lost."""

    def judge(self, effect: Effect, actor: str) -> tuple[str, str] | None:
        """The invariant ``effect`` (a write of ``lease.json`` by ``actor``) broke, if any."""
        name = layout.LEASE_NAME
        if effect.after is None:
            return "lease-epoch-never-goes-back", f"{actor} deleted {name}"
        new = _record(effect.after)
        if new is None:
            return "lease-epoch-never-goes-back", f"{actor} wrote an unreadable {name}"
        if new.holder in self.fenced:
            lost = self.fenced[new.holder]
            return (
                "fenced-writer-never-writes-lease",
                f"{actor} wrote {name} as {_who(new)} after that writer lost epoch {lost} "
                "to a takeover",
            )
        old = _record(effect.before) if effect.before is not None else None
        if old is None:
            return None
        if new.epoch < old.epoch or (new.epoch == old.epoch and new.holder != old.holder):
            return (
                "lease-epoch-never-goes-back",
                f"{actor} replaced {_who(old)} with {_who(new)}",
            )
        if new.holder != old.holder and not old.released:
            self.fenced[old.holder] = old.epoch
        return None


def _record(stored: Stored) -> LeaseRecord | None:
    try:
        return LeaseRecord.decode(stored.data, where=layout.LEASE_NAME)
    except CheckpointError:
        return None


def _who(record: LeaseRecord) -> str:
    released = ", released" if record.released else ""
    return f"{record.holder.rsplit(':', 1)[-1]} (epoch {record.epoch}{released})"
