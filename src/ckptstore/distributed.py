"""Multi-rank save and load over a torch.distributed process group.

Every rank encodes its own state and uploads it, in parallel with the others, under
``rank_<r>/`` in the step directory (``store.stage_files``). Only rank 0 commits, and only after
every rank reported success, so the step's single manifest lists every rank's files with their
checksums and is the commit marker for all of them: a reader never sees a step that some rank
did not finish. If any rank fails, rank 0 discards what the others staged (uploads are whole
objects or aborted, so nothing half-written remains) and every rank raises the same error.

Every rank reaches every collective whatever happened locally: failures travel as text (or as
ckptstore errors, which pickle) instead of skipping a collective, which would hang the job. A
rank that dies outright still hangs the others until the process group's timeout. Object
collectives over NCCL run on the current CUDA device: set it (``torch.cuda.set_device``) first.

Rank 0 also reads ``latest`` and the previous step's manifest, once, and scatters to each rank
only the entries under its own folder (the files it may copy instead of uploading): a rank reads
neither, so its cost does not grow with the number of ranks (README "Scale").

Only rank 0 takes the writer lease (lease.py). Open the store with ``lease=False`` on the other
ranks to say so; a default store is safe too, since staging never takes the lease.

Each rank reads back exactly the files it wrote, so a load needs the world size of the save.
To load with another world size, save through ``torch.distributed.checkpoint`` with
``ckptstore.integrations.dcp.CkptStoreWriter``: DCP reshards on load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from ckptstore import layout
from ckptstore.backends.base import error_context
from ckptstore.commit import Previous
from ckptstore.compat import check_compat
from ckptstore.environment import current_environment
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    ErrorContext,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.info import CheckpointInfo
from ckptstore.manifest import KIND_STATE, FileEntry
from ckptstore.payload import SourceFile
from ckptstore.serialize import SKELETON_FILE, decode_state, encode_state

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)
T = TypeVar("T")
_NOT_SAVED = "was not saved (nothing committed, staged files discarded)"
_COMMITTED = "is committed, but rank 0 failed after committing it"


def rank_dir(rank: int) -> str:
    """The folder of one rank's files inside a step saved by ``save_distributed``."""
    return f"rank_{rank:05d}"


class Collectives:
    """The few object collectives the save and load protocols need, over one process group.

    Without an initialized process group it stands for a world of one, so the same code runs
    (and is tested) in a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active and group is not None:
            raise ConfigError("a process group was given, but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.size = dist.get_world_size(group) if self.active else 1
        self.root = dist.get_global_rank(group, 0) if self.active and group is not None else 0
        """The global rank of the group's rank 0 (collectives address global ranks)."""

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj``, on every rank."""
        if not self.active or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def scatter(self, objs: list[T] | None) -> T:
        """Rank r's item of rank 0's ``objs`` (one per rank; ``None`` on other ranks)."""
        if not self.active or self.size == 1:
            assert objs is not None and len(objs) == self.size
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs, src=self.root, group=self.group)
        return out[0]  # type: ignore[no-any-return]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj``, in rank order, on rank 0; ``None`` elsewhere."""
        if not self.active or self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.root, group=self.group)
        return out

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active or self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def describe(error: BaseException) -> str:
    """An error as one line of text, to send to the other ranks."""
    return f"{type(error).__name__}: {error}"


# -- saving ---------------------------------------------------------------------------------


def save_distributed(
    store: CheckpointStore,
    step: int,
    state: Any,
    metadata: Mapping[str, Any] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    allow_pickle: bool = False,
) -> CheckpointInfo:
    """Save each rank's ``state`` as one step; call it on every rank of ``group``.

    Returns the same committed step's info on every rank, or raises
    :class:`DistributedCheckpointError` on every rank, naming the ranks that failed and what
    became of the step: normally nothing is committed and the staged files are discarded; only
    a failure after the commit (moving ``latest``) leaves it committed. ``metadata`` is rank 0's.
    """
    step = layout.check_step(step)
    comm = Collectives(group)
    started = time.perf_counter()
    # 1. Rank 0 takes the writer lease, checks the step is new before anyone uploads, and
    # hands each rank its files of the previous step.
    plans: list[Previous | CheckpointError] | None = None
    if comm.rank == 0:
        plans = _plans(store, step, comm.size)
    plan = comm.scatter(plans)
    if isinstance(plan, CheckpointError):
        raise DistributedCheckpointError(
            f"step {step} was not saved: rank 0: {describe(plan)}",
            {0: describe(plan)},
            **_step_context(store.uri, step),
        ) from plan
    # 2. Every rank stages its own files; the entries (or the error) go to rank 0.
    local_error: Exception | None = None
    report: list[FileEntry] | str
    try:
        report = _stage(store, step, state, comm.rank, allow_pickle, plan)
    except Exception as e:
        log.exception("rank %d could not stage step %d", comm.rank, step)
        local_error, report = e, describe(e)
    reports = comm.gather(report)
    # 3. Rank 0 commits, or discards; everyone learns which.
    outcome: CheckpointInfo | _Failed | None = None
    if reports is not None:
        outcome = _conclude(store, step, reports, comm.size, metadata, started)
    outcome = comm.broadcast(outcome)
    if isinstance(outcome, CheckpointInfo):
        return outcome
    failed = outcome if outcome is not None else _Failed({}, "failed")  # rank 0 always sends
    listed = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.failures.items()))
    error = DistributedCheckpointError(
        f"step {step} {failed.state}: {listed}", failed.failures, **_step_context(store.uri, step)
    )
    raise error from local_error


