"""The error for a store none of whose committed steps can be loaded: how many, and why.

No job may restart from step 0 because of a wrong key or a corrupt bucket, so a store whose
steps all fail does not read as empty (resolver.py): it raises this error, which counts the
refused steps, groups them by reason, and takes the class the refusals share, so that
``except UntrustedCheckpointError`` still catches a store signed with another key.
"""

from __future__ import annotations

from ckptstore.domain import layout
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    CorruptCheckpointError,
    UntrustedCheckpointError,
)


def refusal(
    uri: str, failures: dict[int, CheckpointError], *, fenced_count: int = 0
) -> CheckpointError:
    """The error for a store whose committed steps were all refused: how many, and why,
    grouped by reason. Its class is the refusals' common one (UntrustedCheckpointError when
    every step is signed with another key or unsigned; CompatibilityError when every step is
    of a newer schema), else CorruptCheckpointError."""
    by_reason: dict[str, list[int]] = {}
    for step, error in sorted(failures.items()):
        by_reason.setdefault(_reason(error, uri), []).append(step)
    reasons = "; ".join(
        f"{reason} (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
        for reason, steps in by_reason.items()
    )
    count = len(failures)
    also = ""
    if fenced_count:
        also = f", and {fenced_count} committed by a writer that had lost the lease"
    message = (
        f"{uri}: no committed step passed verification; {count} step{'s' if count > 1 else ''} "
        f"refused{also}: {reasons}. Nothing was loaded, and a resume must not start from "
        "scratch here: fix the cause (signing key, ckptstore version, storage) or point the "
        "job at another URI"
    )
    kinds = {type(e) for e in failures.values()}
    cls: type[CheckpointError] = CorruptCheckpointError
    for common in (UntrustedCheckpointError, CompatibilityError):
        if all(issubclass(k, common) for k in kinds):
            cls = common
    return cls(message, uri=uri)


def _reason(error: CheckpointError, uri: str) -> str:
    """An error's message as a short reason, to the first ';': a manifest's refusal without
    the manifest's URI (so that steps refused for one reason group), a file's with the file's
    path in the store."""
    text = str(error)
    where = error.uri or ""
    if where.endswith(layout.MANIFEST_NAME) and text.startswith(f"{where}: "):
        text = text[len(where) + 2 :]
    elif text.startswith(f"{uri}/"):
        text = text[len(uri) + 1 :]
    return text.split("; ", 1)[0].split("\n", 1)[0]
