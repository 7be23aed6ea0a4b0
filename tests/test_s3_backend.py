"""What only the S3 backend does, against a real moto server over HTTP on 127.0.0.1.

Where a server behaviour cannot be had from moto (ignored conditional headers, 403s, 5xx,
missing ListMultipartUploads), a thin wrapper around the real moto-backed client changes that
one call and passes everything else through.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import crc32c
import pytest
from botocore.exceptions import ClientError

from ckptstore.backends import s3_multipart, s3_transfer
from ckptstore.backends.checksummed import Crc32cChunks
from ckptstore.backends.registry import open_backend
from ckptstore.backends.s3 import S3Backend
from ckptstore.backends.s3_options import S3Options
from ckptstore.domain import layout
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    ConfigError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)

MiB = 1 << 20


def crc32c_base64(data: bytes) -> str:
    """S3's ``ChecksumCRC32C`` header, computed here apart from the backend's: the CRC32C's
    big-endian bytes in base64."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def client_error(code: str, status: int, operation: str) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        operation,
    )


class Wrapped:
    """The real client, with some calls replaced; records every call's name and key."""

    def __init__(self, real: Any, **overrides: Any) -> None:
        self.real = real
        self.overrides = overrides
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        target = self.overrides.get(name) or getattr(self.real, name)
        if not callable(target) or name in ("get_paginator",):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, str(kwargs.get("Key", ""))))
            return target(*args, **kwargs)

        return call


@pytest.fixture
def backend(s3_uri: str, s3_options: dict[str, Any]) -> Iterator[S3Backend]:
    b = S3Backend(s3_uri, {**s3_options, "part_size": 5 * MiB, "max_concurrency": 2})
    yield b
    b.close()


def make(s3_uri: str, s3_options: dict[str, Any], s3_client: Any, **overrides: Any) -> S3Backend:
    return S3Backend(s3_uri, s3_options, client=Wrapped(s3_client, **overrides))


def uploads(s3_client: Any, bucket: str) -> list[Any]:
    return list(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


# -- configuration ----------------------------------------------------------------------------


def test_registry_opens_s3_and_s3a(s3_uri: str, s3_options: dict[str, Any]) -> None:
    for uri in (s3_uri, s3_uri.replace("s3://", "s3a://") + "/"):
        b = open_backend(uri, s3_options)
        assert isinstance(b, S3Backend)
        assert b.uri == s3_uri
        b.close()


@pytest.mark.parametrize(
    "uri",
    [
        "s3://",
        "s3:///run",
        "s3://ab/run",
        "s3://Upper-Case/run",
        "s3://under_score/run",
        "s3://-dash/run",
        "s3://a..b/run",
        "s3://192.168.1.1/run",
        "s3://bucket/run?versionId=1",
        "s3://bucket/a//b",
        "s3://[bucket/run",
    ],
)
def test_malformed_uris_are_config_errors(uri: str) -> None:
    with pytest.raises(ConfigError):
        S3Backend(uri, {})


def test_credentials_in_the_uri_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError, match="must not contain credentials") as e:
        S3Backend("s3://AKIAXXX:hunter2-secret@bucket/run", {})
    assert "hunter2" not in str(e.value)
    assert "AKIAXXX" not in str(e.value)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"endpoint": "http://x"}, "unknown storage option.*'endpoint'.*endpoint_url"),
        ({"part_size": MiB}, "part_size"),
        ({"part_size": 6 << 30}, "part_size"),
        ({"part_size": "16MiB"}, "part_size"),
        ({"part_size": True}, "part_size"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"multipart_threshold": 0}, "multipart_threshold"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"checksums": "yes"}, "checksums"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"region": "us-east-1", "region_name": "eu-west-1"}, "given twice"),
        ({"key": "a", "aws_access_key_id": "b"}, "given twice"),
        ({"client_kwargs": "x"}, "client_kwargs"),
        ({"config_kwargs": {"no_such_setting": 1}}, "config_kwargs"),
        ({"profile": "ckptstore-no-such-profile"}, "profile"),
    ],
)
def test_bad_storage_options_are_config_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        S3Backend("s3://bucket/run", options)


