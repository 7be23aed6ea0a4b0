"""The environment this process writes steps in: package versions, Python, host, git commit.

Every manifest records it, so that a reader can tell what wrote a step
(:mod:`ckptstore.domain.compat` compares it with its own). Kept apart from that comparison
because finding it out is I/O: it reads package metadata and the hostname, and may run ``git``.
"""

from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata

from ckptstore.config import git_commit_from_env
from ckptstore.domain.manifest import Environment


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


def world_size() -> int:
    """The torch.distributed world size, or 1 outside a process group (or without torch)."""
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except (ImportError, RuntimeError):
        return 1
