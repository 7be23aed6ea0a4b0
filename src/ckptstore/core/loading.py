"""Reading a step back: a state decoded from its verified files, or the files themselves.

A whole state reads every file of the step. A partial load (``keys``) reads the skeleton and
only the shards the selected parts need: with the manifest's ``files_by_key`` index, the shards
of each selected top-level key are fetched alongside the skeleton; otherwise (older manifests,
nested keys) the skeleton names them first. Either way every file read is verified.

Torch is imported only here and in serialize.py, on first use, so the CLI's listing commands
start without it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

from ckptstore.backends.base import Backend, join
from ckptstore.backends.fsutil import move_into_place, unlink_quietly, write_temp
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import ChunkReader, download_dir, path_filter, patterns
from ckptstore.data.verified import StreamCheck, missing_file, size_mismatch
from ckptstore.deadline import map_in_context, submit
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_STATE, FileEntry
from ckptstore.domain.state_selection import check_keys
from ckptstore.errors import ConfigError, CorruptCheckpointError, NotFoundError
from ckptstore.protocol.catalog import Catalog

READ_THREADS = 8


def load_state(
    catalog: Catalog,
    info: CheckpointInfo,
    *,
    allow_pickle: bool,
    keys: Sequence[str] | None = None,
) -> Any:
    """The state a committed step holds, every byte checked against its manifest; with
    ``keys`` (dotted paths, see state_selection.check_keys), only those parts, reading only
    their files."""
    if info.manifest.kind != KIND_STATE:
        raise ConfigError(
            f"{info.uri} was pushed as a directory of files, not saved as a state; fetch "
            "it with pull_dir() (CLI: ckptstore pull)",
            uri=info.uri,
            step=info.step,
        )
    from ckptstore.data.serialize import SKELETON_FILE, decode_state

    selected = check_keys(keys) if keys is not None else None  # before any read

    paths = {f.path for f in info.files}
    if SKELETON_FILE not in paths and any(p.endswith("/" + SKELETON_FILE) for p in paths):
        raise ConfigError(
            f"{info.uri} holds one state per rank (saved by save_distributed); load it on "
            "every rank with ckptstore.integrations.distributed.load_distributed",
            uri=info.uri,
            step=info.step,
        )
    if selected is None:
        data = read_all(catalog, info)
        return decode_state(data.__getitem__, where=info.uri, allow_pickle=allow_pickle)
    index = info.manifest.files_by_key or {}
    with _Reader(catalog, info) as reader:
        # shards of selected top-level keys, by the index, go out with the skeleton; for the
        # rest (nested keys, no index) decode_state asks once the skeleton names them
        reader.start([SKELETON_FILE, *(f for key in selected for f in index.get(key, ()))])
        try:
            return decode_state(
                reader.read,
                where=info.uri,
                allow_pickle=allow_pickle,
                keys=selected,
                prefetch=reader.start,
            )
        except NotFoundError as e:  # a key the state lacks: about the step as a whole
            e.add_context(step=info.step, path=layout.step_dir(info.step))
            raise


class _Reader:
    """Verified reads of one step's files on a thread pool, each file read at most once."""

    def __init__(self, catalog: Catalog, info: CheckpointInfo) -> None:
        self.catalog, self.info = catalog, info
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read")
        self._reads: dict[str, Future[memoryview]] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # reads nobody waits for, on errors

    def start(self, paths: Iterable[str]) -> None:
        """Begin reading ``paths`` in the background (those not begun already)."""
        for path in paths:
            if path not in self._reads:
                self._reads[path] = submit(self._pool, self._read, path)  # the load's deadline

    def read(self, path: str) -> memoryview:
        """The verified bytes of ``path``, read now unless already begun."""
        self.start([path])
        return self._reads[path].result()

    def _read(self, path: str) -> memoryview:
        try:
            entry = self.info.manifest.file(path)
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.info.uri}: the state needs {path!r}, which its manifest does not list; "
                "the step is corrupt. Load an earlier step",
                uri=self.info.uri,
                step=self.info.step,
                path=layout.step_dir(self.info.step),
            ) from None
        # no listing first: a large file is stat'ed before its buffer is allocated instead
        return self.catalog.read_verified(self.info.step, entry)


def read_all(catalog: Catalog, info: CheckpointInfo) -> dict[str, memoryview]:
    """Every payload file of the step by path, verified; one listing checks every size."""
    sizes = catalog.payload_sizes(info.step)

    def read(entry: FileEntry) -> memoryview:
        return catalog.read_verified(
            info.step, entry, actual_size=sizes.get(entry.key(info.step), -1)
        )

    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read") as pool:
        data = map_in_context(pool, read, info.files)
    return dict(zip((f.path for f in info.files), data, strict=True))