def _step_context(store_uri: str, step: int) -> ErrorContext:
    """``uri``, ``step``, ``path`` of an error about a whole step: its directory's."""
    return {**error_context(store_uri, layout.step_dir(step)), "step": step}


def _info_context(info: CheckpointInfo) -> ErrorContext:
    """:func:`_step_context` of a committed step (``info.uri`` is its directory's URI)."""
    return {"uri": info.uri, "step": info.step, "path": layout.step_dir(info.step)}


@dataclass(frozen=True)
class _Failed:
    """Rank 0's word on a failed save: who failed, and what became of the step."""

    failures: dict[int, str]
    state: str
    """How the message describes the step: not saved, or committed after all."""


def _attempt(action: Callable[[], None]) -> CheckpointError | None:
    try:
        action()
    except CheckpointError as e:
        return e
    except Exception as e:
        return CheckpointError(describe(e))
    return None


def _plans(store: CheckpointStore, step: int, size: int) -> list[Previous | CheckpointError]:
    """Rank 0: each rank's :class:`Previous` (the refusal, for every rank, on failure)."""
    previous: list[Previous] = []

    def prepare() -> None:
        _prepare(store, step)
        previous.extend(split_by_rank(store.previous(KIND_STATE), size))

    refusal = _attempt(prepare)
    return [refusal] * size if refusal is not None else list(previous)


def split_by_rank(previous: Previous, size: int) -> list[Previous]:
    """``previous`` cut into each rank's files (under its :func:`rank_dir`), in one pass."""
    folders = {rank_dir(r): r for r in range(size)}
    files: list[list[FileEntry]] = [[] for _ in range(size)]
    for entry in previous.files:
        rank = folders.get(entry.path.split("/", 1)[0])
        if rank is not None:
            files[rank].append(entry)
    return [Previous(previous.step, tuple(f)) for f in files]


def _prepare(store: CheckpointStore, step: int) -> None:
    store.wait()
    store.hold_lease()
    if store.backend.stat(layout.manifest_path(step)) is not None:
        raise ConflictError(
            f"step {step} is already committed in {store.uri}; committed steps are immutable. "
            "Save under a new step, or `ckptstore rm` it first",
            **error_context(store.uri, layout.manifest_path(step)),
        ).add_context(step=step)


def _stage(
    store: CheckpointStore,
    step: int,
    state: Any,
    rank: int,
    allow_pickle: bool,
    previous: Previous,
) -> list[FileEntry]:
    encoded = encode_state(state, shard_size=store.shard_size, allow_pickle=allow_pickle)
    folder = rank_dir(rank)
    files = [SourceFile(f"{folder}/{f.path}", f.chunks, f.size) for f in encoded.files()]
    return store.stage_files(step, files, kind=KIND_STATE, previous=previous)


def _conclude(
    store: CheckpointStore,
    step: int,
    reports: list[list[FileEntry] | str],
    world_size: int,
    metadata: Mapping[str, Any] | None,
    started: float,
) -> CheckpointInfo | _Failed:
    """Rank 0: commit if every rank staged its files, else discard the step."""
    failures = {rank: r for rank, r in enumerate(reports) if isinstance(r, str)}
    if failures:
        store.discard(step)
        return _Failed(failures, _NOT_SAVED)
    entries = [entry for r in reports if not isinstance(r, str) for entry in r]
    try:
        return store.commit_files(
            step,
            entries,
            kind=KIND_STATE,
            metadata=metadata,
            world_size=world_size,
            started=started,
        )
    except Exception as e:  # before the manifest, commit_files has discarded the step
        log.exception("rank 0 could not commit step %d", step)
        try:
            committed = store.backend.stat(layout.manifest_path(step)) is not None
            state = _COMMITTED if committed else _NOT_SAVED
        except CheckpointError:
            state = "failed on rank 0 and may be committed (see `ckptstore ls`)"
        return _Failed({0: describe(e)}, state)


# -- loading --------------------------------------------------------------------------------


