"""Moving whole directories between a local disk and a store, safely.

``scan_dir`` decides which local files a push takes: regular files, and symlinks only while
they resolve inside the directory (a link to ``/etc`` or ``~/.aws`` would otherwise upload
secrets). ``download_dir`` writes each file with the local backend's atomic write (temp name,
fsync, rename, directory fsync: :func:`~ckptstore.backends.fsutil.atomic_write`), after
checking the target stays inside the destination, so a hostile manifest cannot write outside
it and an interrupted pull never leaves a half-written file under its real name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptstore.backends.fsutil import atomic_write
from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.manifest import FileEntry

PULL_WORKERS = 8


def scan_dir(root: Path) -> list[tuple[str, Path]]:
    """``(relative path, file)`` for each file a push of ``root`` takes, sorted."""
    if not root.is_dir():
        raise ConfigError(
            f"{root} is not a directory; push takes the directory of one step", path=str(root)
        )
    base = root.resolve()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            if path.is_symlink() and not path.resolve().is_relative_to(base):
                raise ConfigError(
                    f"{path} is a symlink to {path.resolve()}, outside {root}; push only takes "
                    "files inside the directory. Copy the target in, or remove the link",
                    path=str(path),
                )
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if "\\" in rel:
                raise ConfigError(
                    f"{path}: file names with a backslash cannot be pushed", path=str(path)
                )
            found.append((rel, path))
    if not found:
        raise ConfigError(f"{root} holds no files; there is nothing to push", path=str(root))
    return sorted(found)


def download_dir(
    entries: Iterable[FileEntry], target: Path, read: Callable[[FileEntry], memoryview]
) -> None:
    """Write each entry under ``target``; ``read`` returns its verified bytes."""
    base = target.resolve()

    def fetch(entry: FileEntry) -> None:
        dest = (base / entry.path).resolve()
        if not dest.is_relative_to(base) or dest == base:
            raise CorruptCheckpointError(
                f"manifest entry {entry.path!r} would be written outside {target}; refusing",
                path=str(dest),
            )
        data = read(entry)
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(dest, [data])

    with ThreadPoolExecutor(PULL_WORKERS, thread_name_prefix="ckpt-pull") as pool:
        list(pool.map(fetch, list(entries)))
