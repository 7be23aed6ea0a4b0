"""What a reader does when the environment a step was written in differs from its own.

Loading a checkpoint written by another torch or verl release usually works, and sometimes
silently does not (renamed optimizer keys, changed defaults). So every manifest records the
versions, and ``compat`` decides what a difference does: ``"strict"`` refuses with an error that
names both versions and the override, ``"warn"`` logs once per load, ``"ignore"`` says nothing.
Versions are compared on major.minor: patch releases do not change formats. Pure: finding out
the environment (package metadata, git, hostname) is :mod:`ckptstore.domain.environment`'s job.
"""

from __future__ import annotations

import logging

from ckptstore.domain.manifest import Environment
from ckptstore.errors import CompatibilityError, ConfigError

log = logging.getLogger(__name__)

COMPAT_MODES = ("strict", "warn", "ignore")
_COMPARED = ("ckptstore", "torch", "verl")


def check_mode(compat: str) -> str:
    if compat not in COMPAT_MODES:
        raise ConfigError(f"compat must be one of {', '.join(COMPAT_MODES)}; got {compat!r}")
    return compat


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