def download_step(
    tiers: Sequence[Catalog],
    info: CheckpointInfo,
    target: Path,
    progress: Progress | None,
    *,
    force: bool = False,
    delete: bool = False,
    include: str | Sequence[str] = (),
    exclude: str | Sequence[str] = (),
) -> None:
    """Write a committed step's files (those the filters take) under ``target`` with their
    names, by :func:`~ckptstore.data.transfer.download_dir`'s rules (see
    ``CheckpointStore.pull_dir``).

    Each file streams in ranged chunks (:class:`~ckptstore.data.transfer.ChunkReader`: peak memory
    about ``CHUNK_SIZE * PULL_CONCURRENCY``) into a temp file while its size, CRC32C and
    SHA-256 (where the manifest has one) are computed, and is renamed to its name only after
    they matched the manifest: the checks and errors of
    :func:`~ckptstore.data.verified.check_file`.
    One listing per tier first finds each file in the fastest of ``tiers`` that holds it with
    its size (a node's local tier, then the durable one: only what the node lacks is fetched).
    """
    takes = path_filter(include, exclude)
    entries = _selected(info, takes, include, exclude)
    where_from = _locate(tiers, info.step, entries)  # before any download
    stop = threading.Event()

    backends = {id(b): b for b in where_from.values()}
    with contextlib.ExitStack() as stack:  # one reader (and memory bound) per tier read from
        readers = {
            i: stack.enter_context(ChunkReader(b.read, stop=stop)) for i, b in backends.items()
        }

        def fetch(entry: FileEntry, dest: Path) -> None:
            backend = where_from[entry.key(info.step)]
            _fetch_file(readers[id(backend)], backend, info.step, entry, dest, progress)

        download_dir(entries, target, fetch, force=force, delete=delete, selected=takes, stop=stop)


def _selected(
    info: CheckpointInfo,
    takes: Callable[[str], bool],
    include: str | Sequence[str],
    exclude: str | Sequence[str],
) -> list[FileEntry]:
    """The files of ``info`` the filters take; ConfigError, naming the filters, for none."""
    entries = [f for f in info.files if takes(f.path)]
    if not entries:
        raise ConfigError(
            f"the filters (include {list(patterns(include))}, exclude {list(patterns(exclude))}) "
            f"take none of the {len(info.files)} files of step {info.step} of {info.uri}; "
            "nothing to pull. Patterns match each file's path in the step (ckptstore show "
            "lists them)",
            uri=info.uri,
            step=info.step,
        )
    return entries


def _fetch_file(
    reader: ChunkReader,
    backend: Backend,
    step: int,
    entry: FileEntry,
    dest: Path,
    progress: Progress | None,
) -> None:
    """Stream one file into a temp file beside ``dest``, checked as it comes, and rename it
    to ``dest`` only once it matched its manifest entry."""
    path = entry.key(step)
    where = join(backend.uri, path)
    check = StreamCheck(entry, where=where, step=step)
    try:
        with closing(reader.chunks(path, entry.size)) as chunks:
            tmp, _ = write_temp(dest, _passing(chunks, check, progress))
    except NotFoundError as e:  # deleted since the listing
        raise missing_file(where, path, step) from e
    try:
        check.finish()
    except BaseException:
        unlink_quietly(tmp)
        raise
    move_into_place(tmp, dest)


def _locate(
    tiers: Sequence[Catalog], step: int, entries: Iterable[FileEntry]
) -> dict[str, Backend]:
    """The backend to read each file of ``entries`` from (by its key): the fastest tier
    that holds it with its manifest size (one listing per tier, until every file is found).
    A file no tier holds whole is an error about the last tier, the durable one."""
    left = {e.key(step): e for e in entries}
    found: dict[str, Backend] = {}
    *faster, durable = tiers
    for catalog in faster:
        sizes = catalog.payload_sizes(step)
        for key in [k for k, e in left.items() if sizes.get(k) == e.size]:
            found[key] = catalog.backend
            del left[key]
        if not left:
            return found
    sizes = durable.payload_sizes(step)
    for key, entry in left.items():
        actual = sizes.get(key)
        if actual is None:
            raise missing_file(join(durable.backend.uri, key), key, step)
        if actual != entry.size:
            raise size_mismatch(join(durable.backend.uri, key), actual, entry.size, step, key)
        found[key] = durable.backend
    return found


def _passing(
    chunks: Iterable[memoryview], check: StreamCheck, progress: Progress | None
) -> Iterator[memoryview]:
    """``chunks`` unchanged, each added to ``check``'s digests on its way, then reported to
    ``progress`` once written."""
    for chunk in chunks:
        check.update(chunk)
        size = chunk.nbytes
        yield chunk
        if progress:
            progress(size)
