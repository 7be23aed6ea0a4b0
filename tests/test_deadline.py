"""Deadlines and the pieces that keep S3 transfers bounded, without a server: the Deadline
value and its context, the errors it raises, the shared backoff, the progress watchdog, how
failures are classified, the retry loop's budget, and the local and fsspec backends stopping
between chunks. Clocks are fakes wherever time is the subject."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    HTTPClientError,
    ReadTimeoutError,
)

from ckptstore.backends.fsspec import FsspecBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.s3_progress import (
    MIN_PROGRESS,
    Cancelled,
    CancelToken,
    Meter,
    Progress,
    ProgressBody,
    Stalled,
)
from ckptstore.backends.s3_rate import MIN_RATE, SendRate
from ckptstore.backends.s3_retry import BACKOFF, Kind, Retrier, classify
from ckptstore.deadline import (
    CLEANUP_SLACK,
    Deadline,
    bounded,
    clean_up,
    current_deadline,
    submit,
)
from ckptstore.errors import (
    CheckpointError,
    DeadlineExceededError,
    LoadTimeoutError,
    SaveTimeoutError,
)
from ckptstore.retry import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- Deadline ----------------------------------------------------------------------------------


def test_a_deadline_counts_down_on_its_clock() -> None:
    clock = Clock()
    deadline = Deadline.after(10, rank=3, clock=clock)
    assert deadline.remaining() == 10 and not deadline.expired and deadline.cap(4) == 4
    clock.now += 7
    assert deadline.remaining() == 3 and deadline.cap(4) == 3
    deadline.check("s3://b/run/f")  # not yet
    clock.now += 3
    assert deadline.expired and deadline.remaining() == 0
    with pytest.raises(SaveTimeoutError):
        deadline.check("s3://b/run/f")
    with pytest.raises(ValueError, match="operation"):
        Deadline.after(1, operation="pull")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seconds"):
        Deadline.after(-1)


def test_the_error_names_rank_file_upload_bytes_and_last_error_and_survives_pickling() -> None:
    deadline = Deadline.after(30, rank=7)
    e = deadline.error(
        "s3://b/run/global_step_3/rank_00007/w.safetensors",
        doing="write",
        upload_id="UP-123",
        bytes_done=5 << 20,
        last_error="UploadPart 2 stalled: 0 bytes moved in 1 s",
    )
    assert isinstance(e, SaveTimeoutError) and isinstance(e, DeadlineExceededError)
    assert isinstance(e, CheckpointError)
    message = str(e)
    for part in ("rank 7", "30 s deadline", "write", "rank_00007/w.safetensors", "UP-123"):
        assert part in message
    assert "5242880 bytes done" in message and "UploadPart 2 stalled" in message
    assert "save_timeout" in message  # the fix
    assert "Check the storage (the last error says what failed)" in message
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is SaveTimeoutError and str(back) == message
    assert (back.rank, back.upload_id, back.bytes_done, back.last_error, back.timeout) == (
        7,
        "UP-123",
        5 << 20,
        "UploadPart 2 stalled: 0 bytes moved in 1 s",
        30,
    )
    assert back.uri == "s3://b/run/global_step_3/rank_00007/w.safetensors"
    load = Deadline.after(5, operation="load").error("s3://b/run/f", doing="read")
    assert isinstance(load, LoadTimeoutError) and "load ran past its 5 s deadline" in str(load)
    assert "no request had failed" in str(load) and "last error says" not in str(load)
    assert "Check that the storage answers" in str(load) and "load_timeout" in str(load)


def test_a_cleanup_is_awaited_until_the_deadline_and_slack_then_left_to_the_background(
    caplog: pytest.LogCaptureFixture,
) -> None:
    removed: list[str] = []
    assert clean_up(lambda: removed.append("now"), "a file") is None  # no deadline: awaited
    assert removed == ["now"]
    release = threading.Event()

    def slow_removal() -> None:  # a server that stopped answering
        release.wait(30)
        removed.append("later")

    with bounded(Deadline.after(0.0)) as deadline:  # already past: waits CLEANUP_SLACK at most
        assert deadline is not None
        outcome = clean_up(slow_removal, "a file", otherwise="the next export overwrites it")
        past = time.monotonic() - deadline.expires
    assert outcome == "goes on in the background" and removed == ["now"]
    assert "removing a file goes on in the background" in caplog.text
    assert "if it cannot finish, the next export overwrites it" in caplog.text
    assert CLEANUP_SLACK - 0.01 <= past < CLEANUP_SLACK + 5
    release.set()  # the removal goes on in its own thread and finishes
    until = time.monotonic() + 10
    while removed != ["now", "later"] and time.monotonic() < until:
        time.sleep(0.01)
    assert removed == ["now", "later"]


@pytest.mark.parametrize("deadline", [None, 60.0], ids=["unbounded", "bounded"])
def test_a_cleanup_that_fails_says_so_rather_than_removed(
    deadline: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    def refused() -> None:
        raise PermissionError("AccessDenied on DeleteObjects")

    with bounded(Deadline.after(deadline) if deadline is not None else None):
        outcome = clean_up(refused, "a file")
    assert outcome == "failed (AccessDenied on DeleteObjects)"
    assert "could not remove a file (AccessDenied on DeleteObjects); `ckptstore gc` removes it" in (
        caplog.text
    )


def test_bounded_sets_and_restores_the_deadline_and_submit_carries_it_to_a_pool() -> None:
    outer, inner = Deadline.after(60), Deadline.after(5)
    assert current_deadline() is None
    with bounded(outer):
        with bounded(inner):
            assert current_deadline() is inner
            with bounded(None):
                assert current_deadline() is None
        assert current_deadline() is outer
        with ThreadPoolExecutor(2) as pool:
            assert submit(pool, current_deadline).result() is outer
            assert pool.submit(current_deadline).result() is None  # why submit exists
    assert current_deadline() is None


# -- the shared send rate ------------------------------------------------------------------------


def test_the_shared_rate_falls_once_per_round_and_spaces_requests() -> None:
    clock = Clock()
    rate = SendRate(clock=clock)
    for _ in range(40):  # 40 requests in the last second, unthrottled
        assert rate.delay() == 0.0
    round_ = rate.round()
    for _ in range(64):  # 64 threads answered SlowDown at once: one decision
        rate.throttled(round_)
    assert rate.rate == 20 and rate.lowered == 1 and rate.answered
    assert rate.delay() == pytest.approx(1 / 20)  # the last request went out just now
    clock.now += 1 / 20
    assert rate.delay() == 0.0  # its turn
    rate.throttled(rate.round())  # news: a request sent after the rate fell
    assert rate.rate == 10
    for _ in range(20):
        rate.throttled(rate.round())
    assert rate.rate == MIN_RATE  # a floor: a brownout does not stop the endpoint


def test_successes_raise_the_shared_rate_until_the_limit_is_lifted() -> None:
    clock = Clock()
    rate = SendRate(clock=clock)
    rate.delay()
    rate.throttled(rate.round())
    assert rate.rate == MIN_RATE
    clock.now += 0.5
    rate.succeeded()
    assert rate.rate == pytest.approx(2 * MIN_RATE)  # fourfold per second
    clock.now += 2  # nothing was sent for seconds: the limit is far above the demand
    rate.succeeded()
    assert rate.rate is None and rate.delay() == 0.0


def test_a_request_backs_off_on_its_own_with_full_jitter() -> None:
    waits = [BACKOFF.delay(n - 1) for n in (1, 3, 12) for _ in range(200)]
    assert all(0 <= w <= 5.0 for w in waits)
    assert max(waits[:200]) <= 0.1 and max(waits[400:]) > 1.0


# -- the progress watchdog -------------------------------------------------------------------


def test_the_meter_stops_a_trickle_and_lets_a_steady_flow_pass() -> None:
    clock = Clock()
    steady = Meter(1.0, 10 << 20, CancelToken(), clock=clock)
    for _ in range(20):
        clock.now += 0.25
        steady.moved(32 << 10)  # 128 KiB a second
    trickle = Meter(1.0, 10 << 20, CancelToken(), clock=clock)
    for _ in range(3):
        clock.now += 0.25
        trickle.moved(4 << 10)  # 16 KiB a second
    clock.now += 0.25
    with pytest.raises(Stalled, match="fewer than the 65536 due"):
        trickle.moved(4 << 10)  # one window: 16 KiB
    small = Meter(1.0, 1000, CancelToken(), clock=clock)
    clock.now += 5
    small.moved(1000)  # all it had to move: no stall however slow
    assert MIN_PROGRESS == 64 << 10


def test_the_meter_stops_a_cancelled_or_expired_attempt() -> None:
    token = CancelToken()
    meter = Meter(60.0, 1 << 20, token)
    meter.moved(1)
    token.cancel("its upload was aborted")
    with pytest.raises(Cancelled, match="aborted"):
        meter.moved(1)
    with pytest.raises(Cancelled):
        token.sleep(10)  # a cancelled backoff does not sleep
    clock = Clock()
    with bounded(Deadline.after(1, clock=clock)):
        expiring = Meter(60.0, 1 << 20, CancelToken())
    clock.now += 2
    with pytest.raises(Cancelled, match="deadline"):
        expiring.moved(1)


def test_a_progress_body_reads_like_a_file_and_counts_what_was_sent() -> None:
    sent: list[int] = []
    meter = Meter(60.0, 10, CancelToken(), on_bytes=sent.append)
    body = ProgressBody(b"0123456789", meter)
    assert len(body) == 10 and body.read(4) == b"0123" and body.tell() == 4
    assert body.read(100) == b"456789" and body.read(4) == b""
    assert sent == [4, 6]  # each block counted once the next is asked for
    body.seek(0)
    block = body.read()
    assert block == b"0123456789"
    # a view of the part, not a copy, and one nobody can write through
    assert isinstance(block, memoryview) and block.readonly


# -- classification and the retry loop ---------------------------------------------------------


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (client_error("SlowDown", 503), Kind.THROTTLED),
        (client_error("", 429), Kind.THROTTLED),
        (client_error("InternalError", 500), Kind.TRANSIENT),
        (client_error("RequestTimeout", 400), Kind.TRANSIENT),
        (client_error("NotImplemented", 501), Kind.FATAL),
        (client_error("BadDigest", 400), Kind.FATAL),
        (client_error("AccessDenied", 403), Kind.FATAL),
        (client_error("NoSuchKey", 404), Kind.FATAL),
        (client_error("PreconditionFailed", 412), Kind.FATAL),
        (EndpointConnectionError(endpoint_url="http://x"), Kind.UNREACHABLE),
        (ReadTimeoutError(endpoint_url="http://x"), Kind.TRANSIENT),
        (HTTPClientError(error=Stalled(0, 65536, 1.0)), Kind.TRANSIENT),
        (HTTPClientError(error=Cancelled("aborted")), Kind.CANCELLED),
        (ValueError("a bug"), Kind.FATAL),
    ],
)
def test_failures_are_classified_by_type_code_and_status(error: Exception, kind: Kind) -> None:
    assert classify(error) is kind


FAST = Backoff(base=0.002, cap=5.0)
"""Waits a fiftieth of the backend's."""