def load_distributed(
    store: CheckpointStore,
    step: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    fallback: bool = True,
    allow_pickle: bool = False,
) -> Any:
    """This rank's state of ``step`` (default: latest), every byte verified; call it on every
    rank of ``group``. The step must have been saved by as many ranks as ``group`` has.

    Rank 0 picks the step and every rank loads it. With no ``step`` and ``fallback``, a step
    that fails verification on any rank is skipped, on every rank, for the newest older one
    (as ``store.load`` does). ``store.last_loaded`` tells which step was loaded.
    """
    comm = Collectives(group)
    offers = _Offers(store, step, fallback, comm.size) if comm.rank == 0 else None
    failures: list[str] = []
    while True:
        offer: CheckpointInfo | CheckpointError | None = None
        if offers is not None:
            offer = offers.next()
        offer = comm.broadcast(offer)
        if offer is None:
            raise CorruptCheckpointError(
                f"{store.uri}: no committed step passed verification on every rank:\n  "
                + "\n  ".join(failures),
                uri=store.uri,
            )
        if isinstance(offer, CheckpointError):
            raise offer
        check_layout(offer, comm.size)
        state: Any = None
        local_error: Exception | None = None
        status: tuple[str, str] | None = None
        try:
            state = _read_rank(store, offer, comm.rank, allow_pickle)
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            local_error, status = e, ("corrupt", describe(e))
        except Exception as e:
            local_error, status = e, ("error", describe(e))
        statuses = comm.all_gather(status)
        bad = {r: s for r, s in enumerate(statuses) if s is not None}
        if not bad:
            store.last_loaded = offer
            return state
        listed = "; ".join(f"rank {r}: {text}" for r, (_, text) in sorted(bad.items()))
        if any(kind == "error" for kind, _ in bad.values()):
            raise DistributedCheckpointError(
                f"step {offer.step} could not be loaded: {listed}",
                {r: text for r, (_, text) in bad.items()},
                **_info_context(offer),
            ) from local_error
        if step is not None or not fallback:
            raise CorruptCheckpointError(
                f"{offer.uri}: {listed}", **_info_context(offer)
            ) from local_error
        if comm.rank == 0:
            log.warning(
                "step %d failed verification (%s); trying an older step", offer.step, listed
            )
        failures.append(f"step {offer.step}: {listed}")


class _Offers:
    """Rank 0's candidates: ``step``, or latest then (with ``fallback``) older steps."""

    def __init__(
        self, store: CheckpointStore, step: int | None, fallback: bool, world_size: int
    ) -> None:
        self.store = store
        self.world_size = world_size
        self._candidates = self._generate(step, fallback)

    def _generate(self, step: int | None, fallback: bool) -> Iterator[CheckpointInfo]:
        if step is not None:
            yield self.store.info(step)
            return
        latest = self.store.latest()
        if latest is None:
            raise NotFoundError(
                f"{self.store.uri} holds no committed step: nothing to resume from. Check the "
                "URI (and endpoint), or save a step first",
                uri=self.store.uri,
            )
        yield latest
        if fallback:
            yield from (i for i in reversed(self.store.list()) if i.step < latest.step)

    def next(self) -> CheckpointInfo | CheckpointError | None:
        """The next step to try, the error that ends the search, or None when none is left."""
        try:
            info = next(self._candidates, None)
            if info is not None:
                environment = current_environment(world_size=self.world_size)
                check_compat(
                    info.manifest.environment, environment, mode=self.store.compat, where=info.uri
                )
            return info
        except CheckpointError as e:
            return e
        except Exception as e:
            return CheckpointError(describe(e))


def check_layout(info: CheckpointInfo, world_size: int) -> None:
    """Raise ConfigError unless ``info`` is a step of ``save_distributed`` by ``world_size``."""
    paths = {f.path for f in info.files}
    if info.manifest.kind != KIND_STATE or f"{rank_dir(0)}/{SKELETON_FILE}" not in paths:
        how = "store.load()" if SKELETON_FILE in paths else "store.pull_dir() or the DCP reader"
        raise ConfigError(
            f"{info.uri} was not saved by save_distributed (it has no {rank_dir(0)}/); "
            f"load it with {how}",
            **_info_context(info),
        )
    saved = info.manifest.environment.world_size
    if saved != world_size:
        raise ConfigError(
            f"{info.uri} was saved by {saved} ranks, but this job has {world_size}: each rank "
            "loads the files it saved, so the world size must match. To change it, save with "
            "torch.distributed.checkpoint through ckptstore.integrations.dcp.CkptStoreWriter, "
            "which reshards on load",
            **_info_context(info),
        )


def _read_rank(store: CheckpointStore, info: CheckpointInfo, rank: int, allow_pickle: bool) -> Any:
    """Read and verify this rank's files (several at once), then decode them."""
    prefix = rank_dir(rank) + "/"
    mine = [f.path for f in info.files if f.path.startswith(prefix)]

    def read(path: str) -> memoryview:
        return store.read_file(info, path)

    with ThreadPoolExecutor(8, thread_name_prefix="ckpt-read") as pool:
        data = dict(zip(mine, pool.map(read, mine), strict=True))

    def get(path: str) -> memoryview:
        try:
            return data[prefix + path]
        except KeyError as e:
            raise IncompleteCheckpointError(
                f"{info.uri}: the manifest lists no {prefix}{path}; the step is incomplete",
                **_info_context(info),
            ) from e

    return decode_state(get, where=f"{info.uri}/{rank_dir(rank)}", allow_pickle=allow_pickle)
