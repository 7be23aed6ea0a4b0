"""The fast read paths of a load, and the guarantees they must keep.

Local files are read in ``READ_CHUNK`` pieces, each checksummed as it lands, into buffers that
nobody zero-fills first; S3 bodies are read with ``readinto`` in ``READ_PIECE`` pieces straight into
the destination. The pieces are made tiny here so every file crosses many of them. Each test
checks behaviour (the bytes, the errors), never timing, and each fast path's fallback.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import urllib3
from botocore.config import Config
from botocore.httpchecksum import StreamingChecksumBody
from botocore.response import StreamingBody

from ckptstore import CheckpointStore
from ckptstore.backends import local, s3_download
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.s3_progress import Cancelled, CancelToken, Meter
from ckptstore.backends.s3_transfer import Transfers, read_body_into
from ckptstore.data.verified import read_verified
from ckptstore.errors import CorruptCheckpointError
from keys import file_key
from s3faults.faultproxy import FaultProxy

PIECE = 1000
"""Bytes per read call in these tests: not a divisor of any file size, so the last piece of
every file is a short one."""


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {
        "model": {f"layer{i}": torch.randn(64, 96, generator=gen) for i in range(6)},
        "step": 3,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "READ_CHUNK", PIECE)
    monkeypatch.setattr(s3_download, "READ_PIECE", PIECE)


@pytest.fixture
def store(tmp_path: Path, small_pieces: None) -> Iterator[CheckpointStore]:
    with CheckpointStore(str(tmp_path / "store"), shard_size=40_000) as opened:
        opened.save(1, state())
        yield opened


def biggest_shard(store: CheckpointStore) -> tuple[str, Path]:
    entry = max(store.info(1).files, key=lambda f: f.size)
    assert entry.size > 20 * PIECE  # the file crosses many pieces
    return entry.path, Path(store.backend.uri) / file_key(store, 1, entry.path)


# -- local: pieces checksummed as they land --------------------------------------------------


def test_a_load_read_in_pieces_returns_the_bytes_saved(store: CheckpointStore) -> None:
    assert len(store.info(1).files) > 3  # several shards, read in parallel
    assert same(store.load(1), state())


def test_the_pieces_cover_the_file_in_order(tmp_path: Path, small_pieces: None) -> None:
    data = os.urandom(10 * PIECE + 17)
    (tmp_path / "f").write_bytes(data)
    out, seen = memoryview(bytearray(len(data))), bytearray()
    size = LocalBackend(str(tmp_path), {}).read_into_chunks("f", out, seen.extend)
    assert size == len(data) and bytes(out) == data and bytes(seen) == data


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_piece_is_corruption_naming_the_file(
    store: CheckpointStore, where: str
) -> None:
    path, file = biggest_shard(store)
    data = bytearray(file.read_bytes())
    at = {"first": 3, "middle": len(data) // 2 + 1, "last": len(data) - 2}[where]
    data[at] ^= 0x40
    file.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as caught:
        store.load(1)
    assert path in str(caught.value) and "step 1" in str(caught.value)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_file_of_another_size_is_an_error_naming_it(store: CheckpointStore, change: str) -> None:
    path, file = biggest_shard(store)
    data = file.read_bytes()
    file.write_bytes(data[: -PIECE - 5] if change == "truncated" else data + b"\0" * 3)
    expected = len(data) - PIECE - 5 if change == "truncated" else len(data) + 3
    for load in (lambda: store.load(1), lambda: store.read_file(store.info(1), path)):
        # load lists sizes first; read_file finds the size by reading
        with pytest.raises(CorruptCheckpointError, match=f"{expected} bytes") as caught:
            load()
        assert path in str(caught.value)


def test_a_proxied_backend_reads_in_the_same_pieces_as_the_backend_it_wraps(
    store: CheckpointStore,
) -> None:
    path, _ = biggest_shard(store)
    key = file_key(store, 1, path)
    size = store.info(1).manifest.file(path).size
    pieces: dict[str, list[int]] = {"plain": [], "proxied": []}
    for name, backend in (("plain", store.backend), ("proxied", BackendProxy(store.backend))):
        out = memoryview(bytearray(size))
        backend.read_into_chunks(key, out, lambda piece, n=name: pieces[n].append(len(piece)))
    assert pieces["plain"] == pieces["proxied"] and len(pieces["plain"]) > 20


def test_a_proxied_backend_checks_every_byte(store: CheckpointStore) -> None:
    proxy = BackendProxy(store.backend)
    entry = max(store.info(1).files, key=lambda f: f.size)
    good = read_verified(proxy, 1, entry)
    assert bytes(good) == bytes(read_verified(store.backend, 1, entry))
    _, file = biggest_shard(store)
    data = bytearray(file.read_bytes())
    data[len(data) // 3] ^= 1
    file.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        read_verified(proxy, 1, entry)


def test_sha256_is_checked_piece_by_piece_too(store: CheckpointStore) -> None:
    import dataclasses
    import hashlib

    entry = max(store.info(1).files, key=lambda f: f.size)
    data = store.backend.read(entry.key(1))
    right = dataclasses.replace(entry, sha256=hashlib.sha256(data).hexdigest())
    assert bytes(read_verified(store.backend, 1, right)) == data
    wrong = dataclasses.replace(entry, sha256="0" * 64)
    with pytest.raises(CorruptCheckpointError, match="SHA-256 mismatch"):
        read_verified(store.backend, 1, wrong)


def test_loads_without_read_ahead_hints_read_the_same(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "posix_fadvise")  # a platform without read-ahead hints
    assert same(store.load(1), state())


# -- S3: bodies read straight into the destination -------------------------------------------


@pytest.fixture
def transfers(s3_endpoint: str, s3_bucket: str) -> Iterator[tuple[Any, Transfers]]:
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    yield client, Transfers(client, s3_bucket, 4, 3, checksums=True)
    client.close()


@pytest.fixture(params=["into place", "urllib3 read1", "no readinto"])
def body_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each S3 test runs on every path: socket reads straight into place, urllib3's ``read1``
    (a response that does not allow that: chunked, say), and the fallback for a botocore
    whose bodies have no ``readinto``."""
    if request.param != "into place":
        monkeypatch.setattr(s3_download, "_direct", lambda raw: False)
    if request.param == "no readinto":
        monkeypatch.setattr(StreamingBody, "readinto", None)
        monkeypatch.setattr(StreamingChecksumBody, "readinto", None)
    return str(request.param)


