"""CkptStoreWriter streams each rank's ``.distcp`` file: FileSystemWriter's bytes, no copy of
the shard in memory, and a failure halfway through commits nothing."""

from __future__ import annotations

import io
import pickle
import re
import tracemalloc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from ckptstore import CheckpointStore
from ckptstore.backends.base import Chunk
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.domain.layout import step_dir
from ckptstore.integrations import dcp_write
from ckptstore.integrations.dcp import CkptStoreReader, CkptStoreWriter
from ckptstore.integrations.dcp_write import RankFile

MiB = 1 << 20
DATA = "__0_0.distcp"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def mixed_state() -> dict[str, Any]:
    """Every kind of item DCP writes: dtypes, views saved as they are and views it clones,
    empty tensors, raw bytes and pickled values."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(256, 64, generator=g),
        "bf16": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(1000, generator=g).to(torch.float16),
        "f64": torch.randn(33, dtype=torch.float64, generator=g),
        "i64": torch.arange(5000),
        "i8": torch.randint(-128, 127, (999,), dtype=torch.int8, generator=g),
        "bool": torch.rand(77, generator=g) > 0.5,
        "param": torch.nn.Parameter(torch.randn(40, 40, generator=g)),
        "transposed": base.t(),  # strided, but its storage is its own: saved as it is
        "columns": base[:, 5:29],  # a view with gaps: FileSystemWriter clones it
        "rows": base[10:30],  # contiguous, inside a larger storage: cloned too
        "expanded": torch.randn(1, 16, generator=g).expand(32, 16),
        "empty": torch.empty(0, 4),
        "empty_view": base[:0],
        "scalar": torch.tensor(3.5),
        "blob": io.BytesIO(b"\x00raw bytes\xff" * 700),
        "small_blob": io.BytesIO(b"x"),
        "extra": {"step": 7, "names": ["a", "b"], "lr": 0.1},
    }


def plain_copy(state: dict[str, Any]) -> dict[str, Any]:
    """The same values in fresh objects (a BytesIO is read to its end by a save)."""
    return {
        k: io.BytesIO(v.getvalue()) if isinstance(v, io.BytesIO) else v for k, v in state.items()
    }


def filesystem_writer(state: dict[str, Any], where: Path) -> tuple[bytes, dict[Any, Any]]:
    """What torch's own writer makes of ``state``: the data file and each item's storage."""
    dcp.save(plain_copy(state), storage_writer=FileSystemWriter(where), no_dist=True)
    return (where / DATA).read_bytes(), _storage(where)


def _storage(where: Path) -> dict[Any, Any]:
    metadata = FileSystemReader(where).read_metadata()
    assert metadata.storage_data is not None
    return {k: (v.relative_path, v.offset, v.length) for k, v in metadata.storage_data.items()}


def pulled(store: CheckpointStore, step: int, where: Path) -> tuple[bytes, dict[Any, Any]]:
    store.pull_dir(where, step)
    return (where / DATA).read_bytes(), _storage(where)


def address(view: memoryview) -> int:
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data) if view.nbytes else 0


class ChunkRecorder(BackendProxy):
    """Records each chunk written to a ``.distcp`` file (type, size, address); fails with an
    OSError at chunk ``fail_at`` if given, after the earlier chunks went to the backend."""

    def __init__(self, inner: LocalBackend, fail_at: int | None = None) -> None:
        super().__init__(inner)
        self.chunks: list[tuple[type, int, int]] = []
        self.fail_at = fail_at

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        if path.endswith(".distcp"):
            chunks = self._watch(chunks)
        return super().write(path, chunks)

    def _watch(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for n, chunk in enumerate(chunks):
            if n == self.fail_at:
                raise OSError(f"injected: the disk filled up at chunk {n}")
            view = memoryview(chunk)
            self.chunks.append((type(chunk), view.nbytes, address(view)))
            yield chunk


def assert_nothing_staged(store: CheckpointStore, step: int) -> None:
    assert step not in [i.step for i in store.list()]
    assert list(store.backend.list(step_dir(step) + "/")) == []
    assert store.backend.partial_writes("") == []


# -- the bytes ------------------------------------------------------------------------------


def test_the_streamed_file_is_the_one_filesystemwriter_writes(tmp_path: Path) -> None:
    state = mixed_state()
    want, want_storage = filesystem_writer(state, tmp_path / "fs")
    with CheckpointStore(str(tmp_path / "store")) as store:
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        got, got_storage = pulled(store, 1, tmp_path / "pulled")
    assert got_storage == want_storage  # every item's offset and length
    assert got == want

    # and plain DCP loads the pulled step
    loaded: dict[str, Any] = {
        k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)
    }
    loaded |= {"blob": io.BytesIO(), "small_blob": io.BytesIO()}
    loaded["extra"] = {"step": 0, "names": [], "lr": 0.0}  # DCP loads into the keys it is given
    dcp.load(loaded, checkpoint_id=tmp_path / "pulled", no_dist=True)
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[name], value), name
    assert loaded["blob"].getvalue() == state["blob"].getvalue()
    assert loaded["extra"] == state["extra"]


def test_where_an_accelerator_is_available_tensors_go_smallest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FileSystemWriter loads tensors through its overlapping loader where CUDA is available,
    and that loader writes them smallest first. Its file there is the one it writes anywhere
    for the same items already in that order."""
    state = mixed_state()
    tensors = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    by_size = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    by_size |= dict(sorted(tensors, key=lambda kv: kv[1].nbytes))  # stable, as torch's
    assert list(by_size) != list(state)
    want = filesystem_writer(by_size, tmp_path / "fs")
    monkeypatch.setattr(dcp_write, "tensors_by_size", lambda: True)
    with CheckpointStore(str(tmp_path / "store")) as store:
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        assert pulled(store, 1, tmp_path / "pulled") == want


