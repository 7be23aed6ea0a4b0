"""ckptstore: atomic, verified, resumable checkpoints on local disks, NFS, S3 and fsspec URLs."""

from ckptstore.background import SaveHandle
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
    SerializationError,
    UnsafeLoadError,
)
from ckptstore.info import CheckpointInfo, GcReport, SaveStats, VerifyReport
from ckptstore.retention import KeepEvery, KeepLast, RetentionPolicy
from ckptstore.store import CheckpointStore

__all__ = [
    "AccessDeniedError",
    "BackendError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CompatibilityError",
    "ConfigError",
    "ConflictError",
    "CorruptCheckpointError",
    "GcReport",
    "IncompleteCheckpointError",
    "KeepEvery",
    "KeepLast",
    "NotFoundError",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "SerializationError",
    "UnsafeLoadError",
    "VerifyReport",
]
