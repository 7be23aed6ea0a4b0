"""The one place ckptstore reads its own environment variables.

``CKPTSTORE_SIGNING_KEY``       manifest signing key
``CKPTSTORE_SIGNING_KEY_FILE``  a file holding the key, for secrets mounted as files

One rule reads a key given as text, in the variable, in the file or as ``signing_key="..."``:
surrounding whitespace is dropped, then text that is hex (``openssl rand -hex 32``) stands for
the bytes it spells, and anything else is the key's bytes as they are. So the same text in
the variable and in the file is the same key. ``signing_key=b"..."`` is the key as given.
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
        return text_key(environ[SIGNING_KEY].encode())
    if environ.get(SIGNING_KEY_FILE):
        path = Path(environ[SIGNING_KEY_FILE])
        try:
            return text_key(path.read_bytes())
        except OSError as e:
            raise ConfigError(
                f"{SIGNING_KEY_FILE} names {path}, which cannot be read ({e.strerror}); "
                "fix the path or unset the variable",
                path=str(path),
            ) from e
    return None


def key_bytes(key: str | bytes) -> bytes:
    """The key of ``signing_key=``: bytes as given, text by :func:`text_key`."""
    return key if isinstance(key, bytes) else text_key(key.encode())


def text_key(text: bytes) -> bytes:
    """The key a text stands for (the module docstring's one rule)."""
    raw = text.strip()
    try:
        return bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return raw


def git_commit_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    for name in GIT_COMMIT_VARS:
        if environ.get(name):
            return environ[name]
    return None
