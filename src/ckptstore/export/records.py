"""The exports of a step, recorded beside it: what was written where, with which options.

One small JSON object per (step, destination), under the store's metadata directory::

    <root>/.ckptstore/exports/global_step_<N>/<id>.json

where ``id`` is a digest of the destination, so exporting a step again to the same place
replaces its record and never collides with another's. Records live outside the step's
directory because committed steps are immutable (a file the manifest does not list there would
be garbage to ``gc``); gc leaves ``.ckptstore/`` alone except for pins. A record names the
index it wrote (its SHA-256), so an export that finds the same index at its destination knows
that destination holds its model and skips the work. ``ls`` and ``show`` read them with one
listing. A record of a step that was since deleted is ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptstore.backends.base import Backend
from ckptstore.domain import layout
from ckptstore.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger(__name__)

EXPORTS_DIR = f"{layout.META_DIR}/exports"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ExportRecord:
    """One export of a step: destination, options, files and what they hold."""

    step: int
    out: str
    format: str
    options: dict[str, Any]
    """What shaped the bytes (role, dtype, shard size, LoRA merge, key map): a second export
    with other options is not the same export."""
    source: dict[str, Any]
    """What was read: ``kind`` (verl, dcp, native) and ``world_size``."""
    files: list[dict[str, Any]]
    """``{"path", "size", "crc32c"}`` of each file written."""
    tensors: int
    tensor_bytes: int
    index_sha256: str
    created: float
    ckptstore: str
    schema_version: int = SCHEMA_VERSION
    notes: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> ExportRecord:
        try:
            body = json.loads(data)
            if body.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"schema_version {body.get('schema_version')!r}")
            return cls(**body)
        except (ValueError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: not an export record ({e})") from e


def record_path(step: int, out: str) -> str:
    digest = hashlib.sha256(out.encode()).hexdigest()[:16]
    return f"{EXPORTS_DIR}/{layout.step_dir(step)}/{digest}.json"


def write_record(backend: Backend, record: ExportRecord) -> None:
    backend.write(record_path(record.step, record.out), [record.encode()])


def find_record(backend: Backend, step: int, out: str) -> ExportRecord | None:
    path = record_path(step, out)
    if backend.stat(path) is None:
        return None
    return ExportRecord.decode(backend.read(path), f"{backend.uri}/{path}")


def list_records(backend: Backend, step: int | None = None) -> list[ExportRecord]:
    """Every readable record (of ``step``), by step then time; one listing. An unreadable one
    is logged and left out: a listing must not fail for it."""
    prefix = f"{EXPORTS_DIR}/" + (f"{layout.step_dir(step)}/" if step is not None else "")
    found = []
    for obj in backend.list(prefix):
        if not obj.path.endswith(".json"):
            continue
        try:
            found.append(ExportRecord.decode(backend.read(obj.path), f"{backend.uri}/{obj.path}"))
        except CheckpointError as e:
            log.warning("skipping export record %s: %s", obj.path, e)
    return sorted(found, key=lambda r: (r.step, r.created))


def by_step(records: list[ExportRecord]) -> Mapping[int, list[ExportRecord]]:
    grouped: dict[int, list[ExportRecord]] = {}
    for record in records:
        grouped.setdefault(record.step, []).append(record)
    return grouped


__all__ = [
    "EXPORTS_DIR",
    "ExportRecord",
    "by_step",
    "find_record",
    "list_records",
    "record_path",
    "write_record",
]
