"""Saves and loads that finish or fail in bounded time: S3 over HTTP, through the fault proxy
(s3faults.faultmodes) in front of moto.

Each fault mode, switched on for chosen requests and off again: a stalled request is given up
after ``stall_timeout`` and retried, and the transfer completes; under a deadline, a fault that
never clears fails by the deadline plus :data:`MARGIN` with SaveTimeoutError (LoadTimeoutError)
naming the file, the upload and the last error, and no multipart upload stays open; brownouts,
refused connections and sustained SlowDown shorter than the deadline are ridden out. What the
tests assert about the server they read from moto directly, not through the proxy.

Time: ``stall_timeout`` is 1 s and deadlines a few seconds. The only timed assertions are "by
the deadline plus MARGIN", with a margin several times what the backend promises (half a second
for the running parts, one AbortMultipartUpload): the machine running them is shared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError

from ckptstore import CheckpointStore
from ckptstore.backends.s3 import S3Backend
from ckptstore.deadline import Deadline, bounded, submit
from ckptstore.errors import (
    BackendError,
    ConfigError,
    LoadTimeoutError,
    SaveTimeoutError,
)
from s3faults.faultproxy import Fault, FaultProxy
from s3faults.throttle import Throttle

pytestmark = pytest.mark.wallclock  # timed assertions: run on a quiet machine

MiB = 1 << 20
MARGIN = 3.0
"""Seconds past a deadline a failure may take here (the backend's own bound is about 1.5 s)."""
ProxyFactory = Callable[..., FaultProxy]


@pytest.fixture
def make_proxy(s3_endpoint: str) -> Iterator[ProxyFactory]:
    started: list[FaultProxy] = []

    def make(**kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(s3_endpoint, record=True, **kwargs).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(make_proxy: ProxyFactory) -> FaultProxy:
    return make_proxy()


def options(proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    """Through the proxy; 5 MiB parts, so 11 MiB is a 3-part upload; stalls given up after 1 s."""
    return {"endpoint_url": proxy.endpoint_url, "part_size": 5 * MiB, "stall_timeout": 1, **extra}


@pytest.fixture
def backend(proxy: FaultProxy, s3_uri: str) -> Iterator[S3Backend]:
    """Stalls given up after half a second: these tests wait out one stall each."""
    opened = S3Backend(s3_uri, options(proxy, stall_timeout=0.5))
    yield opened
    opened.close()


def uploads(s3_client: Any, bucket: str) -> list[Any]:
    return list(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def state_for(step: int, mib: int = 6) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * MiB // 4, generator=gen), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


# -- the fault modes themselves ----------------------------------------------------------------


def test_fault_modes_fire_on_their_operations_and_keys_and_switch_at_runtime(
    proxy: FaultProxy, s3_bucket: str
) -> None:
    raw = boto3.client(
        "s3",
        endpoint_url=proxy.endpoint_url,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}),
    )
    down = proxy.add_fault(Fault.brownout(None, operations={"PutObject"}, prefix="run/a/"))
    rank1 = proxy.add_fault(Fault.brownout(None, status=500, glob="*/rank_00001/*"))
    with pytest.raises(ClientError, match="SlowDown"):
        raw.put_object(Bucket=s3_bucket, Key="run/a/x", Body=b"x")
    with pytest.raises(ClientError, match="InternalError"):
        raw.get_object(Bucket=s3_bucket, Key="run/s/rank_00001/f")
    raw.put_object(Bucket=s3_bucket, Key="run/b/x", Body=b"x")  # another prefix
    raw.put_object(Bucket=s3_bucket, Key="run/s/rank_00002/f", Body=b"x")  # another rank
    assert raw.get_object(Bucket=s3_bucket, Key="run/b/x")["Body"].read() == b"x"
    assert (down.fired, rank1.fired) == (1, 1)
    down.off()
    raw.put_object(Bucket=s3_bucket, Key="run/a/x", Body=b"x")
    down.on()
    with pytest.raises(ClientError, match="SlowDown"):
        raw.put_object(Bucket=s3_bucket, Key="run/a/y", Body=b"x")
    assert down.fired == 2
    once = proxy.add_fault(Fault.reset(0, operations={"HeadObject"}, times=1))
    with pytest.raises(Exception):  # noqa: B017 -- botocore's connection error, whichever
        raw.head_object(Bucket=s3_bucket, Key="run/b/x")
    raw.head_object(Bucket=s3_bucket, Key="run/b/x")  # times=1: fired, then spent
    assert once.fired == 1
    refused = proxy.add_fault(Fault.refuse(30))
    with pytest.raises(EndpointConnectionError):
        raw.head_object(Bucket=s3_bucket, Key="run/b/x")
    refused.off()  # listening again, on the same port
    raw.head_object(Bucket=s3_bucket, Key="run/b/x")
    assert refused.fired == 1
    raw.close()


# -- a request that stalls once is given up and retried ----------------------------------------

ONCE = {
    "no answer to a part": Fault.stall(operations={"UploadPart"}),
    "a part's body stops after 1 MiB": Fault.stall(
        after=MiB, direction="request", operations={"UploadPart"}
    ),
    "a part's body trickles": Fault.trickle(
        16 << 10, direction="request", operations={"UploadPart"}
    ),
    "a part's body is reset after 1 MiB": Fault.reset(
        MiB, direction="request", operations={"UploadPart"}
    ),
    "no answer to CreateMultipartUpload": Fault.stall(operations={"CreateMultipartUpload"}),
    "CreateMultipartUpload's answer lost": Fault.stall(
        after=0, operations={"CreateMultipartUpload"}
    ),
    "CompleteMultipartUpload's answer lost": Fault.stall(
        after=0, operations={"CompleteMultipartUpload"}
    ),
    "no answer to a PUT": Fault.stall(operations={"PutObject"}),
}


@pytest.mark.parametrize("fault", ONCE.values(), ids=ONCE.keys())
def test_a_request_stalled_once_is_retried_and_the_write_completes(
    proxy: FaultProxy, backend: S3Backend, s3_client: Any, s3_bucket: str, fault: Fault
) -> None:
    fault.times = 1
    proxy.add_fault(fault)
    size = 11 * MiB if fault.operations != {"PutObject"} else 3 * MiB  # a PUT below 5 MiB
    data = os.urandom(size)
    assert backend.write("f", [data]) == size
    assert fault.fired == 1
    assert backend.read("f") == data
    assert uploads(s3_client, s3_bucket) == []  # the lost upload of a lost answer was found


GETS = {
    "silence after 3 MiB": Fault.stall(after=3 * MiB, operations={"GetObject"}, times=1),
    "a trickle after 1 MiB": Fault.trickle(16 << 10, after=MiB, operations={"GetObject"}, times=1),
    "a reset after 2 MiB": Fault.reset(2 * MiB, operations={"GetObject"}, times=1),
}


@pytest.mark.parametrize("fault", GETS.values(), ids=GETS.keys())
def test_a_broken_get_resumes_from_the_last_byte_received(
    proxy: FaultProxy, backend: S3Backend, fault: Fault
) -> None:
    data = os.urandom(4 * MiB)
    backend.write("f", [data])
    proxy.add_fault(fault)
    assert proxy.requests is not None
    proxy.requests.clear()
    out = memoryview(bytearray(len(data)))
    assert backend.read_into("f", out) == len(data)
    assert bytes(out) == data and fault.fired == 1
    gets = [r for op, _, r in proxy.requests if op == "GetObject"]
    assert len(gets) == 2
    resumed_at = int(gets[1].removeprefix("bytes=").partition("-")[0])
    if fault.kind == "reset":  # an RST drops what the client had not read yet
        assert resumed_at <= (fault.after or 0)
    else:
        assert resumed_at >= (fault.after or 0) > 0  # from the last byte, not from zero


# -- a fault that never clears: the deadline ----------------------------------------------------


def test_a_part_stalled_for_good_fails_by_the_deadline_and_leaves_no_upload(
    proxy: FaultProxy, backend: S3Backend, s3_client: Any, s3_bucket: str, s3_uri: str
) -> None:
    stall = proxy.add_fault(Fault.stall(operations={"UploadPart"}, glob="*/big"))
    started = time.monotonic()
    # 4 s: room, on a loaded machine, to send a part and see it stall (stall_timeout 0.5 s),
    # so that the error can name the stall
    with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(4, rank=5)):
        backend.write("big", [os.urandom(11 * MiB)])
    assert time.monotonic() - started < 4 + MARGIN
    e = caught.value
    assert (e.rank, e.path, e.uri, e.timeout) == (5, "big", f"{s3_uri}/big", 4)
    assert e.upload_id and e.upload_id in str(e) and f"{s3_uri}/big" in str(e)
    assert e.bytes_done == 0 and "rank 5" in str(e)
    assert e.last_error is not None and "UploadPart" in e.last_error and "stall" in e.last_error
    assert uploads(s3_client, s3_bucket) == []
    assert backend.stat("big") is None
    stall.off()  # the fault clears: the next save goes through
    data = os.urandom(11 * MiB)
    with bounded(Deadline.after(30)):
        backend.write("big", [data])
    assert backend.read("big") == data


@pytest.mark.parametrize(
    ("fault", "size"),
    [
        (Fault.stall(operations={"PutObject"}), MiB),
        (Fault.trickle(1 << 10, direction="request", operations={"PutObject"}), 3 * MiB),
        (Fault.stall(operations={"CompleteMultipartUpload"}), 11 * MiB),
    ],
    ids=["a PUT never answered", "a PUT trickling", "CompleteMultipartUpload never answered"],
)
def test_every_request_gives_up_by_the_deadline(
    proxy: FaultProxy,
    backend: S3Backend,
    s3_client: Any,
    s3_bucket: str,
    fault: Fault,
    size: int,
) -> None:
    proxy.add_fault(fault)
    started = time.monotonic()
    with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(1.5)):
        backend.write("f", [os.urandom(size)])
    assert time.monotonic() - started < 1.5 + MARGIN
    assert caught.value.path == "f" and caught.value.last_error
    multipart = fault.operations == {"CompleteMultipartUpload"}
    assert bool(caught.value.upload_id) == multipart
    assert uploads(s3_client, s3_bucket) == []


