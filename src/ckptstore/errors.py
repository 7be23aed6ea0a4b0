"""One error tree for everything ckptstore raises.

Every message names the URI or file it concerns, what was expected, and how to fix it.
Third-party errors (botocore, OSError, fsspec) are translated once, at the backend boundary,
and chained with ``raise ... from e`` so the original stays visible in tracebacks.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(Exception):
    """Root of every error ckptstore raises on purpose."""


class ConfigError(CheckpointError, ValueError):
    """Bad user input: a malformed URI, unknown scheme, invalid option or step."""


class NotFoundError(CheckpointError):
    """A step, object, bucket or store that should exist does not."""


class IncompleteCheckpointError(CheckpointError):
    """A step lacks files its manifest lists (or was never committed)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes in the store do not match what the manifest promises."""


class UntrustedCheckpointError(CorruptCheckpointError):
    """The manifest is unsigned or signed with another key, and the store requires its key."""


class ConflictError(CheckpointError):
    """Another writer got there first: the step is committed, or a compare-and-swap lost."""


class CompatibilityError(CheckpointError):
    """The checkpoint was written by versions this reader refuses (schema or library)."""


class SerializationError(CheckpointError, TypeError):
    """The state holds something the safe format cannot represent."""


class UnsafeLoadError(CheckpointError):
    """Loading would execute pickle from the store and the caller did not opt in."""


class BackendError(CheckpointError):
    """The storage failed. ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class DistributedCheckpointError(CheckpointError):
    """A multi-rank save or load failed; ``failures`` maps each failing rank to its error."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class AccessDeniedError(BackendError):
    """Credentials are missing, wrong or lack permission for the operation."""


class ObjectExistsError(ConflictError):
    """A create-only write found the object already there."""


class PreconditionFailedError(ConflictError):
    """A compare-and-swap found the object changed since it was read."""


class LeaseHeldError(ConflictError):
    """Another live writer holds the store's writer lease; ``takeover=True`` takes it."""


class FencedError(ConflictError):
    """This writer's lease was taken over: it must not commit or move ``latest`` any more."""
