"""Replication (replication/, data/copying.py): committed steps mirrored from one store into
another, over HTTP on moto where S3 is involved.

Two endpoints are two moto servers on 127.0.0.1 (the session's and one more; moto keeps one
in-memory state per process, so bucket names differ, but each side has its own endpoint and
credentials, so every byte streams through this process). A follower is driven pass by pass:
its ``sleep`` is where the source commits its next step, so the schedule is fixed and
``latest`` is checked after every pass, without racing threads or clocks. Faults are injected
by the FaultyBackend on top of the real backends.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, LeaseHeldError, UntrustedCheckpointError
from ckptstore.backends.base import Backend, Chunk, ObjectAddress, ObjectInfo
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.backends.s3 import S3Backend
from ckptstore.data.copying import memory_bound
from ckptstore.domain.step_index import INDEX_DIR
from ckptstore.errors import (
    BackendError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptstore.replication.replicator import DOOMED, FENCED, ReplicationReport, follow, replicate
from ckptstore.testing.s3server import LocalS3Server
from counting import CountingBackend
from faults import FaultyBackend, InjectedFault

MiB = 1 << 20
KEY = "0123456789abcdef-replication-key"


def state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(5000, generator=generator), "b": torch.full((3,), float(step))}


def files_of(root: Path, step: int, big: int = 0) -> Path:
    """A step directory of several files: small ones, an empty one, and ``big`` bytes."""
    folder = root / f"step{step}"
    (folder / "actor").mkdir(parents=True)
    for rank in range(3):
        (folder / "actor" / f"rank_{rank}.pt").write_bytes(os.urandom(50_000 + rank))
    (folder / "empty.txt").write_bytes(b"")
    if big:
        (folder / "big.bin").write_bytes(os.urandom(big))
    return folder


def same_contents(a: CheckpointStore, b: CheckpointStore, step: int) -> bool:
    info = a.info(step)
    return all(
        bytes(a.read_file(info, f.path)) == bytes(b.read_file(b.info(step), f.path))
        for f in info.files
    )


def latest_of(store: CheckpointStore) -> int | None:
    latest = store.latest()
    return latest.step if latest is not None else None


@pytest.fixture(scope="module")
def other_endpoint(aws_env: None) -> Iterator[LocalS3Server]:
    with LocalS3Server() as server:
        yield server


@pytest.fixture
def two_endpoints(
    s3_uri: str, s3_options: dict[str, Any], other_endpoint: LocalS3Server
) -> tuple[tuple[str, dict[str, Any]], tuple[str, dict[str, Any]]]:
    """``(uri, options)`` of a source on the session's server and a destination on another
    server, with credentials of its own; 5 MiB parts, so a 12 MiB file goes multipart."""
    bucket = f"dst-{os.urandom(5).hex()}"
    other_endpoint.create_bucket(bucket)
    dst = (f"s3://{bucket}/mirror", {**other_endpoint.storage_options(), "part_size": 5 * MiB})
    return (s3_uri, {**s3_options, "part_size": 5 * MiB}), dst


def opened(side: tuple[str, dict[str, Any]], **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(side[0], storage_options=side[1], **kwargs)


# -- following a run across two endpoints ------------------------------------------------------


def test_follow_between_two_endpoints_carries_new_steps_and_latest_never_moves_back(
    two_endpoints: Any, tmp_path: Path
) -> None:
    src_side, dst_side = two_endpoints
    src, dst = opened(src_side), opened(dst_side)
    src.push_dir(10, files_of(tmp_path, 10, big=12 * MiB))
    src.save(20, state(20))
    upcoming = [30, 40, 50]
    seen: list[tuple[int | None, list[int]]] = []
    pauses: list[float] = []

    def on_pass(report: ReplicationReport) -> None:
        latest = latest_of(opened(dst_side, lease=False))  # another reader, by the URI alone
        assert not seen or seen[-1][0] is None or (latest or -1) >= seen[-1][0]
        seen.append((latest, [i.step for i in report.copied]))

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if upcoming and len(pauses) % 2 == 1:  # a new step every other pause
            step = upcoming.pop(0)
            src.save(step, state(step))

    follow(src, dst, interval=1, max_interval=4, on_pass=on_pass, passes=7, sleep=sleep)
    assert seen == [
        (20, [10, 20]),
        (30, [30]),
        (30, []),
        (40, [40]),
        (40, []),
        (50, [50]),
        (50, []),
    ]
    assert pauses == [1, 1, 1.5, 1, 1.5, 1]  # back to `interval` after a pass that copied
    resumed = opened(dst_side, lease=False)  # another cluster: the URI and its settings alone
    assert resumed.info(50).manifest == src.info(50).manifest
    loaded = resumed.load()
    assert all(torch.equal(loaded[k], state(50)[k]) for k in ("w", "b"))
    assert same_contents(src, resumed, 10)
    assert all(r.ok for r in resumed.verify_all())
    src.close()
    dst.close()


def test_an_idle_pass_is_one_listing_per_side(tmp_path: Path) -> None:
    source = CountingBackend(open_backend(str(tmp_path / "src"), {}))
    target = CountingBackend(open_backend(str(tmp_path / "dst"), {}))
    src = CheckpointStore(str(tmp_path / "src"), backend=source)
    dst = CheckpointStore(str(tmp_path / "dst"), backend=target)
    for step in (1, 2):
        src.save(step, state(step))
    counts: list[tuple[dict[str, int], dict[str, int]]] = []

    def on_pass(_: ReplicationReport) -> None:
        counts.append((dict(source.take()), dict(target.take())))

    source.take()
    follow(src, dst, interval=0, on_pass=on_pass, passes=3, sleep=lambda _: None)
    assert [i.step for i in dst.list()] == [1, 2]
    for idle in counts[1:]:
        assert idle == ({"index GET": 1, "pointer GET": 1}, {"index GET": 1})  # step indexes
    src.close()
    dst.close()


def test_the_destinations_retention_applies_and_nothing_is_copied_to_be_deleted(
    tmp_path: Path,
) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    for step in (1, 2, 3, 4):
        src.save(step, state(step))
    target = Writes(open_backend(str(tmp_path / "dst"), {}))
    dst = CheckpointStore(str(tmp_path / "dst"), backend=target, keep_last=2)
    report = replicate(src, dst)
    assert [i.step for i in report.copied] == [3, 4]
    assert report.excluded == {1: DOOMED, 2: DOOMED}
    src.save(5, state(5))
    target.payload.clear()
    again = replicate(src, dst)
    assert [i.step for i in again.copied] == [5]
    assert {p.split("/")[0] for p in target.payload} == {"global_step_5"}
    assert [i.step for i in dst.list()] == [4, 5]
    src.close()
    dst.close()


# -- kills, corruption, signatures ---------------------------------------------------------------


class Writes(BackendProxy):
    """Records the payload files written (streamed or copied in), by path."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.payload: list[str] = []

    def _record(self, path: str) -> None:
        if "/.attempt-" in path and not path.endswith(".ckptstore-attempt.json"):
            self.payload.append(path)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        size = super().write(path, chunks)
        self._record(path)
        return size

    def copy_in(self, source: ObjectAddress, dst: str, size: int) -> None:
        super().copy_in(source, dst, size)
        self._record(dst)


