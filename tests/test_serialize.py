"""The safe native format: exact round trips, clear refusals, no pickle unless asked."""

from __future__ import annotations

import io
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ckptstore.errors import CorruptCheckpointError, SerializationError, UnsafeLoadError
from ckptstore.serialize import PICKLE_FILE, SKELETON_FILE, decode_shard, decode_state, encode_state


def files_of(state: Any, **options: Any) -> dict[str, bytearray]:
    encoded = encode_state(state, **options)
    files = {}
    for f in encoded.files():
        data = bytearray(b"".join(bytes(c) for c in f.chunks()))
        assert len(data) == f.size, f"{f.path}: announced size differs from the bytes produced"
        files[f.path] = data
    return files


def round_trip(state: Any, **options: Any) -> Any:
    return decode_state(files_of(state, **options).__getitem__, where="test", allow_pickle=True)


def assert_same(a: Any, b: Any) -> None:
    """Equal structure, and tensors bit-identical with the same dtype and shape."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(raw_bytes(a), raw_bytes(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_round_trips_bit_identical(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=gen)
    tensor = raw.view(dtype) if dtype.itemsize <= 8 and dtype != torch.bool else raw.bool()
    back = round_trip({"t": tensor, "scalar": tensor.reshape(-1)[0].clone()})
    assert_same(back["t"], tensor)
    assert back["scalar"].shape == torch.Size([])


def test_nan_payloads_and_negative_zero_survive() -> None:
    tensor = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    assert_same(round_trip({"t": tensor})["t"], tensor)


def test_model_and_optimizer_state_round_trip_and_reload() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    back = round_trip(state)
    assert_same(back, state)
    model.load_state_dict(back["model"])
    opt.load_state_dict(back["optimizer"])  # int keys and param groups restored exactly


def test_plain_python_values_round_trip_exactly() -> None:
    state = {
        "ints": [0, -1, 2**70],
        "floats": (0.1, 1e308, float("nan"), float("inf"), -float("inf")),
        "nested": {"a": [{"b": (None, True, False, "s")}]},
        "int_keys": {0: "zero", 1: {2: 3}},
        "tuple_keys": {(1, "x"): 1.5},
        "dollar": {"$tensor": "not a tensor", "$x": 1},
        "empty": ({}, [], ()),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "unicode": "ünïcødé ✓",
        "ordered": OrderedDict([("z", 1), ("a", 2)]),
    }
    back = round_trip(state)
    assert_same(back, {**state, "ordered": dict(state["ordered"])})


def test_views_non_contiguous_and_tied_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"transposed": base.t(), "slice": base[1:3, ::2], "a": base, "tied": base}
    back = round_trip(state)
    assert torch.equal(back["transposed"], base.t())
    assert torch.equal(back["slice"], base[1:3, ::2])
    assert back["tied"] is back["a"], "tensors sharing memory come back as one tensor"


def test_large_states_are_split_into_shards_that_safetensors_reads() -> None:
    state = {"w": [torch.full((256,), float(i)) for i in range(10)]}  # 1 KiB each
    files = files_of(state, shard_size=3000)
    shards = sorted(p for p in files if p.endswith(".safetensors"))
    assert len(shards) == 5  # two 1 KiB tensors fit in 3000 bytes
    for path in shards:  # the files are plain safetensors, readable by other tools
        safetensors.torch.load(bytes(files[path]))
    assert_same(decode_state(files.__getitem__, where="t"), state)


def test_top_level_keys_get_files_of_their_own() -> None:
    state = {
        "model": {"w": torch.ones(2)},
        "optimizer": {0: torch.ones(2)},
        "a/b": torch.ones(1),
        "loose": [torch.ones(1)],
        3: torch.ones(1),
    }
    shards = {s.path for s in encode_state(state).shards}
    assert shards == {
        "model-00000.safetensors",
        "optimizer-00000.safetensors",
        "a_b-00000.safetensors",
        "loose-00000.safetensors",
        "tensors-00000.safetensors",
    }


def test_tensor_offsets_stay_aligned_when_dtypes_mix() -> None:
    state = {"m": {"b": torch.ones(3, dtype=torch.bool), "d": torch.ones(3, dtype=torch.float64)}}
    files = files_of(state)
    tensors = decode_shard(files["m-00000.safetensors"], "t")
    assert all(t.data_ptr() % t.element_size() == 0 for t in tensors.values())


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"a": {"b": Opaque()}}, "state['a']['b']"),
        ({"opt": [1, {2: object()}]}, "state['opt'][1][2]"),
        ({"s": {1, 2}}, "state['s']"),
        ({"np": __import__("numpy").zeros(2)}, "state['np']"),
        ({"sparse": torch.eye(2).to_sparse()}, "state['sparse']"),
        ({"meta": torch.empty(2, device="meta")}, "state['meta']"),
        ({"bytes": b"x"}, "state['bytes']"),
    ],
)
def test_unsupported_objects_are_refused_at_save_naming_where_they_are(
    state: Any, where: str
) -> None:
    with pytest.raises(SerializationError) as caught:
        encode_state(state)
    assert where in str(caught.value)
    assert "allow_pickle=True" in str(caught.value) or "tensor" in str(caught.value)


def test_reference_cycles_are_refused() -> None:
    state: dict[str, Any] = {"a": []}
    state["a"].append(state)
    with pytest.raises(SerializationError, match="reference cycle"):
        encode_state(state)


def test_pickle_needs_opt_in_on_both_sides(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    files = files_of({"obj": Exploding(str(marker)), "x": 1}, allow_pickle=True)
    assert PICKLE_FILE in files
    with pytest.raises(UnsafeLoadError, match="allow_pickle=True"):
        decode_state(files.__getitem__, where="s3://b/run/global_step_1")
    assert not marker.exists(), "refusing to load must not have run any pickle code"


def test_a_planted_pickle_file_is_never_read_without_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    files = files_of({"x": torch.ones(2)})
    buffer = io.BytesIO()
    torch.save([Exploding(str(marker))], buffer)
    files[PICKLE_FILE] = bytearray(buffer.getvalue())
    assert_same(decode_state(files.__getitem__, where="t"), {"x": torch.ones(2)})
    assert not marker.exists()


class Exploding:
    """Unpickling this creates a file: proof that pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda f: f.__setitem__(SKELETON_FILE, bytearray(b"{")),
        lambda f: f.__setitem__(SKELETON_FILE, bytearray(json.dumps({"format": "x"}).encode())),
        lambda f: f.__setitem__("x-00000.safetensors", f["x-00000.safetensors"][:20]),
        lambda f: f.__setitem__("x-00000.safetensors", bytearray(b"\xff" * 16)),
    ],
)
def test_malformed_files_are_corruption_errors(mutate: Any) -> None:
    files = files_of({"x": torch.ones(4)})
    mutate(files)
    with pytest.raises(CorruptCheckpointError, match="global_step_3"):
        decode_state(files.__getitem__, where="s3://b/run/global_step_3")
