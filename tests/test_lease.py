"""The writer lease (lease.py): one committing job per store, zombies fenced, no clock trusted.

Store-level tests run on local disk, ``memory://`` and S3 (moto over HTTP); those with a second
process run on local disk and S3 (``memory://`` lives in one process). Tests of how a contender
judges another host's holder drive a WriterLease on fake time, so they wait for nothing.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# Imports torch here, not in a save under a short TTL (its import holds the GIL for long);
# and a first import inside save() would pin that frame, with its store, until exit.
import ckptstore.data.serialize  # noqa: F401
from ckptstore import CheckpointStore
from ckptstore.backends.registry import open_backend
from ckptstore.domain.layout import LEASE_NAME
from ckptstore.errors import ConfigError, FencedError, LeaseHeldError
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.lease import DEFAULT_TTL, WriterLease
from ckptstore.protocol.lease_record import LeaseRecord, Process, _proc_stat
from lease_helpers import (
    FakeTime,
    LeaseTroubles,
    contender,
    read_record,
    script,
    start,
    write_record,
)
from parts import committer_for

Uri = tuple[str, dict[str, Any]]


def troubled(uri: str, options: dict[str, Any] | None = None) -> Any:
    """The backend of ``uri`` wrapped in LeaseTroubles (typed Any: it passes for a Backend)."""
    return LeaseTroubles(open_backend(uri, options))


def open_store(store_uri: Uri, **kwargs: Any) -> CheckpointStore:
    uri, options = store_uri
    return CheckpointStore(uri, storage_options=options, **kwargs)


def latest_step(store: CheckpointStore) -> int | None:
    latest = store.latest()
    return latest.step if latest is not None else None


@pytest.fixture(params=["local", "s3"])
def shared_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Uri:
    """A store that several processes can open: local disk or S3."""
    if request.param == "local":
        return str(tmp_path / "store"), {}
    return request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")


@pytest.fixture
def lease_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING)
    return caplog


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the lease modules logged."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("ckptstore.protocol.lease")]


# -- one writer at a time ------------------------------------------------------------------


def test_a_second_writer_is_refused_while_the_first_is_live(store_uri: Uri) -> None:
    first = open_store(store_uri, lease_ttl=2.0)
    first.save(1, {"step": 1})
    second = open_store(store_uri, lease_ttl=2.0)
    with pytest.raises(LeaseHeldError) as caught:
        second.save(2, {"step": 2})
    message = str(caught.value)
    assert first.writer in message and "takeover=True" in message and "--takeover" in message
    assert [i.step for i in second.list()] == [1]
    assert second.backend.stat("global_step_2/state.json") is None  # refused before uploading
    first.close()
    second.save(2, {"step": 2})  # released: no takeover needed


@pytest.mark.wallclock
def test_a_contender_elsewhere_sees_the_heartbeat_and_is_refused(store_uri: Uri) -> None:
    holder = open_store(store_uri, lease_ttl=1.0)
    holder.hold_lease()
    started = time.monotonic()
    with pytest.raises(LeaseHeldError, match=r"renewed the lease while watched for \d") as caught:
        contender(holder.backend).hold()  # real time: it watches the record for a change
    assert time.monotonic() - started < 1.0  # about one heartbeat, never the whole TTL
    assert holder.writer in str(caught.value) and "takeover=True" in str(caught.value)
    holder.save(1, {"step": 1})


def test_the_heartbeat_keeps_the_lease_across_a_long_gap_between_saves(store_uri: Uri) -> None:
    """Fake time: the holder beats every ttl / 4 through 2.5 TTLs without a save; a contender
    watching it (its own clock, each of its sleeps a beat of the holder's) is refused, and the
    holder saves on under the same epoch."""
    clock = FakeTime()
    backend = open_backend(*store_uri)
    holder = WriterLease(backend, "here:1:beef", ttl=2.0, heartbeat=False,
                         monotonic=clock.monotonic, sleep=clock.sleep)  # fmt: skip
    epoch = holder.hold()
    for _ in range(10):  # 5 s: two and a half TTLs without a save
        clock.sleep(0.5)
        assert holder.heartbeat()
    clock.on_sleep = holder.heartbeat  # the holder goes on beating while the contender watches
    with pytest.raises(LeaseHeldError, match="renewed the lease while watched"):
        contender(backend, clock).hold()
    assert holder.hold() == epoch and read_record(backend)["epoch"] == epoch


@pytest.mark.wallclock
def test_a_live_holder_in_another_process_is_refused_within_a_heartbeat(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    holder = start(uri, {}, "hold", ttl=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(LeaseHeldError, match="renewed the lease while watched") as caught:
            CheckpointStore(uri).hold_lease()  # same host, its process alive: it watches
        assert time.monotonic() - started < 0.5 + 1.5
        assert f":{holder.pid}:" in str(caught.value)
    finally:
        holder.kill()
        holder.wait()


def test_no_lease_means_shared_writing(store_uri: Uri) -> None:
    a = open_store(store_uri, lease=False)
    b = open_store(store_uri, lease=False)
    a.save(1, {"step": 1})
    b.save(2, {"step": 2})
    assert a.backend.stat(LEASE_NAME) is None
    assert latest_step(a) == 2


# -- takeover=True --------------------------------------------------------------------------


def test_takeover_at_open_fences_the_zombie_before_it_loads(
    store_uri: Uri, lease_log: pytest.LogCaptureFixture
) -> None:
    zombie = open_store(store_uri)
    zombie.save(1, {"step": 1})
    replacement = open_store(store_uri, takeover=True)  # no save yet
    assert any(zombie.writer in m for m in warnings_of(lease_log))  # names the holder
    assert replacement.load() == {"step": 1}
    with pytest.raises(FencedError) as caught:
        zombie.save(2, {"step": 2})
    assert replacement.writer in str(caught.value)
    replacement.save(2, {"step": 2})  # used to be ConflictError: the zombie had committed 2
    assert latest_step(replacement) == 2
    assert replacement.info(2).manifest.writer == replacement.writer
    with pytest.raises(FencedError):
        zombie.save(3, {"step": 3})  # fenced for good


def test_a_fenced_writer_cannot_move_latest_even_past_its_check(store_uri: Uri) -> None:
    zombie = open_store(store_uri)
    zombie.save(1, {"step": 1})
    replacement = open_store(store_uri, takeover=True)  # takes over, stamps latest
    assert zombie.lease is not None and zombie.lease.epoch is not None
    with pytest.raises(FencedError, match="newer writer lease"):
        committer_for(zombie.backend, writer=zombie.writer).advance_latest(
            5, epoch=zombie.lease.epoch
        )
    assert latest_step(replacement) == 1


def test_a_takeover_keeps_the_step_a_killed_holder_committed_before_moving_latest(
    store_uri: Uri,
) -> None:
    """The holder dies between its commit and moving ``latest``: that step was committed under
    the lease, so the job that takes over resumes from it; ``latest`` never goes back."""
    crashed = open_store(store_uri)
    crashed.save(1, {"step": 1})

    def killed(self: Committer, step: int, **_: Any) -> bool:
        raise KeyboardInterrupt("killed before moving latest")

    with pytest.MonkeyPatch.context() as patch:  # the one place between commit and pointer
        patch.setattr(Committer, "advance_latest", killed)
        with pytest.raises(KeyboardInterrupt):
            crashed.save(2, {"step": 2})
    assert latest_step(open_store(store_uri, lease=False)) == 2  # by listing, before takeover
    successor = open_store(store_uri, takeover=True)
    assert successor.fenced_steps() == []
    assert successor.load(with_info=True).step == 2
    successor.save(3, {"step": 3})
    assert latest_step(successor) == 3


# -- releasing: close, exit, garbage collection ------------------------------------------------


def test_closing_releases_the_lease(store_uri: Uri) -> None:
    with open_store(store_uri) as first:
        first.save(1, {"step": 1})
    assert read_record(first.backend)["released"] is True
    second = open_store(store_uri)
    second.save(2, {"step": 2})  # no takeover needed after a clean exit
    assert latest_step(second) == 2
    assert read_record(second.backend)["epoch"] == 2  # epochs keep counting up


def test_a_dropped_store_releases_its_lease(store_uri: Uri) -> None:
    first = open_store(store_uri)
    first.save(1, {"step": 1})
    backend, heartbeat = first.backend, f"ckpt-lease-{first.writer}"
    assert heartbeat in [t.name for t in threading.enumerate()]
    del first
    gc.collect()  # released in the background: a finalizer may run in any thread, so no I/O
    deadline = time.monotonic() + 5
    while not read_record(backend)["released"]:
        assert time.monotonic() < deadline, "not released"
        time.sleep(0.01)
    assert heartbeat not in [t.name for t in threading.enumerate()]
    second = open_store(store_uri)
    second.save(2, {"step": 2})
    assert latest_step(second) == 2


def test_a_store_opened_right_after_another_was_dropped_just_works(
    store_uri: Uri, lease_log: pytest.LogCaptureFixture
) -> None:
    first = open_store(store_uri)
    first.save(1, {"step": 1})
    del first
    gc.collect()
    second = open_store(store_uri)  # at once: it finishes the dropped store's release itself
    second.save(2, {"step": 2})
    assert latest_step(second) == 2
    assert warnings_of(lease_log) == []  # released, not taken over


@pytest.mark.slow
def test_a_script_that_exits_without_close_can_run_again(shared_uri: Uri) -> None:
    uri, options = shared_uri
    for how in ("save", "save_async"):  # the async one commits at exit, then releases
        done = subprocess.run(script(uri, options, how), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    with open_store(shared_uri, lease=False) as store:
        assert [i.step for i in store.list()] == [1, 2]
        assert read_record(store.backend)["released"] is True


@pytest.mark.wallclock
def test_a_sigkilled_holder_on_this_host_is_taken_over_at_once(
    shared_uri: Uri, lease_log: pytest.LogCaptureFixture
) -> None:
    uri, options = shared_uri
    killed = start(uri, options, "save")  # saved step 1, holds a 60 s lease
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    started = time.monotonic()
    replacement = open_store(shared_uri)
    replacement.save(2, {"step": 2})
    assert time.monotonic() - started < 10  # not the 60 s TTL
    assert read_record(replacement.backend)["holder"] == replacement.writer
    warned = warnings_of(lease_log)
    assert any(f"its process {killed.pid} on this host is gone" in m for m in warned), warned


def test_a_reused_pid_is_not_taken_for_the_holder(memory_uri: str) -> None:
    here = Process.current()
    if here.started is None:
        pytest.skip("no /proc: a PID alone cannot tell a reused one")
    backend = CheckpointStore(memory_uri, lease=False).backend
    parent = os.getppid()
    true_start = _proc_stat(parent)[1]  # type: ignore[index]
    this_host = {"host": here.host, "pid": parent, "pid_namespace": here.namespace, "ttl": 60.0}
    write_record(backend, pid_started=true_start, **this_host)  # its process is alive
    fake = FakeTime()
    assert contender(backend, fake, process=here).hold() == 6
    assert sum(fake.slept) > 50  # so it watched the record for a TTL
    write_record(backend, pid_started=true_start - 1, **this_host)  # the PID was reused since
    fake = FakeTime()
    assert contender(backend, fake, process=here).hold() == 6
    assert fake.slept == []  # at once: the process that wrote it is gone


# -- judging a holder on another host, on fake time --------------------------------------------


def test_a_silent_holder_elsewhere_is_taken_over_after_one_ttl(
    store_uri: Uri, lease_log: pytest.LogCaptureFixture
) -> None:
    store = open_store(store_uri, lease=False)
    write_record(store.backend, ttl=30.0)
    fake = FakeTime()
    lease = contender(store.backend, fake, process=Process("thishost", 7))
    assert lease.hold() == 6
    assert 30.0 - 1.0 <= sum(fake.slept) <= 30.0 + 1.0  # the TTL, less what the storage saw
    assert max(fake.slept) <= 1.0  # polled every min(ttl / 8, 1 s)
    assert any("stayed unchanged" in m for m in warnings_of(lease_log))


@pytest.mark.wallclock
def test_a_silent_holder_is_taken_over_after_one_real_ttl(store_uri: Uri) -> None:
    store = open_store(store_uri, lease_ttl=1.0)
    write_record(store.backend, ttl=1.0)
    started = time.monotonic()
    store.save(1, {"step": 1})
    assert 0.9 < time.monotonic() - started < 4
    assert read_record(store.backend)["epoch"] == 6


def test_the_storage_clock_says_at_once_that_a_record_is_old(memory_uri: str) -> None:
    backend = troubled(memory_uri)
    write_record(backend, ttl=30.0)
    backend.lease_age = 31.0 + 1.0
    fake = FakeTime()
    assert contender(backend, fake).hold() == 6
    assert fake.slept == []
    assert not list(backend.list(".ckptstore/clock/"))  # the probe is gone


def test_without_modification_times_it_watches_a_whole_ttl(memory_uri: str) -> None:
    backend = troubled(memory_uri)
    backend.mtimes = False
    write_record(backend, ttl=8.0)
    fake = FakeTime()
    assert contender(backend, fake).hold() == 6
    assert sum(fake.slept) == pytest.approx(8.0) and max(fake.slept) == pytest.approx(1.0)


@pytest.mark.parametrize("skew", [-1e6, 1e6])
@pytest.mark.parametrize("alive", [True, False])
def test_clock_skew_does_not_change_the_outcome(store_uri: Uri, skew: float, alive: bool) -> None:
    store = open_store(store_uri, lease=False)
    backend = store.backend
    now = time.time() + skew  # the holder's clock is days off ours
    write_record(backend, renewed=now, acquired=now, ttl=10.0)

    def heartbeat() -> None:  # the holder renews while watched, by its own (wrong) clock
        if alive:
            write_record(backend, renewed=now + 1, acquired=now, ttl=10.0)

    lease = contender(backend, FakeTime(on_sleep=heartbeat))
    if alive:
        with pytest.raises(LeaseHeldError, match="elsewhere:4242"):
            lease.hold()
    else:
        assert lease.hold() == 6


def test_a_holder_whose_lease_never_expires_is_refused_at_once(memory_uri: str) -> None:
    store = CheckpointStore(memory_uri, lease_ttl=math.inf)
    store.hold_lease()
    assert not any(t.name == f"ckpt-lease-{store.writer}" for t in threading.enumerate())
    assert read_record(store.backend)["ttl"] is None
    fake = FakeTime()
    with pytest.raises(LeaseHeldError, match="never expires"):
        contender(store.backend, fake).hold()
    assert fake.slept == []


# -- losing the lease ------------------------------------------------------------------------


def test_a_writer_that_cannot_renew_for_a_ttl_commits_nothing_until_a_renewal_succeeds(
    store_uri: Uri,
) -> None:
    troubles = troubled(*store_uri)
    store = CheckpointStore(store_uri[0], backend=troubles, lease_ttl=0.5)
    store.save(1, {"step": 1})
    troubles.failing = True
    time.sleep(0.8)
    with pytest.raises(FencedError) as caught:
        store.save(2, {"step": 2})
    message = str(caught.value)
    assert store.uri in message and "could not renew the writer lease for" in message
    assert "injected: the storage is unreachable" in message
    assert "Check the storage" in message and "until a renewal succeeds" in message
    troubles.failing = False
    assert [i.step for i in store.list()] == [1] and latest_step(store) == 1
    assert not list(troubles.list("global_step_2/"))
    # The storage is back and nobody took the lease over: the renewal (a compare-and-swap on
    # this writer's own record) proves it, and the writer commits again.
    store.save(2, {"step": 2})
    assert latest_step(store) == 2
    store.close()


def test_renewal_failures_shorter_than_a_ttl_are_ridden_out(memory_uri: str) -> None:
    troubles = troubled(memory_uri)
    fake = FakeTime()
    lease = contender(troubles, fake, process=Process.current(), ttl=10.0)
    epoch = lease.hold()
    troubles.failing = True
    fake.now += 6.0
    assert lease.heartbeat()  # failed, logged, still held
    troubles.failing = False
    assert lease.heartbeat() and lease.hold() == epoch
    troubles.failing = True
    fake.now += 6.0
    assert lease.heartbeat()
    fake.now += 5.0
    assert lease.heartbeat()  # in doubt: it goes on trying
    doubt = lease.unconfirmed()
    assert doubt is not None and "could not renew the writer lease for 11 s" in doubt
    assert "injected: the storage is unreachable" in doubt and lease.lost is None
    with pytest.raises(FencedError, match="could not renew"):
        lease.hold()
    troubles.failing = False
    assert lease.heartbeat() and lease.unconfirmed() is None and lease.hold() == epoch


def test_a_heartbeat_that_finds_the_lease_taken_fences_the_writer(store_uri: Uri) -> None:
    zombie = open_store(store_uri, lease_ttl=0.5)
    zombie.save(1, {"step": 1})
    thief = contender(zombie.backend, takeover=True)
    thief.hold()
    deadline = time.monotonic() + 5
    while zombie.lease is not None and zombie.lease.lost is None:
        assert time.monotonic() < deadline, "the heartbeat did not notice"
        time.sleep(0.02)
    with pytest.raises(FencedError, match=f"taken by {thief.writer}"):
        zombie.save(2, {"step": 2})


# -- the record --------------------------------------------------------------------------------


def test_lease_ttl_is_validated(memory_uri: str) -> None:
    for bad in (0, -1.0, float("nan"), "60", True, None):
        with pytest.raises(ConfigError, match="lease_ttl"):
            CheckpointStore(memory_uri, lease_ttl=bad)  # type: ignore[arg-type]
    assert DEFAULT_TTL == 60.0


def v1(**fields: Any) -> bytes:
    body = {"schema_version": 1, "epoch": 3, "holder": "elsewhere:4242:0123abcd"}
    body.update({"acquired": 1.7e9, "renewed": 1.7e9, "ttl": 900.0, **fields})
    return json.dumps(body).encode()


def test_schema_1_records_are_read(memory_uri: str, lease_log: pytest.LogCaptureFixture) -> None:
    held = LeaseRecord.decode(v1(), "x")
    assert (held.epoch, held.host, held.pid, held.released, held.ttl) == (
        3, "elsewhere", 4242, False, 900.0,
    )  # fmt: skip
    assert LeaseRecord.decode(v1(renewed=0.0), "x").released
    store = CheckpointStore(memory_uri)
    store.backend.write(LEASE_NAME, [v1(renewed=0.0)])  # released by an older ckptstore
    store.save(1, {"step": 1})
    assert read_record(store.backend)["epoch"] == 4 and warnings_of(lease_log) == []
    store.close()
    store.backend.write(LEASE_NAME, [v1()])  # held by an older ckptstore: no heartbeat
    fake = FakeTime()
    assert contender(store.backend, fake).hold() == 4
    assert sum(fake.slept) == pytest.approx(900.0, abs=1.0)  # its TTL, watched


@pytest.mark.parametrize(
    ("data", "epoch"),
    [
        (b"{", 1),
        (b"[]", 1),
        (v1(schema_version=3), 4),  # the epoch is kept where it can be made out
        (v1(epoch=True), 1),
        (v1(ttl=0), 4),
        (v1(extra=1), 4),
    ],
    ids=["truncated", "list", "schema3", "bool-epoch", "zero-ttl", "unknown-field"],
)
def test_an_unreadable_record_is_replaced_with_a_warning(
    memory_uri: str, data: bytes, epoch: int, lease_log: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(memory_uri)
    store.backend.write(LEASE_NAME, [data])
    store.save(1, {"step": 1})
    assert any("unreadable writer lease" in m for m in warnings_of(lease_log))
    record = read_record(store.backend)
    assert (record["holder"], record["schema_version"], record["epoch"]) == (store.writer, 2, epoch)


def test_a_store_that_only_reads_takes_no_lease(store_uri: Uri) -> None:
    with open_store(store_uri) as writer:
        writer.save(1, {"step": 1})
    before = read_record(writer.backend)
    with open_store(store_uri) as reader:
        assert reader.load() == {"step": 1}
    assert read_record(reader.backend) == before
