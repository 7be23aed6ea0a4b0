"""torch.distributed.checkpoint (DCP) storage over a CheckpointStore.

DCP plans who saves what and reshards on load; this module only moves its bytes. Every rank's
``write_data`` uploads its ``.distcp`` file as a staged file of the step
(``store.stage_files``), and the coordinator's ``finish`` stages DCP's ``.metadata`` and then
commits the step with ``commit_files``. So ckptstore's manifest, which lists every rank's files
with their CRC32C, is the commit marker; DCP's ``.metadata`` is payload like the rest.
It is the coordinated save (coordination.py) with DCP's coordinator as ours: it begins the save
in ``prepare_global_plan`` (the writer lease, the refusals, one read of the previous step)
before any upload, and puts into each rank's plan (which DCP scatters anyway) that rank's cut,
so a rank reads nothing and its staging costs the same whatever the number of ranks (README
"Scale"). ``write_data`` never raises (DCP would then skip ``finish`` and leave the other
ranks' files behind): its report travels to ``finish`` as a marker in the rank's write
results, and ``finish`` concludes the save: nothing committed and no staged file left if any
rank failed. The reader asks the store's resolver (resolver.py) which step to load.

Files are named as ``FileSystemWriter`` names them (``__<rank>_0.distcp``, ``.metadata``), so a
step fetched with ``store.pull_dir`` (CLI: ``ckptstore pull``) also loads with plain
``dcp.load(..., checkpoint_id=<dir>)``.

DCP's format uses pickle. The reader never runs pickle from the store unless told to
(``allow_pickle=True``, for writers you trust): :mod:`.dcp_unpickle` says what it admits.

Each rank streams its one file into the store (:mod:`.dcp_write`): ``torch.save``'s archive
records around views of the tensors' own memory, uploaded in parallel parts on S3 as
``CheckpointStore.save`` uploads its shards, so a rank's extra memory is the backend's part
buffers, not a copy of its shard. Every file a rank reads is read whole and verified against
the manifest before any of its bytes is used, so when resharding a rank reads whole files even
where it needs slices.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.backends.base import join
from ckptstore.core.collectives import Collectives
from ckptstore.core.coordination import Coordinator
from ckptstore.core.reports import Staged, describe
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry
from ckptstore.domain.plan import Plan
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.dcp_unpickle import check_weights_only, load_metadata, load_tensor
from ckptstore.integrations.dcp_write import RankFile

if TYPE_CHECKING:
    import torch.distributed as dist

    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
DCP_VERSION: str = getattr(_filesystem, "CURRENT_DCP_VERSION", "1.0.0")
"""The ``Metadata.version`` FileSystemWriter writes."""
_MARKER = MetadataIndex("__ckptstore_staged__")


@dataclass(frozen=True)
class _RankPlan:
    """A rank's ``storage_data`` in the global plan: its file's prefix (as FileSystemWriter's
    ``_StoragePrefix``) and its cut of the coordinated save's plan (coordination.py)."""

    prefix: str
    plan: Plan


def _step_of(checkpoint_id: str | os.PathLike[str]) -> int:
    """A DCP ``checkpoint_id`` for this storage: a step number or a ``global_step_N`` path."""
    name = os.fspath(checkpoint_id).rstrip("/").rsplit("/", 1)[-1]
    step = layout.parse_step_dir(name)
    return step if step is not None else layout.check_step(name, where="checkpoint_id")


