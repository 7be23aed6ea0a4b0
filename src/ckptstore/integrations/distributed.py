"""Multi-rank save and load over a torch.distributed process group.

The save is the coordinated save (coordination.py) with rank 0 as coordinator: rank 0 begins
it and scatters each rank its plan, every rank encodes its own state and uploads it, in
parallel with the others, under ``rank_<r>/`` in the step directory, and rank 0 commits only
after every rank reported success, so the step's single manifest lists every rank's files with
their checksums and is the commit marker for all of them: a reader never sees a step that some
rank did not finish. If any rank fails, rank 0 discards what the others staged (uploads are
whole objects or aborted, so nothing half-written remains) and every rank raises the same error.

Every rank reaches every collective whatever happened locally: failures travel as text (or as
ckptstore errors, which pickle) instead of skipping a collective, which would hang the job. A
rank that dies outright still hangs the others until the process group's timeout. Object
collectives over NCCL run on the current CUDA device: set it (``torch.cuda.set_device``) first.

Rank 0 reads ``latest`` and the previous step's manifest once, and each rank's plan holds only
the entries under its own folder (the files it may copy instead of uploading): a rank reads
neither, so its cost does not grow with the number of ranks (README "Scale"). A load is chosen
by the store's resolver on rank 0 (resolver.py), so fenced steps, fallbacks and refusals follow
the same rules as ``store.load``.

Only rank 0 takes the writer lease (lease.py). Open the store with ``lease=False`` on the other
ranks to say so; a default store is safe too, since staging never takes the lease.

Each rank reads back exactly the files it wrote, so a load needs the world size of the save.
To load with another world size, save through ``torch.distributed.checkpoint`` with
``ckptstore.integrations.dcp.CkptStoreWriter``: DCP reshards on load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from ckptstore.backends.base import error_context
from ckptstore.core.collectives import Collectives
from ckptstore.core.coordination import Coordinator
from ckptstore.core.reports import Staged, describe
from ckptstore.core.resolver import VERIFY_ERRORS
from ckptstore.core.search import Search
from ckptstore.data.serialize import SKELETON_FILE, decode_state, encode_state
from ckptstore.deadline import map_in_context
from ckptstore.domain import layout
from ckptstore.domain.compat import check_compat
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_STATE, FileEntry
from ckptstore.domain.plan import Plan
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    ErrorContext,
    IncompleteCheckpointError,
)
from ckptstore.integrations.early_reads import EarlyReads

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)
T = TypeVar("T")
W = TypeVar("W")


def rank_dir(rank: int) -> str:
    """The folder of one rank's files inside a step saved by ``save_distributed``."""
    return f"rank_{rank:05d}"


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

    With the store's ``save_timeout``, each rank's part runs by that deadline, and the
    collectives wait :attr:`Collectives.MARGIN` seconds longer at most, so a rank that stalls
    makes every rank fail within the deadline plus that margin.
    """
    step = layout.check_step(step)
    return save_coordinated(
        store,
        step,
        lambda plan, size: plan.split([rank_dir(r) for r in range(size)]),
        lambda plan, rank: _stage(store, plan, state, rank, allow_pickle),
        kind=KIND_STATE,
        metadata=metadata,
        group=group,
    )


def save_coordinated(
    store: CheckpointStore,
    step: int,
    cut: Callable[[Plan, int], Sequence[W]],
    stage: Callable[[W, int], Sequence[FileEntry]],
    *,
    kind: str,
    metadata: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    persist: bool = False,
) -> CheckpointInfo:
    """The coordinated save over ``group``, whatever each rank stages; call it on every rank.

    Rank 0 begins the save and calls ``cut(plan, world_size)`` for each rank's work (its cut
    of the plan, and whatever else it needs); every rank then stages its own files with
    ``stage(work, rank)`` and rank 0 commits one manifest after every rank reported, as
    :func:`save_distributed` (which stages encoded state) describes. An error in ``cut`` is
    every rank's error, and nothing is begun on any other rank.
    """
    timeout = store.options.save_timeout
    comm = Collectives.past(group, timeout)
    try:  # the deadline is the coordinated save's (coordination.py), on every rank
        return _save(store, comm, step, cut, stage, kind, metadata, persist)
    except RuntimeError as e:  # a collective gave up waiting: a rank never reported
        raise DistributedCheckpointError(
            f"step {step} was not saved: rank {comm.rank} waited {timeout} s + "
            f"{Collectives.MARGIN:g} s for the other ranks, and some never reported ({e}); "
            "nothing was committed by this rank, and gc removes what was staged",
            {comm.rank: describe(e)},
            **_step_context(store.uri, step),
        ) from e


def _save(
    store: CheckpointStore,
    comm: Collectives,
    step: int,
    cut: Callable[[Plan, int], Sequence[W]],
    stage: Callable[[W, int], Sequence[FileEntry]],
    kind: str,
    metadata: Mapping[str, Any] | None,
    persist: bool,
) -> CheckpointInfo:
    # 1. Rank 0 begins the coordinated save and hands each rank its work.
    coordinator: Coordinator | None = None
    works: list[W | CheckpointError] | None = None
    if comm.rank == 0:
        try:
            coordinator = store.begin_save(step, kind=kind, metadata=metadata, persist=persist)
            works = [*cut(coordinator.plan, comm.size)]
        except Exception as e:
            if coordinator is not None:
                coordinator.discard()
                coordinator = None
            works = [_as_checkpoint_error(e) for _ in range(comm.size)]
    work = comm.scatter(works)
    if isinstance(work, CheckpointError):
        raise DistributedCheckpointError(
            f"step {step} was not saved: rank 0: {describe(work)}",
            {0: describe(work)},
            **_step_context(store.uri, step),
        ) from work
    # 2. Every rank stages its own files (in its node's local tier, if the store has one);
    # the entries (or the error) go to rank 0.
    local_error: Exception | None = None
    try:
        staged = tuple(stage(work, comm.rank))
        report = Staged(comm.rank, staged, node=store.node)
    except Exception as e:
        local_error, report = e, Staged.failure(comm.rank, e)
    try:
        reports = comm.gather(report)
    except RuntimeError:
        if coordinator is not None:
            coordinator.discard()
        raise
    # 3. Rank 0 commits, or discards; everyone learns which, and each node commits it in its
    # local tier too (tiers/local.py) and copies its files to a rank on another node (peers.py),
    # behind.
    outcome: CheckpointInfo | CheckpointError | None = None
    if coordinator is not None and reports is not None:
        try:
            outcome = coordinator.conclude(reports, world_size=comm.size, coordinator=0)
        except CheckpointError as e:
            outcome = e
    outcome = comm.broadcast(outcome)
    _settle_tiers(store, comm, step, outcome, report)
    if isinstance(outcome, CheckpointInfo):
        return outcome
    if outcome is None:  # unreachable: rank 0 always sends one
        outcome = CheckpointError(f"step {step}: rank 0 sent no outcome")
    raise outcome from local_error


PEER_TIMEOUT = 600.0
"""Seconds a copy to a peer node (peers.py) waits for its peer before it gives up."""


def _peer_comm(comm: Collectives) -> Collectives:
    """Collectives of a group of their own for peer copies, which run in a background thread
    beside the save's collectives (made once per process, by every rank at the same point)."""
    return Collectives(comm.group if comm.active else None, timeout=PEER_TIMEOUT, use="peers")


