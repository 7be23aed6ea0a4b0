"""ckptstore: atomic, verified, resumable checkpoints on local disks, NFS, S3 and fsspec URLs."""

from ckptstore import _moved
from ckptstore.data.background import SaveHandle
from ckptstore.domain.info import CheckpointInfo, GcReport, Loaded, SaveStats, VerifyReport
from ckptstore.domain.retention import (
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLast,
    Policy,
    RetentionPolicy,
    StepRecord,
)
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FencedError,
    IncompleteCheckpointError,
    LeaseHeldError,
    NotFoundError,
    SerializationError,
    StepBehindLatestError,
    UnsafeLoadError,
    UntrustedCheckpointError,
    WaitTimeoutError,
)
from ckptstore.store import CheckpointStore

_moved.install()

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
    "DistributedCheckpointError",
    "FencedError",
    "GcReport",
    "IncompleteCheckpointError",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLast",
    "Loaded",
    "LeaseHeldError",
    "NotFoundError",
    "Policy",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "SerializationError",
    "StepBehindLatestError",
    "StepRecord",
    "UnsafeLoadError",
    "UntrustedCheckpointError",
    "VerifyReport",
    "WaitTimeoutError",
]
