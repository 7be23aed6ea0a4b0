"""boto3 sessions that share botocore's parsed service models within a process.

Each S3 client gets a session of its own, so each resolves its own credentials, profile and
region from the environment of the moment. Left alone, each new session also has botocore
read and parse S3's service model, endpoint rules and partitions again: a few MB of JSON,
0.1-0.2 s of CPU per client, paid by every store, tier, replica and CLI command that opens
one. Those files ship with botocore and never change while it runs, so one loader (botocore's
``data_loader``, which caches what it parsed) serves every session that searches the same
model directories (``AWS_DATA_PATH`` may name more). Only the data is shared: config files,
credentials and settings stay per session.
"""

from __future__ import annotations

import threading
from typing import Any

import boto3.session
import botocore.session

_lock = threading.Lock()
_loaders: dict[tuple[str, ...], Any] = {}


def new_session(**session_kwargs: Any) -> boto3.session.Session:
    """A fresh boto3 session (``session_kwargs`` as boto3's) reading models through the
    process's loader for the same model directories."""
    with _lock:  # botocore sessions and the loader's list of directories are not thread-safe
        core = botocore.session.get_session()
        fresh = core.get_component("data_loader")  # parses nothing until asked
        loader = _loaders.setdefault(tuple(fresh.search_paths), fresh)
        core.register_component("data_loader", loader)
        session = boto3.session.Session(botocore_session=core, **session_kwargs)
        _drop_repeated_directories(loader.search_paths)
        return session


def _drop_repeated_directories(paths: list[str]) -> None:
    """boto3 appends its own model directory to the loader's list on every session; keep
    the first of each, in order, so the list stays as one session leaves it."""
    paths[:] = dict.fromkeys(paths)