def test_a_load_stalled_for_good_fails_by_its_deadline(
    proxy: FaultProxy, backend: S3Backend
) -> None:
    data = os.urandom(11 * MiB)
    backend.write("f", [data])
    proxy.add_fault(Fault.stall(after=MiB, operations={"GetObject"}))
    started = time.monotonic()
    out = memoryview(bytearray(len(data)))
    with pytest.raises(LoadTimeoutError) as caught, bounded(Deadline.after(1.5, operation="load")):
        backend.read_into("f", out)
    assert time.monotonic() - started < 1.5 + MARGIN
    assert caught.value.path == "f" and caught.value.bytes_done >= MiB  # type: ignore[operator]
    assert "load ran past" in str(caught.value)


# -- outages shorter than the deadline are ridden out --------------------------------------------


@pytest.mark.parametrize("status", [503, 500])
def test_a_brownout_shorter_than_the_deadline_is_ridden_out(
    proxy: FaultProxy, s3_uri: str, status: int
) -> None:
    with CheckpointStore(s3_uri, storage_options=options(proxy)) as store:
        store.save(1, state_for(1, mib=1))
        brownout = proxy.add_fault(Fault.brownout(0.75, status=status))
        with bounded(Deadline.after(20)):
            store.save(2, state_for(2, mib=1))
        assert brownout.fired > 0
        assert same(store.load(2), state_for(2, mib=1))


