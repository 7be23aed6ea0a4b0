"""A save that cannot take the writer lease: the error names the holder, and comes by the deadline.

The holder runs on "another host": a process in its own UTS and PID namespaces (``unshare``,
root only), with a hostname of its own, so the contender cannot look its process up and must
judge it by the storage's clock or by watching. Killed with SIGKILL, it leaves its record
unreleased. The lease's TTL (60 s) is far longer than the save's deadline (2 s): the save must
fail by the deadline with a LeaseHeldError naming the holder, not watch the record for a TTL,
and not fail with a SaveTimeoutError that says nothing of who holds the lease.

Clock skew: the holder's wall clock (the store's ``clock=``) is five minutes ahead or behind;
nobody compares it with another clock, so a live holder is refused and a dead one is taken over
after one TTL, whatever the skew.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# Imports torch now, not in the first timed save (its import takes seconds on a busy machine).
import ckptstore.data.serialize  # noqa: F401
from ckptstore import CheckpointStore
from ckptstore.deadline import Deadline, bounded
from ckptstore.errors import LeaseHeldError, SaveTimeoutError
from lease_helpers import FakeTime, LeaseTroubles, contender, read_record, ready, write_record
from s3faults.faultproxy import Fault, FaultProxy

Uri = tuple[str, dict[str, Any]]
SLACK = 1.5
"""Seconds past the deadline a refusal may take here (a probe write, a stat, a delete)."""
FIVE_MINUTES = 300.0

HOLDER = """
import json, os, signal, socket, sys, time
socket.sethostname(sys.argv[1])
from ckptstore import CheckpointStore
uri, options, ttl, skew, how = sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]), \\
    float(sys.argv[5]), sys.argv[6]
store = CheckpointStore(uri, storage_options=options, lease_ttl=ttl,
                        clock=lambda: time.time() + skew)
