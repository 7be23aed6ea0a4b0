"""Structured errors: ``uri``, ``step`` and ``path`` where the error is raised, surviving pickling.

The rule (errors.py): ``path`` is the object's key relative to the store, ``uri`` its full URI
(``join(store URI, path)``); an error about the store as a whole carries the store's URI and no
path; one about a local file outside any store carries its local path and no URI.
"""

from __future__ import annotations

import errno
import inspect
import math
import multiprocessing
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckptstore import errors
from ckptstore.backends import fsutil
from ckptstore.backends.base import Backend, join
from ckptstore.backends.registry import open_backend
from ckptstore.backends.s3_errors import Translator
from ckptstore.config import SIGNING_KEY_FILE, signing_key_from_env
from ckptstore.data.transfer import scan_dir
from ckptstore.domain.layout import LATEST_NAME, LEASE_NAME
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FencedError,
    LeaseHeldError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.lease import WriterLease
from ckptstore.protocol.lease_record import LeaseRecord, Process
from ckptstore.protocol.pointer import Pointer

ALL_ERRORS = sorted(
    (
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, CheckpointError)
    ),
    key=lambda cls: cls.__name__,
)


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """An empty store's backend: a local directory, and fsspec's memory filesystem (whose
    create and swap are the base class's fallback)."""
    uri = (
        str(tmp_path / "store")
        if request.param == "local"
        else request.getfixturevalue("memory_uri")
    )
    opened = open_backend(uri)
    yield opened
    opened.close()


def _located(e: CheckpointError, backend: Backend, path: str) -> None:
    assert e.path == path
    assert e.uri == join(backend.uri, path)


# -- the class itself ----------------------------------------------------------------------


def test_attributes_are_keyword_only_and_default_to_none() -> None:
    bare = CheckpointError("plain message")
    assert (bare.uri, bare.step, bare.path) == (None, None, None)
    assert str(bare) == "plain message" and bare.args == ("plain message",)
    full = NotFoundError("gone", uri="s3://b/run/x.bin", step=3, path="x.bin")
    assert str(full) == "gone" and full.args == ("gone",)  # str(e) is the message alone
    assert (full.uri, full.step, full.path) == ("s3://b/run/x.bin", 3, "x.bin")
    with pytest.raises(TypeError):
        CheckpointError("message", "s3://b/run")  # type: ignore[misc]


def test_existing_subclass_constructors_still_work() -> None:
    backend_error = BackendError("slow", retryable=True)
    assert backend_error.retryable and backend_error.uri is None
    located = AccessDeniedError("denied", uri="s3://b/k", path="k")
    assert located.retryable is False and located.path == "k"
    distributed = DistributedCheckpointError("ranks failed", {1: "boom"})
    assert distributed.failures == {1: "boom"} and distributed.step is None
    with_step = DistributedCheckpointError("ranks failed", {2: "x"}, step=9)
    assert with_step.failures == {2: "x"} and with_step.step == 9
    assert isinstance(ConfigError("bad"), ValueError)  # the mix-ins stay
    assert isinstance(errors.SerializationError("bad"), TypeError)


def test_add_context_fills_only_what_is_missing() -> None:
    e = NotFoundError("gone", uri="s3://b/run/a", path="a")
    assert e.add_context(uri="s3://b/other", step=4, path="other") is e
    assert (e.uri, e.step, e.path) == ("s3://b/run/a", 4, "a")


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_pickles_with_its_attributes(cls: type[CheckpointError]) -> None:
    e = cls("it broke", uri="s3://bucket/run/global_step_3/w.bin", step=3, path="w.bin")
    e.retryable = True  # type: ignore[attr-defined]  # any extra attribute travels too
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == "it broke" and back.args == ("it broke",)
    assert (back.uri, back.step, back.path) == (e.uri, 3, "w.bin")
    assert back.retryable is True  # type: ignore[attr-defined]


def test_subclass_attributes_survive_pickling() -> None:
    e = DistributedCheckpointError("step 5 was not saved", {0: "x", 3: "y"}, step=5)
    back = pickle.loads(pickle.dumps(e))
    assert back.failures == {0: "x", 3: "y"} and back.step == 5
    slow = pickle.loads(pickle.dumps(BackendError("slow", retryable=True, uri="u")))
    assert slow.retryable is True and slow.uri == "u"


