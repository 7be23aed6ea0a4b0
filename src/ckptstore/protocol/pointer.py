"""The ``latest`` pointer and the fences that make a fenced writer's late steps recognisable.

``latest.json`` says which committed step a resume starts from. It moves only by
compare-and-swap (commit.py), so it is also the one place where an ordering between writers is
recorded. When a writer takes the lease over (lease.py), it stamps the pointer with its new
epoch and a *fence*: "a step above S committed by writer W (the holder it displaced) belongs to
a writer that lost the lease". The old holder can still write one manifest in the round trip
after its last renewal; the fence is how readers recognise that step and never return it as
latest.

A fence names the displaced writer, not only its epoch: a manifest keeps the epoch of the store
it was first committed in (a step replicated here, or persisted from a local tier, is copied
verbatim, signature and all), and that epoch says nothing about this store's lease. The writer
id does: it is unique per process and store object, and a tiered store's local tier shares its
store's. Pure values, no I/O.

Schema 1 pointers (no fences) are still read; schema 2 adds ``fences`` (epoch and step, which
fence by epoch) and allows a pointer with no step yet (a takeover of a store whose first step
is not committed); schema 3 fences name the displaced writer. A pointer of a newer schema is
refused (CompatibilityError), never overwritten: its fences would be lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptstore.domain import layout
from ckptstore.errors import CompatibilityError, CorruptCheckpointError

POINTER_SCHEMA = 3
MAX_FENCES = 16
"""Older fences are dropped: a zombie writes at most one step right after its takeover."""


@dataclass(frozen=True)
class Fence:
    """Steps above ``step`` committed by ``holder`` (or, in a schema 2 fence that names no
    holder, under an epoch below ``epoch``) are a fenced writer's."""

    epoch: int
    step: int
    """The step ``latest`` was at when ``epoch`` took over; -1 when there was none."""
    holder: str | None = None
    """The writer id of the holder ``epoch`` displaced."""

    def excludes(self, step: int, writer: str, lease_epoch: int) -> bool:
        """Whether this fence marks a step committed by ``writer`` under ``lease_epoch``."""
        if step <= self.step:
            return False
        if self.holder is not None:
            return writer == self.holder
        return 0 < lease_epoch < self.epoch


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

    def fenced(self, step: int, writer: str, lease_epoch: int) -> bool:
        """Whether ``step``, committed by ``writer`` under ``lease_epoch`` (its manifest's),
        was committed by a fenced writer."""
        return any(f.excludes(step, writer, lease_epoch) for f in self.fences)

    def moved(self, step: int, writer: str, time: float, epoch: int) -> Pointer:
        """This pointer moved to ``step`` by ``writer``; the fences stay."""
        return Pointer(step, writer, time, max(epoch, self.epoch), self.fences)

    def stamped(
        self, writer: str, time: float, epoch: int, displaced: str, committed: int | None = None
    ) -> Pointer:
        """This pointer, same step, stamped by a writer that just took the lease as ``epoch``
        from ``displaced``; its fence admits that writer's steps up to the pointer's step or
        ``committed`` (the newest step committed before the takeover), whichever is later."""
        ahead = [s for s in (self.step, committed) if s is not None]
        fence = Fence(epoch, max(ahead, default=-1), displaced)
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
            "fences": [_encode_fence(f) for f in self.fences],
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Pointer:
        """Decode ``latest.json``; ``where`` names it (its URI) in messages and as ``e.uri``."""
        step = None
        try:
            body = json.loads(data)
            version = body["schema_version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ValueError(f"schema_version {version!r}")
            if version > POINTER_SCHEMA:
                raise CompatibilityError(
                    f"{where}: latest pointer schema {version} was written by a newer ckptstore "
                    f"(this one reads up to {POINTER_SCHEMA}); upgrade ckptstore to read or "
                    "write this store",
                    uri=where,
                    path=layout.LATEST_NAME,
                )
            step = body["step"]
            if step is not None or version == 1:
                step = layout.check_step(step, where="latest step")
                if body["manifest"] != layout.manifest_path(step):
                    raise ValueError("manifest path does not match the step")
            epoch = _natural(body["epoch"], "epoch")
            fences = tuple(_decode_fence(f) for f in (body["fences"] if version > 1 else []))
            return cls(step, str(body["writer"]), float(body["time"]), epoch, fences)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where}: unreadable latest pointer ({e}); it is repaired by the next save, "
                "and readers fall back to listing committed steps meanwhile",
                uri=where,
                path=layout.LATEST_NAME,
                step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            ) from e


def _encode_fence(fence: Fence) -> list[int | str]:
    if fence.holder is None:
        return [fence.epoch, fence.step]
    return [fence.epoch, fence.step, fence.holder]


def _decode_fence(value: object) -> Fence:
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise ValueError(f"fence {value!r}")
    holder = value[2] if len(value) == 3 else None
    if holder is not None and not (isinstance(holder, str) and holder):
        raise ValueError(f"fence holder {holder!r}")
    epoch = _natural(value[0], "fence epoch")
    return Fence(epoch, _natural(value[1], "fence step", low=-1), holder)


def _natural(value: object, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} {value!r}")
    return value
