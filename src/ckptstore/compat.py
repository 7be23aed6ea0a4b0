"""The environment a step is written in, and what a reader does when its own differs.

Loading a checkpoint written by another torch or verl release usually works, and sometimes
silently does not (renamed optimizer keys, changed defaults). So every manifest records the
versions, and ``compat`` decides what a difference does: ``"strict"`` refuses with an error that
names both versions and the override, ``"warn"`` logs once per load, ``"ignore"`` says nothing.
Versions are compared on major.minor: patch releases do not change formats.
"""

from __future__ import annotations

import logging
import platform
import socket
import subprocess
from importlib import metadata

from ckptstore.config import git_commit_from_env
from ckptstore.errors import CompatibilityError, ConfigError
from ckptstore.manifest import Environment

log = logging.getLogger(__name__)

COMPAT_MODES = ("strict", "warn", "ignore")
_COMPARED = ("ckptstore", "torch", "verl")


def check_mode(compat: str) -> str:
    if compat not in COMPAT_MODES:
        raise ConfigError(f"compat must be one of {', '.join(COMPAT_MODES)}; got {compat!r}")
    return compat


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def current_environment(world_size: int = 1) -> Environment:
    return Environment(
        ckptstore=package_version("ckptstore") or "unknown",
        python=platform.python_version(),
        torch=package_version("torch"),
        verl=package_version("verl"),
        hostname=socket.gethostname(),
        git_commit=_git_commit(),
        world_size=world_size,
    )


def _git_commit() -> str | None:
    """The training code's commit: from the environment CI systems set, else from git."""
    from_env = git_commit_from_env()
    if from_env:
        return from_env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _major_minor(version: str | None) -> tuple[str, ...] | None:
    if version is None:
        return None
    return tuple(version.split("+")[0].split(".")[:2])


def differences(written: Environment, current: Environment) -> list[tuple[str, str, str]]:
    """``(package, written version, current version)`` for every major.minor difference."""
    found = []
    for name in _COMPARED:
        then, now = getattr(written, name), getattr(current, name)
        if then is None:  # not installed when written: nothing to compare against
            continue
        if _major_minor(then) != _major_minor(now):
            found.append((name, then, now or "not installed"))
    return found


def check_compat(written: Environment, current: Environment, *, mode: str, where: str) -> None:
    """Apply ``mode`` to the differences between the writer's and this environment."""
    if mode == "ignore":
        return
    diffs = differences(written, current)
    if not diffs:
        return
    listed = ", ".join(f"{name} {then} (written) vs {now} (here)" for name, then, now in diffs)
    if mode == "strict":
        raise CompatibilityError(
            f"{where}: written with other versions: {listed}. Install the writing versions, or "
            "load anyway with compat='warn' (CLI: --compat warn)"
        )
    log.warning(
        "%s: written with other versions: %s; loading anyway (compat=%s)", where, listed, mode
    )