def test_ranged_reads_in_pieces_land_every_byte_in_place(
    transfers: tuple[Any, Transfers], s3_bucket: str, small_pieces: None, body_reads: str
) -> None:
    client, moves = transfers
    data = os.urandom(7 * PIECE + 123)
    client.put_object(Bucket=s3_bucket, Key="obj", Body=data)
    for part_size in (len(data), 2 * PIECE + 1, PIECE // 3):
        out = memoryview(mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        assert moves.read_into("obj", out, part_size) == len(data)
        assert bytes(out) == data


@pytest.mark.parametrize("expected", [-500, +500])
def test_an_object_of_another_size_reports_its_true_size(
    transfers: tuple[Any, Transfers],
    s3_bucket: str,
    small_pieces: None,
    body_reads: str,
    expected: int,
) -> None:
    client, moves = transfers
    data = os.urandom(5 * PIECE)
    client.put_object(Bucket=s3_bucket, Key="obj", Body=data)
    out = memoryview(bytearray(len(data) + expected))
    assert moves.read_into("obj", out, 2 * PIECE) == len(data)
    assert bytes(out[: min(len(out), len(data))]) == data[: len(out)]


def test_a_body_longer_than_the_buffer_counts_every_byte(body_reads: str) -> None:
    class Body:  # a server that ignored the Range header
        def __init__(self, data: bytes) -> None:
            self.rest = data

        def read(self, amt: int | None = None) -> bytes:
            taken, self.rest = self.rest[: amt or None], self.rest[amt or len(self.rest) :]
            return taken

        def readinto(self, b: memoryview) -> int:
            taken = self.read(len(b))
            b[: len(taken)] = taken
            return len(taken)

    out = memoryview(bytearray(10))
    assert read_body_into(Body(b"x" * 25), out) == 25 and bytes(out) == b"x" * 10
    plain = Body(b"y" * 25)
    plain.readinto = None  # type: ignore[assignment,method-assign]
    assert read_body_into(plain, out) == 25 and bytes(out) == b"y" * 10


def test_s3_loads_in_pieces_return_the_bytes_saved_and_catch_corruption(
    s3_uri: str,
    s3_options: dict[str, Any],
    s3_client: Any,
    s3_bucket: str,
    small_pieces: None,
    body_reads: str,
) -> None:
    with CheckpointStore(s3_uri, storage_options=s3_options, shard_size=40_000) as store:
        store.save(1, state())
        assert same(store.load(1), state())
        entry = max(store.info(1).files, key=lambda f: f.size)
        key = f"run/{entry.key(1)}"
        data = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 2
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as caught:
            store.load(1)
        assert entry.path in str(caught.value)
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data[:-PIECE]))
        with pytest.raises(CorruptCheckpointError, match=f"{len(data) - PIECE} bytes"):
            store.read_file(store.info(1), entry.path)


