"""An embedded S3 server on 127.0.0.1, for the demo, the benchmark and tests.

It wraps moto's ``ThreadedMotoServer``: a real HTTP endpoint served from a thread of this
process, so the S3 backend runs exactly the code path it runs against AWS or MinIO (signing,
multipart, conditional writes, retries), and other processes can reach the same bucket by URL.
The port is chosen by the OS (bind to port 0), so parallel test runs never collide.

Credentials are not set process-wide: moto accepts any, and the dummy ones it needs travel in
:meth:`LocalS3Server.storage_options` (``key``/``secret``), never through ``os.environ``. The one
process-global change is documented here: the ``werkzeug`` logger (moto's HTTP server) is set to
WARNING if nobody configured its level, or every request would be printed to stderr. The
objects live in this process's memory and vanish with it.

moto is imported inside :meth:`LocalS3Server.start`: it takes about a second to import, and
only the demo and tests need it (``pip install 'ckptstore[demo]'``).

``python -m ckptstore.testing.s3server --port 5000 --bucket demo`` serves it in the foreground,
for trying S3 stores on a machine without Docker; it prints the settings a shell needs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ckptstore.errors import BackendError, CheckpointError, ConfigError

log = logging.getLogger(__name__)

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
REGION = "us-east-1"
_FIX = "pip install 'ckptstore[demo]'"


class LocalS3Server:
    """moto's S3 server on ``127.0.0.1:<free port>``; use as a context manager.

    >>> with LocalS3Server() as server:  # doctest: +SKIP
    ...     server.create_bucket("demo")
    ...     store = CheckpointStore("s3://demo/run", storage_options=server.storage_options())
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._server: Any = None

    def __enter__(self) -> LocalS3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        if self._server is None:
            raise ConfigError("the embedded S3 server is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalS3Server:
        """Start serving (a no-op if already started); returns ``self``."""
        if self._server is not None:
            return self
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise ConfigError(
                f"the embedded S3 server needs moto[server], which is missing ({e.name!r}); "
                f"install it with: {_FIX}"
            ) from e
        quiet = logging.getLogger("werkzeug")
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        try:
            server.start()
        except OSError as e:
            raise BackendError(
                f"cannot start the embedded S3 server on {self.host}:{self.port}: {e}; "
                "pick another port, or leave it 0 to let the OS choose"
            ) from e
        self.port = server.get_host_and_port()[1]
        self._server = server
        log.info("embedded S3 server (moto) listening at %s", self.endpoint_url)
        return self

    def stop(self) -> None:
        """Stop serving; the buckets and objects are gone afterwards."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.stop()
        log.info("embedded S3 server on port %d stopped", self.port)

    def storage_options(self) -> dict[str, Any]:
        """What ``CheckpointStore(..., storage_options=...)`` needs to reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": DUMMY_KEY,
            "secret": DUMMY_SECRET,
            "region": REGION,
        }

    def client(self) -> Any:
        """A boto3 S3 client for this server (for setup in tests; stores use storage_options)."""
        try:
            import boto3
        except ImportError as e:
            raise ConfigError(f"the embedded S3 server needs boto3; install it with: {_FIX}") from e
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_KEY,
            aws_secret_access_key=DUMMY_SECRET,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (us-east-1 needs no location constraint); returns ``s3://name``."""
        from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound

        try:
            self.client().create_bucket(Bucket=name)
        except ProfileNotFound as e:
            raise ConfigError(
                f"cannot create bucket {name!r} on the embedded S3 server: {e}; the AWS_PROFILE "
                "environment variable names a profile that does not exist. Unset it"
            ) from e
        except (BotoCoreError, ClientError) as e:
            raise BackendError(
                f"cannot create bucket {name!r} on the embedded S3 server at "
                f"{self.endpoint_url}: {e}"
            ) from e
        return f"s3://{name}"


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until Ctrl-C, printing how to point ckptstore at the server."""
    parser = argparse.ArgumentParser(
        prog="python -m ckptstore.testing.s3server",
        description="An in-memory S3 server (moto) on 127.0.0.1 for trying ckptstore.",
    )
    parser.add_argument("--port", type=int, default=5000, help="0 lets the OS choose")
    parser.add_argument("--bucket", action="append", default=[], help="create (repeatable)")
    args = parser.parse_args(argv)
    with LocalS3Server(port=args.port) as server:
        try:
            for bucket in args.bucket:
                server.create_bucket(bucket)
        except CheckpointError as e:
            print(f"s3server: error: {e}", file=sys.stderr)
            return 2
        print(
            f"S3 server (moto, in memory) at {server.endpoint_url}; "
            f"buckets: {', '.join(args.bucket) or 'none yet (ckptstore mb s3://NAME)'}\n"
            "In another shell:\n"
            f"  export AWS_ENDPOINT_URL={server.endpoint_url} AWS_ACCESS_KEY_ID={DUMMY_KEY} "
            f"AWS_SECRET_ACCESS_KEY={DUMMY_SECRET} AWS_REGION={REGION}\n"
            "Ctrl-C stops it; the objects vanish with it.",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