store.save(1, {"step": 1})
print("ready", flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.readline()
store.close()
"""
"""Takes the lease (saves step 1) on host ``argv[1]``, its clock ``skew`` s off, then either
kills itself (SIGKILL: the record stays unreleased) or holds it until a line on stdin."""

needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None or sys.platform != "linux", reason="needs unshare (Linux)"
)


def elsewhere(uri: Uri, how: str, *, ttl: float = 60.0, skew: float = 0.0) -> subprocess.Popen[str]:
    """A holder on host ``elsewhere-host`` in its own PID namespace, once it holds the lease."""
    # A shell is the namespace's init (PID 1 ignores even its own SIGKILL); the holder its child.
    init = ["unshare", "--uts", "--pid", "--fork", "sh", "-c", '"$@"; exit 0', "init"]
    holder = ["elsewhere-host", uri[0], json.dumps(uri[1]), str(ttl), str(skew), how]
    try:
        proc = ready([*init, sys.executable, "-c", HOLDER, *holder])
    except AssertionError as e:
        if "Operation not permitted" in str(e):
            pytest.skip("unshare needs root (CAP_SYS_ADMIN)")
        raise
    if how == "kill":
        proc.wait(10)
    return proc


@pytest.fixture(params=["local", "s3"])
def shared_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Uri:
    if request.param == "local":
        return str(tmp_path / "store"), {}
    return request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")


def open_store(uri: Uri, **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(uri[0], storage_options=uri[1], **kwargs)


# -- the error names the holder and the options, by the deadline -------------------------------


@pytest.mark.wallclock
@needs_unshare
@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_killed_holder_on_another_host_is_named_by_the_deadline(
    shared_uri: Uri, how: str
) -> None:
    elsewhere(shared_uri, "kill")
    record = LeaseRecordView(open_store(shared_uri, lease=False))
    store = open_store(shared_uri, save_timeout=2.0)
    started = time.monotonic()
    save = store.save if how == "save" else lambda *a: store.save_async(*a).wait()
    with pytest.raises(LeaseHeldError) as caught:
        save(2, {"step": 2})
    took = time.monotonic() - started
    message = str(caught.value)
    assert took < 2.0 + SLACK, f"refused after {took:.1f} s: {message}"
    assert record.holder in message and "host elsewhere-host" in message
    assert f"pid {record.pid}" in message and "held since 20" in message  # a UTC date
    assert "expires in at most" in message and "takeover=True" in message
    assert "save again once its lease expired" in message and "2 s deadline" in message
    assert caught.value.uri is not None and caught.value.uri.endswith("lease.json")
    assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]
    store.close()


class LeaseRecordView:
    """The lease record as a test reads it."""

    def __init__(self, store: CheckpointStore) -> None:
        body = read_record(store.backend)
        self.holder, self.pid, self.host = body["holder"], body["pid"], body["host"]
        assert self.host == "elsewhere-host" and not body["released"]


def test_a_contest_that_cannot_end_by_the_deadline_fails_at_once(memory_uri: str) -> None:
    """No modification times: only a whole TTL of watching tells; a 2 s deadline refuses at
    once rather than sleeping, on fake time."""
    backend = LeaseTroubles(open_store((memory_uri, {}), lease=False).backend)
    backend.mtimes = False
    write_record(backend, ttl=30.0)
    fake = FakeTime()
    lease = contender(backend, fake)  # type: ignore[arg-type]
    held = r"elsewhere:4242.*host elsewhere, pid 4242"
    with (
        bounded(Deadline.after(2.0, clock=fake.monotonic)),
        pytest.raises(LeaseHeldError, match=held),
    ):
        lease.hold()
    assert fake.slept == []
    with bounded(Deadline.after(40.0, clock=fake.monotonic)):  # the TTL fits: it watches
        assert lease.hold() == 6
    assert sum(fake.slept) == pytest.approx(30.0)


def test_a_live_holder_is_named_with_its_renewal_period(memory_uri: str) -> None:
    backend = LeaseTroubles(open_store((memory_uri, {}), lease=False).backend)
    backend.mtimes = False
    write_record(backend, ttl=8.0)
    fake = FakeTime(on_sleep=lambda: write_record(backend, ttl=8.0, renewed=2e9))
    with pytest.raises(LeaseHeldError) as caught:
        contender(backend, fake).hold()  # type: ignore[arg-type]
    message = str(caught.value)
    assert "renewed the lease while watched" in message and "renewed every 2 s" in message
    assert "held since 2023-11-14 22:13:20 UTC by its clock" in message
    assert "takeover=True" in message


@pytest.mark.wallclock
def test_save_async_does_not_block_its_caller_past_the_deadline(
    s3_endpoint: str, s3_uri: str
) -> None:
    """A bucket answering 503 before the save's first write: the caller's read of ``latest``
    fails by the deadline with SaveTimeoutError, not after the retries' whole course."""
    with FaultProxy(s3_endpoint) as proxy:
        options = {"endpoint_url": proxy.endpoint_url, "stall_timeout": 1}
        store = CheckpointStore(s3_uri, storage_options=options, save_timeout=2.0)
        down = proxy.add_fault(Fault.brownout(None))
        started = time.monotonic()
        with pytest.raises(SaveTimeoutError, match=r"2 s deadline.*latest.*SlowDown"):
            store.save_async(1, {"step": 1})
        took = time.monotonic() - started
        assert took < 2.0 + SLACK, f"blocked {took:.1f} s"
        assert down.fired > 0
        proxy.clear_faults()
        store.save_async(1, {"step": 1}).wait()
        store.close()


# -- clock skew --------------------------------------------------------------------------------


@pytest.mark.wallclock
@needs_unshare
@pytest.mark.parametrize("skew", [-FIVE_MINUTES, FIVE_MINUTES])
def test_a_skewed_live_holder_keeps_a_second_writer_out(shared_uri: Uri, skew: float) -> None:
    holder = elsewhere(shared_uri, "hold", ttl=2.0, skew=skew)
    try:
        rival = open_store(shared_uri, save_timeout=4.0, clock=lambda: time.time() - skew)
        with pytest.raises(LeaseHeldError, match="elsewhere-host"):
            rival.save(2, {"step": 2})
        assert [i.step for i in rival.list()] == [1]
        rival.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(20)
    assert holder.returncode == 0, holder.stderr.read() if holder.stderr else ""


@pytest.mark.wallclock
@needs_unshare
@pytest.mark.parametrize("skew", [-FIVE_MINUTES, FIVE_MINUTES])
def test_a_skewed_dead_holder_locks_the_next_writer_out_one_ttl_at_most(
    shared_uri: Uri, skew: float
) -> None:
    """The dead holder's clock is 5 minutes off, the next writer's 5 minutes off the other way:
    the next writer waits one TTL (plus the storage clock's grain), not the skew."""
    elsewhere(shared_uri, "kill", ttl=2.0, skew=skew)
    killed = time.monotonic()
    store = open_store(shared_uri, clock=lambda: time.time() - skew, lease_ttl=2.0)
    store.save(2, {"step": 2})
    assert time.monotonic() - killed < 2.0 + 1.0 + SLACK
    assert store.latest() is not None and store.latest().step == 2  # type: ignore[union-attr]
    store.save(3, {"step": 3})  # and its own skew never locks itself out
    store.close()


@pytest.mark.parametrize("skew", [-FIVE_MINUTES, FIVE_MINUTES])
def test_a_skewed_writer_reopens_its_own_store_at_once(memory_uri: str, skew: float) -> None:
    """Released on close: the next writer, its clock the other way off, takes it with no wait."""
    first = CheckpointStore(memory_uri, clock=lambda: time.time() + skew)
    first.save(1, {"step": 1})
    first.close()
    second = CheckpointStore(memory_uri, clock=lambda: time.time() - skew)
    started = time.monotonic()
    second.save(2, {"step": 2})
    assert time.monotonic() - started < 5.0  # no TTL (60 s) waited, let alone the skew
    assert read_record(second.backend)["epoch"] == 2
    second.close()