def test_a_file_just_over_a_part_is_one_get(
    transfers: tuple[Any, Transfers], s3_bucket: str, body_reads: str
) -> None:
    """A shard is its tensors' budget (a part) plus a header of a few KiB: its read is one GET,
    not a second one for the header's bytes (which moto answers by reading the whole object
    again); a tail longer than ``s3_options.tail`` (an eighth of so small a part) still gets a
    range of its own."""
    client, moves = transfers
    gets: list[str] = []
    client.meta.events.register("before-call.s3.GetObject", lambda **_: gets.append("GET"))
    part = 4 * PIECE
    for size, expected in ((part + 100, 1), (part + part // 8 + 1, 2), (3 * part + 400, 3)):
        data = os.urandom(size)
        client.put_object(Bucket=s3_bucket, Key="obj", Body=data)
        gets.clear()
        out = memoryview(bytearray(size))
        assert moves.read_into("obj", out, part) == size
        assert bytes(out) == data
        assert len(gets) == expected, (size, gets)


# -- S3 bodies read straight into place: the connection after it -----------------------------


@pytest.fixture
def keep_alive(s3_endpoint: str, s3_bucket: str) -> Iterator[tuple[FaultProxy, Any]]:
    """A client reaching moto through the fault proxy, which keeps connections open between
    requests as S3 does (moto's server closes each one after its answer). Whole-object GETs
    are not checksummed by botocore here, as a load's ranged GETs are not."""
    with FaultProxy(s3_endpoint) as proxy:
        config = Config(response_checksum_validation="when_required")
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, config=config)
        yield proxy, client
        client.close()


def test_bodies_read_into_place_give_their_connection_back(
    keep_alive: tuple[FaultProxy, Any], s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads bypass urllib3, which returns a connection to its pool only when it read the
    end itself: here the connection must still serve the next request, and no byte may pass
    through urllib3's reads (which copy)."""
    proxy, client = keep_alive
    data = os.urandom(3 << 20)
    client.put_object(Bucket=s3_bucket, Key="obj", Body=data)
    through_urllib3: list[int] = []
    monkeypatch.setattr(
        urllib3.response.HTTPResponse, "read1", lambda *a, **k: through_urllib3.append(1)
    )
    moves = Transfers(client, s3_bucket, 4, 3, checksums=True)
    opened = proxy.connections
    for _ in range(3):
        out = memoryview(bytearray(len(data)))
        assert moves.read_into("obj", out, len(data)) == len(data)
        assert bytes(out) == data
    assert proxy.connections == opened  # the put's connection served all three reads
    assert not through_urllib3


def test_a_body_given_up_midway_closes_its_connection(
    keep_alive: tuple[FaultProxy, Any], s3_bucket: str
) -> None:
    """A read stopped mid-body (cancelled here; stalled, past its deadline) leaves the rest of
    that body on its connection: the connection is closed, never handed to the next request,
    which would read those bytes as its answer."""
    proxy, client = keep_alive
    first, second = os.urandom(3 << 20), os.urandom(1 << 20)
    client.put_object(Bucket=s3_bucket, Key="first", Body=first)
    client.put_object(Bucket=s3_bucket, Key="second", Body=second)
    token = CancelToken()
    meter = Meter(60.0, len(first), token, on_bytes=lambda n: token.cancel("given up"))
    out = memoryview(bytearray(len(first)))
    body = client.get_object(Bucket=s3_bucket, Key="first")["Body"]
    assert s3_download._direct(body._raw_stream)  # the path under test
    connection = body._raw_stream.connection
    with pytest.raises(Cancelled, match="given up"):
        read_body_into(body, out, meter)
    assert connection.sock is None  # closed, not back in the pool
    opened = proxy.connections
    assert client.get_object(Bucket=s3_bucket, Key="second")["Body"].read() == second
    assert proxy.connections == opened + 1  # a new connection, not the abandoned one
