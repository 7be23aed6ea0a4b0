"""close() of a tiered store finishes what a crash left, and a failed close leaves nothing
running (issue 33, defects 4 and 5), over S3 on moto.

A writer killed (SIGKILL, a real process: harness/tiersaver.py) while its copies to the bucket
were in flight leaves its due steps pinned in the local tier; the next writer on that node that
opens with ``takeover=True`` and closes without saving must still make them durable. A
``close()`` that raises (a background save failed) must still make the newest step durable,
stop every thread of the store and leave the lease record released.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.domain.layout import PINS_DIR
from ckptstore.errors import ConflictError, FencedError
from harness.tiersaver import state
from s3faults.faultmodes import Fault
from s3faults.faultproxy import FaultProxy

TESTS = Path(__file__).parent
PROCESS_WIDE = "ckpt-lease-releaser"
"""The one thread that releases the leases of collected stores, for the whole process."""
PAYLOAD_WRITES = {"PutObject", "CreateMultipartUpload", "UploadPart", "CopyObject"}


def durable_steps(uri: str, options: dict[str, Any]) -> list[int]:
    """The steps committed in the bucket, as a plain reader (no lease) sees them."""
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


def lease_record(s3_client: Any, uri: str) -> dict[str, Any]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    body = s3_client.get_object(Bucket=bucket, Key=f"{prefix}/.ckptstore/lease.json")["Body"]
    return dict(json.loads(body.read()))


def pins(local: Path) -> list[str]:
    """The pins written in the local tier (due steps not yet durable)."""
    folder = local / PINS_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_close_without_a_save_persists_what_a_killed_writer_left(
    tmp_path: Path, s3_endpoint: str, s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    local = tmp_path / "local"
    prefix = s3_uri.removeprefix("s3://").partition("/")[2]
    src = str(Path(ckptstore.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), src])}
    with FaultProxy(s3_endpoint) as proxy:
        proxy.add_fault(Fault.stall(operations=PAYLOAD_WRITES, glob=f"{prefix}/global_step_*"))
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness.tiersaver",
                s3_uri,
                str(local),
                proxy.endpoint_url,
                "3",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        killer = threading.Timer(120, child.kill)  # a child that never says "saved"
        killer.start()
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "saved", "the writer died before saving"
            assert pins(local) == ["global_step_1", "global_step_2", "global_step_3"]
            assert durable_steps(s3_uri, s3_options) == []  # every copy is in flight
            os.kill(child.pid, signal.SIGKILL)
        finally:
            killer.cancel()
            child.kill()
            child.wait(30)
        assert child.returncode == -signal.SIGKILL
        proxy.clear_faults()

    store = CheckpointStore(
        s3_uri, local=str(local), persist_every=1, takeover=True, storage_options=s3_options
    )
    store.wait()
    store.close()  # never saved: close() still persists the pins and the newest step
    assert durable_steps(s3_uri, s3_options) == [1, 2, 3]
    assert pins(local) == []
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as reader:
        assert same(reader.load(), state(3))
    assert lease_record(s3_client, s3_uri)["released"] is True


def test_a_failed_close_still_persists_stops_every_thread_and_releases_the_lease(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any], s3_client: Any
) -> None:
    before = set(threading.enumerate())
    store = CheckpointStore(
        s3_uri, local=str(tmp_path / "local"), persist_every=5, storage_options=s3_options
    )
    store.save(1, state(1), persist=True)  # a copy: the persist thread runs
    store.save(2, state(2))  # not due: only close() makes it durable
    store.save_async(2, state(2))  # fails in the background: step 2 is committed
    with pytest.raises(ConflictError, match="step 2 is already committed"):
        store.close()
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("ckpt")]
    for thread in ours:  # the S3 helpers end once told (close does not join them)
        thread.join(timeout=3.0)
    left = [t.name for t in ours if t.is_alive() and t.name != PROCESS_WIDE]
    assert left == [], f"threads still running after close(): {left}"
    assert lease_record(s3_client, s3_uri)["released"] is True
    assert durable_steps(s3_uri, s3_options) == [1, 2]
    assert store.lease is not None
    with pytest.raises(FencedError, match="was closed"):
        store.lease.hold()  # nothing of the closed store can take the lease back
    store.close()  # a second close does nothing
    assert lease_record(s3_client, s3_uri)["released"] is True
