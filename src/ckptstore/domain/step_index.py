"""The step index's values: what it records of a step, and how its objects are encoded.

Listing a run by its manifests costs one GET per step; the index records, for each committed
step, the few fields that ``list()``, ``ls``, retention, ``wait`` and replication judge by (a
*summary*), in objects of up to :data:`SEGMENT_SIZE` summaries, so a run of 10,000 steps is
listed in a dozen requests. Manifests stay the truth (commit.py): the index is derived from
them and never consulted by what a load verifies.

::

    <root>/.ckptstore/index/head.json          the open segment, moved by compare-and-swap
    <root>/.ckptstore/index/seg-<id>.json      a sealed segment: written once, never changed

The head names the sealed segments that are part of the index, so every change of the index
is one compare-and-swap of one object (no update can be lost between two writers), and a
sealed segment can be cached by name forever. Dropping steps from a sealed segment writes a
new segment under a new name and swaps the head to it.

Besides summaries, the head holds two kinds of claims a reader must check against the
manifests: ``pending`` steps (a writer announces a step before it writes the manifest, so a
writer killed between its commit and its index update leaves a step a reader finds and adds)
and ``removing`` steps (a removal announces them before it uncommits, so a reader racing a
prune never returns a deleted step as committed). ``complete`` is false while the head only
holds writers' claims and the steps committed before the index existed are not yet in it: a
reader then lists the manifests and merges what it found.

Pure values, no I/O. Decoding is strict: a newer schema is a CompatibilityError (never
overwritten, never taken for corruption); anything else undecodable is a
CorruptCheckpointError, which readers answer by rebuilding from the manifests.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptstore.domain.layout import META_DIR
from ckptstore.domain.manifest import KIND_DIRECTORY, KIND_STATE, Manifest
from ckptstore.errors import CompatibilityError, CorruptCheckpointError

INDEX_SCHEMA = 1
INDEX_DIR = f"{META_DIR}/index"
HEAD_NAME = f"{INDEX_DIR}/head.json"
SEGMENT_SIZE = 1000
"""Summaries per sealed segment: a 10,000-step run is ten segments (about 300 KB each)."""


def segment_path(name: str) -> str:
    return f"{INDEX_DIR}/{name}"


def segment_last(name: str) -> int:
    """The newest step a sealed segment holds, from its name (``seg-<first>-<last>-<id>``)."""
    return int(name.split("-")[2])


def manifest_digest(manifest: Manifest) -> str:
    """A digest of the manifest's canonical encoding: two stores hold the same step if their
    summaries' digests are equal (replication compares them without reading manifests)."""
    return hashlib.sha256(manifest.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Summary:
    """What the index records of one committed step (copied from its manifest)."""

    step: int
    created: float
    kind: str
    size: int
    files: int
    """How many payload files the manifest lists."""
    writer: str
    lease_epoch: int
    digest: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, manifest: Manifest) -> Summary:
        return cls(
            manifest.step,
            manifest.created,
            manifest.kind,
            manifest.size,
            len(manifest.files),
            manifest.writer,
            manifest.lease_epoch,
            manifest_digest(manifest),
            dict(manifest.metadata),
        )

    def to_json(self) -> list[Any]:
        meta = dict(self.metadata)
        return [
            self.step,
            self.created,
            self.kind,
            self.size,
            self.files,
            self.writer,
            self.lease_epoch,
            self.digest,
            meta,
        ]

    @classmethod
    def from_json(cls, value: object) -> Summary:
        if not isinstance(value, list) or len(value) != 9:
            raise ValueError(f"summary {value!r}")
        step, created, kind, size, files, writer, epoch, digest, metadata = value
        created = float(created) if _number(created) else math.nan
        if not math.isfinite(created):
            raise ValueError(f"created {value[1]!r}")
        if kind not in (KIND_STATE, KIND_DIRECTORY) or not isinstance(metadata, dict):
            raise ValueError(f"summary of step {step!r}")
        if not isinstance(writer, str) or not isinstance(digest, str):
            raise ValueError(f"summary of step {step!r}")
        return cls(
            _natural(step, "step"),
            created,
            kind,
            _natural(size, "size"),
            _natural(files, "files"),
            writer,
            _natural(epoch, "lease_epoch"),
            digest,
            metadata,
        )


@dataclass(frozen=True)
class Pending:
    """A step a writer is about to commit (announced before its manifest is written)."""

    step: int
    writer: str
    since: float


