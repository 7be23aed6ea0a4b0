"""Where things live inside a store, as pure functions of names (no I/O).

::

    <root>/latest.json                              the pointer, moved by compare-and-swap
    <root>/global_step_<N>/ckptstore.manifest.json  the commit marker, written last, create-only
    <root>/global_step_<N>/.attempt-<id>/<files>    one save attempt's payload, verl's names inside
    <root>/global_step_<N>/.attempt-<id>/.ckptstore-attempt.json   the attempt marker, written first
    <root>/.ckptstore/pins/global_step_<N>          one object per pin (no shared file to race on)
    <root>/.ckptstore/lease.json                    the writer lease (lease.py)

The manifest sits inside its step directory so that deleting or copying a step moves its commit
marker with it, and so that a listing of step directories plus one GET per step is all it takes
to know which steps are committed.

Every save attempt writes into a directory of its own, named by a random id that the manifest
records per file. Two writers of the same step therefore never overwrite each other's bytes: the
manifest that wins the create-only write describes exactly the bytes it lists, and the loser's
attempt is garbage that ``gc`` can prove dead. The marker written first tells ``gc`` that the
directory is ckptstore's (it never touches what it did not write). Manifests of schema 1 list
files directly under the step directory (``attempt`` is ``None``); they still load.

A *tombstone* may stand at a step's manifest key while ``gc`` or ``discard`` removes the step's
uncommitted attempts: being create-only, that key admits either a manifest or a tombstone, so no
commit can slip in between the check for a manifest and the deletion of the files.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from ckptstore.errors import ConfigError, CorruptCheckpointError

STEP_PREFIX = "global_step_"
MANIFEST_NAME = "ckptstore.manifest.json"
ATTEMPT_PREFIX = ".attempt-"
ATTEMPT_MARKER = ".ckptstore-attempt.json"
LATEST_NAME = "latest.json"
META_DIR = ".ckptstore"
PINS_DIR = f"{META_DIR}/pins"
LEASE_NAME = f"{META_DIR}/lease.json"
VERL_TRACKER_NAME = "latest_checkpointed_iteration.txt"
DEFAULT_SHARD_SIZE = 32 << 20
"""Tensor files are split near this size: files up- and download in parallel, and an
incremental save re-uploads only the files whose bytes changed, so small files keep it small
(training the top 10% of a model re-uploads about 14% of a 1 GiB state, against 100% with 1 GiB
files), while costing no speed (measured on local disk and S3)."""

_STEP_DIR = re.compile(r"^global_step_(0|[1-9][0-9]*)$")
_ATTEMPT_ID = re.compile(r"^[0-9a-f]{16}$")
_RESERVED_NAMES = frozenset({MANIFEST_NAME, ATTEMPT_MARKER})


def step_dir(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def payload_path(step: int, relpath: str, attempt: str | None = None) -> str:
    """Where a payload file's bytes live: in its attempt's directory (schema 1: directly)."""
    if attempt is None:
        return f"{step_dir(step)}/{relpath}"
    return f"{attempt_dir(step, attempt)}/{relpath}"


def attempt_dir(step: int, attempt: str) -> str:
    return f"{step_dir(step)}/{ATTEMPT_PREFIX}{attempt}"


def attempt_marker_path(step: int, attempt: str) -> str:
    return f"{attempt_dir(step, attempt)}/{ATTEMPT_MARKER}"


def check_attempt(attempt: object, *, where: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT_ID.match(attempt):
        raise CorruptCheckpointError(f"{where}: attempt id {attempt!r} is not 16 hex digits")
    return attempt


def parse_attempt_path(step: int, path: str) -> str | None:
    """The attempt id of an object path inside step ``step``, or ``None`` if it is in none."""
    head = f"{step_dir(step)}/{ATTEMPT_PREFIX}"
    if not path.startswith(head):
        return None
    attempt = path[len(head) :].split("/", 1)[0]
    return attempt if _ATTEMPT_ID.match(attempt) else None


def pin_path(step: int) -> str:
    return f"{PINS_DIR}/{step_dir(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or ``None`` if it is not a step directory."""
    match = _STEP_DIR.match(name.strip("/"))
    return int(match.group(1)) if match else None


def split_step_uri(uri: str) -> tuple[str, int] | None:
    """``s3://b/run/global_step_100`` -> ``("s3://b/run", 100)``; ``None`` for other URIs."""
    head, _, name = uri.rstrip("/").rpartition("/")
    step = parse_step_dir(name)
    if step is None:
        return None
    if head.endswith(":/"):  # s3://global_step_1: a bucket, with no store above it
        return None
    if not head:
        head = "/" if uri.startswith("/") else "."
    return head, step


def check_step(step: object, *, where: str = "step") -> int:
    """Accept a non-negative integer (or its decimal string); anything else is a ConfigError."""
    if isinstance(step, bool):
        raise ConfigError(f"{where} must be a non-negative integer, got {step!r}")
    if isinstance(step, str) and step.strip().isdigit():
        step = int(step.strip())
    if not isinstance(step, int) or step < 0:
        raise ConfigError(
            f"{where} must be a non-negative integer (like 100), got {step!r}; "
            "steps number the training iterations a checkpoint was taken at"
        )
    return step


def check_relpath(relpath: str, *, where: str) -> str:
    """Validate a file path recorded in a manifest or taken from a directory.

    Rejects what could escape the step directory on pull or confuse the commit marker:
    absolute paths, ``..``, backslashes, empty parts and the manifest's own name.
    ``where`` names the manifest or directory, for the message.
    """
    problem = _relpath_problem(relpath)
    if problem:
        raise CorruptCheckpointError(
            f"{where}: unsafe file path {relpath!r} ({problem}); a checkpoint file path must be "
            "relative, use '/' separators and stay inside its step directory"
        )
    return relpath


def _relpath_problem(relpath: str) -> str | None:
    if not isinstance(relpath, str) or not relpath:
        return "empty"
    if "\\" in relpath:
        return "contains a backslash"
    if "\x00" in relpath:
        return "contains a NUL byte"
    if relpath.startswith("/") or re.match(r"^[A-Za-z]:", relpath):
        return "absolute"
    parts = relpath.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "contains '..', '.' or an empty part"
    if PurePosixPath(relpath).name in _RESERVED_NAMES and len(parts) == 1:
        return f"{MANIFEST_NAME} is reserved for the commit marker"
    return None
