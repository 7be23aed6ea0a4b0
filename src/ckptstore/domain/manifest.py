"""The manifest: the commit marker of a step and the record of what it holds.

A step is committed if and only if its manifest exists. The manifest lists every payload file
with its size and CRC32C, so a reader can tell a complete, uncorrupted step from anything else
without trusting the listing. Decoding is strict: an unknown ``schema_version`` or field is an
error, never a guess, because a misread manifest is how a resume silently loads the wrong bytes.

Schema versions, all of which this module reads (old checkpoints must always load):

* 1: files lie directly in the step directory.
* 2: each file names its save ``attempt`` (its bytes live in that attempt's directory, so rival
  writers never share a key); a file may carry a ``sha256`` (always, in signed stores: CRC32C
  detects accidents, not forgeries); the manifest records the writer's ``lease_epoch``, so a
  step that a fenced writer committed is recognisable.
* 3: a state's manifest may carry ``files_by_key``, which files hold the tensors of each
  top-level key of the state, so ``load(keys=[...])`` reads only those (loading.py).

A new field is a new schema, never an optional extra in an old one: decoding is strict, so a
ckptstore that reads up to schema 2 would take a schema-2 manifest with an unknown
``files_by_key`` for corruption, and ``load()`` would fall back past every new step to an old
one. Under schema 3 it refuses them with "upgrade ckptstore" instead. Every manifest written is
of the newest schema (``files_by_key`` is ``null`` where there is no index: ``push_dir`` and
multi-rank steps); manifests of schema 1 and 2 have no index and load as they always did.

A manifest of an older schema keeps its schema and fields when re-encoded (``copy_to`` writes it
verbatim), so signatures over it stay valid.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

from ckptstore.domain.layout import check_attempt, check_relpath, payload_path
from ckptstore.errors import (
    CompatibilityError,
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
)

SCHEMA_VERSION = 3
MAX_FILE_SIZE = 1 << 50  # 1 PiB: larger sizes in a manifest are corruption, not checkpoints
_CRC = re.compile(r"^[0-9a-f]{8}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_V1_MANIFEST_FIELDS = frozenset(
    {"step", "created", "kind", "files", "environment", "writer", "metadata", "schema_version"}
    | {"signature"}
)
_V1_FILE_FIELDS = frozenset({"path", "size", "crc32c", "copied_from"})
_V3_MANIFEST_FIELDS = frozenset({"files_by_key"})
TOMBSTONE_KEY = "tombstone"

KIND_STATE = "state"  # written by save(): safetensors shards + a JSON skeleton
KIND_DIRECTORY = "directory"  # written by push_dir(): arbitrary files, fetched by pull_dir()


@dataclass(frozen=True)
class FileEntry:
    """One payload file: path relative to the step directory, size, CRC32C as 8 hex digits."""

    path: str
    size: int
    crc32c: str
    copied_from: int | None = None
    """The earlier step this file was copied from unchanged (incremental saves)."""
    attempt: str | None = None
    """The save attempt whose directory holds the bytes (``None``: schema 1, the step's)."""
    sha256: str | None = None
    """SHA-256 of the bytes as 64 hex digits: written always in signed stores."""

    def __post_init__(self) -> None:
        check_relpath(self.path, where="manifest")
        if self.attempt is not None:
            check_attempt(self.attempt, where=f"manifest entry {self.path!r}")
        if self.sha256 is not None and (
            not isinstance(self.sha256, str) or not _SHA256.match(self.sha256)
        ):
            raise CorruptCheckpointError(
                f"sha256 of {self.path!r} is {self.sha256!r}, expected 64 hex digits"
            )
        if self.copied_from is not None and (
            isinstance(self.copied_from, bool)
            or not isinstance(self.copied_from, int)
            or self.copied_from < 0
        ):
            raise CorruptCheckpointError(f"copied_from of {self.path!r} is not a step")
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise CorruptCheckpointError(f"size of {self.path!r} is not an integer")
        if not 0 <= self.size <= MAX_FILE_SIZE:
            raise CorruptCheckpointError(
                f"size of {self.path!r} is {self.size}, outside 0..{MAX_FILE_SIZE}"
            )
        if not isinstance(self.crc32c, str) or not _CRC.match(self.crc32c):
            raise CorruptCheckpointError(
                f"checksum of {self.path!r} is {self.crc32c!r}, expected 8 hex digits"
            )

    def key(self, step: int) -> str:
        """The object path of this file's bytes in step ``step``."""
        return payload_path(step, self.path, self.attempt)


@dataclass(frozen=True)
class Environment:
    """Versions and host a step was written with, compared on load (see compat.py)."""

    ckptstore: str
    python: str
    torch: str | None
    verl: str | None
    hostname: str
    git_commit: str | None
    world_size: int


@dataclass(frozen=True)
class Manifest:
    """Everything known about one committed step."""

    step: int
    created: float
    """Seconds since the epoch (UTC) when the step was committed."""
    kind: str
    files: tuple[FileEntry, ...]
    environment: Environment
    writer: str
    """Who committed: ``host:pid:random``, to tell rival writers apart."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    signature: str | None = None
    """``hmac-sha256:<key id>:<hex>`` over :meth:`signed_bytes`, when the writer had a key."""
    lease_epoch: int = 0
    """The writer lease epoch it was committed under (lease.py); 0 without a lease."""
    files_by_key: Mapping[str, tuple[str, ...]] | None = None
    """For a dict state written by ``save``/``save_async``: each top-level key, and the listed
    files holding its tensors (the skeleton ``state.json`` and a pickle file are not listed:
    a load reads them when it needs them). ``None``: no index (older schemas, ``push_dir``,
    multi-rank steps); a load then finds the files from the skeleton."""

    def __post_init__(self) -> None:
        if isinstance(self.lease_epoch, bool) or not isinstance(self.lease_epoch, int):
            raise CorruptCheckpointError(f"lease_epoch {self.lease_epoch!r} is not an integer")
        if self.lease_epoch < 0:
            raise CorruptCheckpointError(f"lease_epoch {self.lease_epoch} is negative")
        if self.signature is not None and not isinstance(self.signature, str):
            raise CorruptCheckpointError("signature is not a string")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise CorruptCheckpointError(f"step {self.step!r} is not a non-negative integer")
        if self.kind not in (KIND_STATE, KIND_DIRECTORY):
            raise CorruptCheckpointError(f"unknown kind {self.kind!r}")
        if not isinstance(self.created, (int, float)) or not math.isfinite(self.created):
            raise CorruptCheckpointError(f"created time {self.created!r} is not a time")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise CorruptCheckpointError("a file is listed twice")
        if self.files_by_key is not None:
            if self.schema_version < 3:
                raise CorruptCheckpointError(
                    f"files_by_key needs schema_version 3, not {self.schema_version}"
                )
            _check_files_by_key(self.files_by_key, set(paths))

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def encode(self) -> bytes:
        return self._encoded

    @cached_property
    def _encoded(self) -> bytes:
        """Encoded once per manifest (it is immutable): a commit writes it and indexes its
        digest, a listing digests every manifest it reads."""
        return json.dumps(self._body(), indent=1, sort_keys=True, allow_nan=False).encode()

    def signed_bytes(self) -> bytes:
        """The canonical bytes a signature covers: every field but the signature."""
        body = self._body()
        del body["signature"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    def _body(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in _MANIFEST_FIELDS}
        body["environment"] = asdict(self.environment)
        body["files"] = [{name: getattr(f, name) for name in _FILE_FIELDS} for f in self.files]
        body["metadata"] = dict(self.metadata)
        if self.files_by_key is not None:
            body["files_by_key"] = {k: list(v) for k, v in self.files_by_key.items()}
        if self.schema_version < 3:  # exactly the fields it was signed with
            for name in _V3_MANIFEST_FIELDS:
                del body[name]
        if self.schema_version == 1:
            body = {k: v for k, v in body.items() if k in _V1_MANIFEST_FIELDS}
            body["files"] = [
                {k: v for k, v in f.items() if k in _V1_FILE_FIELDS} for f in body["files"]
            ]
        return body

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> Manifest:
        """Parse strictly; ``where`` (the manifest's URI) goes into every error message."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"{where}: manifest is not valid JSON ({e}); it is corrupt or truncated. "
                "Load an earlier step, or delete this one with `ckptstore rm`"
            ) from e
        if not isinstance(body, dict):
            raise CorruptCheckpointError(f"{where}: manifest is not a JSON object")
        if TOMBSTONE_KEY in body:
            raise NotFoundError(f"{where}: the step is not committed (its files are being removed)")
        version = body.get("schema_version")
        if version not in range(1, SCHEMA_VERSION + 1) or isinstance(version, bool):
            if isinstance(version, int) and version > SCHEMA_VERSION:
                raise CompatibilityError(
                    f"{where}: manifest schema_version {version} is newer than this ckptstore "
                    f"reads (up to {SCHEMA_VERSION}); upgrade ckptstore to load it"
                )
            raise CorruptCheckpointError(
                f"{where}: manifest schema_version is {version!r}, expected 1 to {SCHEMA_VERSION}"
            )
        only: tuple[frozenset[str] | None, frozenset[str] | None] = (None, None)
        if version == 1:
            only = (_V1_MANIFEST_FIELDS, _V1_FILE_FIELDS)
        elif version == 2:
            only = (_all_fields(cls) - _V3_MANIFEST_FIELDS, None)
        try:
            _expect_keys(body, cls, where, only[0])
            if isinstance(body.get("files_by_key"), dict):
                body["files_by_key"] = {
                    k: tuple(v) if isinstance(v, list) else v
                    for k, v in body["files_by_key"].items()
                }
            _expect_keys(body["environment"], Environment, f"{where} environment")
            files = []
            for f in body["files"]:
                _expect_keys(f, FileEntry, f"{where} file entry", only[1])
                files.append(FileEntry(**f))
            if not isinstance(body["metadata"], dict):
                raise CorruptCheckpointError(f"{where}: metadata is not an object")
            return cls(
                **{**body, "files": tuple(files), "environment": Environment(**body["environment"])}
            )
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(
                f"{where}: {e}. The manifest is corrupt; load an earlier step"
            ) from e
        except (TypeError, KeyError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from e


_MANIFEST_FIELDS = tuple(f.name for f in fields(Manifest))
_FILE_FIELDS = tuple(f.name for f in fields(FileEntry))
"""What :meth:`Manifest._body` copies: a manifest's fields, and each file's (all flat values)."""


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """User metadata as plain JSON values (a copy), or ConfigError saying what to convert.

    0-d tensors and NumPy scalars (what Lightning logs) become Python numbers and bools, in
    nested dicts and lists too; they are recognised by duck typing (``.item()``, ``.ndim``), so
    this module never imports torch or NumPy: file-only CLI commands start without them.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    plain = {key: _plain_value(value, f"metadata[{key!r}]") for key, value in metadata.items()}
    try:
        return dict(json.loads(json.dumps(plain, allow_nan=False)))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"metadata must hold only JSON values (str, numbers, bools, None, lists, dicts "
            f"with str keys): {e}; convert tensors with .item()"
        ) from e


def _plain_value(value: Any, where: str) -> Any:
    """``value`` with 0-d tensors and array scalars made Python scalars; ConfigError for a
    tensor or array of any other shape, and for NaN or infinity (JSON has neither)."""
    if isinstance(value, Mapping):
        return {k: _plain_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    ndim = getattr(value, "ndim", None)
    if isinstance(ndim, int) and callable(getattr(value, "item", None)):
        if ndim != 0:
            shape = tuple(getattr(value, "shape", ()))
            raise ConfigError(
                f"metadata must hold only JSON values: {where} is a {type(value).__name__} of "
                f"shape {shape}; convert it with .item() (one element) or .tolist()"
            )
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"metadata must hold only JSON values: {where} is {value}, and JSON has no NaN or "
            "infinity; log a finite number, or None or a string in its place"
        )
    return value


def encode_tombstone(
    writer: str,
    time: float,
    attempts: Iterable[str],
    *,
    committed: bool = False,
    dropping: float | None = None,
) -> bytes:
    """What stands at a step's manifest key once its files are being removed: who removes it,
    and which save attempts (only those: a save that began later may commit over it).
    ``committed``: the attempts were a committed step's (an uncommit), which nobody commits
    again, so whoever finds the removal unfinished may finish it and drop the tombstone at
    once; otherwise (gc or a coordinator removing uncommitted attempts) the tombstone stays
    until no committer of those attempts can be alive (garbage.py). ``dropping``: when its
    deletion began (tombstones.py's ``Tombstones.drop``); nobody commits over it meanwhile."""
    body: dict[str, Any] = {
        TOMBSTONE_KEY: 1,
        "writer": writer,
        "time": time,
        "attempts": sorted(attempts),
        "committed": committed,
    }
    if dropping is not None:
        body["dropping"] = dropping
    return json.dumps(body, sort_keys=True).encode()


def dropping_tombstone(data: bytes, writer: str, time: float) -> bytes:
    """``data`` (a tombstone) marked as being deleted by ``writer`` since ``time``."""
    body = _tombstone_body(data) or {}
    return encode_tombstone(
        writer,
        body.get("time", time),
        tombstone_attempts(data) or (),
        committed=body.get("committed") is True,
        dropping=time,
    )


def _tombstone_body(data: bytes) -> dict[str, Any] | None:
    """The fields of a tombstone, or ``None`` if ``data`` is not one."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return body if isinstance(body, dict) and TOMBSTONE_KEY in body else None


def tombstone_dropping(data: bytes) -> float | None:
    """When the deletion of a tombstone began, or ``None`` (not a tombstone being dropped)."""
    when = (_tombstone_body(data) or {}).get("dropping")
    return float(when) if isinstance(when, int | float) and not isinstance(when, bool) else None


def tombstone_attempts(data: bytes) -> frozenset[str] | None:
    """The attempts a tombstone removes, or ``None`` if ``data`` is not a tombstone."""
    body = _tombstone_body(data)
    if body is None:
        return None
    attempts = body.get("attempts")
    return (
        frozenset(a for a in attempts if isinstance(a, str))
        if isinstance(attempts, list)
        else frozenset()
    )


def is_tombstone(data: bytes) -> bool:
    return _tombstone_body(data) is not None


def tombstone_of_commit(data: bytes) -> bool:
    """Whether ``data`` is an uncommit's tombstone (:func:`encode_tombstone`)."""
    return (_tombstone_body(data) or {}).get("committed") is True


def _check_files_by_key(index: object, paths: set[str]) -> None:
    """Raise CorruptCheckpointError unless ``index`` maps str keys to tuples of listed paths."""
    if not isinstance(index, Mapping):
        raise CorruptCheckpointError("files_by_key is not an object")
    for key, files in index.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"files_by_key has a key {key!r} that is not a string")
        if not isinstance(files, tuple) or not all(isinstance(f, str) for f in files):
            raise CorruptCheckpointError(f"files_by_key[{key!r}] is not a list of paths")
        unlisted = [f for f in files if f not in paths]
        if unlisted:
            raise CorruptCheckpointError(
                f"files_by_key[{key!r}] names {unlisted[0]!r}, which the manifest does not list"
            )


def _all_fields(kind: type) -> frozenset[str]:
    return frozenset(f.name for f in kind.__dataclass_fields__.values())  # type: ignore[attr-defined]


def _expect_keys(body: object, kind: type, where: str, only: frozenset[str] | None = None) -> None:
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{where} is not a JSON object")
    fields = kind.__dataclass_fields__.values()  # type: ignore[attr-defined]
    allowed = {f.name for f in fields} & (only if only is not None else {f.name for f in fields})
    required = {f.name for f in fields if f.default is MISSING and f.default_factory is MISSING}
    if not required <= set(body) <= allowed:
        missing, unknown = required - set(body), set(body) - allowed
        raise CorruptCheckpointError(
            f"{where} has missing fields {sorted(missing)} or unknown fields {sorted(unknown)}"
        )