@pytest.mark.wallclock
def test_retries_are_budgeted_by_time_not_by_count() -> None:
    calls: list[float] = []

    def slow_down() -> None:
        calls.append(time.monotonic())
        raise client_error("InternalError", 500)

    retrier = Retrier(SendRate(), retry_timeout=0.3, backoff=FAST)
    started = time.monotonic()
    with pytest.raises(ClientError):
        retrier.call("PutObject", slow_down, Progress("s3://b/k", "write"))
    assert time.monotonic() - started < 2  # no wait would have ended past the budget
    assert len(calls) > 5  # more than botocore's count would have allowed
    capped = Retrier(SendRate(), retry_timeout=60, max_attempts=3, backoff=FAST)
    calls.clear()
    with pytest.raises(ClientError):
        capped.call("PutObject", slow_down, Progress("s3://b/k", "write"))
    assert len(calls) == 3


@pytest.mark.wallclock
def test_under_a_deadline_the_retry_loop_raises_its_error_naming_the_last_failure() -> None:
    def slow_down() -> None:
        raise client_error("SlowDown", 503)

    retrier = Retrier(SendRate(), retry_timeout=300, backoff=Backoff(0.02, 5.0))
    started = time.monotonic()
    with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(0.5, rank=2)):
        retrier.call("PutObject", slow_down, Progress("s3://b/run/k", "write"))
    assert time.monotonic() - started < 2
    assert caught.value.last_error == "PutObject: SlowDown (HTTP 503)"
    assert caught.value.rank == 2 and caught.value.uri == "s3://b/run/k"
    retrier.close()


