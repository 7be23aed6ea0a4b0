"""Credentials that rotate mid-save (s3_credentials.py): every face spans rotations and commits.

The server (the fault proxy with ``key_lifetime``, in front of moto over HTTP) accepts each key
for :data:`LIFETIME` seconds after it was issued and answers ``400 ExpiredToken`` afterwards.
The keys come from a real ``credential_process`` profile (s3faults.rotation), read by
botocore's own chain in every process; it announces an hour of validity, so botocore never
refreshes on its own first and only the renewal on ExpiredToken keeps a save alive (the worst
case: a clock off, a session revoked early). Each save spans at least three rotations: at
least three requests were refused and the keys were renewed as many times, and no multipart
upload is aborted or left open.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore
from ckptstore.backends.s3 import S3Backend
from ckptstore.backends.s3_retry import RENEWALS
from ckptstore.errors import AccessDeniedError
from ckptstore.integrations.dcp import CkptStoreWriter
from ckptstore.replication.replicator import replicate
from ranks import run_ranks
from s3faults.faultproxy import FaultProxy
from s3faults.rotation import PROFILE, rotating_profile

MiB = 1 << 20
LIFETIME = 1.0
"""Seconds the server accepts a key after its issue."""
ROTATIONS = 3


@dataclass
class Rotation:
    proxy: FaultProxy
    options: dict[str, Any]
    issued: Path

    def keys_issued(self) -> int:
        return len(self.issued.read_text().split()) if self.issued.exists() else 0

    def check_spanned(self, s3_client: Any, bucket: str) -> None:
        """The save met ROTATIONS expired keys, renewed each, and left no upload behind."""
        refused = sum(self.proxy.expired.values())
        assert refused >= ROTATIONS, f"only {refused} requests refused: {self.proxy.expired}"
        assert len(self.proxy.keys) >= ROTATIONS + 1, self.proxy.keys
        assert self.keys_issued() >= ROTATIONS + 1
        assert self.proxy.seen["AbortMultipartUpload"] == 0
        assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.fixture
def rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_endpoint: str
) -> Iterator[Rotation]:
    config = rotating_profile(tmp_path / "aws", announced=3600.0)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))  # child processes (ranks) inherit it
    with FaultProxy(s3_endpoint, key_lifetime=LIFETIME) as proxy:
        options = {"endpoint_url": proxy.endpoint_url, "profile": PROFILE, "part_size": 5 * MiB}
        yield Rotation(proxy, options, config.parent / "issued.log")


def state(mib: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=gen), "step": seed}


def slow_reads(rotation: Rotation) -> None:
    """Pace the proxy so that a save of a few dozen MiB lasts several key lifetimes on any
    machine: each part's answer waits a little (the server is slow, not failing)."""
    rotation.proxy.rate, rotation.proxy.faults = 1.0, ("delay",)
    rotation.proxy.operations = frozenset({"UploadPart", "PutObject"})
    rotation.proxy.max_delay = 0.6


def test_a_large_save_spans_rotations_and_commits(
    rotation: Rotation, s3_uri: str, s3_bucket: str, s3_client: Any
) -> None:
    slow_reads(rotation)
    # One part at a time: parts in flight together could all arrive within one key's lifetime
    # (the proxy checks a key when a request arrives, and delays only its answer), leaving the
    # refusals to the requests after them; in a row, the seeded delays carry the parts past it.
    options = {**rotation.options, "max_concurrency": 1}
    store = CheckpointStore(s3_uri, storage_options=options)
    saved = state(48, seed=1)
    store.save(1, saved)
    rotation.check_spanned(s3_client, s3_bucket)
    assert rotation.proxy.expired["UploadPart"] > 0  # refused mid-upload, and the upload went on
    assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]
    assert torch.equal(store.load()["w"], saved["w"])
    store.close()


def test_an_async_save_spans_rotations_and_commits(
    rotation: Rotation, s3_uri: str, s3_bucket: str, s3_client: Any
) -> None:
    slow_reads(rotation)
    store = CheckpointStore(s3_uri, storage_options=rotation.options)
    saved = state(40, seed=2)
    store.save_async(2, saved).wait()
    rotation.check_spanned(s3_client, s3_bucket)
    assert store.latest() is not None and store.latest().step == 2  # type: ignore[union-attr]
    assert torch.equal(store.load()["w"], saved["w"])
    store.close()


