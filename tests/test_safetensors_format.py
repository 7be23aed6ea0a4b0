"""Our safetensors files against the safetensors library, both ways.

Both writers (checkpoint shards, exported shards) build their header with
``safetensors_header.build``, streaming the data after it; here the library reads what they
write, tensor for tensor, and what the library writes has the header we would write. On the
way back every header goes through the library, so a file it rejects is rejected here too, as
our error naming the file.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

from ckptstore import CheckpointStore
from ckptstore.data import safetensors_header
from ckptstore.data.serialize import FORMAT, Shard, decode_shard, decode_state, encode_state
from ckptstore.errors import CorruptCheckpointError
from ckptstore.export import export_hf
from ckptstore.export.native_source import _header
from ckptstore.export.stream import header as export_header


def tensors() -> dict[str, torch.Tensor]:
    """What a header must get right: bfloat16, float8, 0-d, empty, bool, odd sizes."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }


def shard_bytes(named: dict[str, torch.Tensor]) -> bytes:
    shard = Shard("m-00000.safetensors", dict(named))
    data = b"".join(bytes(c) for c in shard.chunks())
    assert len(data) == shard.size
    return data


def json_header(data: bytes) -> dict[str, Any]:
    (length,) = struct.unpack_from("<Q", data, 0)
    parsed: dict[str, Any] = json.loads(data[8 : 8 + length])
    return parsed


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_raw(got[name]), _raw(tensor)), name


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


# -- what we write, the library reads ------------------------------------------------------------


def test_a_checkpoint_shard_loads_with_the_library_tensor_for_tensor(tmp_path: Path) -> None:
    want = tensors()
    path = tmp_path / "m-00000.safetensors"
    path.write_bytes(shard_bytes(want))
    with safetensors.safe_open(str(path), framework="pt") as opened:
        assert opened.metadata() == {"format": FORMAT}
        got = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    assert_same_tensors(got, want)
    assert_same_tensors(safetensors.torch.load_file(path), want)
    assert_same_tensors(safetensors.torch.load(path.read_bytes()), want)


def test_a_whole_state_round_trips_through_the_library(tmp_path: Path) -> None:
    state = {"model": tensors(), "step": 3}
    encoded = encode_state(state)
    files = {f.path: b"".join(bytes(c) for c in f.chunks()) for f in encoded.files()}
    names = json.loads(files["state.json"])["state"]["model"]
    [path] = [p for p in files if p.endswith(".safetensors")]
    (tmp_path / path).write_bytes(files[path])
    loaded = safetensors.torch.load_file(tmp_path / path)
    got = {key: loaded[ref["$tensor"]] for key, ref in names.items()}
    assert_same_tensors(got, state["model"])


def test_an_export_shard_header_is_the_one_builder_with_the_hugging_face_metadata() -> None:
    want = tensors()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in want.items()]
    out = [_OutTensor(n, d, s) for n, d, s in specs]
    assert export_header(out) == safetensors_header.build(specs, {"format": "pt"})  # type: ignore[arg-type]
    data = export_header(out) + b"".join(  # type: ignore[arg-type]
        t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in want.values()
    )
    assert_same_tensors(safetensors.torch.load(data), want)
    assert json_header(data)["__metadata__"] == {"format": "pt"}


class _OutTensor:
    """What export/stream.py's header reads of an OutTensor: name, dtype, shape."""

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape


def test_a_native_step_exports_files_the_library_reads(tmp_path: Path) -> None:
    model = tensors()
    store = CheckpointStore(str(tmp_path / "store"))
    store.save(1, {"model": model})
    export_hf(store, 1, tmp_path / "out")
    [path] = list((tmp_path / "out").glob("*.safetensors"))
    with safetensors.safe_open(str(path), framework="pt") as opened:
        assert opened.metadata() == {"format": "pt"}
    assert_same_tensors(safetensors.torch.load_file(path), model)
    store.close()


# -- what the library writes, we write the same way --------------------------------------------


def test_the_library_writes_the_header_we_write() -> None:
    want = tensors()
    theirs = safetensors.torch.save(want, metadata={"format": FORMAT})
    ours = shard_bytes(want)
    their_header, our_header = json_header(theirs), json_header(ours)
    assert their_header["__metadata__"] == our_header["__metadata__"] == {"format": FORMAT}
    for name in want:  # the layout may differ (each packs in its own order); the meaning not
        assert {k: v for k, v in their_header[name].items() if k != "data_offsets"} == {
            k: v for k, v in our_header[name].items() if k != "data_offsets"
        }
    assert_same_tensors(decode_shard(bytearray(theirs), "t"), want)
    assert_same_tensors(decode_shard(bytearray(ours), "t"), want)


@pytest.mark.parametrize("dtype", sorted(safetensors_header.DTYPES, key=str))
def test_every_dtype_has_the_library_code(dtype: torch.dtype) -> None:
    data = safetensors.torch.save({"x": torch.zeros(2, dtype=dtype)})
    assert json_header(data)["x"]["dtype"] == safetensors_header.DTYPES[dtype]


