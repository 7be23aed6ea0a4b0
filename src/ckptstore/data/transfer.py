"""Moving whole directories between a local disk and a store, safely.

``scan_dir`` decides which local files a push takes: regular files, and symlinks only while
they resolve inside the directory (a link to ``/etc`` or ``~/.aws`` would otherwise upload
secrets).

``download_dir`` is a pull's local half. It never writes into its target while bytes are still
arriving: every file goes into a temporary directory beside the target, named
``.ckpt-tmp-<random>-pull-<name>`` (:func:`~ckptstore.backends.fsutil.temp_name`), under a temp
name of its own until it is verified, then renamed to its real name. Only when every file is
there does the directory reach the target: a new or empty target is replaced by it in one
rename, so it holds the whole step or nothing; into a non-empty one (only with ``force`` or
``delete``) the files are renamed one by one, and so into a mount point, where the temporary
directory goes inside the target (a rename cannot cross filesystems). A failed or interrupted
pull removes the temporary directory; only a killed process leaves it behind, under that name.
A manifest path that would land outside the target (``..``, or a symlink already in the
target) is refused.

:class:`ChunkReader` is its remote half's memory bound: files are read in ranged chunks of
:data:`CHUNK_SIZE` (one ranged GET each on S3), at most :data:`PULL_CONCURRENCY` chunks alive
at once, whatever the size of the files.

Filters (:func:`path_filter`) follow the aws CLI's ``--include``/``--exclude``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType

from ckptstore.backends.fsutil import fsync_dir, temp_name
from ckptstore.deadline import submit
from ckptstore.domain.manifest import FileEntry
from ckptstore.errors import ConfigError, CorruptCheckpointError

CHUNK_SIZE = 8 << 20
"""Bytes per ranged read of a pull (one ranged GET on S3), as aws s3's ``multipart_chunksize``."""
PULL_CONCURRENCY = 8
"""Chunks a pull holds at once, in flight or waiting to be written: its peak memory is about
``CHUNK_SIZE * PULL_CONCURRENCY`` (64 MiB) whatever the size of the files. A lone large file
gets all of them, as parallel ranged reads."""
PULL_WORKERS = 8
"""Files a pull writes at once."""
_SLOT_WAIT = 0.2
"""Seconds between looks at the stop flag while a read waits for a free chunk slot."""

log = logging.getLogger(__name__)


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


# -- filters ---------------------------------------------------------------------------------


def path_filter(
    include: str | Sequence[str] = (), exclude: str | Sequence[str] = ()
) -> Callable[[str], bool]:
    """Whether a pull takes a file, by its path in the step: the aws CLI's filters.

    Every file is taken unless an ``exclude`` pattern matches its path; an ``include`` pattern
    that matches takes it back (excludes apply first, then includes, and the later wins). So
    ``exclude="*", include="actor/*"`` takes only ``actor/``, and ``include`` alone changes
    nothing. Patterns are :func:`fnmatch.fnmatchcase` globs on the whole path: ``*`` also
    matches ``/``, case matters.
    """
    includes = patterns(include)
    excludes = patterns(exclude)
    if includes and not excludes:
        log.warning(
            "an include filter without an exclude selects every file (the aws CLI's rules: "
            "includes only take back what an exclude left out); to pull only %s, exclude "
            "everything first (--exclude '*' --include PATTERN)",
            ", ".join(includes),
        )

    def takes(path: str) -> bool:
        if any(fnmatchcase(path, p) for p in includes):
            return True
        return not any(fnmatchcase(path, p) for p in excludes)

    return takes


def patterns(given: str | Sequence[str]) -> tuple[str, ...]:
    """Filter patterns as a tuple: one string is one pattern (not its characters)."""
    found = (given,) if isinstance(given, str) else tuple(given)
    for pattern in found:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"filter pattern {pattern!r} is not a non-empty string")
    return found


# -- the target ------------------------------------------------------------------------------


def check_target(target: Path, *, force: bool) -> bool:
    """Whether ``target`` is new (absent, or an empty directory). Raises ConfigError if it is
    not a directory, or holds anything and ``force`` is false."""
    if not target.exists():
        return True
    if not target.is_dir():
        raise ConfigError(
            f"{target} exists and is not a directory; a pull writes a step's files into a "
            "directory. Choose another one",
            path=str(target),
        )
    if not any(target.iterdir()):
        return True
    if force:
        return False
    raise ConfigError(
        f"{target} is not empty; a pull writes into a new or empty directory only, so that "
        "nothing there is overwritten or mixed with the step by surprise. Pull into a new "
        "directory, or pass force=True (CLI: --force) to overwrite the step's files there and "
        "keep the others, or delete=True (CLI: --delete) to make it an exact copy of the step "
        "(files the step lacks are removed)",
        path=str(target),
    )


