"""Uploads a failure left open that the server would not abort (s3_leftovers.py): recorded,
then aborted by the next write, close() and gc, never one this process is running; and the
deadline's error says whether its upload was aborted.

The uploads here are real ones on the moto server, opened with boto3 and recorded as the
backend records an abort that got no answer; tests/test_sigstop.py makes the server stop."""

from __future__ import annotations

from typing import Any

import torch

from ckptstore import CheckpointStore
from ckptstore.backends.s3 import S3Backend
from ckptstore.backends.s3_leftovers import RECORDED, UNKNOWN, Leftovers
from ckptstore.deadline import Deadline


def open_upload(client: Any, bucket: str, key: str) -> str:
    return str(client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])


def open_uploads(client: Any, bucket: str) -> set[str]:
    found = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return {str(u["UploadId"]) for u in found}


def leftovers_of(store: CheckpointStore) -> Leftovers:
    backend = store.backend
    assert isinstance(backend, S3Backend)
    return backend.leftovers


def test_the_next_save_aborts_a_recorded_upload_and_no_other(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, {"w": torch.zeros(4)})
    recorded = open_upload(s3_client, s3_bucket, "run/global_step_2/.attempt-a/w.safetensors")
    other = open_upload(s3_client, s3_bucket, "run/global_step_2/.attempt-b/w.safetensors")
    leftovers_of(store).record("run/global_step_2/.attempt-a/w.safetensors", recorded)
    store.save(3, {"w": torch.ones(4)})
    assert open_uploads(s3_client, s3_bucket) == {other}  # a stranger's stays, for gc's grace
    assert not leftovers_of(store)
    store.close()


def test_a_lost_create_aborts_every_upload_of_its_key_but_a_live_one(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    key = "run/global_step_2/.attempt-a/w.safetensors"
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, {"w": torch.zeros(4)})
    lost = open_upload(s3_client, s3_bucket, key)
    live = open_upload(s3_client, s3_bucket, key)
    leftovers = leftovers_of(store)
    leftovers.started(live)  # this process is running it
    leftovers.record(key, UNKNOWN)
    store.close()
    assert open_uploads(s3_client, s3_bucket) == {live}
    assert lost not in open_uploads(s3_client, s3_bucket)


def test_gc_aborts_a_recorded_upload_however_young(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, {"w": torch.zeros(4)})
    key = "run/global_step_2/.attempt-a/w.safetensors"
    recorded = open_upload(s3_client, s3_bucket, key)
    young = open_upload(s3_client, s3_bucket, "run/global_step_2/.attempt-b/w.safetensors")
    leftovers_of(store).record(key, recorded)
    ages = 1e9  # seconds: every upload is younger than that
    assert store.gc(dry_run=True, older_than=ages).aborted_uploads == (key[len("run/") :],)
    assert open_uploads(s3_client, s3_bucket) == {recorded, young}  # a dry run aborts nothing
    assert store.gc(older_than=ages).aborted_uploads == (key[len("run/") :],)
    assert open_uploads(s3_client, s3_bucket) == {young}
    assert not leftovers_of(store)
    store.close()


def test_the_error_says_whether_the_upload_was_aborted() -> None:
    deadline = Deadline.after(0.0)
    aborted = str(deadline.error("s3://b/k", doing="write", upload_id="U1"))
    assert "multipart upload U1 aborted" in aborted
    left = str(deadline.error("s3://b/k", doing="write", upload_id="U1", upload_left=RECORDED))
    assert "(multipart upload" not in left and "U1 aborted" not in left
    assert left.endswith(
        "Its multipart upload U1 could not be aborted (the server did not answer): recorded, "
        "the next save, close() or `ckptstore gc` removes it"
    )
