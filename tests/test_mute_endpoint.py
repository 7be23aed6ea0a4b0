"""An S3 endpoint that never answers: commands fail in seconds, naming it and the option.

Issue 27: ``ckptstore ls`` against an endpoint that accepts TCP and never answers printed
nothing for 302 s (botocore's read timeout, ``stall_timeout``, then retries for
``retry_timeout``). Now a request to an endpoint that has not answered this process gets
``first_byte_timeout`` seconds (default 15), retries included, then a BackendError that is not
retryable names the endpoint and the option (s3_retry.py). The servers here are real sockets on
127.0.0.1: one that accepts and never sends a byte, a port where nothing listens, one whose
listen backlog is full (it never accepts). An endpoint that answered before and stalls now is
a brownout, retried for ``retry_timeout`` as before (tests/test_bounded_s3.py; and below, on the
retry loop itself).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from botocore.exceptions import ReadTimeoutError

from ckptstore import CheckpointStore
from ckptstore.backends.s3 import S3Backend
from ckptstore.backends.s3_errors import NoAnswer
from ckptstore.backends.s3_progress import Progress
from ckptstore.backends.s3_rate import SendRate
from ckptstore.backends.s3_retry import Retrier
from ckptstore.cli.main import run
from ckptstore.errors import BackendError, ConfigError
from ckptstore.retry import Backoff

pytestmark = [pytest.mark.wallclock, pytest.mark.usefixtures("aws_env")]  # dummy credentials

BOUND = 30.0
"""What any of these may take: the default first_byte_timeout is 15 s."""


class Mute:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self.accepted.append(self._server.accept()[0])

    def close(self) -> None:
        self._server.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def mute() -> Iterator[Mute]:
    server = Mute()
    yield server
    server.close()


@pytest.fixture
def refused() -> str:
    """An endpoint where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def unaccepting() -> Iterator[str]:
    """An endpoint whose listen backlog is full: connections are never accepted (the kernel
    drops their SYNs, so a connect waits for its timeout)."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    with socket.socket() as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(("127.0.0.1", port))
        except OSError:
            pass
        else:
            server.close()
            pytest.skip("this kernel accepts connections beyond a full listen backlog")
    yield f"http://127.0.0.1:{port}"
    for filler in fillers:
        filler.close()
    server.close()


def ls(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    code = run(["ls", "s3://bucket/run", *args])
    elapsed = time.monotonic() - started
    return code, capsys.readouterr().err, elapsed


# -- the command and the API --------------------------------------------------------------------


def test_ls_on_a_mute_endpoint_fails_in_seconds_naming_it_and_the_option(
    capsys: pytest.CaptureFixture[str], mute: Mute
) -> None:
    code, err, elapsed = ls(capsys, "-o", f"endpoint_url={mute.url}")
    assert code == 6, err  # a storage error
    assert elapsed < BOUND, elapsed  # was 301 s: stall_timeout (60), retried for 300
    assert (
        f"{mute.url} accepted the connection but sent no answer within 15 s (first_byte_timeout)"
        in err
    )
    assert "raise storage_options first_byte_timeout" in err
    assert mute.accepted  # it did accept


def test_latest_on_a_mute_endpoint_fails_in_seconds_and_is_not_retryable(mute: Mute) -> None:
    options = {"endpoint_url": mute.url, "first_byte_timeout": 2}
    started = time.monotonic()
    with (
        pytest.raises(BackendError) as caught,
        CheckpointStore("s3://bucket/run", storage_options=options) as store,
    ):
        store.latest()
    elapsed = time.monotonic() - started
    assert 2 <= elapsed < BOUND, elapsed
    assert not caught.value.retryable  # a wrong endpoint_url does not heal by trying again
    message = str(caught.value)
    assert mute.url in message and "within 2 s (first_byte_timeout)" in message
    assert isinstance(caught.value.__cause__, NoAnswer)


def test_a_short_stall_timeout_retries_within_first_byte_timeout(
    capsys: pytest.CaptureFixture[str], mute: Mute
) -> None:
    """Each attempt ends at its socket timeout (1 s); the silent endpoint's retries stop at
    first_byte_timeout, not retry_timeout."""
    options = ["-o", "stall_timeout=1", "-o", "first_byte_timeout=3"]
    code, err, elapsed = ls(capsys, "-o", f"endpoint_url={mute.url}", *options)
    assert code == 6 and elapsed < 10, (elapsed, err)
    assert f"{mute.url} accepted the connection but sent no answer within 3 s" in err
    assert len(mute.accepted) >= 2  # it was tried again in between


def test_a_refused_port_fails_in_seconds(capsys: pytest.CaptureFixture[str], refused: str) -> None:
    code, err, elapsed = ls(capsys, "-o", f"endpoint_url={refused}")
    assert code == 6 and elapsed < 10, (elapsed, err)
    assert f"cannot reach the S3 endpoint {refused}" in err
    started = time.monotonic()
    with (
        pytest.raises(BackendError, match="cannot reach the S3 endpoint"),
        CheckpointStore("s3://bucket/run", storage_options={"endpoint_url": refused}) as store,
    ):
        store.latest()
    assert time.monotonic() - started < 10


def test_a_server_that_never_accepts_fails_in_seconds(
    capsys: pytest.CaptureFixture[str], unaccepting: str
) -> None:
    """stall_timeout 1 s lowers botocore's connect timeout to 1 s: the attempts end in
    ConnectTimeoutError, the request at first_byte_timeout."""
    options = ["-o", "stall_timeout=1", "-o", "first_byte_timeout=3"]
    code, err, elapsed = ls(capsys, "-o", f"endpoint_url={unaccepting}", *options)
    assert code == 6 and elapsed < 10, (elapsed, err)
    assert f"{unaccepting} accepted no connection within 3 s (first_byte_timeout)" in err


def test_the_command_exits_at_once_though_its_request_still_waits(mute: Mute) -> None:
    """The attempt given up is still blocked in its socket (for stall_timeout, 60 s); it runs
    on a daemon thread, so the process does not wait for it at exit."""
    command = [sys.executable, "-m", "ckptstore.cli", "ls", "s3://bucket/run"]
    command += ["-o", f"endpoint_url={mute.url}", "-o", "first_byte_timeout=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.monotonic() - started
    assert done.returncode == 6, done.stderr
    assert elapsed < 20, elapsed  # interpreter start and imports included
    assert "sent no answer within 2 s (first_byte_timeout)" in done.stderr


# -- the rule, on the retry loop ----------------------------------------------------------------


FAST = Backoff(base=0.002, cap=5.0)
"""Waits a fiftieth of the backend's."""


