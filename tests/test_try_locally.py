"""The README's no-Docker path: an S3 server from the package, a bucket made by ``ckptstore mb``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.main import run
from ckptstore.testing.s3server import DUMMY_KEY, DUMMY_SECRET

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served() -> Iterator[str]:
    """``python -m ckptstore.testing.s3server`` in its own process; yields its endpoint."""
    child = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.testing.s3server", "--port", "0", "--bucket", "first"],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
    )
    try:
        assert child.stdout is not None
        banner = child.stdout.readline()
        assert banner.startswith("S3 server (moto, in memory) at http://127.0.0.1:"), banner
        yield banner.split(" at ", 1)[1].split(";", 1)[0]
    finally:
        child.terminate()
        child.wait(timeout=30)


def _cli(endpoint: str, *args: str) -> list[str]:
    return [
        "--endpoint-url",
        endpoint,
        "-o",
        f"key={DUMMY_KEY}",
        "-o",
        f"secret={DUMMY_SECRET}",
        "-o",
        "region=us-east-1",
        *args,
    ]


def test_mb_makes_a_bucket_a_store_can_use(served: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_cli(served, "mb", "s3://made-here")) == 0
    assert "created bucket s3://made-here" in capsys.readouterr().out
    options = {"endpoint_url": served, "key": DUMMY_KEY, "secret": DUMMY_SECRET}
    with CheckpointStore("s3://made-here/run", storage_options=options) as store:
        store.save(1, {"w": torch.arange(4)})
    with CheckpointStore("s3://made-here/run", storage_options=options) as store:
        assert torch.equal(store.load()["w"], torch.arange(4))


def test_mb_of_a_bucket_already_owned_is_not_an_error(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(_cli(served, "mb", "s3://first")) == 0
    assert "bucket s3://first already exists" in capsys.readouterr().out


def test_mb_refuses_a_bad_bucket_name(served: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_cli(served, "mb", "s3://Bad_Name")) == 2
    err = capsys.readouterr().err
    assert "'Bad_Name'" in err
    assert "not a valid S3 bucket name" in err


def test_mb_of_a_local_path_makes_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a" / "b"
    assert run(["mb", str(target)]) == 0
    assert target.is_dir()
    assert run(["mb", str(target)]) == 0
    assert f"exists: {target}" in capsys.readouterr().out
