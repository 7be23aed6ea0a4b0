"""``ckptstore replicate`` (and ``cp``, the same pass): options per side, output, exit codes.

In-process through ``run()`` where the command ends by itself; a real subprocess for
``--follow``, which only Ctrl-C ends (exit 130, the destination's lease released).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.main import run
from ckptstore.protocol.lease_record import read_lease
from ckptstore.testing.s3server import LocalS3Server


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step))}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def error_of(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("ckptstore: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def src(tmp_path: Path) -> str:
    uri = str(tmp_path / "src")
    with CheckpointStore(uri) as store:
        for step in (10, 20):
            store.save(step, state(step))
    return uri


def test_replicate_between_two_endpoints_with_options_per_side(
    capsys: pytest.CaptureFixture[str], s3_uri: str, s3_options: dict[str, Any]
) -> None:
    with LocalS3Server() as other:
        bucket = other.create_bucket("replica-bucket")
        with CheckpointStore(s3_uri, storage_options=s3_options) as source:
            source.save(1, state(1))
            source.save(2, state(2))
        dst = f"{bucket}/mirror"
        side = [
            "--endpoint-url", s3_options["endpoint_url"],
            "--dst-endpoint-url", other.endpoint_url,
            "--dst-storage-option", "key=other-account",
            "--dst-storage-option", "secret=other-secret",
            "--dst-region", "eu-west-1",
        ]  # fmt: skip
        code, out, _ = cli(capsys, "replicate", s3_uri, dst, *side, "--json")
        assert code == 0, out
        doc = json.loads(out)
        assert doc["copied"] == [1, 2] and doc["latest"] == 2 and doc["failed"] == {}
        assert doc["streamed"] == doc["size"] > 0 and doc["server_side"] == 0
        code, out, _ = cli(capsys, "replicate", s3_uri, dst, *side)
        assert code == 0
        assert out.splitlines() == [
            f"copied nothing to {dst}",
            f"skipped steps 1, 2: already in {dst} with the same files",
        ]
        options = {**other.storage_options(), "key": "other-account", "secret": "other-secret"}
        with CheckpointStore(dst, storage_options=options, lease=False) as replica:
            assert torch.equal(replica.load()["w"], state(2)["w"])
        assert "other-secret" not in out


def test_replicate_refusals_and_their_exit_codes(
    capsys: pytest.CaptureFixture[str], src: str, tmp_path: Path
) -> None:
    dst = str(tmp_path / "dst")
    code, _, err = cli(capsys, "replicate", src, dst, "10", "--follow")
    assert code == 2 and "give no STEP with it" in err
    code, _, err = cli(capsys, "replicate", src, src)
    assert code == 2 and "both the source and the destination" in error_of(err)
    with CheckpointStore(dst) as holder:
        holder.hold_lease()  # another replicator (or a training job) holds the lease
        code, _, err = cli(capsys, "replicate", src, dst)
        assert code == 5 and "writer lease" in error_of(err)
    code, out, _ = cli(capsys, "replicate", src, dst, "latest", "--keep-last", "1")
    assert code == 0 and out.startswith(f"copied step 20 to {dst}: ")

    with CheckpointStore(src) as store:
        info = store.info(10)
    path = Path(src) / info.files[0].key(10)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    fresh = str(tmp_path / "fresh")
    code, out, err = cli(capsys, "replicate", src, fresh, "--json")
    assert code == 4
    doc = json.loads(out)
    assert doc["copied"] == [20] and list(doc["failed"]) == ["10"]
    assert doc["error"]["type"] == "CorruptCheckpointError" and doc["error"]["step"] == 10
    assert f"{path}: checksum mismatch" in error_of(err)
    code, out, err = cli(capsys, "cp", src, str(tmp_path / "by-cp"))  # cp is the same pass
    assert code == 4 and "failed step 10: " in out and "copied step 20 to " in out


def test_replicate_follow_goes_on_until_ctrl_c(src: str, tmp_path: Path) -> None:
    dst = str(tmp_path / "dst")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "ckptstore.cli", "replicate", src, dst, "--follow"]
    # A SIGINT ignored here (a suite started in the background of a non-interactive shell) is
    # inherited by the child, which then never sees the Ctrl-C below; a handled one is not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        follower = subprocess.Popen(
            [*command, "--interval", "0.05", "--max-interval", "0.2", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert follower.stdout is not None
        first = json.loads(follower.stdout.readline())
        assert first["copied"] == [10, 20] and first["latest"] == 20
        with CheckpointStore(src) as store:
            store.save(30, state(30))
        second = json.loads(follower.stdout.readline())  # printed once the step is copied
        assert second["copied"] == [30] and second["latest"] == 30
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 130, err
    assert "ckptstore: interrupted" in err
    with CheckpointStore(dst, lease=False) as replica:
        record, _, _ = read_lease(replica.backend)
        assert record is not None and record.released  # it let go of the lease on its way out
        assert [i.step for i in replica.list()] == [10, 20, 30]