def silent() -> None:
    raise ReadTimeoutError(endpoint_url="http://x")


def test_silence_from_an_endpoint_that_never_answered_ends_at_first_byte_timeout() -> None:
    retrier = Retrier(SendRate(), retry_timeout=300, backoff=FAST, first_byte_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(NoAnswer) as caught:
        retrier.call("ListObjectsV2", silent, Progress("s3://b/run/", "list"))
    assert time.monotonic() - started < 3  # no wait that would end past the budget
    assert caught.value.accepted is True and caught.value.seconds == 0.5
    assert "ReadTimeoutError" in (caught.value.last_error or "")
    retrier.close()


def test_silence_from_an_endpoint_that_answered_before_is_a_brownout() -> None:
    """Retried for retry_timeout, however short first_byte_timeout is."""
    rate = SendRate()
    rate.answered = True
    retrier = Retrier(
        rate, retry_timeout=2.0, backoff=FAST, first_byte_timeout=0.1, rng=random.Random(1)
    )
    calls: list[float] = []

    def stalls() -> None:
        calls.append(time.monotonic())
        silent()

    with pytest.raises(ReadTimeoutError):
        retrier.call("GetObject", stalls, Progress("s3://b/run/k", "read"))
    assert calls[-1] - calls[0] > 0.3  # well past first_byte_timeout
    retrier.close()


def test_an_attempt_blocked_on_a_silent_endpoint_is_given_up_and_cancelled() -> None:
    progress = Progress("s3://b/run/k", "read")

    def blocked() -> None:
        progress.token.sleep(30)  # a request stuck in a socket call, until cancelled

    retrier = Retrier(SendRate(), retry_timeout=300, first_byte_timeout=0.3, connect_timeout=0.1)
    started = time.monotonic()
    with pytest.raises(NoAnswer) as caught:
        retrier.call("GetObject", blocked, progress)
    assert time.monotonic() - started < 2
    assert caught.value.accepted is True  # silent longer than the connect timeout: connected
    assert progress.token.cancelled
    retrier.close()


def test_an_attempt_that_moves_bytes_is_not_held_to_first_byte_timeout() -> None:
    """A large first upload takes its time: the endpoint reads it, so it is not mute."""
    progress = Progress("s3://b/run/k", "write")

    def uploading() -> str:
        for _ in range(10):
            time.sleep(0.1)
            progress.add(64 << 10)
        return "done"

    retrier = Retrier(SendRate(), retry_timeout=300, first_byte_timeout=0.3)
    assert retrier.call("PutObject", uploading, progress) == "done"
    retrier.close()


def test_first_byte_timeout_is_validated() -> None:
    for value in (0, "15s", True, -1):
        with pytest.raises(ConfigError, match="'first_byte_timeout' must be a number of seconds"):
            S3Backend("s3://bucket/run", {"first_byte_timeout": value})


def test_any_answer_marks_the_endpoint_answered(s3_uri: str, s3_options: dict[str, object]) -> None:
    """A 404 is an answer: from then on the endpoint's requests follow the usual rules."""
    backend = S3Backend(s3_uri, s3_options)
    rate = backend.retrier.rate  # shared by the process's backends of the bucket
    rate.answered = False
    assert backend.stat("nothing-here") is None
    assert rate.answered
    backend.close()