class CkptStoreWriter(StorageWriter):
    """Save a DCP checkpoint as ``step`` of ``store``: ``dcp.save(sd, storage_writer=...)``.

    Pass the same ``step`` on every rank; ``metadata`` (JSON values) goes into the manifest.
    Stores on non-coordinator ranks may be opened with ``lease=False``.
    """

    def __init__(
        self, store: CheckpointStore, step: int, *, metadata: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.store = store
        self.step = layout.check_step(step)
        self.metadata = dict(metadata or {})
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = True
        self._coordinator: Coordinator | None = None
        """The coordinated save, begun on the coordinator in ``prepare_global_plan``."""

    @property
    def checkpoint_id(self) -> str:
        return join(self.store.uri, layout.step_dir(self.step))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP from a bare id: pass the writer explicitly

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "CkptStoreWriter commits each step once, from the coordinator: call dcp.save "
                "with use_collectives=True"
            )
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else Collectives().rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator, before any rank writes: begin the coordinated save (the writer
        lease, the refusals, one read of the previous step) and give each rank's plan its
        cut, the previous step's entry of its file."""
        coordinator = self._coordinator = self.store.begin_save(
            self.step, kind=KIND_DIRECTORY, metadata=self.metadata
        )

        def plan_of(i: int) -> _RankPlan:
            prefix = f"__{i}_"
            return _RankPlan(prefix, coordinator.plan.among([f"{prefix}0{DATA_SUFFIX}"]))

        return [dataclasses.replace(p, storage_data=plan_of(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stream this rank's items into one staged file; a failure travels to ``finish`` as a
        marker."""
        results: list[WriteResult] = []

        def stage() -> list[FileEntry]:
            if not plan.items:
                return []
            name = f"{plan.storage_data.prefix}0{DATA_SUFFIX}"
            file = RankFile(name, plan, planner, where=f"{self.checkpoint_id}/{name}")
            entries = self.store.stage_files(
                self.step, [file.source()], plan=plan.storage_data.plan
            )
            results.extend(file.results)
            return entries

        staged = Staged.of(self.rank, stage, node=self.store.node)
        results.append(WriteResult(index=_MARKER, size_in_bytes=0, storage_data=staged))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: stage DCP's ``.metadata``, then conclude the coordinated save:
        commit if every rank staged its file, else discard the step and raise."""
        coordinator = self._coordinator
        if coordinator is None:
            raise CheckpointError("finish before prepare_global_plan on the coordinator")
        staged: list[Staged] = [r.storage_data for rs in results for r in rs if r.index == _MARKER]
        if any(s.error is not None for s in staged):
            coordinator.conclude(staged)  # discards and raises, naming every failure
        metadata.version = DCP_VERSION
        metadata.storage_data = {
            r.index: r.storage_data for rs in results for r in rs if r.index != _MARKER
        }
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        source = SourceFile(METADATA_FILE, lambda: iter((blob,)), len(blob))
        plan = coordinator.plan.among([METADATA_FILE])
        staged.append(
            Staged.of(
                "coordinator",
                lambda: self.store.stage_files(self.step, [source], plan=plan),
                node=self.store.node,
            )
        )
        coordinator.conclude(staged, world_size=len(results))


class CkptStoreReader(StorageReader):
    """Load a DCP checkpoint from ``store``: ``dcp.load(sd, storage_reader=...)``.

    ``step=None`` loads the latest step: rank 0 of ``group`` (pass the group given to
    ``dcp.load``) picks it, skipping with a warning a latest step whose manifest or
    ``.metadata`` fails verification, and tells the other ranks. A corrupt data file is found
    while reading; DCP then raises on every rank, and an explicit older ``step`` loads.
    """

    def __init__(
        self,
        store: CheckpointStore,
        step: int | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.store = store
        self.step = None if step is None else layout.check_step(step)
        self.group = group
        self.allow_pickle = allow_pickle
        self.info: CheckpointInfo | None = None
        """The step being loaded, known after ``read_metadata``."""
        self.load_id = str(uuid.uuid4())
        self._storage: dict[MetadataIndex, _StorageInfo] = {}

    @property
    def checkpoint_id(self) -> str:
        step = self.info.step if self.info else self.step
        return self.store.uri if step is None else join(self.store.uri, layout.step_dir(step))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.info = None
        self._storage = {}
        self.load_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotFoundError(
                f"{self.store.uri}: ckptstore DCP steps have one global {METADATA_FILE}; "
                "rank-local metadata (use_collectives=False) is not supported"
            )
        self.info, data = self._resolve()
        metadata = load_metadata(data, f"{self.info.uri}/{METADATA_FILE}", self.allow_pickle)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _resolve(self) -> tuple[CheckpointInfo, bytes]:
        """The step to load and its verified ``.metadata``, the same on every rank: rank 0
        asks the store's resolver (resolver.py), falling back past a step whose manifest or
        ``.metadata`` fails verification."""

        def read(info: CheckpointInfo) -> bytes:
            return _read_metadata_file(self.store, info)

        if self.step is not None:
            found = self.store.resolver.resolve(self.step, False, read)
            return found.info, found.value
        timeout = self.store.options.load_timeout
        try:  # making the group is a collective too
            return self._agree(Collectives.past(self.group, timeout), read)
        except RuntimeError as e:  # a collective gave up: a rank never reached it
            waited = (
                "the process group's timeout"
                if timeout is None
                else (f"load_timeout {timeout:g} s + {Collectives.MARGIN:g} s")
            )
            rank = Collectives(self.group).rank
            raise DistributedCheckpointError(
                f"{self.store.uri}: the DCP load was abandoned: rank {rank} waited {waited} "
                f"for the other ranks to agree on the step, and some never came ({e}); call "
                "dcp.load on every rank of the group, or raise load_timeout",
                {rank: describe(e)},
                uri=self.store.uri,
            ) from e

    def _agree(
        self, comm: Collectives, read: Callable[[CheckpointInfo], bytes]
    ) -> tuple[CheckpointInfo, bytes]:
        """Rank 0 resolves the step; every rank gets it with its verified ``.metadata``."""
        chosen: tuple[CheckpointInfo, bytes] | CheckpointError | None = None
        if comm.rank == 0:
            try:
                found = self.store.resolver.resolve(None, True, read)
                chosen = found.info, found.value
            except CheckpointError as e:
                chosen = e
        chosen = comm.broadcast(chosen)  # with the verified bytes: one read, not one per rank
        if isinstance(chosen, CheckpointError):
            raise chosen
        if chosen is None:
            raise CheckpointError("rank 0 chose no step")  # unreachable: rank 0 sends one
        return chosen

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.checkpoint_id}: {METADATA_FILE} has no storage")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each needed file once, whole and verified; hand DCP its slices."""
        if self.info is None:
            raise CheckpointError("read_data before read_metadata")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._storage[item.storage_index].relative_path, []).append(item)
        with self.store.resolver.loading():  # the store's load_timeout
            for path, items in per_file.items():
                data = memoryview(self.store.read_file(self.info, path))
                for item in items:
                    self._read_item(item, data, planner, f"{self.info.uri}/{path}")
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(
        self, item: ReadItem, data: memoryview, planner: LoadPlanner, where: str
    ) -> None:
        info = self._storage[item.storage_index]
        if info.transform_descriptors:
            raise ConfigError(f"{where}: DCP stream transforms are not supported")
        if info.offset < 0 or info.offset + info.length > len(data):
            raise CorruptCheckpointError(f"{where}: {item.storage_index.fqn} lies outside")
        piece = io.BytesIO(data[info.offset : info.offset + info.length])
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                check_weights_only(piece, f"{where}: {fqn}")
                piece.seek(0)
            planner.load_bytes(item, piece)
            return
        tensor = load_tensor(piece, f"{where}: {fqn}", self.allow_pickle)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{where}: {fqn} has shape {tuple(tensor.size())}, DCP expects "
                f"{tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _read_metadata_file(store: CheckpointStore, info: CheckpointInfo) -> bytes:
    """Plain bytes (the file is small): rank 0 broadcasts them, and a memoryview cannot be
    pickled."""
    if METADATA_FILE not in {f.path for f in info.files}:
        raise ConfigError(
            f"{info.uri} has no DCP {METADATA_FILE}: it was not saved with CkptStoreWriter "
            "(load it with store.load() or ckptstore.integrations.distributed.load_distributed)"
        )
    return bytes(store.read_file(info, METADATA_FILE))