def test_an_incremental_save_reads_the_file_twice_and_runs_torch_save_once_per_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison with the previous step reads the file before writing it; the second
    pass replays the archive records of the first, and must still give the new bytes."""
    state = mixed_state()
    tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    with CheckpointStore(str(tmp_path / "store")) as store:
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 2), no_dist=True)
        assert store.info(2).manifest.file(DATA).copied_from == 1

        saves: list[bool] = []
        real_save = torch.save

        def counting_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(obj, torch.Tensor):
                saves.append(bool(torch.serialization._serialization_tls.skip_data))
            real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", counting_save)
        passes: list[int] = []
        real_chunks = RankFile.chunks

        def counting_chunks(self: RankFile) -> Iterator[Chunk]:
            passes.append(1)
            return real_chunks(self)

        monkeypatch.setattr(RankFile, "chunks", counting_chunks)
        with torch.no_grad():
            for name, value in state.items():
                if not isinstance(value, torch.Tensor) or name == "expanded":
                    continue  # same sizes, so the file is compared before it is written
                value.logical_not_() if value.dtype == torch.bool else value.add_(1)
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 3), no_dist=True)
        monkeypatch.undo()
        assert len(passes) == 2  # compared with step 2's file, then written
        assert saves.count(True) == tensors  # the lengths, before the first byte
        assert saves.count(False) == tensors  # the data: once, though the file was read twice
        assert store.info(3).manifest.file(DATA).copied_from is None
        got, got_storage = pulled(store, 3, tmp_path / "pulled")
    want, want_storage = filesystem_writer(state, tmp_path / "fs")
    assert (got_storage, got) == (want_storage, want)


def test_a_state_on_s3_round_trips_through_parallel_parts(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(1024, 1024, generator=g)  # 4 MiB
    state: dict[str, Any] = {
        "a": torch.randn(2 * MiB // 4, generator=g),
        "b": torch.randn(1024, 768, generator=g).to(torch.bfloat16),
        "view": big[:, 100:900],  # cloned while it streams
        "t": big.t(),
        "blob": io.BytesIO(bytes(range(256)) * 4096),
        "extra": {"epoch": 3},
    }
    options = {**s3_options, "part_size": 5 * MiB, "max_concurrency": 3}
    with CheckpointStore(s3_uri, storage_options=options) as store:
        dcp.save(plain_copy(state), storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        info = store.info(1)
        assert info.manifest.file(DATA).size > 10 * MiB  # a multipart upload of 3+ parts
        assert store.verify(1).ok
        loaded: dict[str, Any] = {
            k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)
        }
        loaded |= {"blob": io.BytesIO(), "extra": {"epoch": 0}}
        dcp.load(loaded, storage_reader=CkptStoreReader(store, 1, allow_pickle=True))
        got = pulled(store, 1, tmp_path / "pulled")
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[name], value), name
    assert loaded["blob"].getvalue() == state["blob"].getvalue()
    assert loaded["extra"] == {"epoch": 3}
    assert got == filesystem_writer(state, tmp_path / "fs")


# -- memory ---------------------------------------------------------------------------------


def eight_mib() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {f"layer{i}": torch.randn(MiB // 4, generator=g) for i in range(8)}


def test_chunks_are_views_of_the_tensors_not_a_copy_of_the_file(tmp_path: Path) -> None:
    state = eight_mib()
    backend = ChunkRecorder(LocalBackend(str(tmp_path), {}))
    with CheckpointStore(str(tmp_path), backend=backend) as store:
        dcp.save(state, storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        size = store.info(1).manifest.file(DATA).size
    assert sum(n for _, n, _ in backend.chunks) == size
    assert max(n for _, n, _ in backend.chunks) == MiB  # the largest tensor, not the file
    views = {(a, n) for kind, n, a in backend.chunks if kind is memoryview and n >= 4096}
    for name, tensor in state.items():
        assert (tensor.data_ptr(), tensor.nbytes) in views, f"{name} was copied"
    copied = [n for kind, n, _ in backend.chunks if kind is not memoryview]
    assert max(copied) < 4096 and sum(copied) < 4096 * len(state)  # the archives' records


def test_a_save_holds_no_copy_of_the_shard(tmp_path: Path) -> None:
    """Python-level allocations during a save (a serialized file in a BytesIO would be one)
    stay far below the 8 MiB state."""
    state = eight_mib()
    with CheckpointStore(str(tmp_path)) as store:
        dcp.save(state, storage_writer=CkptStoreWriter(store, 1), no_dist=True)  # warm up
        tracemalloc.start()
        try:
            dcp.save(state, storage_writer=CkptStoreWriter(store, 2), no_dist=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < MiB, f"{peak / MiB:.1f} MiB allocated"


# -- failures -------------------------------------------------------------------------------


def test_a_backend_failing_mid_stream_commits_nothing_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    state = eight_mib()
    backend = ChunkRecorder(LocalBackend(str(tmp_path), {}), fail_at=5)
    with CheckpointStore(str(tmp_path), backend=backend) as store:
        with pytest.raises(CheckpointException) as caught:
            dcp.save(state, storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        assert len(backend.chunks) == 5  # it failed halfway, after writing some
        message = str(caught.value)
        assert "step 1 was not saved (nothing committed, staged files discarded)" in message
        assert "injected: the disk filled up at chunk 5" in message
        assert_nothing_staged(store, 1)
        backend.fail_at = None
        dcp.save(state, storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        assert [i.step for i in store.list()] == [1]


class FailingPlanner(DefaultSavePlanner):
    """``resolve_data`` of item ``fqn`` misbehaves from its ``after``-th call on: raises, or
    returns a tensor of another shape."""

    def __init__(self, fqn: str, after: int, *, wrong_shape: bool = False) -> None:
        super().__init__()
        self.fqn, self.after, self.wrong_shape = fqn, after, wrong_shape
        self.calls = 0

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if write_item.index.fqn == self.fqn:
            self.calls += 1
            if self.calls > self.after:
                if not self.wrong_shape:
                    raise RuntimeError(f"injected: {self.fqn} cannot be read")
                assert isinstance(data, torch.Tensor)
                return data[:-1]
        return data


@pytest.mark.parametrize(
    ("wrong_shape", "expected"),
    [
        (False, r"RuntimeError: injected: layer6 cannot be read"),
        (True, r"__0_0\.distcp: layer6 came out 1050089 bytes long, its planned length is 1050153"),
    ],
)
def test_a_tensor_failing_mid_stream_commits_nothing(
    tmp_path: Path, wrong_shape: bool, expected: str
) -> None:
    """The first call plans the item's length; the one that fails comes while the file
    streams, after the items before it were written."""
    state = eight_mib()
    with CheckpointStore(str(tmp_path)) as store:
        planner = FailingPlanner("layer6", 1, wrong_shape=wrong_shape)
        with pytest.raises(CheckpointException) as caught:
            dcp.save(state, storage_writer=CkptStoreWriter(store, 1), planner=planner, no_dist=True)
        assert planner.calls == 2
        assert "step 1 was not saved (nothing committed, staged files discarded)" in str(
            caught.value
        )
        assert re.search(expected, str(caught.value))
        assert_nothing_staged(store, 1)


def test_the_rank_results_pickle_as_filesystemwriters_do(tmp_path: Path) -> None:
    """``.metadata`` holds the same storage records (no transform descriptors)."""
    with CheckpointStore(str(tmp_path / "store")) as store:
        dcp.save({"t": torch.ones(3)}, storage_writer=CkptStoreWriter(store, 1), no_dist=True)
        store.pull_dir(tmp_path / "pulled", 1)
    metadata = pickle.loads((tmp_path / "pulled" / ".metadata").read_bytes())
    ((info),) = metadata.storage_data.values()
    assert info.__getstate__() == {"relative_path": DATA, "offset": 0, "length": info.length}
