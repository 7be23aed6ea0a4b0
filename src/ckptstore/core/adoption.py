"""Bringing checkpoints that ckptstore did not write under its protection.

Two ways in. *Adoption* commits, in place, step directories that are already in a store but
have no manifest: a verl run uploaded with ``aws s3 sync``, files copied by another tool. Each
file is read once to checksum it (CRC32C, and a SHA-256 in a signed store), then a manifest is
committed through the normal create-only commit (lease, ``latest`` forward only, signing). The
manifest lists the files where they lie, directly under ``global_step_N/`` with no attempt (as
schema-1 manifests do), so no byte is copied, and every reader resolves them like any other
step's: ``verify``, ``pull``, ``cp`` and ``rm``/``prune`` act on them, and ``gc`` no longer
reports them as foreign. Files inside ``.attempt-*`` directories (a ckptstore save's) and files
named like ckptstore's own markers are never adopted. The manifest records the adopting
process's versions, with the world size that verl's file names say.

Adoption must run on a quiescent directory: the checksums describe the bytes read now, so a
file changed afterwards fails ``verify``, and a file added afterwards stays foreign. A step
that is committed, or whose removal is in progress (a tombstone naming no attempt: its files
may be half-deleted), is refused; adoption never deletes or moves a file it did not write, not
even when it fails. Steps older than ``latest`` are adopted too (adoption is migration); the
pointer only moves forward.

The other way in, a local verl run directory (``trainer.default_local_dir``) pushed whole, is
planned here (:func:`local_steps`, :func:`difference`) and done by ``push_dir`` step by step.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.core.saving import Saver
from ckptstore.data.payload import Progress
from ckptstore.data.transfer import ChunkReader, scan_dir
from ckptstore.domain import layout
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry, tombstone_attempts
from ckptstore.errors import (
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)

log = logging.getLogger(__name__)

CHECKSUM_WORKERS = 8
"""Files checksummed at once; their ranged reads share the pull's memory bound (transfer.py)."""
_RESERVED = frozenset({layout.MANIFEST_NAME, layout.ATTEMPT_MARKER})
_RANK_FILE = re.compile(r"_world_size_(\d+)_rank_\d+\.pt$")
"""verl's per-rank file names (``model_world_size_8_rank_0.pt``), which say its world size."""


