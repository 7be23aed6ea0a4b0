"""Manifest v1: round trip and strict decoding, with plain values."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckptstore.domain.layout import check_relpath, check_step, parse_step_dir
from ckptstore.domain.manifest import KIND_STATE, SCHEMA_VERSION, Environment, FileEntry, Manifest
from ckptstore.errors import CompatibilityError, ConfigError, CorruptCheckpointError

ENV = Environment("0.1.0", "3.11.7", "2.13.0", None, "host", None, 1)


def manifest(**changes: Any) -> Manifest:
    fields: dict[str, Any] = {
        "step": 7,
        "created": 1700000000.5,
        "kind": KIND_STATE,
        "files": (
            FileEntry("actor/model.pt", 10, "0badf00d"),
            FileEntry("state.json", 2, "00000000"),
        ),
        "environment": ENV,
        "writer": "host:1:abc",
        "metadata": {"loss": 0.5, "tags": ["a"]},
    }
    fields.update(changes)
    return Manifest(**fields)


def encoded(**changes: Any) -> bytes:
    body = json.loads(manifest().encode())
    body.update(changes)
    return json.dumps(body).encode()


def test_round_trip_is_exact() -> None:
    original = manifest()
    assert Manifest.decode(original.encode(), where="m") == original
    assert original.size == 12


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"{not json", CorruptCheckpointError, "not valid JSON"),
        (manifest().encode()[:40], CorruptCheckpointError, "corrupt or truncated"),
        (b"[]", CorruptCheckpointError, "not a JSON object"),
        (encoded(schema_version=4), CompatibilityError, "newer than this ckptstore reads"),
        (encoded(schema_version="1"), CorruptCheckpointError, "expected 1"),
        (encoded(surprise=1), CorruptCheckpointError, "unknown fields \\['surprise'\\]"),
        (encoded(step=-3), CorruptCheckpointError, "non-negative integer"),
        (encoded(kind="zip"), CorruptCheckpointError, "unknown kind"),
        (encoded(metadata=[1]), CorruptCheckpointError, "metadata is not an object"),
        (
            encoded(files=[{"path": "../../etc/passwd", "size": 1, "crc32c": "00000000"}]),
            CorruptCheckpointError,
            "unsafe file path",
        ),
        (
            encoded(files=[{"path": "a", "size": -1, "crc32c": "00000000"}]),
            CorruptCheckpointError,
            "outside 0",
        ),
        (
            encoded(files=[{"path": "a", "size": 1 << 62, "crc32c": "00000000"}]),
            CorruptCheckpointError,
            "outside 0",
        ),
        (
            encoded(files=[{"path": "a", "size": 1, "crc32c": "xyz"}]),
            CorruptCheckpointError,
            "expected 8 hex digits",
        ),
        (
            encoded(files=[{"path": "a", "size": 1, "crc32c": "00000000"}] * 2),
            CorruptCheckpointError,
            "listed twice",
        ),
    ],
)
def test_strict_decoding_names_the_manifest_and_the_problem(
    data: bytes, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as caught:
        Manifest.decode(data, where="s3://b/run/global_step_7/ckptstore.manifest.json")
    assert "s3://b/run/global_step_7/ckptstore.manifest.json" in str(caught.value)


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "a/../../x",
        "/etc/passwd",
        "C:/x",
        "a\\b",
        "",
        "a//b",
        "./a",
        "a/./b",
        "x\x00y",
        "ckptstore.manifest.json",
    ],
)
def test_unsafe_relative_paths_are_rejected(path: str) -> None:
    with pytest.raises(CorruptCheckpointError, match="unsafe file path"):
        check_relpath(path, where="manifest")


@pytest.mark.parametrize(
    "path",
    [
        "a",
        "actor/model_world_size_2_rank_0.pt",
        "huggingface/x.json",
        "ünïcode/файл.bin",
        "sub/ckptstore.manifest.json",
    ],
)
def test_ordinary_relative_paths_pass(path: str) -> None:
    assert check_relpath(path, where="m") == path


@pytest.mark.parametrize("bad", [-1, 1.0, "x", None, True, "-2"])
def test_steps_must_be_non_negative_integers(bad: object) -> None:
    with pytest.raises(ConfigError, match="non-negative integer"):
        check_step(bad)


def test_step_parsing() -> None:
    assert check_step("12") == 12
    assert parse_step_dir("global_step_40") == 40
    assert parse_step_dir("global_step_040") is None
    assert parse_step_dir("global_step_x") is None
    assert parse_step_dir("other") is None


# -- schema 3: the files_by_key index -----------------------------------------------------------

INDEX = {"model": ("actor/model.pt",), "step": ()}


def test_the_index_round_trips_and_is_signed() -> None:
    indexed = manifest(files_by_key=INDEX)
    assert indexed.schema_version == SCHEMA_VERSION == 3
    assert Manifest.decode(indexed.encode(), where="m") == indexed
    assert json.loads(indexed.signed_bytes())["files_by_key"] == {
        "model": ["actor/model.pt"],
        "step": [],
    }
    other = manifest(files_by_key={"model": (), "step": ("actor/model.pt",)})
    assert other.signed_bytes() != indexed.signed_bytes()
    assert json.loads(manifest().encode())["files_by_key"] is None


def test_schema_2_manifests_have_no_index_and_keep_their_bytes() -> None:
    """Written before schema 3: decoded without the field, re-encoded (and so signed) without
    it, and a schema-2 manifest that carries it is refused as the strict decoder always did."""
    old = manifest(schema_version=2)
    assert "files_by_key" not in json.loads(old.encode())
    assert "files_by_key" not in json.loads(old.signed_bytes())
    decoded = Manifest.decode(old.encode(), where="m")
    assert decoded == old and decoded.files_by_key is None
    body = json.loads(old.encode())
    body["files_by_key"] = {"model": ["actor/model.pt"]}
    with pytest.raises(CorruptCheckpointError, match=r"unknown fields \['files_by_key'\]"):
        Manifest.decode(json.dumps(body).encode(), where="m")
    with pytest.raises(CorruptCheckpointError, match="needs schema_version 3"):
        manifest(schema_version=2, files_by_key=INDEX)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ([], "files_by_key is not an object"),
        ({"model": "actor/model.pt"}, "is not a list of paths"),
        ({"model": [1]}, "is not a list of paths"),
        ({"model": ["elsewhere.safetensors"]}, "which the manifest does not list"),
    ],
)
def test_a_malformed_index_is_corruption(index: Any, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        Manifest.decode(encoded(files_by_key=index), where="m")