def _settle_tiers(
    store: CheckpointStore,
    comm: Collectives,
    step: int,
    outcome: CheckpointInfo | CheckpointError | None,
    report: Staged,
) -> None:
    """With local tiers, after every rank learned the outcome: each other node commits the
    step in its tier too and every rank copies its files to a rank on another node (behind the
    save); or each rank drops what it staged of the failed step from both tiers, once its
    copies to the durable tier are done (rank 0 discarded only what it sees)."""
    tiers = store.tiers
    if tiers is None:
        return
    peers = _peer_comm(comm) if store.options.replicas else None  # every rank, every save
    if not isinstance(outcome, CheckpointInfo):
        if isinstance(outcome, DistributedCheckpointError) and outcome.discarded:
            tiers.abandon(step, {e.attempt for e in report.entries if e.attempt})
        return  # a step that may be committed keeps its files (gc judges them)
    if comm.rank != 0:
        tiers.join(outcome.manifest)
    if peers is not None:
        tiers.send_to_peer(peers, step, report.entries)


def _step_context(store_uri: str, step: int) -> ErrorContext:
    """``uri``, ``step``, ``path`` of an error about a whole step: its directory's."""
    return {**error_context(store_uri, layout.step_dir(step)), "step": step}


def _info_context(info: CheckpointInfo) -> ErrorContext:
    """:func:`_step_context` of a committed step (``info.uri`` is its directory's URI)."""
    return {"uri": info.uri, "step": info.step, "path": layout.step_dir(info.step)}