@dataclass(frozen=True)
class Head:
    """The index's one mutable object: sealed segment names, the open segment, the claims."""

    segments: tuple[str, ...] = ()
    steps: tuple[Summary, ...] = ()
    """The open segment's summaries, ascending."""
    pending: tuple[Pending, ...] = ()
    removing: tuple[int, ...] = ()
    complete: bool = True
    """False: steps committed before the index was created may be missing (module doc)."""
    removals: int = 0
    """How many times steps were dropped: a reader's repair from what it read before is
    refused once this moved (the steps it saw committed may be gone since)."""

    def dropped(self, steps: set[int], segments: tuple[str, ...], *, claims: bool = True) -> Head:
        """``steps`` gone from the open segment (and, with ``claims``, from the claims);
        ``segments`` the sealed segments rewritten without them."""
        gone = steps if claims else set()
        return Head(
            segments,
            tuple(s for s in self.steps if s.step not in steps),
            tuple(p for p in self.pending if p.step not in gone),
            tuple(s for s in self.removing if s not in gone),
            self.complete,
            self.removals + 1,
        )

    def steps_after(self, step: int) -> list[int] | None:
        """Steps above ``step`` the head knows of (summaries and claims), ascending; ``None``
        when a sealed segment may hold some too, or the head is incomplete."""
        if not self.complete or any(segment_last(n) > step for n in self.segments):
            return None
        known = {s.step for s in self.steps} | {p.step for p in self.pending}
        return sorted(s for s in known | set(self.removing) if s > step)

    def with_summaries(self, summaries: Iterable[Summary]) -> Head:
        """Summaries added (replacing those of the same step) and their pending claims gone."""
        new = {s.step: s for s in summaries}
        steps = {s.step: s for s in self.steps} | new
        pending = tuple(p for p in self.pending if p.step not in new)
        return Head(
            self.segments,
            _sorted(steps.values()),
            pending,
            self.removing,
            self.complete,
            self.removals,
        )

    def with_claimed(self, summaries: Iterable[Summary], writer: str) -> Head | None:
        """Summaries added for the steps ``writer`` still claims (others are skipped: a
        removal dropped the claim, or a reader already added the step from its manifest);
        ``None`` if none is."""
        mine = {p.step for p in self.pending if p.writer == writer}
        chosen = [s for s in summaries if s.step in mine]
        return self.with_summaries(chosen) if chosen else None

    def with_pending(self, claim: Pending) -> Head:
        pending = (*(p for p in self.pending if p.step != claim.step), claim)
        return Head(self.segments, self.steps, pending, self.removing, self.complete, self.removals)

    def without_pending(self, steps: Iterable[int]) -> Head:
        gone = set(steps)
        pending = tuple(p for p in self.pending if p.step not in gone)
        return Head(self.segments, self.steps, pending, self.removing, self.complete, self.removals)

    def with_removing(self, steps: Iterable[int]) -> Head:
        removing = tuple(sorted(set(self.removing) | set(steps)))
        return Head(self.segments, self.steps, self.pending, removing, self.complete, self.removals)

    def encode(self) -> bytes:
        body = {
            "schema_version": INDEX_SCHEMA,
            "complete": self.complete,
            "segments": list(self.segments),
            "steps": [s.to_json() for s in self.steps],
            "pending": [[p.step, p.writer, p.since] for p in self.pending],
            "removing": list(self.removing),
            "removals": self.removals,
        }
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Head:
        body = _body(data, where, "index head")
        try:
            complete = body["complete"]
            if not isinstance(complete, bool):
                raise ValueError(f"complete {complete!r}")
            segments = tuple(_segment_name(n) for n in body["segments"])
            steps = _sorted(Summary.from_json(s) for s in body["steps"])
            pending = tuple(_pending(p) for p in body["pending"])
            removing = tuple(sorted(_natural(s, "removing step") for s in body["removing"]))
            removals = _natural(body["removals"], "removals")
        except (ValueError, KeyError, TypeError) as e:
            raise _corrupt(where, "index head", e) from e
        return cls(segments, steps, pending, removing, complete, removals)


def encode_segment(summaries: Iterable[Summary]) -> bytes:
    body = {"schema_version": INDEX_SCHEMA, "steps": [s.to_json() for s in _sorted(summaries)]}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def decode_segment(data: bytes, where: str) -> tuple[Summary, ...]:
    body = _body(data, where, "index segment")
    try:
        return _sorted(Summary.from_json(s) for s in body["steps"])
    except (ValueError, KeyError, TypeError) as e:
        raise _corrupt(where, "index segment", e) from e


def _body(data: bytes, where: str, what: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        version = body["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"schema_version {version!r}")
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise _corrupt(where, what, e) from e
    if version > INDEX_SCHEMA:
        raise CompatibilityError(
            f"{where}: {what} schema {version} was written by a newer ckptstore (this one "
            f"reads up to {INDEX_SCHEMA}); upgrade ckptstore to list or write this store",
            uri=where,
        )
    return body


def _corrupt(where: str, what: str, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: unreadable {what} ({e}); it is ignored and rebuilt from the manifests "
        "(`ckptstore index --rebuild URI` does it at once)",
        uri=where,
    )


def _sorted(summaries: Iterable[Summary]) -> tuple[Summary, ...]:
    return tuple(sorted(summaries, key=lambda s: s.step))


def _pending(value: object) -> Pending:
    if not isinstance(value, list) or len(value) != 3 or not isinstance(value[1], str):
        raise ValueError(f"pending {value!r}")
    if not _number(value[2]):
        raise ValueError(f"pending {value!r}")
    return Pending(_natural(value[0], "pending step"), value[1], float(value[2]))


def _segment_name(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("seg-") or "/" in value:
        raise ValueError(f"segment name {value!r}")
    segment_last(value)
    return value


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _natural(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} {value!r}")
    return value