def test_a_tiered_persist_spans_rotations_and_commits(
    rotation: Rotation, s3_uri: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    slow_reads(rotation)
    store = CheckpointStore(
        s3_uri, storage_options=rotation.options, local=str(tmp_path / "tier"), persist_every=1
    )
    saved = state(40, seed=3)
    store.save(3, saved)
    store.wait()  # the copy to the bucket, in the background
    rotation.check_spanned(s3_client, s3_bucket)
    durable = CheckpointStore(s3_uri, storage_options=rotation.options, lease=False)
    assert durable.latest() is not None and durable.latest().step == 3  # type: ignore[union-attr]
    assert torch.equal(durable.load()["w"], saved["w"])
    store.close()
    durable.close()


def _dcp_save(rank: int, world: int, uri: str, options: dict[str, Any]) -> int:
    """One rank's share of a DCP save: its own shard of 16 MiB (its own client and key)."""
    shard = state(16, seed=10 + rank)["w"]
    store = CheckpointStore(uri, storage_options=options, lease=rank == 0)
    dcp.save({f"w{rank}": shard}, storage_writer=CkptStoreWriter(store, 4))
    store.close()
    return rank


def test_a_dcp_save_on_2_ranks_spans_rotations_and_commits(
    rotation: Rotation, s3_uri: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    slow_reads(rotation)
    assert run_ranks(_dcp_save, 2, tmp_path / "ranks", s3_uri, rotation.options) == [0, 1]
    rotation.check_spanned(s3_client, s3_bucket)
    with CheckpointStore(s3_uri, storage_options=rotation.options, lease=False) as store:
        assert [i.step for i in store.list()] == [4]
        assert store.verify(4).ok


def test_a_replication_spans_rotations_and_commits(
    rotation: Rotation, s3_uri: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    source = CheckpointStore(str(tmp_path / "source"))
    saved = state(40, seed=5)
    source.save(5, saved)
    slow_reads(rotation)
    destination = CheckpointStore(s3_uri, storage_options=rotation.options)
    report = replicate(source, destination)
    assert [i.step for i in report.copied] == [5], report
    rotation.check_spanned(s3_client, s3_bucket)
    assert torch.equal(destination.load(5)["w"], saved["w"])
    source.close()
    destination.close()


def test_static_keys_that_expire_fail_naming_the_expired_token(
    s3_endpoint: str, s3_uri: str, s3_bucket: str, s3_client: Any
) -> None:
    """Keys passed as storage options cannot be renewed: the save fails at once, saying so,
    with nothing left open."""
    stale = f"ASIAROT{int((time.time() - 60) * 1000):013d}"
    with FaultProxy(s3_endpoint, key_lifetime=LIFETIME) as proxy:
        options = {"endpoint_url": proxy.endpoint_url, "key": stale, "secret": "s"}
        store = CheckpointStore(s3_uri, storage_options=options)
        with pytest.raises(AccessDeniedError, match=r"expired \(ExpiredToken\).*static keys"):
            store.save(1, {"step": 1})
        store.close()
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_a_renewal_happens_once_per_refused_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_endpoint: str, s3_uri: str
) -> None:
    """Many requests refused at once renew the key once, not once each. The keys expire when
    the test says (``expire_keys``), not by age: a loaded machine that runs the burst slowly
    must not see the renewed key expire of itself."""
    config = rotating_profile(tmp_path / "aws", announced=3600.0)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    proxy = FaultProxy(s3_endpoint, key_lifetime=3600.0).start()
    backend = S3Backend(s3_uri, {"endpoint_url": proxy.endpoint_url, "profile": PROFILE})
    backend.write("a", [b"x"])
    proxy.expire_keys()
    renewal = backend.retrier.renewal
    assert renewal is not None
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: backend.write(f"k{i}", [b"y"]), range(8)))
    assert renewal.renewals == 1 and proxy.expired["PutObject"] >= 1
    proxy.expire_keys()
    info = backend.stat("a")  # a HEAD: its 400 carries no code, and is renewed all the same
    assert info is not None and info.size == 1
    assert renewal.renewals == 2 and proxy.expired["HeadObject"] == 1
    backend.close()
    proxy.stop()


def test_a_source_whose_keys_the_server_always_refuses_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_endpoint: str, s3_uri: str
) -> None:
    """Renewing does not help (a clock hours off, a role the bucket no longer trusts): the
    request gives up after a few renewals, saying the credentials expired and what to check."""
    config = rotating_profile(tmp_path / "aws", announced=3600.0)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    with FaultProxy(s3_endpoint, key_lifetime=-1.0) as proxy:  # every key refused
        options = {"endpoint_url": proxy.endpoint_url, "profile": PROFILE}
        store = CheckpointStore(s3_uri, storage_options=options)
        with pytest.raises(AccessDeniedError, match=r"as expired \(ExpiredToken\).*clock"):
            store.save(1, {"step": 1})
        store.close()
    assert sum(proxy.expired.values()) == RENEWALS + 1  # the first attempt, then each renewal