def download_dir(
    entries: Sequence[FileEntry],
    target: Path,
    fetch: Callable[[FileEntry, Path], None],
    *,
    force: bool = False,
    delete: bool = False,
    selected: Callable[[str], bool] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Put ``entries`` under ``target`` by the rules of the module docstring.

    ``fetch(entry, dest)`` writes one verified file at ``dest`` (inside the temporary
    directory, whose folders exist). A non-empty ``target`` needs ``force`` (the entries
    overwrite files of the same name, others stay) or ``delete`` (files the entries lack are
    removed too, but only those ``selected`` takes, and folders that leaves empty). ``stop``
    is set on the first failure, so that fetches in flight can end early.
    """
    fresh = check_target(target, force=force or delete)
    real = target.resolve()  # a symlinked target: the pull lands where it leads
    paths = [e.path for e in entries]
    if not fresh:
        _check_room(real, target, paths, replace=delete)
    # a mount point is another filesystem than its parent: the temporary directory goes
    # inside it (renames stay on one filesystem), and the files are renamed in one by one
    mounted = os.path.ismount(real)
    real.parent.mkdir(parents=True, exist_ok=True)
    tmp = (real if mounted else real.parent) / temp_name(f"pull-{real.name}")
    tmp.mkdir()
    try:
        _fetch_all(entries, tmp, target, fetch, stop or threading.Event())
        for dirpath, _, _ in os.walk(tmp):  # each folder's entries, durable before it moves
            fsync_dir(Path(dirpath))
        if fresh and not mounted:
            _rename_dir(tmp, real, target)
        else:
            _merge(tmp, real, paths)
            if delete:
                _remove_strays(real, set(paths), selected or (lambda _: True), skip=tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fetch_all(
    entries: Sequence[FileEntry],
    tmp: Path,
    target: Path,
    fetch: Callable[[FileEntry, Path], None],
    stop: threading.Event,
) -> None:
    def one(entry: FileEntry) -> None:
        if stop.is_set():
            raise PullStopped
        dest = (tmp / entry.path).resolve()
        if not dest.is_relative_to(tmp) or dest == tmp:
            raise _outside(entry.path, target, dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fetch(entry, dest)

    pool = ThreadPoolExecutor(PULL_WORKERS, thread_name_prefix="ckpt-pull")
    try:
        for done in as_completed([submit(pool, one, e) for e in entries]):
            done.result()  # the first failure, before stop makes the others fail too
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_room(real: Path, target: Path, paths: Sequence[str], *, replace: bool) -> None:
    """Before any read: refuse paths that would land outside ``target`` through a symlink in
    it, and (unless ``replace``) paths that a folder or file already there stands in the way of."""
    blocked: list[str] = []
    for rel in paths:
        dest = real / rel
        if not (dest.parent.resolve() / dest.name).is_relative_to(real) and not replace:
            raise _outside(rel, target, dest)
        if replace:
            continue
        if dest.is_dir() and not dest.is_symlink():
            blocked.append(f"{target / rel} is a directory, the step has a file there")
        parent = Path(rel).parent
        while parent != Path("."):
            if os.path.lexists(real / parent) and not (real / parent).is_dir():
                blocked.append(f"{target / parent} is a file, the step has a directory there")
            parent = parent.parent
    if blocked:
        shown = sorted(set(blocked))
        more = f" (and {len(shown) - 3} more)" if len(shown) > 3 else ""
        raise ConfigError(
            f"cannot pull into {target}: " + "; ".join(shown[:3]) + more + ". Move them away, "
            "or pass delete=True (CLI: --delete) to replace them with the step's files",
            path=str(target),
        )


def _rename_dir(tmp: Path, real: Path, target: Path) -> None:
    try:
        os.replace(tmp, real)  # also over an empty directory, atomically
    except OSError as e:
        if real.is_dir() and any(real.iterdir()):
            raise ConfigError(
                f"{target} was filled by someone else while the step was pulled; nothing of "
                "the step was written to it. Pull again (with --force or --delete to write "
                "into it)",
                path=str(target),
            ) from e
        raise
    fsync_dir(real.parent)


def _merge(tmp: Path, real: Path, paths: Sequence[str]) -> None:
    """Rename each downloaded file over its place in ``real``, clearing what stands in the way
    (only there with ``delete``: :func:`_check_room` refused it otherwise)."""
    folders: set[Path] = set()
    for rel in paths:
        _clear_way(real, rel)
        dest = real / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, dest)
        folders.add(dest.parent)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)


def _clear_way(root: Path, rel: str) -> None:
    """Remove a file or symlink where ``rel`` needs a folder, a folder where it needs a file."""
    path = root
    for part in rel.split("/")[:-1]:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
    dest = root / rel
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)


def _remove_strays(
    root: Path, keep: set[str], selected: Callable[[str], bool], *, skip: Path
) -> None:
    """``--delete``: remove the files under ``root`` that are not in ``keep`` but ``selected``
    takes, then the folders that leaves empty; never anything under ``skip``."""
    emptied: set[Path] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == skip.parent and skip.name in dirnames:  # the pull's own temp directory
            dirnames.remove(skip.name)
        links = [d for d in dirnames if (here / d).is_symlink()]  # not followed: a leaf
        for name in [*filenames, *links]:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if rel not in keep and selected(rel):
                path.unlink()
                emptied.add(here)
    for folder in sorted(emptied, key=lambda p: len(p.parts), reverse=True):
        if not folder.is_dir():  # removed already, as the parent of an emptied folder
            continue
        while folder != root and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
        fsync_dir(folder)


def _outside(rel: str, target: Path, dest: Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"manifest entry {rel!r} would be written outside {target} (to {dest}); refusing",
        path=str(dest),
    )


# -- bounded reads ---------------------------------------------------------------------------


class PullStopped(Exception):
    """Raised in a pull's other reads once one of them failed (never reaches the caller)."""


class ChunkReader:
    """Ranged reads of a pull's files on one thread pool, at most ``slots`` chunks alive.

    ``chunks(path, size)`` yields an object's first ``size`` bytes in order, each chunk a
    ``read(path, start, end)`` of at most ``chunk_size`` bytes, reading ahead while slots are
    free; ``ranges(spans)`` does the same for any sequence of ``(path, start, end)``. A
    chunk's slot is given back, and its memoryview released, when the consumer asks for the
    next one, so a consumer that keeps the view does not keep the bytes: at most ``slots``
    chunks exist at any time. Close each ``chunks`` generator (``contextlib.closing``); once
    ``stop`` is set, every generator raises :class:`PullStopped` at its next chunk.
    """

    def __init__(
        self,
        read: Callable[[str, int, int], bytes],
        *,
        chunk_size: int | None = None,
        slots: int | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.chunk_size = chunk_size or CHUNK_SIZE
        count = slots or PULL_CONCURRENCY
        self._read = read
        self._slots = threading.Semaphore(count)
        self._stop = stop or threading.Event()
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="ckpt-pull-read")

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def chunks(self, path: str, size: int) -> Generator[memoryview, None, None]:
        step = self.chunk_size
        return self.ranges((path, start, min(start + step, size)) for start in range(0, size, step))

    def ranges(self, spans: Iterable[tuple[str, int, int]]) -> Generator[memoryview, None, None]:
        """Each ``(path, start, end)`` of ``spans`` read, yielded in order, under the same
        bound as :meth:`chunks` (which reads one object's consecutive chunks through it):
        ``spans`` is consumed lazily, as slots free up."""
        pending: deque[Future[bytes]] = deque()
        todo = iter(spans)
        upcoming = next(todo, None)
        try:
            while upcoming is not None or pending:
                if self._stop.is_set():
                    raise PullStopped
                # read ahead while slots are free; wait for one only with nothing in flight
                while upcoming is not None and self._take_slot(wait=not pending):
                    pending.append(submit(self._pool, self._read, *upcoming))
                    upcoming = next(todo, None)
                future = pending.popleft()
                try:
                    view = memoryview(future.result())
                except BaseException:
                    self._slots.release()
                    raise
                del future  # it holds the bytes too
                try:
                    yield view
                finally:
                    view.release()
                    self._slots.release()
        finally:
            for future in pending:
                future.cancel()
                future.add_done_callback(self._give_back)  # at once if cancelled or done

    def _take_slot(self, *, wait: bool) -> bool:
        if not wait:
            return self._slots.acquire(blocking=False)
        while not self._slots.acquire(timeout=_SLOT_WAIT):
            if self._stop.is_set():
                raise PullStopped
        return True

    def _give_back(self, _: Future[bytes]) -> None:
        self._slots.release()