def test_an_error_raised_in_another_process_keeps_its_attributes(tmp_path: Path) -> None:
    missing = tmp_path / "absent-key"
    context = multiprocessing.get_context("spawn")  # no fork of a threaded test process
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        future = pool.submit(signing_key_from_env, {SIGNING_KEY_FILE: str(missing)})
        with pytest.raises(ConfigError) as caught:
            future.result()
    assert caught.value.path == str(missing) and caught.value.uri is None
    assert str(caught.value).startswith(f"{SIGNING_KEY_FILE} names {missing}, which cannot")


# -- backends ------------------------------------------------------------------------------


def test_reading_a_missing_object_names_it(backend: Backend) -> None:
    for read in (
        lambda: backend.read("global_step_1/w.bin"),
        lambda: backend.read_versioned("global_step_1/w.bin"),
        lambda: backend.read_into("global_step_1/w.bin", memoryview(bytearray(4))),
    ):
        with pytest.raises(NotFoundError) as caught:
            read()
        _located(caught.value, backend, "global_step_1/w.bin")
        assert "global_step_1/w.bin does not exist (while trying to read it)" in str(caught.value)
        assert caught.value.step is None  # backends know nothing of steps


@pytest.mark.filterwarnings("ignore:.*compare-and-swap across processes:RuntimeWarning")
def test_create_only_and_compare_and_swap_name_the_object(backend: Backend) -> None:
    backend.create("a/marker.json", b"one")
    with pytest.raises(ObjectExistsError) as exists:
        backend.create("a/marker.json", b"two")
    _located(exists.value, backend, "a/marker.json")
    _, version = backend.read_versioned("a/marker.json")
    backend.swap("a/marker.json", b"three", version)
    with pytest.raises(PreconditionFailedError) as changed:
        backend.swap("a/marker.json", b"four", version)  # the version moved on
    _located(changed.value, backend, "a/marker.json")
    assert backend.read("a/marker.json") == b"three"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_a_permission_error_names_the_object(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"))
    backend.write("x.bin", [b"x"])
    (tmp_path / "store").chmod(0o500)
    try:
        with pytest.raises(AccessDeniedError) as caught:
            backend.write("y.bin", [b"y"])
    finally:
        (tmp_path / "store").chmod(0o700)
    _located(caught.value, backend, "y.bin")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EACCES, AccessDeniedError),
        (errno.EROFS, AccessDeniedError),
        (errno.ENOSPC, BackendError),
    ],
)
def test_a_failing_disk_names_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, expected: type[BackendError]
) -> None:
    backend = open_backend(str(tmp_path / "store"))

    def refuse(src: object, dst: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fsutil.os, "replace", refuse)  # the rename that publishes a write
    with pytest.raises(expected) as caught:
        backend.write("global_step_1/w.bin", [b"data"])
    assert type(caught.value) is expected
    _located(caught.value, backend, "global_step_1/w.bin")
    assert not caught.value.retryable


def test_a_local_store_whose_root_is_a_file_fails_with_the_object_named(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "global_step_1").write_bytes(b"a file where a directory belongs")
    backend = open_backend(str(tmp_path / "store"))
    with pytest.raises(BackendError) as caught:
        backend.write("global_step_1/w.bin", [b"data"])
    _located(caught.value, backend, "global_step_1/w.bin")
    assert str(caught.value).startswith("cannot write ")


def test_a_bad_uri_carries_it_and_a_secret_never_does() -> None:
    with pytest.raises(ConfigError) as unknown:
        open_backend("nosuchscheme-xyz://bucket/run")
    assert unknown.value.uri == "nosuchscheme-xyz://bucket/run" and unknown.value.path is None
    with pytest.raises(ConfigError) as options:
        open_backend("s3://bucket-name/run", {"part_size": 1})
    assert options.value.uri == "s3://bucket-name/run"
    with pytest.raises(ConfigError) as secret:
        open_backend("s3://AKIAKEY:hunter2@bucket-name/run")
    assert secret.value.uri is None and "hunter2" not in repr(vars(secret.value))