def test_refused_connections_for_a_while_are_ridden_out(proxy: FaultProxy, s3_uri: str) -> None:
    with CheckpointStore(s3_uri, storage_options=options(proxy)) as store:
        store.save(1, state_for(1, mib=1))  # the endpoint answered: refusals are an outage now
        refused = proxy.add_fault(Fault.refuse(1))
        with bounded(Deadline.after(20)):
            store.save(2, state_for(2, mib=1))
        assert refused.fired == 1 and not refused.active
        assert same(store.load(2), state_for(2, mib=1))


def test_sustained_slowdown_is_ridden_out_until_the_deadline(s3_endpoint: str, s3_uri: str) -> None:
    """16 PUTs from 8 threads at 8 writes a second: SlowDown answers all along. With time
    (10 s) they all land; with too little (1.5 s) the deadline, not a count of attempts, ends
    them, and the error says SlowDown."""
    throttle = Throttle(write_rate=8, read_rate=100, burst=0.25)
    with FaultProxy(s3_endpoint, throttle=throttle) as proxy:
        backend = S3Backend(s3_uri, options(proxy))

        def put_two(rank: int) -> None:
            for i in range(2):
                backend.write(f"rank_{rank}/f{i}", [b"x" * 100])

        with ThreadPoolExecutor(8) as pool, bounded(Deadline.after(10)):
            for future in [submit(pool, put_two, rank) for rank in range(8)]:
                future.result()
        assert throttle.throttled["PutObject"] > 0  # SlowDown all along, yet every PUT landed
        assert len(list(backend.list("rank_"))) == 16

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool, bounded(Deadline.after(1.5, rank=3)):
            futures = [submit(pool, put_two, rank) for rank in range(8, 16)]
            errors = [f.exception() for f in futures]
        assert time.monotonic() - started < 1.5 + MARGIN
        timeouts = [e for e in errors if isinstance(e, SaveTimeoutError)]
        assert timeouts and all(isinstance(e, SaveTimeoutError) for e in errors if e)
        assert any("SlowDown" in (e.last_error or "") for e in timeouts)
        backend.close()