def _as_checkpoint_error(error: Exception) -> CheckpointError:
    """An error to send to the other ranks: ckptstore's pickle; others travel as text."""
    return error if isinstance(error, CheckpointError) else CheckpointError(describe(error))


def _stage(
    store: CheckpointStore, plan: Plan, state: Any, rank: int, allow_pickle: bool
) -> list[FileEntry]:
    encoded = encode_state(state, shard_size=store.shard_size, allow_pickle=allow_pickle)
    folder = rank_dir(rank)
    files = [replace(f, path=f"{folder}/{f.path}") for f in encoded.files()]
    return store.stage_files(plan.step, files, plan=plan, rank=rank)


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

    Rank 0 asks the store's resolver (resolver.py: latest, fenced steps, refusals) and every
    rank loads the step it offers. With no ``step`` and ``fallback``, a step that fails
    verification on any rank is skipped, on every rank, for the newest older one (as
    ``store.load`` does). ``store.last_loaded`` tells which step was loaded. Every rank loads
    by the store's ``load_timeout``, and its collectives wait :attr:`Collectives.MARGIN` seconds
    longer at most (without one, the process group's own timeout); copies from peer nodes wait
    :data:`PEER_TIMEOUT` at most.
    """
    timeout = store.options.load_timeout
    try:
        comm = Collectives.past(group, timeout)
        with store.resolver.loading():
            return _load(store, comm, step, fallback, allow_pickle)
    except RuntimeError as e:  # a collective gave up waiting: a rank never reached it
        waited = (
            "the process group's timeout"
            if timeout is None
            else (f"load_timeout {timeout:g} s + {Collectives.MARGIN:g} s")
        )
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        raise DistributedCheckpointError(
            f"{store.uri}: the load was abandoned: rank {rank} waited {waited} for the "
            f"other ranks, and some never came ({e}); call load_distributed on every rank of "
            "the group, or raise load_timeout if a rank's read takes longer",
            {rank: describe(e)},
            uri=store.uri,
        ) from e


def _load(
    store: CheckpointStore, comm: Collectives, step: int | None, fallback: bool, allow_pickle: bool
) -> Any:
    tiers = store.tiers
    # a node that kept a newer step than rank 0's offers it too: asked before the early reads,
    # whose 8 threads slowed that Python work from 50 to 130 ms, on the way to the agreement
    here = tiers.newest_here() if tiers is not None and comm.rank != 0 else None
    # this rank's files of the step its node's local tier names, read while the ranks agree
    named = tiers.named_here(step) if tiers is not None else None
    early = EarlyReads(tiers, named, _paths_of(named, comm.rank)) if tiers and named else None
    try:
        return _agree_and_read(store, comm, step, fallback, allow_pickle, early, here)
    finally:
        if early is not None:
            early.close()


def _agree_and_read(
    store: CheckpointStore,
    comm: Collectives,
    step: int | None,
    fallback: bool,
    allow_pickle: bool,
    early: EarlyReads | None,
    here: CheckpointInfo | None,
) -> Any:
    tiers = store.tiers
    search = store.resolver.search(step, fallback=fallback) if comm.rank == 0 else None
    if tiers is not None:  # what the other nodes' tiers hold (``here``), to rank 0
        if search is not None:  # rank 0 finds latest (its own tier's too) meanwhile
            search.prime()
        also = [i for i in comm.all_gather(here) if i is not None]
        if search is not None:
            search.also = tuple(also)
    while True:
        offer: CheckpointInfo | CheckpointError | None = None
        if search is not None:
            offer = _offer(store, search, comm.size)
        offer = comm.broadcast(offer)
        if not isinstance(offer, CheckpointInfo):
            raise offer if offer is not None else CheckpointError("rank 0 offered no step")
        check_layout(offer, comm.size)
        state: Any = None
        local_error: Exception | None = None
        status: tuple[str, str] | None = None
        try:
            if tiers is not None and store.options.replicas:
                tiers.recover_from_peer(_peer_comm(comm), offer, _paths_of(offer, comm.rank))
            state = _read_rank(store, offer, comm.rank, allow_pickle, early)
        except VERIFY_ERRORS as e:
            local_error, status = e, ("corrupt", describe(e))
        except Exception as e:
            local_error, status = e, ("error", describe(e))
        statuses = comm.all_gather(status)
        bad = {r: s for r, s in enumerate(statuses) if s is not None}
        if not bad:
            store.last_loaded = offer
            if tiers is not None:  # this node's local tier holds the step whole again
                tiers.hold(offer.manifest)
            return state
        listed = "; ".join(f"rank {r}: {text}" for r, (_, text) in sorted(bad.items()))
        if any(kind == "error" for kind, _ in bad.values()):
            raise DistributedCheckpointError(
                f"step {offer.step} could not be loaded: {listed}",
                {r: text for r, (_, text) in bad.items()},
                **_info_context(offer),
            ) from local_error
        if search is not None:
            search.failed(offer, CorruptCheckpointError(listed, **_info_context(offer)))


def _offer(
    store: CheckpointStore, search: Search, world_size: int
) -> CheckpointInfo | CheckpointError:
    """Rank 0: the next step to try, or the error that ends the search."""
    try:
        info = search.next()
        if info is None:
            return search.exhausted()
        # the store's, read once (a load would run `git rev-parse` and read package metadata)
        environment = replace(store.environment, world_size=world_size)
        check_compat(info.manifest.environment, environment, mode=store.compat, where=info.uri)
        return info
    except Exception as e:
        return _as_checkpoint_error(e)


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


def _paths_of(info: CheckpointInfo, rank: int) -> list[str]:
    """The paths of ``rank``'s files in a step of ``save_distributed``."""
    prefix = rank_dir(rank) + "/"
    return [f.path for f in info.files if f.path.startswith(prefix)]


def _read_rank(
    store: CheckpointStore,
    info: CheckpointInfo,
    rank: int,
    allow_pickle: bool,
    early: EarlyReads | None = None,
) -> Any:
    """Read and verify this rank's files (several at once; with a local tier, the local
    copies where good; those read ``early`` for the same entries taken from there), then
    decode them."""
    prefix = rank_dir(rank) + "/"
    mine = _paths_of(info, rank)

    def read(path: str) -> memoryview:
        taken = early.take(info, path) if early is not None else None
        return taken if taken is not None else store.read_file(info, path)

    with ThreadPoolExecutor(8, thread_name_prefix="ckpt-read") as pool:
        data = dict(zip(mine, map_in_context(pool, read, mine), strict=True))

    def get(path: str) -> memoryview:
        try:
            return data[prefix + path]
        except KeyError as e:
            raise IncompleteCheckpointError(
                f"{info.uri}: the manifest lists no {prefix}{path}; the step is incomplete",
                **_info_context(info),
            ) from e

    return decode_state(get, where=f"{info.uri}/{rank_dir(rank)}", allow_pickle=allow_pickle)