def test_accepted_option_spellings(s3_endpoint: str) -> None:
    b = S3Backend(
        "s3://bucket/run",
        {
            "client_kwargs": {"endpoint_url": s3_endpoint},
            "region_name": "eu-west-1",
            "aws_access_key_id": "k",
            "aws_secret_access_key": "s",
            "addressing_style": "path",
            "config_kwargs": {"read_timeout": 30, "s3": {"payload_signing_enabled": False}},
            "part_size": 8 * MiB,
            "max_concurrency": 4,
            "max_attempts": 2,
            "checksums": False,
        },
    )
    config = b.client.meta.config
    assert config.retries == {"mode": "standard", "total_max_attempts": 1}  # ours retry
    assert b.retrier.policy.attempts == 2
    assert config.read_timeout == 30
    assert config.s3 == {"addressing_style": "path", "payload_signing_enabled": False}
    assert b.client.meta.region_name == "eu-west-1"
    assert b.client.meta.endpoint_url == s3_endpoint
    b.close()


def test_defaults_follow_the_checkpoint_layer_without_importing_it() -> None:
    """Parts as large as a default shard (one PUT per shard); the same CRC32C as loads check."""
    assert S3Options().part_size == layout.DEFAULT_SHARD_SIZE
    assert S3Options().multipart_threshold == layout.DEFAULT_SHARD_SIZE
    for data in (b"", b"x", bytes(range(256)) * 99):
        assert s3_transfer.crc32c_base64(data) == crc32c_base64(data)


