"""The S3 backend behind a fault-injecting proxy (s3faults.faultproxy) on moto.

Faults: 500, 503 SlowDown, connections reset mid-response, truncated bodies, delays, all on
real sockets, so botocore's retries, our body re-reads and our error translation run for real.
Quirks: one S3-compatible server difference at a time; for each, the probe's verdict, the
protocol the store falls back to, and a check that no committed step is lost or overwritten.
Everything the tests assert about the server they read from moto directly, not via the proxy.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.s3 import S3Backend
from ckptstore.data.payload import SourceFile
from ckptstore.domain.layout import LATEST_NAME
from ckptstore.errors import (
    BackendError,
    ConflictError,
    CorruptCheckpointError,
    PreconditionFailedError,
)
from parts import committer_for
from s3faults.faultproxy import QUIRKS, FaultProxy

MiB = 1 << 20
ProxyFactory = Callable[..., FaultProxy]


@pytest.fixture
def make_proxy(s3_endpoint: str) -> Iterator[ProxyFactory]:
    started: list[FaultProxy] = []

    def make(**kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(s3_endpoint, **kwargs).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


def options(proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    """Through the proxy, 5 MiB parts: a state of a few MiB goes up as a multipart upload."""
    return {"endpoint_url": proxy.endpoint_url, "part_size": 5 * MiB, **extra}


def state_for(step: int, mib: int = 1) -> dict[str, Any]:
    """A frozen part (incremental saves copy it) and ``mib`` MiB that change every step."""
    gen = torch.Generator().manual_seed(step)
    frozen = torch.Generator().manual_seed(0)
    return {
        "frozen": torch.randn(MiB // 4, generator=frozen),
        "w": torch.randn(mib * MiB // 4, generator=gen),
        "step": step,
    }


def assert_state_is(state: dict[str, Any], step: int, mib: int = 1) -> None:
    expected = state_for(step, mib)
    assert state["step"] == step
    assert torch.equal(state["w"], expected["w"])
    assert torch.equal(state["frozen"], expected["frozen"])


def uploads(s3_client: Any, bucket: str) -> list[Any]:
    return list(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def keys(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    found = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(str(o["Key"]) for o in found)


# -- retries: one loop (s3_retry), bounded by time, or by max_attempts when set ----------------


@pytest.mark.parametrize("attempts", [1, 3])
def test_max_attempts_bounds_every_request_and_body_read(
    make_proxy: ProxyFactory, s3_uri: str, attempts: int
) -> None:
    proxy = make_proxy(rate=1.0, faults=("503",), operations=frozenset({"HeadObject"}))
    backend = S3Backend(s3_uri, options(proxy, max_attempts=attempts))
    assert backend.client.meta.config.retries == {"mode": "standard", "total_max_attempts": 1}
    with pytest.raises(BackendError, match="after retries") as caught:
        backend.stat("x")
    assert caught.value.retryable
    assert f"{s3_uri}/x" in str(caught.value)
    assert proxy.seen["HeadObject"] == attempts
    # a body that breaks after its headers is read again, under the same bound
    proxy.operations = frozenset({"GetObject"})
    proxy.faults = ("truncate",)
    proxy.rate = 0.0
    backend.write("y", [b"y" * 100_000])
    proxy.rate = 1.0
    with pytest.raises(BackendError, match=f"{s3_uri}/y"):
        backend.read("y")
    assert proxy.seen["GetObject"] == attempts
    backend.close()


# -- 10% faults: everything completes and verifies ----------------------------------------------


def test_saves_and_loads_complete_at_ten_percent_faults(
    make_proxy: ProxyFactory, s3_uri: str, s3_client: Any, s3_bucket: str
) -> None:
    proxy = make_proxy(rate=0.1, seed=11, max_delay=0.2)
    with CheckpointStore(s3_uri, keep_last=2, storage_options=options(proxy)) as store:
        for step in (1, 2, 3):
            store.save(step, state_for(step, mib=11))  # 12 MiB: three parts of 5 MiB
        store.save_async(4, state_for(4, mib=11)).wait()
        assert [i.step for i in store.list()] == [3, 4]
        assert store.latest().step == 4  # type: ignore[union-attr]
        for step in (3, 4):
            assert_state_is(store.load(step), step, mib=11)
            assert store.verify(step).ok
        assert proxy.seen["UploadPart"] >= 12 and proxy.seen["CopyObject"] >= 1
        assert sum(proxy.injected.values()) >= 5, proxy.injected
        proxy.rate = 0.0
        # a reset CreateMultipartUpload that landed leaves an upload nobody knows: gc finds it
        store.gc(older_than=0)
    assert uploads(s3_client, s3_bucket) == []


# -- 100% faults: a clear error, nothing committed, nothing left behind -------------------------


def test_a_total_outage_fails_clearly_and_commits_nothing(
    make_proxy: ProxyFactory, s3_uri: str, s3_client: Any, s3_bucket: str
) -> None:
    proxy = make_proxy(rate=1.0, faults=("500", "503", "reset"), seed=3)
    store = CheckpointStore(s3_uri, storage_options=options(proxy, max_attempts=2))
    with pytest.raises(BackendError) as caught:
        store.save(1, state_for(1, mib=6))
    assert s3_uri in str(caught.value)
    assert caught.value.retryable
    proxy.rate = 0.0
    assert store.list() == [] and store.latest() is None
    assert uploads(s3_client, s3_bucket) == []
    assert keys(s3_client, s3_bucket, "run/global_step_") == []


def test_parts_that_always_fail_leave_no_upload_behind(
    make_proxy: ProxyFactory, s3_uri: str, s3_client: Any, s3_bucket: str
) -> None:
    proxy = make_proxy(
        rate=1.0, faults=("500", "503", "reset"), operations=frozenset({"UploadPart"})
    )
    store = CheckpointStore(s3_uri, storage_options=options(proxy, max_attempts=2))
    with pytest.raises(BackendError) as caught:
        store.save(1, state_for(1, mib=11))
    assert s3_uri in str(caught.value)
    assert proxy.seen["CreateMultipartUpload"] >= 1 and proxy.seen["AbortMultipartUpload"] >= 1
    assert store.list() == [] and store.latest() is None
    assert uploads(s3_client, s3_bucket) == []
    assert keys(s3_client, s3_bucket, "run/global_step_") == []


# -- quirks of S3-compatible servers ------------------------------------------------------------


def exercise(uri: str, opts: dict[str, Any]) -> CheckpointStore:
    """Two saves, a rival committing the same step, a rival moving ``latest`` back, one more
    save: no committed step may be lost or overwritten, ``latest`` only moves forward."""
    store = CheckpointStore(uri, keep_last=5, storage_options=opts)
    store.save(1, state_for(1, mib=6))  # multipart
    store.save(2, state_for(2))
    original = store.info(2).manifest
    rival = CheckpointStore(uri, storage_options=opts, lease=False)
    forged = dataclasses.replace(original, writer="rival", metadata={"rival": True})
    with pytest.raises(ConflictError, match="already committed"):
        committer_for(rival.backend, writer="rival").commit(forged)
    with pytest.raises(ConflictError, match="already committed"):
        rival.save(2, state_for(99))
    # even a writer holding a newer lease epoch moves latest only forward
    assert not committer_for(rival.backend, writer="rival").advance_latest(1, epoch=99)
    assert store.latest().step == 2  # type: ignore[union-attr]
    assert store.info(2).manifest == original
    store.save(3, state_for(3, mib=6))
    assert store.latest().step == 3  # type: ignore[union-attr]
    assert [i.step for i in store.list()] == [1, 2, 3]
    for step, mib in ((1, 6), (2, 1), (3, 6)):
        assert_state_is(store.load(step), step, mib)
    assert all(r.ok for r in store.verify_all())
    rival.close()
    return store


def test_every_quirk_is_emulated() -> None:
    assert set(QUIRKS) == {
        "complete-ignores-if-none-match",
        "put-ignores-conditions",
        "if-match-unquoted-only",
        "complete-empty-etag",
        "no-checksums",
        "no-upload-listing",
    }


def test_put_ignoring_conditions_falls_back_and_warns_once(
    make_proxy: ProxyFactory, s3_uri: str
) -> None:
    proxy = make_proxy(quirk="put-ignores-conditions")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = exercise(s3_uri, options(proxy))
        caps = store.backend.capabilities
        probing = proxy.conditions.copy()
        store.save(4, state_for(4))
    assert not caps.atomic_create and not caps.atomic_swap
    lost = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # once per backend (the store's and the rival's each probe once), not once per write
    assert sum("ignores If-None-Match" in m for m in lost) == 2, lost
    assert sum("does not honour If-Match" in m for m in lost) == 2, lost
    # the fallback sends no conditional header the server would ignore
    assert proxy.conditions == probing
    assert store.load()["step"] == 4
    store.close()


def test_if_match_with_unquoted_etags_only_keeps_compare_and_swap(
    make_proxy: ProxyFactory, s3_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = make_proxy(quirk="if-match-unquoted-only")
    with caplog.at_level(logging.INFO, logger="ckptstore"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no guarantee is lost: no warning
        store = exercise(s3_uri, options(proxy))
    assert store.backend.capabilities.atomic_swap
    assert caplog.text.count("accepts only unquoted ETags") == 2  # the store's and the rival's
    backend = store.backend
    data, version = backend.read_versioned(LATEST_NAME)
    backend.swap(LATEST_NAME, data + b"\n", version)  # other bytes: a new ETag
    with pytest.raises(PreconditionFailedError):  # the stale version is refused
        backend.swap(LATEST_NAME, b"{}", version)
    assert store.latest().step == 3  # type: ignore[union-attr]
    store.close()


def test_complete_ignoring_if_none_match_is_never_relied_on(
    make_proxy: ProxyFactory, s3_uri: str
) -> None:
    """Manifests are small single PUTs: the commit never rides on CompleteMultipartUpload."""
    proxy = make_proxy(quirk="complete-ignores-if-none-match")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        store = exercise(s3_uri, options(proxy))
    assert store.backend.capabilities.atomic_create
    assert proxy.seen["CompleteMultipartUpload"] >= 2
    assert proxy.conditions["CompleteMultipartUpload If-None-Match"] == 0
    assert proxy.conditions["PutObject If-None-Match"] >= 4  # probe and each commit
    store.close()


def test_an_empty_etag_from_complete_is_never_used(make_proxy: ProxyFactory, s3_uri: str) -> None:
    """Payload integrity is the manifest's CRC32C; swap tokens come from single PUTs."""
    proxy = make_proxy(quirk="complete-empty-etag")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        store = exercise(s3_uri, options(proxy))
    assert proxy.seen["CompleteMultipartUpload"] >= 2
    store.close()


