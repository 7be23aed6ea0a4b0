"""URI scheme -> backend class, imported lazily.

Only the backend a URI needs is imported, so ``import ckptstore`` stays cheap and a missing
optional dependency is reported as our own error with the ``pip install`` line that fixes it.
Other packages can add schemes through the ``ckptstore.backends`` entry-point group
(``name = "module:Class"``, where the class takes ``(uri, storage_options)``); such a class
subclasses :class:`~ckptstore.backends.base.BaseBackend` and runs the shipped contract suite,
:mod:`ckptstore.testing.contract`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit

from ckptstore.backends.base import Backend
from ckptstore.errors import ConfigError

ENTRY_POINT_GROUP = "ckptstore.backends"

_BUILTIN: dict[str, tuple[str, str]] = {
    # scheme: ("module:Class", extra that installs its dependencies)
    "file": ("ckptstore.backends.local:LocalBackend", ""),
    "s3": ("ckptstore.backends.s3:S3Backend", "s3"),
    "s3a": ("ckptstore.backends.s3:S3Backend", "s3"),
}
_FSSPEC = ("ckptstore.backends.fsspec:FsspecBackend", "")


def scheme_of(uri: str) -> str:
    """The URI's scheme, ``file`` for plain paths; a malformed URI is a ConfigError."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(
            f"store URI must be a non-empty string like 's3://bucket/prefix' or a path, got {uri!r}"
        )
    if "://" not in uri:
        if ":" in uri.split("/")[0] and not _looks_like_windows_drive(uri):
            raise ConfigError(
                f"store URI {uri!r} is malformed: expected 'scheme://...' (like s3://bucket/run) "
                "or a plain path",
                uri=uri,
            )
        return "file"
    scheme = urlsplit(uri).scheme.lower()
    if not scheme or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        raise ConfigError(f"store URI {uri!r} has no valid scheme before '://'", uri=uri)
    return scheme


def _looks_like_windows_drive(uri: str) -> bool:
    return len(uri) > 2 and uri[1] == ":" and uri[0].isalpha() and uri[2] in "\\/"


def open_backend(uri: str, storage_options: Mapping[str, Any] | None = None) -> Backend:
    """The backend for ``uri``, configured with ``storage_options``."""
    scheme = scheme_of(uri)
    target, extra = _BUILTIN.get(scheme) or _entry_point(scheme) or _fsspec_target(uri, scheme)
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        fix = f"pip install 'ckptstore[{extra}]'" if extra else f"pip install {e.name}"
        raise ConfigError(
            f"cannot open {uri!r}: the {scheme}:// backend needs the missing package "
            f"{e.name!r}; install it with: {fix}",
            uri=uri,
        ) from e
    cls = getattr(module, class_name)
    backend: Backend = cls(uri, dict(storage_options or {}))
    return backend


def _entry_point(scheme: str) -> tuple[str, str] | None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            return ep.value, ""
    return None


def _fsspec_target(uri: str, scheme: str) -> tuple[str, str]:
    """Any scheme fsspec knows (memory, gs, az, hdfs, ...) goes through the fsspec backend."""
    from fsspec.registry import known_implementations, registry

    if scheme in registry or scheme in known_implementations:
        return _FSSPEC
    known = sorted({*_BUILTIN, *known_implementations})
    raise ConfigError(
        f"cannot open {uri!r}: unknown URI scheme {scheme!r}. Use a local path, "
        f"s3://bucket/prefix, or a scheme fsspec supports ({', '.join(known[:12])}, ...)",
        uri=uri,
    )
