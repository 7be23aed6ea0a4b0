"""Where a committed step's files live in its store, for tests that tamper with them."""

from __future__ import annotations

from ckptstore import CheckpointStore


def file_key(store: CheckpointStore, step: int, path: str) -> str:
    """The object key of ``path`` in committed ``step`` (inside its save attempt's directory)."""
    return store.info(step).manifest.file(path).key(step)
