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

from ckptstore.data.serialize import (
    PICKLE_FILE,
    SKELETON_FILE,
    decode_shard,
    decode_state,
    encode_state,
)
from ckptstore.domain.state_selection import check_keys
from ckptstore.errors import (
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    SerializationError,
    UnsafeLoadError,
)


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


# -- partial decoding: keys select parts, and only their shards are read ------------------------


def partial(state: Any, keys: list[str], **options: Any) -> tuple[Any, list[str], list[str]]:
    """``decode_state(keys=...)`` of ``state``: the result, the files read, the prefetch list."""
    files = files_of(state, **options)
    read: list[str] = []
    prefetched: list[str] = []

    def reader(path: str) -> bytearray:
        read.append(path)
        return files[path]

    back = decode_state(reader, where="t", keys=keys, prefetch=prefetched.extend)
    return back, read, prefetched


def test_files_by_key_names_the_shards_of_each_top_level_key() -> None:
    tied = torch.ones(3)
    state = {"a": {"w": tied, "x": torch.zeros(64)}, "b": {"t": tied}, "n": 1, 5: torch.ones(1)}
    index = encode_state(state, shard_size=64).files_by_key
    assert index == {
        "a": ("a-00000.safetensors", "a-00001.safetensors"),
        "b": ("a-00000.safetensors",),  # the tied tensor lives with the key saved first
        "n": (),
    }  # 5 is no str: no dotted path reaches it
    assert encode_state([torch.ones(1)]).files_by_key is None
    assert encode_state({}).files_by_key == {}


def test_keys_decode_only_the_selected_parts_from_their_shards() -> None:
    state = {
        "model": {"enc": {"w": torch.ones(4)}, "dec": {"w": torch.zeros(64)}},
        "opt": {0: torch.ones(2)},
        "step": 3,
    }
    back, read, prefetched = partial(state, ["model.enc", "step"], shard_size=64)
    assert_same(back, {"model": {"enc": state["model"]["enc"]}, "step": 3})
    assert read == [SKELETON_FILE, "model-00000.safetensors"]
    assert prefetched == ["model-00000.safetensors"]
    back, read, _ = partial(state, ["opt"], shard_size=64)
    assert_same(back, {"opt": state["opt"]})
    assert read == [SKELETON_FILE, "opt-00000.safetensors"]


def test_keys_reach_str_keys_of_dicts_with_other_keys_too() -> None:
    state = {"m": {1: torch.ones(1), "s": {"w": torch.ones(2)}}, 2: "two"}
    back, _, _ = partial(state, ["m.s.w"])
    assert_same(back, {"m": {"s": {"w": torch.ones(2)}}})


def test_a_missing_key_is_not_found_naming_what_there_is() -> None:
    with pytest.raises(NotFoundError, match=r"no key 'x'; its top-level keys are \['a', 'b'\]"):
        partial({"a": 1, "b": 2}, ["x"])
    many = {f"k{i}": i for i in range(30)}
    with pytest.raises(NotFoundError, match=r"'k19', \.\.\. \(10 more\)\]"):
        partial(many, ["x"])
    with pytest.raises(NotFoundError, match="not a dict"):
        partial([1, 2], ["0"])


@pytest.mark.parametrize("keys", ["a", b"a", [], ["a."], [".a"], [None], 3])
def test_keys_must_be_a_list_of_dotted_paths(keys: Any) -> None:
    with pytest.raises(ConfigError, match="keys"):
        check_keys(keys)
    assert check_keys(("a", "b.c")) == ("a", "b.c")
