"""Atomic writes on a local (POSIX) filesystem: the one recipe every local write uses.

A file is written to a temp name in its own directory, flushed and fsynced, renamed over its
real name, and the directory fsynced. A crash then leaves either the old file or the new one,
never a torn one: ``rename`` within one directory is atomic on POSIX (also on NFS, because
source and target share a directory, where a ``shutil.move`` across devices would be a copy),
and the directory fsync makes the rename itself durable, so a power loss cannot bring back the
old name after a caller was told the write succeeded.

A write stops between chunks once the deadline in force has passed (:mod:`ckptstore.deadline`),
removing its temp file. The local backend and the verl tracker file go through
:func:`atomic_write`; pulls
(``loading.download_step``), which verify each file between writing and renaming it, and the
local backend's create-only and compare-and-swap writes use its halves, :func:`write_temp`,
:func:`move_into_place` and :func:`fsync_dir`. Temp names come from :func:`temp_name` only,
so listings and ``gc`` recognise them by one prefix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ckptstore import deadline
from ckptstore.backends.base import Chunk

HIDDEN_PREFIX = ".ckpt-"
"""Names our temp and lock files start with; listings hide them."""
TMP_PREFIX = ".ckpt-tmp-"
"""Names of temp files a write leaves while it runs (or when it is killed): ``gc`` removes them."""
_NAME_MAX = 255


def temp_name(name: str) -> str:
    """A fresh temp name for a file called ``name``: ``.ckpt-tmp-<random>-<name>``, cut to the
    255 bytes a file name may have."""
    return f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"[:_NAME_MAX]


def temp_path(target: Path) -> Path:
    """A fresh temp file beside ``target`` (in its directory, so a rename stays atomic)."""
    return target.parent / temp_name(target.name)


def write_temp(target: Path, chunks: Iterable[Chunk]) -> tuple[Path, int]:
    """Write ``chunks`` to a fsynced temp file beside ``target``; returns it and its size.

    The caller moves it into place (rename, or link for create-only). On any failure the temp
    file is removed and the error re-raised. The directory must exist; one that a concurrent
    delete removed while it was empty (it prunes empty directories) is made again.
    """
    tmp = temp_path(target)
    size = 0
    try:
        with _open_new(tmp) as f:
            for chunk in chunks:
                deadline.check(str(target), doing="write", bytes_done=size)
                size += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp, size


def _open_new(tmp: Path) -> BinaryIO:
    """``open(tmp, "xb")``, making its directory again if it vanished meanwhile."""
    for _ in range(3):
        try:
            return open(tmp, "xb")
        except FileNotFoundError:
            tmp.parent.mkdir(parents=True, exist_ok=True)
    return open(tmp, "xb")


def atomic_write(target: Path, chunks: Iterable[Chunk]) -> int:
    """Temp + write + fsync + rename + directory fsync; returns the size written.

    ``target`` appears whole or not at all (an old file stays until the rename). The directory
    must exist.
    """
    tmp, size = write_temp(target, chunks)
    move_into_place(tmp, target)
    return size


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename a finished temp file over ``target`` and fsync the directory; on failure the
    temp file is removed."""
    try:
        os.replace(tmp, target)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(target.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or link durable: fsync the directory that holds the name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