@dataclass(frozen=True)
class ForeignStep:
    """A step directory of files ckptstore did not write, that :meth:`Adopter.adopt` would
    commit: ``files`` are the objects (paths from the store's root) it would list."""

    step: int
    uri: str
    files: tuple[ObjectInfo, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def adoptable_path(step: int, path: str) -> bool:
    """Whether an object of step ``step``'s directory may be adopted: not in an attempt
    directory, not named like the manifest or an attempt marker (at any depth)."""
    rel = path[len(layout.step_dir(step)) + 1 :]
    return not rel.startswith(layout.ATTEMPT_PREFIX) and rel.rsplit("/", 1)[-1] not in _RESERVED


class Adopter:
    """Commits foreign step directories of one store in place (the module docstring)."""

    def __init__(self, saver: Saver) -> None:
        self.saver = saver
        self.catalog = saver.catalog
        self.backend: Backend = saver.catalog.backend

    def find(self, step: int | None) -> list[ForeignStep]:
        """The step directories to adopt: ``step``'s (raising if it cannot be adopted), or,
        with ``None``, every uncommitted one holding foreign files, oldest first."""
        if step is not None:
            return [self.plan(layout.check_step(step))]
        found = []
        for candidate in self._candidates():
            try:
                found.append(self.plan(candidate))
            except (ConflictError, NotFoundError) as e:  # changed since the listing
                log.warning("%s; skipped", e)
        return found

    def adopt(
        self,
        step: int | None,
        metadata: Mapping[str, Any],
        progress: Progress | None = None,
    ) -> list[CheckpointInfo]:
        """Commit ``find(step)`` in place, oldest first; returns the steps committed."""
        self.saver.hold_lease()  # fail before reading a byte if another writer holds it
        return [self.commit(found, metadata, progress) for found in self.find(step)]

    def plan(self, step: int) -> ForeignStep:
        """What adopting ``step`` would commit; ConflictError or NotFoundError if nothing."""
        where = self.catalog.uri(layout.step_dir(step))
        self._check_uncommitted(step, where)
        prefix = layout.step_dir(step) + "/"
        objects = list(self.backend.list(prefix))
        files = tuple(o for o in objects if adoptable_path(step, o.path))
        if not files:
            raise NotFoundError(_nothing_there(step, where, objects), uri=where, step=step)
        for obj in files:
            rel = obj.path[len(prefix) :]
            try:
                layout.check_relpath(rel, where=where)
            except CorruptCheckpointError as e:
                raise ConfigError(
                    f"step {step} cannot be adopted: {e}. Rename or remove the file, then "
                    "adopt again; nothing was adopted",
                    uri=where,
                    step=step,
                    path=obj.path,
                ) from e
        return ForeignStep(step, where, files)

    def commit(
        self, found: ForeignStep, metadata: Mapping[str, Any], progress: Progress | None
    ) -> CheckpointInfo:
        """Checksum ``found``'s files where they lie, then commit a manifest listing them."""
        coordinator = self.saver.begin(
            found.step, KIND_DIRECTORY, metadata=metadata, allow_older=True
        )  # adopting older steps too: latest only moves forward
        entries = self._checksum(found, progress)
        # the files are committed where they lie: no attempt of ours to discard on failure
        info = coordinator.commit(entries, world_size=_world_size(entries))
        log.info("adopted %s in place: %d files, %d bytes", found.uri, len(entries), info.size)
        return info

    def _candidates(self) -> list[int]:
        """Uncommitted steps with adoptable files, from one listing of the whole store."""
        foreign: set[int] = set()
        marked: set[int] = set()
        for obj in self.backend.list(""):
            head, _, rest = obj.path.partition("/")
            step = layout.parse_step_dir(head)
            if step is None or not rest:
                continue
            if obj.path == layout.manifest_path(step):
                marked.add(step)  # committed, or a tombstone: never foreign
            elif adoptable_path(step, obj.path):
                foreign.add(step)
        return sorted(foreign - marked)

    def _check_uncommitted(self, step: int, where: str) -> None:
        path = layout.manifest_path(step)
        try:
            data = self.backend.read(path)
        except NotFoundError:
            return
        removing = tombstone_attempts(data)
        if removing is None:
            raise ConflictError(
                f"step {step} is already committed in {self.backend.uri} ({path} exists); "
                "adopt takes only step directories ckptstore did not write. Nothing was "
                "adopted; `ckptstore verify` checks the step",
                uri=where,
                step=step,
                path=path,
            )
        if not removing:  # an uncommit's tombstone: its files may be half-deleted
            raise ConflictError(
                f"step {step} in {self.backend.uri} is being removed (a tombstone stands at "
                f"{path}; an interrupted rm or prune?), so its files may be incomplete and are "
                "not adopted. Let the removal finish, or delete the leftover files",
                uri=where,
                step=step,
                path=path,
            )

    def _checksum(self, found: ForeignStep, progress: Progress | None) -> list[FileEntry]:
        """Read each file once, in ranged chunks, into its manifest entry."""
        prefix = layout.step_dir(found.step) + "/"
        digests = self.saver.committer.digests
        stop = threading.Event()

        def one(obj: ObjectInfo) -> FileEntry:
            crc, sha = Crc32c(), hashlib.sha256() if digests else None
            read = 0
            with closing(reader.chunks(obj.path, obj.size)) as chunks:
                for chunk in chunks:
                    crc.update(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    read += chunk.nbytes
                    if progress:
                        progress(chunk.nbytes)
            if read != obj.size:
                raise _changed(found, obj, read)
            digest = sha.hexdigest() if sha is not None else None
            return FileEntry(obj.path[len(prefix) :], obj.size, crc.hexdigest(), sha256=digest)

        workers = max(1, min(CHECKSUM_WORKERS, len(found.files)))
        with (
            ChunkReader(self.backend.read, stop=stop) as reader,
            ThreadPoolExecutor(workers, thread_name_prefix="ckpt-adopt") as pool,
        ):
            futures = [pool.submit(one, obj) for obj in found.files]
            try:
                for done in as_completed(futures):
                    done.result()  # the first failure, before stop makes the others fail too
            except BaseException:
                stop.set()
                raise
            return [f.result() for f in futures]


def _world_size(entries: Iterable[FileEntry]) -> int:
    """The world size verl's file names record (the manifest's, for a step no process group
    of this one wrote); 1 when none says."""
    sizes = [int(m.group(1)) for e in entries if (m := _RANK_FILE.search(e.path))]
    return max(sizes, default=1)


def _nothing_there(step: int, where: str, objects: Iterable[ObjectInfo]) -> str:
    found = list(objects)
    if not found:
        return f"{where} does not exist or holds no files; there is nothing to adopt as step {step}"
    if any(layout.parse_attempt_path(step, o.path) for o in found):
        return (
            f"{where} holds only ckptstore save attempts (.attempt-*: an uncommitted save, "
            f"not foreign files); there is nothing to adopt as step {step}. `ckptstore gc` "
            "removes dead attempts"
        )
    return f"{where} holds only ckptstore's own marker files; there is nothing to adopt"


def _changed(found: ForeignStep, obj: ObjectInfo, read: int) -> IncompleteCheckpointError:
    rel = obj.path[len(layout.step_dir(found.step)) + 1 :]
    return IncompleteCheckpointError(
        f"{found.uri}/{rel} changed while it was adopted (listed with {obj.size} bytes, "
        f"{read} read); adopt needs a quiescent directory. Nothing was committed: wait for "
        "the writer to finish, then adopt again",
        uri=found.uri,
        step=found.step,
        path=obj.path,
    )


# -- pushing a local run directory -----------------------------------------------------------


@dataclass(frozen=True)
class LocalStep:
    """One local step directory a push takes, and the step it is committed as."""

    step: int
    path: Path


@dataclass(frozen=True)
class LocalPush:
    """What ``ckptstore push LOCAL_DIR`` takes: one step directory, or (``run``) each
    ``global_step_N`` of a run directory, oldest first."""

    steps: tuple[LocalStep, ...]
    run: bool


def local_steps(local_dir: Path, step: int | None) -> LocalPush:
    """Which directories a push of ``local_dir`` commits, as which steps.

    ``local_dir`` is one step's directory (its step is ``step``, else read from its name
    ``global_step_N``) or a run directory holding ``global_step_N`` subdirectories (verl's
    ``default_local_dir``: all of them, or only ``step``'s). Other entries of a run directory,
    verl's ``latest_checkpointed_iteration.txt`` among them, are not steps and are left out.
    """
    own = layout.parse_step_dir(local_dir.resolve().name)
    subdirs = sorted(
        (number, child)
        for child in (local_dir.iterdir() if local_dir.is_dir() else ())
        if child.is_dir() and (number := layout.parse_step_dir(child.name)) is not None
    )
    if own is None and subdirs:
        chosen = [(n, p) for n, p in subdirs if step is None or n == step]
        if step is not None and not chosen:
            names = ", ".join(p.name for _, p in subdirs[:5]) + (
                ", ..." if len(subdirs) > 5 else ""
            )
            raise ConfigError(
                f"{local_dir} is a run directory (it holds {names}) without "
                f"{layout.step_dir(step)}; give a step it holds, or push the directory of "
                "the step itself",
                path=str(local_dir),
            )
        found = LocalPush(tuple(LocalStep(n, p) for n, p in chosen), run=step is None)
    else:
        number = step if step is not None else own
        if number is None:
            raise ConfigError(
                f"cannot tell which step {local_dir} holds: give the STEP (ckptstore push "
                f"{local_dir} URI 100), or push a global_step_N directory, or a run directory "
                "holding them",
                path=str(local_dir),
            )
        found = LocalPush((LocalStep(number, local_dir),), run=False)
    for local in found.steps:
        _check_not_a_store(local.path)
    return found


def _check_not_a_store(path: Path) -> None:
    """A step directory of a local ckptstore store is copied with ``cp``, which keeps its
    manifest; pushing its attempts as files would commit ckptstore's internals."""
    marker = path / layout.MANIFEST_NAME
    attempts = [c for c in path.iterdir() if c.name.startswith(layout.ATTEMPT_PREFIX)]
    if marker.exists() or attempts:
        shown = marker if marker.exists() else attempts[0]
        raise ConfigError(
            f"{path} is a step of a ckptstore store (it holds {shown.name}), not a checkpoint "
            f"directory; copy stores with `ckptstore cp {path.parent} URI`",
            path=str(shown),
        )


def difference(local: Path, info: CheckpointInfo) -> str | None:
    """How the files under ``local`` differ from those committed as ``info``; ``None`` if
    they are the same paths with the same sizes and CRC32C (and SHA-256, where recorded)."""
    files = dict(scan_dir(local))
    entries = {f.path: f for f in info.files}
    extra = sorted(set(files) - set(entries))
    if extra:
        return f"{extra[0]!r} is here but not in the step"
    missing = sorted(set(entries) - set(files))
    if missing:
        return f"{missing[0]!r} is in the step but not here"
    for rel, path in sorted(files.items()):
        entry, size = entries[rel], path.stat().st_size
        if size != entry.size:
            return f"{rel!r} has {size} bytes here, {entry.size} in the step"
    for rel, path in sorted(files.items()):
        if not _same_bytes(path, entries[rel]):
            return f"{rel!r} has other bytes here than in the step"
    return None


def _same_bytes(path: Path, entry: FileEntry) -> bool:
    crc, sha = Crc32c(), hashlib.sha256() if entry.sha256 is not None else None
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc.update(chunk)
            if sha is not None:
                sha.update(chunk)
    if sha is not None and sha.hexdigest() != entry.sha256:
        return False
    return crc.hexdigest() == entry.crc32c
