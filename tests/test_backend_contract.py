"""One contract every backend keeps, run against local disk, ``memory://`` and S3 over HTTP.

Each test opens its backend through the registry, exactly as the store does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ckptstore.backends.base import Backend, Capabilities
from ckptstore.backends.registry import open_backend
from ckptstore.errors import NotFoundError, ObjectExistsError, PreconditionFailedError

MiB = 1 << 20

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*safe against writers in this process only:RuntimeWarning"
)


def kind_of(uri: str) -> str:
    return uri.split("://")[0] if "://" in uri else "local"


@pytest.fixture
def backend(backend_uri: tuple[str, dict[str, Any]]) -> Iterator[Backend]:
    uri, options = backend_uri
    b = open_backend(uri, options)
    yield b
    b.close()


def test_is_a_backend(backend: Backend) -> None:
    assert isinstance(backend, Backend)
    assert "://" not in backend.uri or backend.uri.split("://")[0] in ("s3", "memory")


def test_write_then_read_whole_and_ranges(backend: Backend) -> None:
    assert backend.write("step/a.bin", [b"hello ", bytearray(b"wor"), memoryview(b"ld")]) == 11
    assert backend.read("step/a.bin") == b"hello world"
    assert backend.read("step/a.bin", 6) == b"world"
    assert backend.read("step/a.bin", 0, 5) == b"hello"
    assert backend.read("step/a.bin", 4, 7) == b"o w"
    assert backend.read("step/a.bin", 3, 3) == b""
    assert backend.read("step/a.bin", 20) == b""
    info = backend.stat("step/a.bin")
    assert info is not None
    assert info.path == "step/a.bin"
    assert info.size == 11
    assert info.mtime is None or info.mtime > 0


def test_read_into_fills_a_preallocated_buffer_and_reports_the_true_size(
    backend: Backend,
) -> None:
    data = os.urandom(12 * MiB + 123)  # several ranges on S3 (5 MiB parts in these tests)
    backend.write("big.bin", [data])
    out = bytearray(len(data))
    assert backend.read_into("big.bin", memoryview(out)) == len(data)
    assert out == data
    shorter = bytearray(100)  # a manifest that expects less than the object holds
    assert backend.read_into("big.bin", memoryview(shorter)) == len(data)
    assert shorter == data[:100]
    longer = bytearray(len(data) + 10)  # ... or more
    assert backend.read_into("big.bin", memoryview(longer)) == len(data)
    backend.write("empty", [b""])
    assert backend.read_into("empty", memoryview(bytearray())) == 0
    with pytest.raises(NotFoundError):
        backend.read_into("missing", memoryview(bytearray(3)))


def test_write_replaces_and_empty_objects_exist(backend: Backend) -> None:
    backend.write("x", [b"old"])
    backend.write("x", [b"new content"])
    assert backend.read("x") == b"new content"
    assert backend.write("empty", []) == 0
    assert backend.read("empty") == b""
    info = backend.stat("empty")
    assert info is not None
    assert info.size == 0


def test_read_of_missing_object_names_it(backend: Backend) -> None:
    with pytest.raises(NotFoundError, match="does not exist") as e:
        backend.read("no/such/object")
    assert backend.uri in str(e.value)
    assert "no/such/object" in str(e.value)
    with pytest.raises(NotFoundError):
        backend.read_versioned("no/such/object")
    with pytest.raises(NotFoundError):
        backend.read("no/such/object", 0, 0)


def test_stat_of_missing_is_none(backend: Backend) -> None:
    assert backend.stat("missing") is None
    assert backend.stat("missing/deeper") is None


def test_streamed_write_of_many_chunks(backend: Backend) -> None:
    """About 12 MiB in odd chunk sizes: S3 (5 MiB parts) takes the parallel multipart path."""
    data = os.urandom(12 * MiB + 12345)
    sizes = [1, 4096, 1 << 20, 3 * MiB + 7, 333_333]

    def chunks() -> Iterator[bytes | memoryview]:
        pos, i = 0, 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            piece = data[pos : pos + n]
            yield memoryview(piece) if i % 2 else piece
            pos, i = pos + n, i + 1

    assert backend.write("big/model.safetensors", chunks()) == len(data)
    assert backend.read("big/model.safetensors") == data
    assert (
        backend.read("big/model.safetensors", 5 * MiB - 10, 5 * MiB + 10)
        == data[5 * MiB - 10 : 5 * MiB + 10]
    )
    info = backend.stat("big/model.safetensors")
    assert info is not None
    assert info.size == len(data)


@pytest.mark.parametrize("size", [1000, 7 * MiB], ids=["small", "multipart"])
def test_failed_write_leaves_nothing_visible(backend: Backend, size: int) -> None:
    backend.write("kept", [b"the old version"])

    def failing() -> Iterator[bytes]:
        yield os.urandom(size)
        raise RuntimeError("serializer broke")

    for path in ("fresh", "kept"):
        with pytest.raises(RuntimeError, match="serializer broke"):
            backend.write(path, failing())
    assert backend.stat("fresh") is None
    assert backend.read("kept") == b"the old version"
    assert backend.partial_writes("") == []
    assert sorted(i.path for i in backend.list("")) == ["kept"]


def test_create_is_create_only(backend: Backend) -> None:
    backend.create("step/manifest.json", b'{"step": 1}')
    assert backend.read("step/manifest.json") == b'{"step": 1}'
    with pytest.raises(ObjectExistsError, match="already exists") as e:
        backend.create("step/manifest.json", b'{"step": "other"}')
    assert backend.uri in str(e.value)
    assert "step/manifest.json" in str(e.value)
    assert backend.read("step/manifest.json") == b'{"step": 1}'


def test_create_refuses_an_object_written_by_write(backend: Backend) -> None:
    backend.write("m", [b"payload"])
    with pytest.raises(ObjectExistsError):
        backend.create("m", b"other")
    assert backend.read("m") == b"payload"


def test_swap_is_compare_and_swap(backend: Backend) -> None:
    first = backend.swap("latest.json", b"1", None)
    data, token = backend.read_versioned("latest.json")
    assert (data, token) == (b"1", first)

    with pytest.raises(PreconditionFailedError) as e:
        backend.swap("latest.json", b"x", None)  # must be absent, is not
    assert backend.uri in str(e.value)
    assert "latest.json" in str(e.value)

    second = backend.swap("latest.json", b"2", token)
    assert second != first
    assert backend.read_versioned("latest.json") == (b"2", second)

    with pytest.raises(PreconditionFailedError):
        backend.swap("latest.json", b"stale", first)  # an old version
    with pytest.raises(PreconditionFailedError):
        backend.swap("latest.json", b"junk", "not-a-version")
    assert backend.read("latest.json") == b"2"


def test_swap_with_a_token_on_a_missing_object_fails(backend: Backend) -> None:
    token = backend.swap("p", b"1", None)
    backend.delete(["p"])
    with pytest.raises(PreconditionFailedError):
        backend.swap("p", b"2", token)
    assert backend.stat("p") is None


def test_copy(backend: Backend) -> None:
    backend.write("src/a", [b"abc" * 1000])
    backend.copy("src/a", "dst/deep/a")
    assert backend.read("dst/deep/a") == b"abc" * 1000
    assert backend.read("src/a") == b"abc" * 1000
    with pytest.raises(NotFoundError) as e:
        backend.copy("src/missing", "dst/b")
    assert "src/missing" in str(e.value)
    assert backend.stat("dst/b") is None


def test_list_and_list_dirs(backend: Backend) -> None:
    for path in (
        "global_step_1/actor/model.pt",
        "global_step_1/manifest.json",
        "global_step_10/manifest.json",
        "latest.json",
    ):
        backend.write(path, [path.encode()])
    everything = {i.path: i for i in backend.list("")}
    assert sorted(everything) == [
        "global_step_1/actor/model.pt",
        "global_step_1/manifest.json",
        "global_step_10/manifest.json",
        "latest.json",
    ]
    assert everything["latest.json"].size == len(b"latest.json")
    assert sorted(i.path for i in backend.list("global_step_1/")) == [
        "global_step_1/actor/model.pt",
        "global_step_1/manifest.json",
    ]
    assert len(list(backend.list("global_step_1"))) == 3  # a prefix, not a directory
    assert list(backend.list("nothing/")) == []
    assert backend.list_dirs("") == ["global_step_1", "global_step_10"]
    assert backend.list_dirs("global_step_1") == ["actor"]
    assert backend.list_dirs("global_step_1/") == ["actor"]
    assert backend.list_dirs("global_step_10") == []
    assert backend.list_dirs("nothing") == []


def test_list_of_an_empty_store(backend: Backend) -> None:
    assert list(backend.list("")) == []
    assert backend.list_dirs("") == []
    assert backend.partial_writes("") == []


def test_delete_is_idempotent(backend: Backend) -> None:
    backend.write("d/a", [b"1"])
    backend.write("d/b", [b"2"])
    backend.delete(["d/a", "d/missing"])
    assert backend.stat("d/a") is None
    assert backend.read("d/b") == b"2"
    backend.delete(["d/a", "d/b"])
    backend.delete([])
    assert list(backend.list("")) == []
    assert backend.list_dirs("") == []


def test_capabilities(backend: Backend, backend_uri: tuple[str, dict[str, Any]]) -> None:
    expected = {
        "local": Capabilities(
            atomic_create=True, atomic_swap=True, server_side_copy=True, parallel_writes=8
        ),
        "memory": Capabilities(atomic_create=False, atomic_swap=False, server_side_copy=True),
        # moto enforces If-None-Match and If-Match on PutObject; it echoes the CRC32C it is
        # sent without checking it, so the probe finds that the server does not verify them
        # and a save writes max_concurrency (8 by default) files at once, one PUT each
        "s3": Capabilities(
            atomic_create=True, atomic_swap=True, server_side_copy=True, parallel_writes=8
        ),
    }
    assert backend.capabilities == expected[kind_of(backend_uri[0])]
