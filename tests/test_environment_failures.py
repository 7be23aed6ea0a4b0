"""Failures of the world around the store: disks that fill up or turn read-only, buckets that
vanish, credentials that expire mid-save, odd file names and hostile symlinks. Each must give
a clear error and leave every committed step as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.domain.layout import payload_path
from ckptstore.errors import AccessDeniedError, BackendError, CorruptCheckpointError
from faults import FaultyBackend


def can_mount_tmpfs() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    not can_mount_tmpfs(), reason="needs root and mount namespaces to make a small tmpfs"
)

CHILD = """
import sys, torch
from ckptstore import CheckpointStore, CheckpointError
store = CheckpointStore(sys.argv[1], lease=False)
print("committed", [i.step for i in store.list()])
try:
    store.save(2, {"w": torch.ones(int(sys.argv[2]) // 4)})
except CheckpointError as e:
    print("ERROR", type(e).__name__, e)
store = CheckpointStore(sys.argv[1], lease=False)
print("after", [i.step for i in store.list()], store.load()["step"])
print("stray", sorted(p.name for p in __import__("pathlib").Path(sys.argv[1]).rglob(".ckpt-tmp-*")))
"""


def run_in_tmpfs(tmp_path: Path, setup: str, nbytes: int) -> str:
    """Mount a 2 MiB tmpfs in a private mount namespace, commit step 1, run CHILD there."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "child.py").write_text(CHILD)
    seed = (
        "import sys, torch; from ckptstore import CheckpointStore; "
        "CheckpointStore(sys.argv[1], lease=False).save(1, {'w': torch.ones(1000), 'step': 1})"
    )
    script = textwrap.dedent(
        f"""
        set -e
        mount -t tmpfs -o size=2m tmpfs {mnt}
        {sys.executable} -c "{seed}" {mnt}/store
        {setup}
        {sys.executable} {tmp_path / "child.py"} {mnt}/store {nbytes}
        """
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_tmpfs
def test_disk_full_is_a_clear_error_and_keeps_committed_steps(tmp_path: Path) -> None:
    out = run_in_tmpfs(tmp_path, "", nbytes=4 << 20)  # twice the disk
    assert "ERROR BackendError no space left to write" in out
    assert "committed steps were not touched" in out
    assert "after [1] 1" in out  # step 1 is intact and loads
    assert "stray []" in out  # the failed save removed its temp files


@needs_tmpfs
def test_read_only_disk_is_a_clear_error(tmp_path: Path) -> None:
    out = run_in_tmpfs(tmp_path, f"mount -o remount,ro {tmp_path / 'mnt'}", nbytes=1000)
    assert "ERROR AccessDeniedError" in out and "read-only" in out
    assert "after [1] 1" in out


def test_bucket_deleted_mid_run(s3_uri: str, s3_options: dict[str, Any], s3_client: Any) -> None:
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, {"w": torch.ones(3)})
    bucket = s3_uri.split("/")[2]
    for obj in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []):
        s3_client.delete_object(Bucket=bucket, Key=obj["Key"])
    s3_client.delete_bucket(Bucket=bucket)
    with pytest.raises(BackendError) as caught:  # not NotFoundError: no "empty store"
        store.save(2, {"w": torch.ones(3)})
    assert bucket in str(caught.value) and "does not exist" in str(caught.value)


def test_credentials_expiring_mid_save(s3_uri: str, s3_options: dict[str, Any]) -> None:
    """The 3rd upload of the save is refused as S3 refuses an expired token (403)."""
    store = CheckpointStore(s3_uri, storage_options=s3_options)
    store.save(1, {"a": torch.ones(3), "b": torch.ones(3)})

    class Expired(FaultyBackend):
        def _tick(self, op: str, path: str) -> None:
            self.count += 1
            if self.count >= 3:
                raise AccessDeniedError(
                    f"access denied to write {self.uri}/{path}: ExpiredToken; refresh the "
                    "credentials (AWS_PROFILE, AWS_SESSION_TOKEN) and save again"
                )

    expiring = CheckpointStore(s3_uri, backend=Expired(store.backend, fail_at=None), lease=False)
    with pytest.raises(AccessDeniedError, match="ExpiredToken"):
        expiring.save(2, {"a": torch.zeros(3), "b": torch.zeros(3)})
    assert [i.step for i in store.list()] == [1]
    assert store.verify(1).ok


def test_unknown_files_inside_a_step_are_ignored_and_never_deleted(
    store: CheckpointStore, tmp_path: Path
) -> None:
    store.save(1, {"w": torch.ones(3)})
    store.backend.write(payload_path(1, "planted.pt"), [b"\x80\x04evil pickle"])
    assert torch.equal(store.load(1)["w"], torch.ones(3))
    store.pull_dir(tmp_path / "out", 1)
    assert not (tmp_path / "out" / "planted.pt").exists()
    report = store.gc(older_than=0)
    assert payload_path(1, "planted.pt") in report.foreign  # not ckptstore's: reported only
    assert report.deleted == () and store.verify(1).ok


def test_unicode_and_very_long_paths_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    deep = src / "ä" / ("d" * 100) / "日本語"
    deep.mkdir(parents=True)
    long_name = "x" * 200 + ".bin"
    (deep / long_name).write_bytes(b"long")
    (src / "emoji-🙂.txt").write_bytes(b"smile")
    store.push_dir(1, src)
    store.pull_dir(tmp_path / "out", 1)
    assert (tmp_path / "out" / deep.relative_to(src) / long_name).read_bytes() == b"long"
    assert (tmp_path / "out" / "emoji-🙂.txt").read_bytes() == b"smile"


def test_pull_refuses_a_target_whose_symlink_leads_outside(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "actor").mkdir(parents=True)
    (src / "actor" / "model.pt").write_bytes(b"weights")
    store.push_dir(1, src)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (target / "actor").symlink_to(outside)  # a planted link in the destination
    with pytest.raises(CorruptCheckpointError, match="outside"):
        store.pull_dir(target, 1, force=True)
    assert list(outside.iterdir()) == []
