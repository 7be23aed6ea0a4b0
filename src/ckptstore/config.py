"""The one place ckptstore reads its own environment variables.

``CKPTSTORE_SIGNING_KEY``       manifest signing key (hex if it parses as hex, else its UTF-8)
``CKPTSTORE_SIGNING_KEY_FILE``  a file holding the key (raw bytes; surrounding whitespace
                                stripped), for secrets mounted as files
``CKPTSTORE_GIT_COMMIT``        the training code's commit, recorded in manifests
                                (environment.py also falls back to ``GIT_COMMIT``,
                                ``GITHUB_SHA`` and git)

AWS settings are read by boto3 itself, from the usual ``AWS_*`` variables and files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ckptstore.errors import ConfigError

SIGNING_KEY = "CKPTSTORE_SIGNING_KEY"
SIGNING_KEY_FILE = "CKPTSTORE_SIGNING_KEY_FILE"
GIT_COMMIT_VARS = ("CKPTSTORE_GIT_COMMIT", "GIT_COMMIT", "GITHUB_SHA")


def signing_key_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The signing key the environment provides, or None."""
    if environ.get(SIGNING_KEY):
        return key_bytes(environ[SIGNING_KEY])
    if environ.get(SIGNING_KEY_FILE):
        path = Path(environ[SIGNING_KEY_FILE])
        try:
            return path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(
                f"{SIGNING_KEY_FILE} names {path}, which cannot be read ({e.strerror}); "
                "fix the path or unset the variable",
                path=str(path),
            ) from e
    return None


def key_bytes(key: str | bytes) -> bytes:
    """A key given as text: hex when it is hex, else its UTF-8 bytes."""
    if isinstance(key, bytes):
        return key
    try:
        return bytes.fromhex(key)
    except ValueError:
        return key.encode()


def git_commit_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    for name in GIT_COMMIT_VARS:
        if environ.get(name):
            return environ[name]
    return None
