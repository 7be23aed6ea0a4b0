"""The methods the benchmark compares, one class per table row, and the row catalog.

A method's ``setup`` runs once, untimed (a load row writes its checkpoint there); ``before``
runs untimed before each run (a save row changes the state, as a training step would; a local
load row drops the page cache of its files); ``run`` is the timed part and returns what a load
produced, which ``verify`` checks against the bytes that were saved. Every durable local write
is fsynced. Every run writes new files and a row keeps them until it ends, as a store keeps its
steps: on this machine's disk, rewriting blocks freed a moment ago is several times faster than
writing fresh ones, and deleting between runs would favour whichever rows did it. The raw
limits live in :mod:`bench_local_limits` and :mod:`bench_s3_limits`, the S3 methods in
:mod:`bench_s3`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_state as st
import torch

from ckptstore import CheckpointStore


@dataclass(frozen=True)
class S3Target:
    endpoint_url: str | None
    bucket: str
    prefix: str
    region: str
    key: str | None = None
    secret: str | None = None

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{name}"


@dataclass(frozen=True)
class Spec:
    """What one subprocess measures (it arrives as JSON)."""

    row: str
    target: str
    size_bytes: int
    runs: int
    workdir: str
    part_size: int
    concurrency: int
    s3: S3Target | None = None
    shard_size: int | None = None
    """ckptstore's shard_size; None keeps the library's default."""
    quick: bool = False
    """A smoke run: each raw limit times its first setting once instead of its sweep."""


class Method:
    kind = "save"

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.dir = Path(spec.workdir)
        self.expected: dict[str, str] = {}
        self.notes: dict[str, Any] = {}

    def setup(self, state: Any) -> None:
        if self.kind == "load":
            self.expected = st.fingerprint(state)
            self.skeleton = _meta(state)
            self.write(state)

    def write(self, state: Any) -> None:
        """A load row's untimed save."""

    def before(self, i: int, state: Any) -> None:
        if self.kind == "save" and i:
            st.step(state)
        if self.kind == "load" and self.spec.target == "local":
            st.evict(self.dir)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        raise NotImplementedError

    def verify(self, out: Any) -> None:
        if st.fingerprint(out) != self.expected:
            raise AssertionError(f"{self.spec.row}: the loaded state differs from the saved one")

    def finish(self, state: Any) -> None:
        """Untimed, after the memory window (the async row times a clone here)."""

    def close(self) -> None:
        """Release clients."""


# -- ckptstore ---------------------------------------------------------------------------------


class Ckpt(Method):
    """``CheckpointStore.save``, one store and a new step per run, as in a training loop."""

    def setup(self, state: Any) -> None:
        s3 = self.spec.s3
        shard: dict[str, Any] = {"shard_size": self.spec.shard_size} if self.spec.shard_size else {}
        if s3 is None:
            self.store = CheckpointStore(str(self.dir / "store"), **shard)
        else:
            opts: dict[str, Any] = {
                "region": s3.region,
                "part_size": self.spec.part_size,
                "max_concurrency": self.spec.concurrency,
            }
            opts |= {"endpoint_url": s3.endpoint_url} if s3.endpoint_url else {}
            opts |= {"key": s3.key, "secret": s3.secret} if s3.key and s3.secret else {}
            self.store = CheckpointStore(s3.uri("store"), storage_options=opts, **shard)
        super().setup(state)

    def write(self, state: Any) -> None:
        self.store.save(1, state)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        info = self.store.save(i + 1, state)
        assert info.stats is not None
        return None, {"uploaded": info.stats.bytes_uploaded / info.stats.bytes_total}

    def close(self) -> None:
        self.store.close()


class CkptAsync(Ckpt):
    """``save_async``: the call blocks for the snapshot; the row's time runs to ``wait()``."""

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        started = time.perf_counter()
        handle = self.store.save_async(i + 1, state)
        blocked = time.perf_counter() - started
        handle.wait()
        return None, {"blocked": blocked}

    def setup(self, state: Any) -> None:
        super().setup(state)
        self.clones = self._time_clones(state)

    def finish(self, state: Any) -> None:
        """Clones timed before and after the runs, so the reference sees the same machine."""
        self.clones += self._time_clones(state)
        self.notes["clone_s"] = statistics.median(self.clones)

    def _time_clones(self, state: Any) -> list[float]:
        times = []
        for _ in range(max(2, self.spec.runs)):
            started = time.perf_counter()
            copy = st.clone(state)
            times.append(time.perf_counter() - started)
            del copy
        return times


