"""boto3 sessions that share botocore's parsed service models within a process.

Each S3 client gets a session of its own, so each resolves its own credentials, profile and
region from the environment of the moment. Left alone, each new session also has botocore
read and parse S3's service model, endpoint rules and partitions again: a few MB of JSON,
0.1-0.2 s of CPU per client, paid by every store, tier, replica and CLI command that opens
one. Those files ship with botocore and never change while it runs, so one loader (botocore's
``data_loader``, which caches what it parsed) serves every session. Only the data is shared:
config files, credentials and settings stay per session. A process that changes
``AWS_DATA_PATH`` after its first client keeps the model directories it started with.
"""

from __future__ import annotations

import threading
from typing import Any

import boto3.session
import botocore.session

_lock = threading.Lock()
_loader: Any = None


def new_session(**session_kwargs: Any) -> boto3.session.Session:
    """A fresh boto3 session (``session_kwargs`` as boto3's) reading models through the
    process's one loader."""
    global _loader
    with _lock:  # botocore sessions and the loader's list of directories are not thread-safe
        core = botocore.session.get_session()
        if _loader is None:
            _loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _loader)
        session = boto3.session.Session(botocore_session=core, **session_kwargs)
        _drop_repeated_directories(_loader.search_paths)
        return session


def _drop_repeated_directories(paths: list[str]) -> None:
    """boto3 appends its own model directory to the loader's list on every session; keep
    the first of each, in order, so the list stays as one session leaves it."""
    paths[:] = dict.fromkeys(paths)