@pytest.mark.parametrize("target", ["local", "s3", "s3 server-side"])
@pytest.mark.slow
def test_a_replication_killed_at_every_point_resumes_without_copying_finished_files(
    target: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Streamed into a local directory and into S3 (from a local source), and server-side
    between two buckets of one S3 endpoint (copy_in is a mutating operation too). Each point
    copies into a bucket of its own (moto lists in time proportional to every key of a bucket)
    through one backend, so the server's capabilities are probed once per point."""
    client = request.getfixturevalue("s3_client") if target != "local" else None

    def backend(uri: str) -> Backend:  # one S3 client for all: creating one takes 0.2 s
        if uri.startswith("s3://"):
            return S3Backend(uri, {}, client=client)
        return open_backend(uri, {})

    src_uri = str(tmp_path / "src")
    if target == "s3 server-side":
        src_uri = f"{request.getfixturevalue('s3_uri')}-source"
    src = CheckpointStore(src_uri, backend=backend(src_uri))
    src.push_dir(1, files_of(tmp_path, 1))
    src.push_dir(2, files_of(tmp_path, 2))
    points = 0

    for fail_at in range(1, 100):
        uri = str(tmp_path / f"dst{fail_at}")
        if client is not None:
            bucket = f"{request.getfixturevalue('s3_bucket')}-{fail_at}"
            client.create_bucket(Bucket=bucket)
            uri = f"s3://{bucket}/run"
        dst = backend(uri)
        faulty = FaultyBackend(dst, fail_at=fail_at, mode="crash")
        dying = CheckpointStore(uri, backend=faulty, lease=False)
        try:
            replicate(src, dying)
        except InjectedFault:
            points += 1
        else:
            break  # past the last mutating operation: the first run completed
        finished = {o.path: o.size for o in dst.list("")}
        after_kill = CheckpointStore(uri, backend=dst, lease=False)
        committed = [i.step for i in after_kill.list()]
        pointer = after_kill.resolver.catalog.pointer_or_none()
        if pointer is not None:  # latest names a step whose copy is complete
            assert pointer.step in committed and after_kill.verify(pointer.step).ok
        writes = Writes(dst)
        resumed = CheckpointStore(uri, backend=writes, lease=False)
        report = replicate(src, resumed)
        assert not set(writes.payload) & set(finished), f"fail_at={fail_at}: copied again"
        assert (report.bytes_server_side > 0) == (
            target == "s3 server-side" and bool(writes.payload)
        )
        staged = [
            finished[key]
            for key in _payload_keys(src)
            if key in finished and int(key.split("/")[0].rpartition("_")[2]) not in committed
        ]
        assert report.bytes_resumed == sum(staged) and report.files_resumed == len(staged)
        assert [i.step for i in resumed.list()] == [1, 2]
        assert latest_of(resumed) == 2
        assert all(same_contents(src, resumed, s) for s in (1, 2))
        assert all(r.ok for r in resumed.verify_all())
    # per step: 1 marker, 4 files, the step announced in the index, the manifest, its summary
    # added; the pointer, once
    assert points == 2 * (1 + 4 + 3) + 1
    src.close()


def _payload_keys(store: CheckpointStore) -> list[str]:
    return [f.key(i.step) for i in store.list() for f in i.files]


@pytest.mark.parametrize("route", ["two endpoints", "same endpoint"])
def test_a_corrupt_source_file_is_refused_and_nothing_is_committed_for_its_step(
    route: str, two_endpoints: Any, s3_client: Any, s3_bucket: str, tmp_path: Path
) -> None:
    src_side, dst_side = two_endpoints
    if route == "same endpoint":  # server-side copies: the source is checked before them
        dst_side = (f"s3://{s3_bucket}/mirror-same", src_side[1])
    src = opened(src_side)
    src.save(1, state(1))
    info = src.push_dir(2, files_of(tmp_path, 2))
    bad = next(f for f in info.files if f.size > 0)
    bucket, _, prefix = src_side[0][len("s3://") :].partition("/")
    key = f"{prefix}/{bad.key(2)}"
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    dst = opened(dst_side)
    report = replicate(src, dst)
    assert [i.step for i in report.copied] == [1]
    error = report.failed[2]
    assert isinstance(error, CorruptCheckpointError)
    assert f"{src.uri}/{bad.key(2)}" in str(error) and "checksum mismatch" in str(error)
    assert f"Step 2 was not replicated to {dst.uri}: nothing was committed" in str(error)
    assert [i.step for i in dst.list()] == [1] and latest_of(dst) == 1
    assert [o.path for o in dst.backend.list("global_step_2/")] == []  # staged files removed
    assert route == "two endpoints" or report.bytes_server_side > 0
    again = replicate(src, dst)
    assert again.failed and [i.step for i in again.copied] == []  # a new pass checks again
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        src.copy_to(dst, [2])
    src.close()
    dst.close()


def test_a_missing_source_file_is_refused_naming_it(tmp_path: Path) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    src.save(1, state(1))
    info = src.push_dir(2, files_of(tmp_path, 2))
    gone = next(f for f in info.files if f.size > 0)
    (tmp_path / "src" / gone.key(2)).unlink()
    dst = CheckpointStore(str(tmp_path / "dst"))
    report = replicate(src, dst)
    error = report.failed[2]
    assert isinstance(error, IncompleteCheckpointError)
    assert f"{src.uri}/{gone.key(2)} is missing" in str(error)
    assert "its retention deleted the step meanwhile" in str(error)
    assert [i.step for i in dst.list()] == [1] and latest_of(dst) == 1
    assert not (tmp_path / "dst" / "global_step_2").exists() or not any(
        p.is_file() for p in (tmp_path / "dst" / "global_step_2").rglob("*")
    )
    src.close()
    dst.close()


def test_a_file_gone_from_the_destination_before_its_commit_ends_the_pass_only(
    tmp_path: Path,
) -> None:
    """The destination's side failing is no fault of the source's step: the pass raises, keeps
    what it finished, and the next pass commits the step (not a ``failed`` step)."""

    class Vanishing(Writes):
        listings = 0

        def list(self, prefix: str) -> Iterator[ObjectInfo]:
            found = list(super().list(prefix))
            if prefix == "global_step_1/":
                self.listings += 1
                if self.listings == 2:  # the confirming listing: one file gone (a gc?)
                    found = [o for o in found if not o.path.endswith("rank_0.pt")]
            return iter(found)

    src = CheckpointStore(str(tmp_path / "src"))
    src.push_dir(1, files_of(tmp_path, 1))
    target = Vanishing(open_backend(str(tmp_path / "dst"), {}))
    dst = CheckpointStore(str(tmp_path / "dst"), backend=target)
    with pytest.raises(IncompleteCheckpointError, match="vanished or changed size"):
        replicate(src, dst)
    assert dst.list() == []
    target.payload.clear()
    report = replicate(src, dst)
    assert [i.step for i in report.copied] == [1] and not report.failed
    assert target.payload == [] and report.files_resumed == 4  # nothing copied again
    src.close()
    dst.close()


def test_a_signed_source_replicates_with_its_signature_and_loads_with_the_key(
    two_endpoints: Any,
) -> None:
    src_side, dst_side = two_endpoints
    src = opened(src_side, signing_key=KEY)
    src.save(1, state(1))
    with opened(dst_side) as dst:  # no key here: the manifest is kept as it is
        assert [i.step for i in replicate(src, dst).copied] == [1]
    with opened(dst_side, signing_key=KEY, lease=False) as reader:
        assert reader.info(1).manifest.signature == src.info(1).manifest.signature
        assert reader.info(1).manifest == src.info(1).manifest
        assert torch.equal(reader.load()["w"], state(1)["w"])
    other = (dst_side[0] + "-other-key", dst_side[1])
    with opened(other, signing_key="another-key-of-16-bytes-or-more") as strict:
        report = replicate(src, strict)
        assert isinstance(report.failed[1], UntrustedCheckpointError)
        assert "signed with another key" in str(report.failed[1])
        assert strict.list() == [] and list(strict.backend.list("global_step_1/")) == []
    src.close()


def test_same_endpoint_copies_go_server_side(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    src = CheckpointStore(s3_uri, storage_options={**s3_options, "part_size": 5 * MiB})
    src.save(1, state(1))
    bucket = f"ckpt-{os.urandom(5).hex()}"
    s3_client.create_bucket(Bucket=bucket)  # another bucket, the same endpoint and credentials
    dst = CheckpointStore(f"s3://{bucket}/mirror", storage_options=s3_options)
    report = replicate(src, dst)
    assert report.bytes_streamed == 0 and report.bytes_server_side == src.info(1).size
    assert torch.equal(dst.load()["w"], state(1)["w"])
    trusting = CheckpointStore(s3_uri + "-trusting", storage_options=s3_options)
    assert replicate(src, trusting, check_server_copies=False).bytes_server_side > 0
    for store in (src, dst, trusting):
        store.close()


# -- writers and fences ---------------------------------------------------------------------------


def test_a_fenced_source_step_is_never_replicated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path / "src")
    zombie = CheckpointStore(uri)
    zombie.save(1, state(1))
    epoch = zombie.hold_lease()
    replacement = CheckpointStore(uri, takeover=True)
    assert zombie.lease is not None
    monkeypatch.setattr(zombie.lease, "hold", lambda: epoch)  # its renewal landed just before
    with pytest.raises(ConflictError, match="newer writer lease"):
        zombie.save(2, state(2))
    assert replacement.fenced_steps() == [2]
    dst = CheckpointStore(str(tmp_path / "dst"))
    report = replicate(replacement, dst)
    assert [i.step for i in report.copied] == [1] and report.excluded == {2: FENCED}
    assert [i.step for i in dst.list()] == [1] and latest_of(dst) == 1
    replacement.close()
    dst.close()


def test_a_destination_ahead_keeps_its_latest(tmp_path: Path) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    for step in (10, 20):
        src.save(step, state(step))
    dst = CheckpointStore(str(tmp_path / "dst"))
    dst.save(50, state(50))
    report = replicate(src, dst)
    assert [i.step for i in report.copied] == [10, 20] and report.latest is None
    assert latest_of(dst) == 50 and [i.step for i in dst.list()] == [10, 20, 50]
    src.save(30, state(30))
    dst.save(30, state(99), allow_older=True)  # the destination went its own way at step 30
    with pytest.raises(ConflictError, match=r"step 30 exists in .* with other contents"):
        replicate(src, dst)
    src.close()
    dst.close()


def test_a_second_replicator_into_the_same_destination_is_refused(tmp_path: Path) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    src.save(1, state(1))
    first = CheckpointStore(str(tmp_path / "dst"))
    follow(src, first, passes=1, sleep=lambda _: None)
    second = CheckpointStore(str(tmp_path / "dst"))
    with pytest.raises(LeaseHeldError, match=r"holds the writer lease|is open in this process"):
        follow(src, second, passes=1, sleep=lambda _: None)
    first.close()  # the first lets go: the next one takes over without --takeover
    follow(src, second, passes=1, sleep=lambda _: None)
    second.close()
    src.close()


def test_a_follower_retries_a_storage_error_that_may_pass(tmp_path: Path) -> None:
    class Flaky(BackendProxy):
        failures = 0

        def read_versioned(self, path: str) -> tuple[bytes, str]:
            if self.failures and path.startswith(INDEX_DIR):  # a listing reads the step index
                self.failures -= 1
                raise BackendError("injected: the endpoint is unreachable", retryable=True)
            return super().read_versioned(path)

    flaky = Flaky(open_backend(str(tmp_path / "src"), {}))
    src = CheckpointStore(str(tmp_path / "src"), backend=flaky)
    src.save(1, state(1))
    flaky.failures = 1
    dst = CheckpointStore(str(tmp_path / "dst"))
    reports: list[ReplicationReport] = []
    follow(src, dst, on_pass=reports.append, passes=2, sleep=lambda _: None)
    assert [[i.step for i in r.copied] for r in reports] == [[1]]  # the failed pass reports none
    src.close()
    dst.close()


def test_replicating_a_store_into_itself_is_refused(tmp_path: Path) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    src.save(1, state(1))
    with pytest.raises(ValueError, match="both the source and the destination"):
        replicate(src, CheckpointStore(str(tmp_path / "src")))
    src.close()


def test_s3_domains_name_the_endpoint_and_the_credentials(
    s3_options: dict[str, Any], other_endpoint: LocalS3Server
) -> None:
    here = S3Backend("s3://bucket-a/run", s3_options).address("k")
    assert S3Backend("s3://bucket-b/other", s3_options).address("k").domain == here.domain
    keyed = {**s3_options, "key": "someone-else", "secret": "do-not-show-this"}
    elsewhere = [
        S3Backend("s3://bucket-a/run", keyed),
        S3Backend("s3://bucket-a/run", other_endpoint.storage_options()),
    ]
    for backend in elsewhere:
        assert backend.address("k").domain != here.domain
        with pytest.raises(ValueError, match="another endpoint or under other credentials"):
            backend.copy_in(here, "k", 1)
    assert "do-not-show-this" not in repr(elsewhere[0].address("k"))


# -- memory ---------------------------------------------------------------------------------------


def test_a_streamed_copy_holds_the_read_ahead_not_the_file(tmp_path: Path) -> None:
    """Locally both sides stream (no server-side copy across local stores); Python's own
    allocations, traced, stay within the read-ahead (+10%) for a file 8 times larger."""
    src = CheckpointStore(str(tmp_path / "src"))
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "one.bin").write_bytes(os.urandom(32 * MiB))
    src.push_dir(1, folder)
    dst = CheckpointStore(str(tmp_path / "dst"))
    bound = memory_bound(part_size=0, parts_in_flight=0, chunk_size=MiB, read_ahead=4)
    tracemalloc.start()
    try:
        report = replicate(src, dst, chunk_size=MiB, read_ahead=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.bytes_streamed == 32 * MiB
    assert peak <= 1.1 * bound, f"peak {peak / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB"
    assert dst.verify(1).ok
    src.close()
    dst.close()


def test_steps_replicated_after_a_takeover_of_the_destinations_lease_are_not_fenced(
    tmp_path: Path,
) -> None:
    src = CheckpointStore(str(tmp_path / "src"))
    src.save(1, state(1))
    crashed = CheckpointStore(str(tmp_path / "dst"))
    replicate(src, crashed)  # holds the destination's lease (epoch 1), then "dies"
    restarted = CheckpointStore(str(tmp_path / "dst"), takeover=True)  # epoch 2, fence at 1
    src.save(2, state(2))  # the source's writer still holds its own epoch 1
    replicate(src, restarted)
    assert latest_of(restarted) == 2
    assert restarted.fenced_steps() == []  # the fence names the crashed replicator, not src's
    assert torch.equal(restarted.load()["b"], state(2)["b"])