def test_header_bytes_stay_as_they_were() -> None:
    """Unchanged parts of a state must give byte-identical shards, so an incremental save can
    copy them; these are the bytes the format has always had for this shard."""
    shard = Shard(
        "m-00000.safetensors",
        {
            "0": torch.zeros(2, 3, dtype=torch.float64),
            "1": torch.tensor(1.5, dtype=torch.bfloat16),
            "2": torch.empty(0, 4, dtype=torch.int32),
            "3": torch.ones(3, dtype=torch.bool),
        },
    )
    assert shard.header() == (
        b'\x10\x01\x00\x00\x00\x00\x00\x00{"__metadata__":{"format":"ckptstore-state-1"},'
        b'"0":{"dtype":"F64","shape":[2,3],"data_offsets":[0,48]},'
        b'"1":{"dtype":"BF16","shape":[],"data_offsets":[48,50]},'
        b'"2":{"dtype":"I32","shape":[0,4],"data_offsets":[50,50]},'
        b'"3":{"dtype":"BOOL","shape":[3],"data_offsets":[50,53]}} '
    )


# -- what the library rejects, we reject ---------------------------------------------------------


def with_header(entries: dict[str, Any], data: bytes, *, pad: bytes = b"") -> bytes:
    body = json.dumps(entries).encode() + pad
    return struct.pack("<Q", len(body)) + body + data


F32 = {"dtype": "F32", "shape": [2]}
REJECTED = {
    "offsets with a hole": with_header(
        {"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [12, 20]}}, bytes(20)
    ),
    "overlapping offsets": with_header(
        {"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)
    ),
    "a size that is not the shape's": with_header(
        {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)
    ),
    "bytes past the last tensor": with_header({"a": {**F32, "data_offsets": [0, 8]}}, bytes(9)),
    "a file cut short": with_header({"a": {**F32, "data_offsets": [0, 8]}}, bytes(7)),
    "a header not starting with a brace": with_header(
        {"a": {**F32, "data_offsets": [0, 8]}}, bytes(8)
    ).replace(b"{", b" ", 1),
    "metadata that is not text": with_header(
        {"__metadata__": {"step": 3}, "a": {**F32, "data_offsets": [0, 8]}}, bytes(8)
    ),
    "an unknown dtype": with_header({"a": {**F32, "dtype": "F33", "data_offsets": [0, 8]}}, b"1"),
    "a header longer than the file": struct.pack("<Q", 1000) + b"{}",
    "no header at all": b"\x01\x00",
}


@pytest.mark.parametrize("data", REJECTED.values(), ids=REJECTED.keys())
def test_a_file_the_library_rejects_is_a_corruption_error_naming_the_file(data: bytes) -> None:
    with pytest.raises(safetensors.SafetensorError):
        safetensors.deserialize(data)
    where = "s3://b/run/global_step_3/model-00000.safetensors"
    with pytest.raises(CorruptCheckpointError, match=r"global_step_3/model-00000\.safetensors"):
        decode_shard(bytearray(data), where)


@pytest.mark.parametrize("data", REJECTED.values(), ids=REJECTED.keys())
def test_a_state_whose_shard_the_library_rejects_fails_to_load(data: bytes) -> None:
    files = {f.path: f for f in encode_state({"x": torch.ones(2)}).files()}
    read = {p: bytearray(b"".join(bytes(c) for c in f.chunks())) for p, f in files.items()}
    read["x-00000.safetensors"] = bytearray(data)
    with pytest.raises(CorruptCheckpointError, match=r"global_step_3/x-00000\.safetensors"):
        decode_state(read.__getitem__, where="s3://b/run/global_step_3")


class _Source:
    """The part of a StepSource an export's header read uses, over bytes in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def where(self, path: str) -> str:
        return f"s3://b/run/global_step_3/{path}"

    def size(self, path: str) -> int:
        return len(self.data)

    def read(self, path: str, start: int, end: int) -> bytes:
        return self.data[start:end]


@pytest.mark.parametrize("data", REJECTED.values(), ids=REJECTED.keys())
def test_an_export_refuses_a_shard_header_the_library_rejects(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"global_step_3/m\.safetensors"):
        _header(_Source(data), "m.safetensors")  # type: ignore[arg-type]


def test_a_dtype_the_library_reads_and_we_do_not_is_named() -> None:
    data = with_header({"a": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}, b"12")
    safetensors.deserialize(data)  # the library accepts it
    with pytest.raises(CorruptCheckpointError, match=r"'a' has dtype F8_E8M0"):
        decode_shard(bytearray(data), "m.safetensors")


def test_the_library_judges_a_stand_in_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    judged: list[tuple[Path, int]] = []

    def spy(path: str, **options: Any) -> Any:
        judged.append((Path(path).parent, Path(path).stat().st_size))
        return safetensors.safe_open(path, **options)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(safetensors_header, "safe_open", spy)
    good, bad = shard_bytes(tensors()), REJECTED["offsets with a hole"]
    decode_shard(bytearray(good), "ok")
    with pytest.raises(CorruptCheckpointError):
        decode_shard(bytearray(bad), "bad")
    assert judged == [(tmp_path, len(good)), (tmp_path, len(bad))]
    assert list(tmp_path.iterdir()) == []


def test_without_a_temporary_directory_a_shard_still_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or full temporary directory costs the library's judgement, not the load."""
    want = tensors()
    data = bytearray(shard_bytes(want))

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", no_room)
    assert_same_tensors(decode_shard(data, "global_step_3/m-00000.safetensors"), want)
    torn = data[:8] + b"[" + data[9:]  # not a JSON object: still named as corrupt
    with pytest.raises(CorruptCheckpointError, match=r"global_step_3/m-00000\.safetensors"):
        decode_shard(torn, "global_step_3/m-00000.safetensors")
