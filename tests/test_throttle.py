"""The throttling S3 (s3faults.throttle, through the fault proxy) and the S3 backend
under it: token buckets per prefix as tables with a fake clock, the SlowDown answer on a real
socket, and a store whose saves converge when the limit binds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ClientError

from ckptstore import CheckpointStore
from s3faults.faultproxy import FaultProxy
from s3faults.throttle import S3_READ_RATE, S3_WRITE_RATE, Throttle, TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("rate", "capacity", "times", "expected"),
    [
        (1.0, 2.0, [0, 0, 0], [True, True, False]),  # starts full, then empty
        (1.0, 2.0, [0, 0, 0, 1.0], [True, True, False, True]),  # one token a second
        (10.0, 1.0, [0, 0, 0.05, 0.1], [True, False, False, True]),  # a tenth of a second each
        (1.0, 2.0, [0, 0, 0, 100, 100, 100], [True, True, False, True, True, False]),  # capped
        (1.0, 1.0, [5, 4, 4], [True, False, False]),  # a clock going back refills nothing
    ],
)
def test_a_token_bucket_admits_its_rate_and_its_burst(
    rate: float, capacity: float, times: list[float], expected: list[bool]
) -> None:
    bucket = TokenBucket(rate, capacity)
    assert [bucket.take(t) for t in times] == expected


@pytest.mark.parametrize(
    ("depth", "path", "prefix"),
    [
        (0, "/b/run/global_step_1/x", "b"),
        (1, "/b/run/global_step_1/x", "b/run"),
        (2, "/b/run/global_step_1/x", "b/run/global_step_1"),
        (2, "/b/latest.json", "b/latest.json"),
        (1, "/b/", "b/"),
    ],
)
def test_a_prefix_is_the_bucket_and_the_first_segments(depth: int, path: str, prefix: str) -> None:
    assert Throttle(prefix_depth=depth).prefix(path) == prefix


def test_writes_and_reads_draw_from_separate_buckets_per_prefix() -> None:
    clock = FakeClock()
    throttle = Throttle(write_rate=2, read_rate=3, prefix_depth=1, clock=clock)
    writes = [throttle.admit("PutObject", "/b/run/k") for _ in range(3)]
    reads = [throttle.admit("GetObject", "/b/run/k") for _ in range(4)]
    other = [throttle.admit("DeleteObjects", "/b/other/k") for _ in range(3)]
    assert writes == [True, True, False]
    assert reads == [True, True, True, False]
    assert other == [True, True, False]
    clock.now += 0.5  # one write token back
    assert throttle.admit("UploadPart", "/b/run/k") and not throttle.admit("CopyObject", "/b/run/x")
    assert throttle.throttled == {
        "PutObject": 1,
        "GetObject": 1,
        "DeleteObjects": 1,
        "CopyObject": 1,
    }
    assert sum(throttle.admitted.values()) == 2 + 3 + 2 + 1


def test_the_default_rates_are_s3s_divided_by_the_stated_scale() -> None:
    throttle = Throttle.scaled(10)
    assert (throttle.write_rate, throttle.read_rate) == (S3_WRITE_RATE / 10, S3_READ_RATE / 10)
    assert Throttle().write_rate == 70 and Throttle().read_rate == 110
    assert throttle.lower_bound(350 + 700, 0) == pytest.approx(2.0)  # past the first second's
    with pytest.raises(ValueError, match="positive"):
        Throttle(write_rate=0)
    with pytest.raises(ValueError, match="scale"):
        Throttle.scaled(0)


# -- on a real socket, in front of moto ------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def throttled(s3_endpoint: str, clock: FakeClock) -> Iterator[FaultProxy]:
    """Three writes and three reads per prefix (``bucket/<first segment>``), frozen in time."""
    throttle = Throttle(write_rate=3, read_rate=3, prefix_depth=1, clock=clock)
    with FaultProxy(s3_endpoint, throttle=throttle) as proxy:
        yield proxy


def raw_client(proxy: FaultProxy) -> Any:
    """No retries: every SlowDown surfaces."""
    return boto3.client(
        "s3",
        endpoint_url=proxy.endpoint_url,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}),
    )


def test_beyond_the_rate_the_proxy_answers_slowdown_with_s3s_error_body(
    throttled: FaultProxy, s3_bucket: str, clock: FakeClock
) -> None:
    client = raw_client(throttled)
    for i in range(3):
        client.put_object(Bucket=s3_bucket, Key=f"run/{i}", Body=b"x")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=s3_bucket, Key="run/3", Body=b"x")
    error = refused.value.response
    assert error["Error"]["Code"] == "SlowDown"
    assert error["Error"]["Message"] == "Please reduce your request rate."
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 503
    # the refused PUT never reached the server; reads and another prefix have their own buckets
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")
    assert [o["Key"] for o in listed["Contents"]] == ["run/0", "run/1", "run/2"]
    client.put_object(Bucket=s3_bucket, Key="elsewhere/0", Body=b"x")
    clock.now += 0.5
    client.put_object(Bucket=s3_bucket, Key="run/3", Body=b"x")  # a token came back
    assert throttled.throttle is not None and throttled.throttle.throttled == {"PutObject": 1}
    assert throttled.seen["PutObject"] == 6


def test_a_head_beyond_the_rate_gets_a_bare_503_and_a_listing_counts_for_its_prefix(
    throttled: FaultProxy, s3_bucket: str
) -> None:
    client = raw_client(throttled)
    client.put_object(Bucket=s3_bucket, Key="run/k", Body=b"x")
    for _ in range(3):
        client.head_object(Bucket=s3_bucket, Key="run/k")
    with pytest.raises(ClientError) as refused:
        client.head_object(Bucket=s3_bucket, Key="run/k")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    with pytest.raises(ClientError, match="SlowDown"):
        client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")
    client.list_objects_v2(Bucket=s3_bucket, Prefix="elsewhere/")  # another prefix's bucket


def test_a_store_under_the_limit_saves_and_loads_every_byte(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """A real clock at 20 writes a second with a burst of two: a save of 40 files must wait
    for the bucket however slow this machine is at the moment (a burst of a second's worth
    let a loaded machine's save pass unthrottled), and the default retries (by time, with the
    send rate the process shares) carry it through."""
    throttle = Throttle(write_rate=20, read_rate=40, burst=0.1, prefix_depth=1)
    with FaultProxy(s3_endpoint, throttle=throttle) as proxy:
        options = {"endpoint_url": proxy.endpoint_url}
        state = {f"t{i}": torch.full((4,), float(i)) for i in range(40)}
        with CheckpointStore(
            f"s3://{s3_bucket}/run", storage_options=options, shard_size=16, lease=False
        ) as store:
            info = store.save(1, state)
            assert len(info.files) > 40
            loaded = store.load()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        assert sum(throttle.throttled.values()) > 0, "the limit never bound: the test is moot"