def test_no_checksums_is_detected_and_loads_still_verify(
    make_proxy: ProxyFactory,
    s3_uri: str,
    s3_client: Any,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = make_proxy(quirk="no-checksums")
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        store = exercise(s3_uri, options(proxy))
    assert not store.backend.capabilities.server_checksums
    assert caplog.text.count("does not verify the CRC32C") == 2  # the store's and the rival's
    key = f"run/{store.info(3).manifest.file('w-00000.safetensors').key(3)}"
    assert key in keys(s3_client, s3_bucket, "run/global_step_3/")
    data = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 1
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"w-00000\.safetensors.*step 3"):
        store.load(3)
    assert_state_is(store.load(), 2)  # resume falls back to the previous good step
    store.close()


def test_no_upload_listing_degrades_gc_with_one_warning(
    make_proxy: ProxyFactory,
    s3_uri: str,
    s3_client: Any,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = make_proxy(quirk="no-upload-listing")
    store = exercise(s3_uri, options(proxy))

    def exploding() -> Iterator[bytes]:
        yield b"x" * (6 * MiB)
        raise RuntimeError("the trainer died mid-stream")

    with caplog.at_level(logging.WARNING, logger="ckptstore"), pytest.raises(RuntimeError):
        committer_for(store.backend, writer="t").write_payload(9, [SourceFile("big", exploding)])
    assert "could not be aborted (the server refused)" in caplog.text
    assert "AbortIncompleteMultipartUpload" in caplog.text
    assert len(uploads(s3_client, s3_bucket)) == 1  # the server would not abort it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.gc(older_than=0).aborted_uploads == ()
        store.gc(older_than=0)
    messages = [str(w.message) for w in caught]
    assert sum("does not implement ListMultipartUploads" in m for m in messages) == 1, messages
    assert [i.step for i in store.list()] == [1, 2, 3]  # committed steps are untouched
    assert all(r.ok for r in store.verify_all())
    store.close()


# -- requests that landed, answers that did not ---------------------------------------------------


def test_a_commit_whose_answer_was_lost_is_not_a_conflict(
    s3_uri: str, s3_options: dict[str, Any]
) -> None:
    """A reset after the manifest PUT landed: the retry finds our own manifest there."""
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    create = store.backend.create

    def landed_then_retried(path: str, data: bytes) -> None:
        create(path, data)
        create(path, data)  # the retry: refused, the object exists

    store.backend.create = landed_then_retried  # type: ignore[method-assign]
    assert store.save(1, state_for(1)).step == 1
    assert store.latest().step == 1  # type: ignore[union-attr]
    store.close()


def test_a_probe_answer_lost_in_transit_does_not_fake_a_quirk(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    class FirstPutRetried:
        """The real client; the first PutObject lands, its answer is lost, botocore retries."""

        retried = False

        def __getattr__(self, name: str) -> Any:
            return getattr(s3_client, name)

        def put_object(self, **kwargs: Any) -> Any:
            if not self.retried:
                self.retried = True
                s3_client.put_object(**kwargs)
            return s3_client.put_object(**kwargs)

    backend = S3Backend(s3_uri, s3_options, client=FirstPutRetried())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert backend.capabilities.atomic_create and backend.capabilities.atomic_swap


def test_probe_objects_of_a_killed_process_are_garbage_gc_removes(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, state_for(1))
    s3_client.put_object(Bucket=s3_bucket, Key="run/.ckptstore/probe-0123abcd", Body=b"probe")
    assert store.gc(older_than=3600).aborted_uploads == ()  # young: maybe a probe in flight
    assert store.gc(older_than=0).aborted_uploads == (".ckptstore/probe-0123abcd",)
    assert keys(s3_client, s3_bucket, "run/.ckptstore/probe-") == []
    assert_state_is(store.load(), 1)
    store.close()