@pytest.mark.wallclock
def test_an_attempt_blocked_past_the_deadline_is_abandoned_and_cancelled() -> None:
    progress = Progress("s3://b/run/k", "write")

    def blocked() -> None:
        progress.token.sleep(30)  # a request stuck in a socket call, until cancelled

    retrier = Retrier(SendRate(), retry_timeout=300)
    started = time.monotonic()
    with pytest.raises(SaveTimeoutError), bounded(Deadline.after(0.3)):
        retrier.call("PutObject", blocked, progress)
    assert time.monotonic() - started < 2
    assert progress.token.cancelled  # the abandoned attempt stops at its next block
    retrier.close()


# -- local disks and fsspec: between chunks ------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def plain(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "local":
        yield LocalBackend(str(tmp_path / "store"), {})
    else:
        yield FsspecBackend(f"memory://deadline-{tmp_path.name}", {})


def test_local_and_fsspec_writes_stop_between_chunks_and_leave_nothing(plain: Any) -> None:
    clock = Clock()

    def chunks() -> Iterator[bytes]:
        yield b"a" * 100
        clock.now += 10  # serializing the next chunk took the rest of the time
        yield b"b" * 100
        yield b"c" * 100

    with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(5, clock=clock)):
        plain.write("step/f", chunks())
    assert caught.value.path == "step/f" and caught.value.bytes_done == 100
    assert caught.value.uri is not None and caught.value.uri.endswith("step/f")
    assert plain.stat("step/f") is None
    assert plain.partial_writes("") == []
    plain.write("step/f", [b"x"])  # no deadline: it goes through
    with pytest.raises(LoadTimeoutError), bounded(Deadline.after(0, operation="load")):
        plain.read_into("step/f", memoryview(bytearray(1)))