# -- the store ------------------------------------------------------------------------------------


def test_a_stalled_save_is_retried_and_loads_bit_exact(
    proxy: FaultProxy, s3_uri: str, s3_client: Any, s3_bucket: str
) -> None:
    with CheckpointStore(s3_uri, storage_options=options(proxy, stall_timeout=0.5)) as store:
        stall = proxy.add_fault(Fault.stall(operations={"UploadPart", "PutObject"}, times=2))
        store.save(1, state_for(1, mib=11))
        assert stall.fired == 2
        assert same(store.load(1), state_for(1, mib=11))
    assert uploads(s3_client, s3_bucket) == []


def test_a_commit_stalled_for_good_fails_by_the_deadline_and_commits_nothing(
    proxy: FaultProxy, s3_uri: str
) -> None:
    """The commit marker is written from the caller's thread, which holds the deadline."""
    with CheckpointStore(s3_uri, storage_options=options(proxy)) as store:
        stall = proxy.add_fault(Fault.stall(operations={"PutObject"}, glob="*.manifest.json"))
        started = time.monotonic()
        with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(3, rank=0)):
            store.save(1, state_for(1, mib=1))
        assert time.monotonic() - started < 3 + MARGIN
        assert caught.value.path is not None and caught.value.path.endswith(".manifest.json")
        stall.off()
        assert store.list() == [] and store.latest() is None
        store.save(1, state_for(1, mib=1))  # the fault cleared: the same step commits
        assert same(store.load(1), state_for(1, mib=1))


def test_a_save_whose_part_stalls_for_good_fails_by_the_deadline(
    proxy: FaultProxy, s3_uri: str, s3_client: Any, s3_bucket: str
) -> None:
    opts = options(proxy, retry_timeout=2.5)  # longer than the deadline: it decides
    with CheckpointStore(s3_uri, storage_options=opts) as store:
        proxy.add_fault(Fault.stall(operations={"UploadPart"}))
        started = time.monotonic()
        with pytest.raises(SaveTimeoutError) as caught, bounded(Deadline.after(1.5, rank=0)):
            store.save(1, state_for(1, mib=11))
        assert time.monotonic() - started < 1.5 + MARGIN
        # the error is the stalled part's, not one of the cleanup after it
        assert caught.value.upload_id and caught.value.rank == 0
        assert (caught.value.path or "").endswith(".safetensors")
        assert store.list() == []
    assert uploads(s3_client, s3_bucket) == []


# -- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("stall_timeout", 0),
        ("stall_timeout", "60s"),
        ("stall_timeout", True),
        ("retry_timeout", -1),
    ],
)
def test_timeouts_are_validated(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"'{name}' must be a number of seconds"):
        S3Backend("s3://bucket/run", {name: value})


def test_stall_timeout_bounds_botocores_socket_timeouts(s3_uri: str, s3_endpoint: str) -> None:
    backend = S3Backend(s3_uri, {"endpoint_url": s3_endpoint, "stall_timeout": 4})
    config = backend.client.meta.config
    assert (config.read_timeout, config.connect_timeout) == (4, 4)
    assert config.retries == {"mode": "standard", "total_max_attempts": 1}  # retries are ours
    backend.close()


def test_a_typo_in_the_endpoint_fails_fast_not_after_the_retry_budget(s3_uri: str) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    backend = S3Backend(s3_uri, {"endpoint_url": endpoint})
    started = time.monotonic()
    with pytest.raises(BackendError, match="cannot reach the S3 endpoint"):
        backend.stat("x")
    assert time.monotonic() - started < 5
    backend.close()