def test_s3_errors_name_the_object(s3_uri: str, s3_options: dict[str, Any]) -> None:
    backend = open_backend(s3_uri, s3_options)
    try:
        with pytest.raises(NotFoundError) as caught:
            backend.read("global_step_1/w.bin")
    finally:
        backend.close()
    assert caught.value.uri == join(s3_uri, "global_step_1/w.bin")
    assert str(caught.value) == (
        f"{s3_uri}/global_step_1/w.bin does not exist (while trying to read it)"
    )
    assert pickle.loads(pickle.dumps(caught.value)).uri == caught.value.uri


def test_s3_translation_derives_the_store_relative_path() -> None:
    store = "s3://bucket/run"
    translator = Translator("bucket", "http://127.0.0.1:9", store)
    missing = translator.error("NoSuchKey", f"{store}/global_step_2/w.bin", "read")
    assert isinstance(missing, NotFoundError)
    assert (missing.uri, missing.path) == (f"{store}/global_step_2/w.bin", "global_step_2/w.bin")
    bucket = translator.error("NoSuchBucket", store, "stat")  # about the store: no path
    assert (bucket.uri, bucket.path) == (store, None)
    several = translator.error("AccessDenied", f"3 object(s) under {store}", "delete")
    assert isinstance(several, AccessDeniedError)
    assert (several.uri, several.path) == (store, None)
    unknown_root = Translator("bucket", "AWS S3").error("NoSuchKey", f"{store}/k", "read")
    assert (unknown_root.uri, unknown_root.path) == (f"{store}/k", None)


# -- the pointer, the lease, local files --------------------------------------------------


def test_a_corrupt_pointer_names_latest_json(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"))
    backend.write(LATEST_NAME, [b'{"schema_version": 2, "step": '])  # torn
    with pytest.raises(CorruptCheckpointError) as caught:
        Catalog(backend, sleep=lambda _: None).read_pointer()
    _located(caught.value, backend, "latest.json")
    assert "unreadable latest pointer" in str(caught.value)


def test_a_pointer_with_a_bad_field_keeps_its_step() -> None:
    body = b'{"schema_version": 2, "step": 4, "manifest": "global_step_4/ckptstore.manifest.json"}'
    with pytest.raises(CorruptCheckpointError) as caught:
        Pointer.decode(body, "s3://b/run/latest.json")
    assert (caught.value.uri, caught.value.path) == ("s3://b/run/latest.json", LATEST_NAME)
    assert caught.value.step == 4


def _lease(backend: Backend, host: str, **kwargs: Any) -> WriterLease:
    process = Process(host, 4242)
    return WriterLease(backend, f"{host}:4242:abc", process=process, heartbeat=False, **kwargs)


def test_a_lease_conflict_carries_the_lease_uri(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"))
    holder = _lease(backend, "here", ttl=math.inf)
    holder.hold()
    with pytest.raises(LeaseHeldError) as caught:
        _lease(backend, "there").hold()
    _located(caught.value, backend, LEASE_NAME)
    assert str(caught.value).startswith(f"{backend.uri} is being written by writer here:4242:abc")
    # taken over: the old holder is fenced, and says where
    _lease(backend, "third", takeover=True).hold()
    with pytest.raises(FencedError) as fenced:
        holder.hold()
    _located(fenced.value, backend, LEASE_NAME)
    assert "lost the writer lease" in str(fenced.value)


def test_an_unreadable_lease_record_names_it() -> None:
    with pytest.raises(CorruptCheckpointError) as caught:
        LeaseRecord.decode(b"[1, 2]", "/data/run/.ckptstore/lease.json")
    assert caught.value.uri == "/data/run/.ckptstore/lease.json"
    assert caught.value.path == LEASE_NAME


def test_local_files_outside_a_store_carry_their_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        scan_dir(tmp_path / "nowhere")
    assert caught.value.path == str(tmp_path / "nowhere") and caught.value.uri is None
    assert str(caught.value).endswith("is not a directory; push takes the directory of one step")
