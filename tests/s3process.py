"""moto's S3 server in a process of its own, which a test stops (SIGSTOP) and continues
(SIGCONT): a bucket that stops answering with requests in flight, whatever the machine's
speed, and comes back as it was."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
from botocore.config import Config

MiB = 1 << 20
HOLD = 60.0
"""The longest the server stays stopped if the test never gets to continue it."""


class Server:
    """moto's S3 server in a child process, which the tests stop and continue."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptstore.testing.s3server", "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "S3 server (moto, in memory) at URL; buckets: ..."
        self.url = line.split(" at ", 1)[1].split(";", 1)[0]
        self.client = boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
        )

    def options(self) -> dict[str, Any]:
        """Short stalls, small parts one at a time: a large file is a multipart upload that
        takes long enough to be caught in flight."""
        return {
            "endpoint_url": self.url,
            "key": "testing",
            "secret": "testing",
            "region": "us-east-1",
            "part_size": 5 * MiB,
            "max_concurrency": 1,
            "stall_timeout": 1.0,
        }

    def bucket(self) -> str:
        name = f"sig-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def uploads(self, bucket: str) -> list[str]:
        """The keys of the multipart uploads open in ``bucket``."""
        found = self.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return [str(u["Key"]) for u in found]

    @contextlib.contextmanager
    def stopped_mid_upload(self, bucket: str, prefix: str) -> Iterator[threading.Event]:
        """Stop the server as soon as an upload of a key under ``prefix`` is open; continue
        it when the block ends (the event tells whether it was stopped)."""
        stopped, done = threading.Event(), threading.Event()

        def watch() -> None:
            while not done.is_set():
                found = self.client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
                if found.get("Uploads"):
                    os.kill(self.proc.pid, signal.SIGSTOP)
                    stopped.set()
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield stopped
        finally:
            done.set()
            watcher.join(HOLD)
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(30)
        self.client.close()

    def stop(self) -> None:
        """SIGSTOP: the server keeps its sockets and answers nothing until :meth:`cont`."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The server stopped for the block, continued whatever happens in it."""
        self.stop()
        try:
            yield
        finally:
            self.cont()