def test_environment_is_left_to_boto3(
    s3_uri: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No endpoint option: AWS_ENDPOINT_URL still points the client at the server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    b = S3Backend(s3_uri, {})
    b.write("x", [b"1"])
    assert b.read("x") == b"1"
    b.close()


def test_credentials_never_show(
    s3_uri: str, s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = {"key": "AKIASHOWNOWHERE", "secret": "s3cr3t-value", "token": "t0ken-value"}
    caplog.set_level(logging.DEBUG, logger="ckptstore")
    b = S3Backend(s3_uri, {"endpoint_url": s3_endpoint, **secrets})
    texts = [repr(b), b.uri]  # the repr shows the parsed options too
    b.write("x", [b"1"])
    b.create("m", b"1")
    for action in (lambda: b.create("m", b"2"), lambda: b.read("missing")):
        with pytest.raises(CheckpointError) as e:
            action()
        texts.append(str(e.value))
    with pytest.raises(ConfigError) as bad:
        S3Backend(s3_uri, {"secret": "s3cr3t-value", "bogus": 1})
    texts.append(str(bad.value))
    texts.extend(r.getMessage() for r in caplog.records)
    for text in texts:
        for value in secrets.values():
            assert value not in text
    b.close()


# -- error translation ------------------------------------------------------------------------


def test_missing_bucket_says_how_to_create_it(s3_options: dict[str, Any]) -> None:
    """A storage error, never NotFoundError: a typo in a bucket name is no empty store."""
    b = S3Backend("s3://ckpt-no-such-bucket/run", s3_options)
    for action in (
        lambda: b.read("x"),
        lambda: b.stat("x"),
        lambda: list(b.list("")),
        lambda: b.write("x", [b"1"]),
    ):
        with pytest.raises(BackendError, match="bucket 'ckpt-no-such-bucket' does not exist") as e:
            action()
        assert not isinstance(e.value, NotFoundError)
        assert "aws s3 mb s3://ckpt-no-such-bucket" in str(e.value)
    b.close()


def test_forbidden_is_never_missing(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    def denied(**kwargs: Any) -> Any:
        raise client_error("403", 403, "HeadObject")

    b = make(s3_uri, s3_options, s3_client, head_object=denied)
    with pytest.raises(AccessDeniedError, match="access denied to stat s3://") as e:
        b.stat("latest.json")
    assert s3_uri in str(e.value)
    assert "AWS_PROFILE" in str(e.value)


def test_no_credentials_explains_where_they_come_from(
    s3_uri: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    b = S3Backend(s3_uri, {"endpoint_url": s3_endpoint})
    with pytest.raises(AccessDeniedError, match="no usable AWS credentials") as e:
        b.stat("x")
    assert "AWS_PROFILE" in str(e.value)
    assert s3_uri in str(e.value)
    b.close()


def test_unreachable_endpoint_is_retryable_and_named(s3_uri: str) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    b = S3Backend(s3_uri, {"endpoint_url": endpoint, "max_attempts": 1})
    with pytest.raises(BackendError, match="cannot reach the S3 endpoint") as e:
        b.stat("x")
    assert e.value.retryable
    assert endpoint in str(e.value)
    b.close()


def test_server_errors_are_retryable(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    def slow_down(**kwargs: Any) -> Any:
        raise client_error("SlowDown", 503, "GetObject")

    b = make(s3_uri, {**s3_options, "retry_timeout": 0.5}, s3_client, get_object=slow_down)
    with pytest.raises(BackendError, match="SlowDown") as e:
        b.read("x")
    assert e.value.retryable


def test_delete_reports_per_key_errors(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    def partly(**kwargs: Any) -> Any:
        key = kwargs["Delete"]["Objects"][0]["Key"]
        return {"Errors": [{"Key": key, "Code": "AccessDenied", "Message": "no"}]}

    b = make(s3_uri, s3_options, s3_client, delete_objects=partly)
    with pytest.raises(AccessDeniedError, match="delete") as e:
        b.delete(["a", "b"])
    assert f"{s3_uri}/a (AccessDenied)" in str(e.value)


def test_delete_batches_of_1000(s3_uri: str, s3_options: dict[str, Any], s3_client: Any) -> None:
    b = make(s3_uri, s3_options, s3_client)
    b.delete([f"k{i}" for i in range(2500)])
    assert [name for name, _ in b.client.calls].count("delete_objects") == 3


# -- multipart --------------------------------------------------------------------------------


def test_multipart_runs_parts_in_parallel_within_the_bound(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    lock, state = threading.Lock(), {"now": 0, "peak": 0}
    real = s3_client.upload_part

    def counted(**kwargs: Any) -> Any:
        body = kwargs["Body"]  # a file the progress watchdog counts
        assert kwargs["ChecksumCRC32C"] == crc32c_base64(body.read())
        body.seek(0)
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        try:
            return real(**kwargs)
        finally:
            with lock:
                state["now"] -= 1

    b = S3Backend(
        s3_uri,
        {**s3_options, "part_size": 5 * MiB, "max_concurrency": 2},
        client=Wrapped(s3_client, upload_part=counted),
    )
    data = os.urandom(17 * MiB)
    assert b.write("big", (data[i : i + MiB] for i in range(0, len(data), MiB))) == len(data)
    assert b.read("big") == data
    head = s3_client.head_object(Bucket=s3_bucket, Key="run/big", ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-4"')
    assert head["ChecksumCRC32C"]  # the upload was created with ChecksumAlgorithm=CRC32C
    assert 1 <= state["peak"] <= 2
    b.close()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_multipart_upload_is_aborted(
    backend: S3Backend, s3_client: Any, s3_bucket: str, error: type[BaseException]
) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(12):
            yield os.urandom(MiB)
        raise error("stop")

    with pytest.raises(error):
        backend.write("big", chunks())
    assert uploads(s3_client, s3_bucket) == []
    assert backend.stat("big") is None


def test_failed_part_aborts_the_upload(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    real = s3_client.upload_part

    def flaky(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 2:
            raise client_error("InternalError", 500, "UploadPart")
        return real(**kwargs)

    b = S3Backend(
        s3_uri,
        {**s3_options, "part_size": 5 * MiB, "retry_timeout": 0.5},
        client=Wrapped(s3_client, upload_part=flaky),
    )
    with pytest.raises(BackendError, match="InternalError") as e:
        b.write("big", [os.urandom(12 * MiB)])
    assert e.value.retryable
    assert uploads(s3_client, s3_bucket) == []
    b.close()


def test_too_many_parts_is_a_clear_error(
    backend: S3Backend, s3_client: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_multipart, "MAX_PARTS", 2)
    with pytest.raises(ConfigError, match="raise the storage option part_size"):
        backend.write("huge", [os.urandom(11 * MiB)])
    assert uploads(s3_client, s3_bucket) == []
    assert backend.stat("huge") is None


def test_copy_above_the_single_copy_limit_uses_part_copies(
    backend: S3Backend, s3_client: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_transfer, "MAX_SINGLE_PUT", 5 * MiB)
    data = os.urandom(12 * MiB)
    backend.write("src", [data])
    backend.copy("src", "dst")
    assert backend.read("dst") == data
    assert s3_client.head_object(Bucket=s3_bucket, Key="run/dst")["ETag"].endswith('-3"')


def test_checksums_off(s3_uri: str, s3_options: dict[str, Any]) -> None:
    b = S3Backend(s3_uri, {**s3_options, "checksums": False, "part_size": 5 * MiB})
    data = os.urandom(6 * MiB)
    b.write("big", [data])
    assert b.read("big") == data
    assert not b.capabilities.server_checksums
    b.close()


def test_partial_writes_lists_and_aborts_stray_uploads(
    backend: S3Backend, s3_client: Any, s3_bucket: str
) -> None:
    s3_client.create_multipart_upload(Bucket=s3_bucket, Key="run/global_step_3/model.pt")
    s3_client.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/x")
    (stray,) = backend.partial_writes("")
    assert stray.path == "global_step_3/model.pt"
    assert stray.started
    assert backend.partial_writes("global_step_4/") == []
    backend.abort(stray)
    backend.abort(stray)  # already gone: fine
    assert backend.partial_writes("") == []


def test_partial_writes_on_a_server_without_list_uploads(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    def list_multipart_uploads(**kwargs: Any) -> Any:
        raise client_error("NotImplemented", 501, "ListMultipartUploads")

    b = make(s3_uri, s3_options, s3_client, list_multipart_uploads=list_multipart_uploads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert b.partial_writes("") == []
        assert b.partial_writes("") == []
    assert len(caught) == 1
    assert "ListMultipartUploads" in str(caught[0].message)


def test_a_file_a_header_past_a_part_goes_up_in_one_put(
    backend: S3Backend, s3_client: Any, s3_bucket: str
) -> None:
    """A shard is a part's worth of tensors plus a header: it goes up in one PutObject (a
    multipart upload's ETag ends in ``-<parts>``), and a larger file's last few bytes ride with
    its last part instead of a part of their own; past the tail, they are a part again."""
    part = 5 * MiB
    cases = {"shard": (part + 700, ""), "two": (2 * part + 700, "-2")}
    cases["three"] = (2 * part + part // 4, "-3")
    for name, (size, suffix) in cases.items():
        data = os.urandom(size)
        assert backend.write(name, [data[:1000], memoryview(data)[1000:]]) == size
        etag = s3_client.head_object(Bucket=s3_bucket, Key=f"run/{name}")["ETag"].strip('"')
        assert (
            etag.rpartition("-")[1] + etag.rpartition("-")[2] if "-" in etag else ""
        ) == suffix, name
        assert backend.read(name) == data


def test_a_whole_file_put_carries_the_crc32c_its_chunks_counted(
    backend: S3Backend, s3_client: Any, s3_bucket: str
) -> None:
    """A file sent in one PutObject carries the CRC32C its chunks counted on the way (the
    manifest's), not a second pass over the body: a count that says otherwise is what the
    request carries. Plain chunks, or a file in parts, get the checksum computed here."""

    class Miscounted(Crc32cChunks):
        def whole(self, size: int) -> int | None:
            return 0x0BADC0DE

    def stored(key: str) -> str:
        head = s3_client.head_object(Bucket=s3_bucket, Key=f"run/{key}", ChecksumMode="ENABLED")
        return str(head["ChecksumCRC32C"])

    data = os.urandom(MiB + 300)
    pieces = [data[:300], memoryview(data)[300:]]
    counted = Crc32cChunks(iter(pieces))
    assert backend.write("counted", counted) == len(data)
    assert counted.whole(len(data)) == crc32c.crc32c(data)
    assert stored("counted") == crc32c_base64(data)
    backend.write("miscounted", Miscounted(iter(pieces)))
    assert stored("miscounted") == base64.b64encode((0x0BADC0DE).to_bytes(4, "big")).decode()
    backend.write("plain", iter(pieces))
    assert stored("plain") == crc32c_base64(data)


# -- capability probe and fallbacks -------------------------------------------------------------


def test_probe_on_moto_finds_conditional_writes_and_cleans_up(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    b = make(s3_uri, s3_options, s3_client)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no atomicity is missing on moto: no warning
        b.create("a", b"1")
        b.swap("b", b"1", None)
        caps = b.capabilities
    assert caps.atomic_create
    assert caps.atomic_swap
    assert not caps.server_checksums  # moto accepts a wrong CRC32C
    assert caps.server_side_copy
    probes = [key for _, key in b.client.calls if "/.ckptstore/probe-" in key]
    assert probes
    assert len(set(probes)) == 1
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert sorted(keys) == ["run/a", "run/b"]


def test_probe_finds_a_server_that_verifies_checksums(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def verifying(**kwargs: Any) -> Any:
        if kwargs["ChecksumCRC32C"] != crc32c_base64(kwargs["Body"]):
            raise client_error("BadDigest", 400, "PutObject")
        return s3_client.put_object(**kwargs)

    assert make(s3_uri, s3_options, s3_client, put_object=verifying).capabilities.server_checksums
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        assert not make(s3_uri, s3_options, s3_client).capabilities.server_checksums
    notes = [r for r in caplog.records if "does not verify the CRC32C" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.INFO]  # loads verify anyway: not a warning


def test_readers_never_probe(s3_uri: str, s3_options: dict[str, Any], s3_client: Any) -> None:
    S3Backend(s3_uri, s3_options).write("x", [b"1"])
    b = make(s3_uri, s3_options, s3_client)
    b.read("x")
    b.read_versioned("x")
    b.stat("x")
    list(b.list(""))
    b.list_dirs("")
    reads = {"get_object", "head_object", "list_objects_v2"}
    assert {name for name, _ in b.client.calls} <= reads


def drop_conditions(real: Any) -> Any:
    def put_object(**kwargs: Any) -> Any:
        kwargs.pop("IfNoneMatch", None)
        kwargs.pop("IfMatch", None)
        return real.put_object(**kwargs)

    return put_object


def test_fallback_when_the_server_ignores_conditional_headers(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    b = make(s3_uri, s3_options, s3_client, put_object=drop_conditions(s3_client))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b.create("manifest.json", b"mine")
        token = b.swap("latest.json", b"1", None)
        with pytest.raises(ObjectExistsError, match="already exists"):
            b.create("manifest.json", b"theirs")
        with pytest.raises(PreconditionFailedError):
            b.swap("latest.json", b"x", None)
        token2 = b.swap("latest.json", b"2", token)
        with pytest.raises(PreconditionFailedError):
            b.swap("latest.json", b"stale", token)
        caps = b.capabilities
    assert not caps.atomic_create
    assert not caps.atomic_swap
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # once per lost guarantee, not once per call
    assert "If-None-Match" in messages[0]
    assert "falling back" in messages[0]
    assert "If-Match" in messages[1]
    assert "compare-and-swap" in messages[1]
    assert b.read("manifest.json") == b"mine"
    assert b.read_versioned("latest.json") == (b"2", token2)


def test_fallback_create_detects_a_concurrent_writer(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    """Another process's PUT lands between our PUT and our read-back: we must not claim success."""
    real_get = s3_client.get_object

    def get_after_rival(**kwargs: Any) -> Any:
        s3_client.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=b"rival")
        return real_get(**kwargs)

    b = make(
        s3_uri,
        s3_options,
        s3_client,
        put_object=drop_conditions(s3_client),
        get_object=get_after_rival,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not b.capabilities.atomic_create
    with pytest.raises(ObjectExistsError, match="concurrently"):
        b.create("manifest.json", b"mine")


def test_server_accepting_only_unquoted_etags(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    def put_object(**kwargs: Any) -> Any:
        if kwargs.get("IfMatch", "").startswith('"'):
            raise client_error("PreconditionFailed", 412, "PutObject")
        return s3_client.put_object(**kwargs)

    b = make(s3_uri, s3_options, s3_client, put_object=put_object)
    token = b.swap("latest.json", b"1", None)
    assert b.capabilities.atomic_swap
    token = b.swap("latest.json", b"2", token)
    assert b.read_versioned("latest.json") == (b"2", token)
    with pytest.raises(PreconditionFailedError):
        b.swap("latest.json", b"3", '"0123"')