class CkptIncremental(Ckpt):
    """A save after a step that changed ~10% of the bytes (the top of the model)."""

    def setup(self, state: Any) -> None:
        super().setup(state)
        self.store.save(1, state)
        self.changed = st.changed_part(state)
        changed = sum(t.numel() * t.element_size() for t in self.changed)
        self.notes["changed_fraction"] = changed / st.nbytes(state)

    def before(self, i: int, state: Any) -> None:
        for tensor in self.changed:
            tensor.add_(1.0)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        info = self.store.save(i + 2, state)
        assert info.stats is not None
        return None, {"uploaded": info.stats.bytes_uploaded / info.stats.bytes_total}


class CkptLoad(Ckpt):
    kind = "load"

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        return self.store.load(), {}


# -- torch.save / torch.distributed.checkpoint on a local disk ----------------------------------


class TorchSave(Method):
    """``torch.save`` to a file, then ``fsync`` (the verl docs' way, made durable)."""

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state, f"state-{i}.pt")
        return None, {}

    def write(self, state: Any, name: str = "state.pt") -> None:
        with open(self.dir / name, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


class TorchLoad(TorchSave):
    kind = "load"

    def before(self, i: int, state: Any) -> None:
        st.evict(self.dir)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        return torch.load(self.dir / "state.pt", map_location="cpu"), {}


class DcpSave(Method):
    """``torch.distributed.checkpoint.save`` with its ``FileSystemWriter`` (fsyncs files)."""

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state, f"dcp-{i}")
        return None, {}

    def write(self, state: Any, name: str = "dcp") -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        save(state, storage_writer=FileSystemWriter(self.dir / name))


class DcpLoad(DcpSave):
    """``dcp.load`` into a freshly allocated template (DCP loads in place)."""

    kind = "load"

    def before(self, i: int, state: Any) -> None:
        st.evict(self.dir)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        out = materialize(self.skeleton)
        load(out, storage_reader=FileSystemReader(self.dir / "dcp"))
        return out, {}


def _meta(state: Any) -> Any:
    """The state's structure with meta tensors: no memory, enough to allocate a template."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state, device="meta")
    if isinstance(state, dict):
        return {k: _meta(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_meta(v) for v in state)
    return state


def materialize(skeleton: Any) -> Any:
    if isinstance(skeleton, torch.Tensor):
        return torch.empty(skeleton.shape, dtype=skeleton.dtype)
    if isinstance(skeleton, dict):
        return {k: materialize(v) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(materialize(v) for v in skeleton)
    return skeleton


# -- the catalog --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    target: str
    name: str
    kind: str
    """save or load: which raw limit the row is compared with."""
    factory: Callable[[Spec], Method]
    limit: bool = False


def catalog() -> list[Row]:
    import bench_dcp
    import bench_local_limits as local_limits
    import bench_s3 as s3
    import bench_s3_limits as limits

    local: list[tuple[str, Callable[[Spec], Method]]] = [
        ("raw write+fsync", local_limits.RawWrite),
        ("ckptstore save", Ckpt),
        ("ckptstore save_async", CkptAsync),
        ("ckptstore incremental", CkptIncremental),
        ("torch.save+fsync", TorchSave),
        ("dcp.save FileSystemWriter", DcpSave),
        ("ckptstore dcp.save", bench_dcp.CkptDcpSave),
        ("raw read", local_limits.RawRead),
        ("ckptstore load", CkptLoad),
        ("torch.load", TorchLoad),
        ("dcp.load FileSystemReader", DcpLoad),
    ]
    remote: list[tuple[str, Callable[[Spec], Method]]] = [
        ("raw boto3 multipart upload", limits.RawUpload),
        ("ckptstore save", Ckpt),
        ("ckptstore save_async", CkptAsync),
        ("ckptstore incremental", CkptIncremental),
        ("torch.save>BytesIO>upload_fileobj", s3.BotoSave),
        ("torch.save>s3fs.open", s3.S3fsSave),
        ("dcp.save FsspecWriter", s3.DcpFsspecSave),
        ("ckptstore dcp.save", bench_dcp.CkptDcpSave),
        ("s3torchconnector save", s3.S3tcSave),
        ("raw boto3 download", limits.RawDownload),
        ("ckptstore load", CkptLoad),
        ("download_fileobj>torch.load", s3.BotoLoad),
        ("s3fs.open>torch.load", s3.S3fsLoad),
        ("dcp.load FsspecReader", s3.DcpFsspecLoad),
        ("s3torchconnector load", s3.S3tcLoad),
    ]
    rows = []
    for target, methods in (("local", local), ("s3", remote)):
        for name, factory in methods:
            kind = factory.kind  # type: ignore[attr-defined]
            rows.append(Row(target, name, kind, factory, limit=name.startswith("raw ")))
    return rows
