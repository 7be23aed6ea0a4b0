"""What the store reports back: committed steps, save costs, verify and gc results.

Plain frozen values, so they print, compare and serialize (the CLI's ``--json``) without
touching storage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ckptstore.domain.manifest import FileEntry, Manifest
from ckptstore.domain.step_index import Summary


@dataclass(frozen=True)
class SaveStats:
    """What one save cost: bytes written and reused, wall time, and time the caller waited."""

    step: int
    bytes_total: int
    bytes_reused: int
    """Bytes copied from the previous step instead of uploaded (incremental saves)."""
    seconds: float
    """From the first byte written to ``latest`` moved (retention not included)."""
    blocked_seconds: float
    """Time the caller was blocked by the snapshot (async saves; 0 for sync saves)."""

    @classmethod
    def of(cls, manifest: Manifest, seconds: float, blocked: float) -> SaveStats:
        reused = sum(f.size for f in manifest.files if f.copied_from is not None)
        return cls(manifest.step, manifest.size, reused, seconds, blocked)

    @property
    def bytes_uploaded(self) -> int:
        return self.bytes_total - self.bytes_reused

    @property
    def mb_per_s(self) -> float:
        return self.bytes_total / 1e6 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"committed step {self.step}: {self.bytes_total / 1e6:.1f} MB "
            f"({self.bytes_reused / 1e6:.1f} MB reused) in {self.seconds:.2f} s "
            f"({self.mb_per_s:.1f} MB/s), trainer blocked {self.blocked_seconds:.3f} s"
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed step: where it is, its summary, and (read when first asked for) its
    manifest.

    A listing answered by the step index (protocol/step_index.py) knows a step's summary
    only; ``manifest`` (and ``files``) then reads the step's own manifest, the truth, once.
    """

    uri: str
    summary: Summary
    stats: SaveStats | None = field(default=None, compare=False)
    """Set on the info a save returns."""
    tier: str | None = field(default=None, compare=False)
    """Where a tiered store holds it (``local``, ``durable``, ``local+durable``, ``local
    (copying)``); None for a plain store."""
    source: Callable[[], Manifest] | None = field(default=None, compare=False, repr=False)
    """Reads the manifest (the catalog's); ``None`` when ``known`` holds it."""
    known: Manifest | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, uri: str, manifest: Manifest, stats: SaveStats | None = None) -> CheckpointInfo:
        return cls(uri, Summary.of(manifest), stats, known=manifest)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its manifest (read now if need be), never with the catalog."""
        return (
            CheckpointInfo,
            (self.uri, self.summary, self.stats, self.tier, None, self.manifest),
        )

    @cached_property
    def manifest(self) -> Manifest:
        if self.known is not None:
            return self.known
        assert self.source is not None, "an info without a manifest has a source"
        return self.source()

    @property
    def step(self) -> int:
        return self.summary.step

    @property
    def time(self) -> float:
        return self.summary.created

    @property
    def size(self) -> int:
        return self.summary.size

    @property
    def kind(self) -> str:
        return self.summary.kind

    @property
    def file_count(self) -> int:
        return self.summary.files

    @property
    def writer(self) -> str:
        return self.summary.writer

    @property
    def lease_epoch(self) -> int:
        return self.summary.lease_epoch

    @property
    def files(self) -> tuple[FileEntry, ...]:
        return self.manifest.files

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.summary.metadata


@dataclass(frozen=True)
class Loaded:
    """A loaded state and the step it came from, read together (``load(with_info=True)``)."""

    state: Any
    info: CheckpointInfo

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.info.metadata


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found for one step; ``ok`` when ``problems`` is empty."""

    step: int
    problems: tuple[str, ...]
    signature: str = "unsigned"
    """``checked`` (signed, and this store's key verified it), ``unsigned``, or
    ``not checked (no key)``: signed, but opened without the key, so an edited manifest
    cannot be told from the original; ``ok`` is then about the bytes only."""
    tiers: tuple[str, ...] = ()
    """The URIs of the tiers whose copies were checked (a store with a local tier checks
    each tier's copy: core/maintenance.py)."""

    @property
    def ok(self) -> bool:
        return not self.problems


SIGNATURE_NOT_CHECKED = "not checked (no key)"


def signature_status(manifest: Manifest, checked: bool) -> str:
    """A manifest's signature as :class:`VerifyReport` tells it; ``checked``: the catalog
    has a signing key (it refuses a manifest whose signature does not verify)."""
    if checked:
        return "checked"
    return "unsigned" if manifest.signature is None else SIGNATURE_NOT_CHECKED


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``)."""

    deleted: tuple[str, ...]
    aborted_uploads: tuple[str, ...]
    foreign: tuple[str, ...] = ()
    """Objects in step directories that ckptstore did not write: reported, never deleted."""
    kept: tuple[str, ...] = ()
    """Uncommitted attempts (and tombstones) left alone because they may still be live: young,
    or written under the writer lease held now."""
    why: Mapping[str, str] = field(default_factory=dict)
    """Why each of ``kept`` was kept, by its path."""
