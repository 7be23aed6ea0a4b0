"""The backend contract, as pytest test classes that a backend's own tests subclass.

Every backend ckptstore ships runs it (``tests/test_backend_contract.py``: a local directory,
``memory://``, and S3 on a real server over HTTP), and a third-party backend (one registered in
the ``ckptstore.backends`` entry-point group) runs it the way fsspec implementations run
``fsspec/tests/abstract/``: subclass :class:`BackendContract` and give it a ``backend`` fixture
that yields an empty backend on a fresh root::

    from ckptstore.testing.contract import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path): yield MyBackend(f"my://{tmp_path}", {})

The mixins (:class:`ReadWriteContract`, :class:`ConditionalWriteContract`,
:class:`ListingContract`) can also be taken one at a time. What a backend guarantees is read
from its own :class:`~ckptstore.backends.base.Capabilities`, never from a table here: the
races between independent clients run only where ``atomic_create`` / ``atomic_swap`` claim
them, and only if the subclass also gives a ``reopen`` fixture, a function that opens another
instance on the same root as another process would (the default, ``None``, skips them).

The assertions are what users see: contents and sizes, and error types and messages (a
NotFoundError names the store's URI and the path; ``create`` over an existing object raises
ObjectExistsError; a stale ``swap`` raises PreconditionFailedError). Large writes are 12 MiB
and more, so a backend configured with 5 MiB parts runs its multipart path.

This module imports pytest; nothing else in ckptstore does, so users who never run these tests
need not install it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

from ckptstore.backends.base import Backend, Capabilities, ObjectAddress
from ckptstore.errors import ConfigError, NotFoundError, ObjectExistsError, PreconditionFailedError

__all__ = [
    "BackendContract",
    "ConditionalWriteContract",
    "ListingContract",
    "ReadWriteContract",
    "Reopen",
]

MiB = 1 << 20
RACERS = 8
Reopen = Callable[[], Backend]
"""Opens another, independent instance of the backend under test, on the same root."""

_quiet = pytest.mark.filterwarnings(
    # a backend without conditional writes warns once that it is safe within one process only
    "ignore:.*safe against writers in this process only:RuntimeWarning"
)


def _race(attempt: Callable[[int], bool], racers: int = RACERS) -> list[int]:
    """Run ``attempt(i)`` in ``racers`` threads released at once; the ``i`` that returned True."""
    barrier = threading.Barrier(racers)
    winners: list[int] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            if attempt(i):
                winners.append(i)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return winners


@_quiet
class ReadWriteContract:
    """Whole and ranged reads, streamed and failed writes, copies (within the backend, and in
    from an address of its domain), and what is missing."""

    def test_is_a_backend(self, backend: Backend) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.uri, str)
        assert backend.uri

    def test_write_then_read_whole_and_ranges(self, backend: Backend) -> None:
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
        self, backend: Backend
    ) -> None:
        data = os.urandom(12 * MiB + 123)  # several ranges where reads go in parts
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
        with pytest.raises(NotFoundError, match="does not exist") as e:
            backend.read_into("missing", memoryview(bytearray(3)))
        assert backend.uri in str(e.value)
        assert "missing" in str(e.value)

    def test_write_replaces_and_empty_objects_exist(self, backend: Backend) -> None:
        backend.write("x", [b"old"])
        backend.write("x", [b"new content"])
        assert backend.read("x") == b"new content"
        assert backend.write("empty", []) == 0
        assert backend.read("empty") == b""
        info = backend.stat("empty")
        assert info is not None
        assert info.size == 0

    def test_read_of_missing_object_names_it(self, backend: Backend) -> None:
        with pytest.raises(NotFoundError, match="does not exist") as e:
            backend.read("no/such/object")
        assert backend.uri in str(e.value)
        assert "no/such/object" in str(e.value)
        with pytest.raises(NotFoundError):
            backend.read_versioned("no/such/object")
        with pytest.raises(NotFoundError):
            backend.read("no/such/object", 0, 0)

    def test_stat_of_missing_is_none(self, backend: Backend) -> None:
        assert backend.stat("missing") is None
        assert backend.stat("missing/deeper") is None

    def test_streamed_write_of_many_chunks(self, backend: Backend) -> None:
        """About 12 MiB in odd chunk sizes: a backend with 5 MiB parts writes several."""
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
    def test_failed_write_leaves_nothing_visible(self, backend: Backend, size: int) -> None:
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

    def test_copy(self, backend: Backend) -> None:
        backend.write("src/a", [b"abc" * 1000])
        backend.copy("src/a", "dst/deep/a")
        assert backend.read("dst/deep/a") == b"abc" * 1000
        assert backend.read("src/a") == b"abc" * 1000
        with pytest.raises(NotFoundError) as e:
            backend.copy("src/missing", "dst/b")
        assert backend.uri in str(e.value)
        assert "src/missing" in str(e.value)
        assert backend.stat("dst/b") is None

    def test_address_and_copy_in(self, backend: Backend) -> None:
        """``address`` is None (no server-side copy across backends: ``copy_in`` refuses), or
        names one domain for every path, and ``copy_in`` from it copies whole."""
        backend.write("src/a", [b"xyz" * 1000])
        address = backend.address("src/a")
        if address is None:
            with pytest.raises(ConfigError, match="stream the bytes"):
                backend.copy_in(ObjectAddress("elsewhere", "bucket", "key"), "dst/a", 3000)
            assert backend.stat("dst/a") is None
            return
        other = backend.address("dst/deep/a")
        assert other is not None and other.domain == address.domain
        backend.copy_in(address, "dst/deep/a", 3000)
        assert backend.read("dst/deep/a") == b"xyz" * 1000
        assert backend.read("src/a") == b"xyz" * 1000


@_quiet
class ConditionalWriteContract:
    """``create`` and ``swap``: the two writes the commit protocol rides on."""

    @pytest.fixture
    def reopen(self) -> Reopen | None:
        """Override to return a function opening another instance on the same root."""
        return None

    def test_create_is_create_only(self, backend: Backend) -> None:
        backend.create("step/manifest.json", b'{"step": 1}')
        assert backend.read("step/manifest.json") == b'{"step": 1}'
        with pytest.raises(ObjectExistsError, match="already exists") as e:
            backend.create("step/manifest.json", b'{"step": "other"}')
        assert backend.uri in str(e.value)
        assert "step/manifest.json" in str(e.value)
        assert backend.read("step/manifest.json") == b'{"step": 1}'

    def test_create_refuses_an_object_written_by_write(self, backend: Backend) -> None:
        backend.write("m", [b"payload"])
        with pytest.raises(ObjectExistsError):
            backend.create("m", b"other")
        assert backend.read("m") == b"payload"

    def test_swap_is_compare_and_swap(self, backend: Backend) -> None:
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

    def test_swap_with_a_token_on_a_missing_object_fails(self, backend: Backend) -> None:
        token = backend.swap("p", b"1", None)
        backend.delete(["p"])
        with pytest.raises(PreconditionFailedError):
            backend.swap("p", b"2", token)
        assert backend.stat("p") is None

    def test_create_is_atomic_between_threads(self, backend: Backend) -> None:
        """Within one process every backend is atomic, with or without conditional writes."""
        self._race_create(backend, [backend] * RACERS)

    def test_swap_is_atomic_between_threads(self, backend: Backend) -> None:
        self._race_swap(backend, [backend] * RACERS)

    def test_create_is_atomic_across_clients(self, backend: Backend, reopen: Reopen | None) -> None:
        if not backend.capabilities.atomic_create:
            pytest.skip("capabilities.atomic_create is False: atomic within one process only")
        with self._clients(reopen) as clients:
            self._race_create(backend, clients)

    def test_swap_is_atomic_across_clients(self, backend: Backend, reopen: Reopen | None) -> None:
        if not backend.capabilities.atomic_swap:
            pytest.skip("capabilities.atomic_swap is False: atomic within one process only")
        with self._clients(reopen) as clients:
            self._race_swap(backend, clients)

    def test_a_lost_guarantee_is_warned_once_naming_the_store(self, backend: Backend) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            caps = backend.capabilities
            backend.create("a", b"1")
            token = backend.swap("b", b"1", None)
            backend.create("c", b"1")
            backend.swap("b", b"2", token)
        lost = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if caps.atomic_create and caps.atomic_swap:
            assert lost == []
        else:
            assert lost, "a backend without atomic create or swap must say so"
            assert len(lost) <= 2, lost  # once per lost guarantee, not once per call
            assert all(backend.uri in message for message in lost), lost

    @staticmethod
    def _race_create(backend: Backend, clients: list[Backend]) -> None:
        def attempt(i: int) -> bool:
            try:
                clients[i].create("race/manifest.json", str(i).encode())
            except ObjectExistsError:
                return False
            return True

        winners = _race(attempt, len(clients))
        assert len(winners) == 1, winners
        assert backend.read("race/manifest.json") == str(winners[0]).encode()

    @staticmethod
    def _race_swap(backend: Backend, clients: list[Backend]) -> None:
        start = backend.swap("race/latest.json", b"start", None)

        def attempt(i: int) -> bool:
            try:
                clients[i].swap("race/latest.json", str(i).encode(), start)
            except PreconditionFailedError:
                return False
            return True

        winners = _race(attempt, len(clients))
        assert len(winners) == 1, winners
        assert backend.read("race/latest.json") == str(winners[0]).encode()

    @staticmethod
    def _clients(reopen: Reopen | None) -> _Clients:
        if reopen is None:
            pytest.skip("no reopen fixture: cannot open independent clients")
        return _Clients(reopen)


class _Clients:
    """``RACERS`` independent instances from ``reopen``, closed on exit."""

    def __init__(self, reopen: Reopen) -> None:
        self._reopen = reopen
        self._opened: list[Backend] = []

    def __enter__(self) -> list[Backend]:
        self._opened = [self._reopen() for _ in range(RACERS)]
        for client in self._opened:
            assert client.capabilities  # probe now, so the racers' writes meet at the server
        return self._opened

    def __exit__(self, *exc: object) -> None:
        for client in self._opened:
            client.close()


@_quiet
class ListingContract:
    """``list``, ``list_dirs``, ``delete``, and what a backend says it can do."""

    def test_list_and_list_dirs(self, backend: Backend) -> None:
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

    def test_list_of_an_empty_store(self, backend: Backend) -> None:
        assert list(backend.list("")) == []
        assert backend.list_dirs("") == []
        assert backend.partial_writes("") == []

    def test_delete_is_idempotent(self, backend: Backend) -> None:
        backend.write("d/a", [b"1"])
        backend.write("d/b", [b"2"])
        backend.delete(["d/a", "d/missing"])
        assert backend.stat("d/a") is None
        assert backend.read("d/b") == b"2"
        backend.delete(["d/a", "d/b"])
        backend.delete([])
        assert list(backend.list("")) == []
        assert backend.list_dirs("") == []

    def test_capabilities_are_a_stable_value(self, backend: Backend) -> None:
        caps = backend.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.parallel_writes >= 1
        assert backend.capabilities == caps


class BackendContract(ReadWriteContract, ConditionalWriteContract, ListingContract):
    """The whole contract: subclass it as ``Test<YourBackend>`` with a ``backend`` fixture."""
