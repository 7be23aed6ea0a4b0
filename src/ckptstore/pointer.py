"""The ``latest`` pointer and the fences that make a fenced writer's late steps recognisable.

``latest.json`` says which committed step a resume starts from. It moves only by
compare-and-swap (commit.py), so it is also the one place where an ordering between writers is
recorded. When a writer takes the lease over (lease.py), it stamps the pointer with its new
epoch and a *fence*: "from epoch E on, a step above S committed under an older epoch belongs to
a writer that lost the lease". The old holder can still write one manifest in the round trip
after its last renewal; the fence is how readers recognise that step and never return it as
latest. Pure values, no I/O.

Schema 1 pointers (no fences) are still read; schema 2 adds ``fences`` and allows a pointer with
no step yet (a takeover of a store whose first step is not committed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptstore import layout
from ckptstore.errors import CorruptCheckpointError

POINTER_SCHEMA = 2
MAX_FENCES = 16
"""Older fences are dropped: a zombie writes at most one step right after its takeover."""


@dataclass(frozen=True)
class Fence:
    """Steps above ``step`` committed under an epoch below ``epoch`` are a fenced writer's."""

    epoch: int
    step: int
    """The step ``latest`` was at when ``epoch`` took over; -1 when there was none."""


@dataclass(frozen=True)
class Pointer:
    """The decoded ``latest.json``: which step, who moved it there, when, and the fences."""

    step: int | None
    """``None`` only for a pointer stamped by a takeover before any step was committed."""
    writer: str
    time: float
    epoch: int = 0
    """The writer lease epoch of whoever moved it (lease.py); 0 without leases."""
    fences: tuple[Fence, ...] = ()

    def fenced(self, step: int, lease_epoch: int) -> bool:
        """Whether a step committed under ``lease_epoch`` was committed by a fenced writer."""
        return lease_epoch > 0 and any(lease_epoch < f.epoch and step > f.step for f in self.fences)

    def moved(self, step: int, writer: str, time: float, epoch: int) -> Pointer:
        """This pointer moved to ``step`` by ``writer``; the fences stay."""
        return Pointer(step, writer, time, max(epoch, self.epoch), self.fences)

    def stamped(
        self, writer: str, time: float, epoch: int, committed: int | None = None
    ) -> Pointer:
        """This pointer, same step, stamped by a writer that just took the lease as ``epoch``;
        its fence admits the steps of older epochs up to the pointer's step or ``committed``
        (the newest step committed before the takeover), whichever is later."""
        ahead = [s for s in (self.step, committed) if s is not None]
        fence = Fence(epoch, max(ahead, default=-1))
        fences = (*self.fences, fence)[-MAX_FENCES:]
        return Pointer(self.step, writer, time, epoch, fences)

    def encode(self) -> bytes:
        body = {
            "schema_version": POINTER_SCHEMA,
            "epoch": self.epoch,
            "step": self.step,
            "manifest": layout.manifest_path(self.step) if self.step is not None else None,
            "writer": self.writer,
            "time": self.time,
            "fences": [[f.epoch, f.step] for f in self.fences],
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Pointer:
        """Decode ``latest.json``; ``where`` names it (its URI) in messages and as ``e.uri``."""
        step = None
        try:
            body = json.loads(data)
            version = body["schema_version"]
            if version not in (1, POINTER_SCHEMA) or isinstance(version, bool):
                raise ValueError(f"schema_version {version!r}")
            step = body["step"]
            if step is not None or version == 1:
                step = layout.check_step(step, where="latest step")
                if body["manifest"] != layout.manifest_path(step):
                    raise ValueError("manifest path does not match the step")
            epoch = _natural(body["epoch"], "epoch")
            fences = tuple(
                Fence(_natural(e, "fence epoch"), _natural(s, "fence step", low=-1))
                for e, s in (body["fences"] if version > 1 else [])
            )
            return cls(step, str(body["writer"]), float(body["time"]), epoch, fences)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where}: unreadable latest pointer ({e}); it is repaired by the next save, "
                "and readers fall back to listing committed steps meanwhile",
                uri=where,
                path=layout.LATEST_NAME,
                step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            ) from e


def _natural(value: object, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} {value!r}")
    return value
