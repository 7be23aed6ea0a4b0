"""Shared fixtures: a real S3 server on 127.0.0.1 and one URI per backend for contract tests.

The S3 server is moto's ``ThreadedMotoServer``: real HTTP on loopback, so the S3 backend runs
the code path it runs against AWS (signing, multipart, conditional headers, retries), not
in-process mocks. Dummy AWS credentials are set in the environment for the whole session, and
any AWS settings of the person running the tests are hidden, so tests never reach a real account.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.nodes import Cluster, refused
from s3process import Server

MiB = 1 << 20
BACKENDS = ["local", "memory", "s3"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a ``slow`` test first, then the others by their number of tests, most first.
    scripts/test hands pytest-xdist's workers a file at a time in this order (it passes
    ``--no-loadscope-reorder``): a long file taken last keeps one worker busy while the others
    idle. Tests keep their order within each file."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    tests_in = Counter(item.path for item in items)
    items.sort(key=lambda item: (0,) if item.path in slow_files else (1, -tests_in[item.path]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """moto's S3 server in a process of its own (s3process.py), which a test stops and
    continues: one per test module that asks for it."""
    s = Server()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Dummy credentials and no trace of the caller's AWS config, for the whole session."""
    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            mp.delenv(name)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(nowhere))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@pytest.fixture(scope="session")
def s3_endpoint(aws_env: None) -> Iterator[str]:
    """The URL of a moto S3 server on 127.0.0.1, shared by the session."""
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")  # moto's HTTP server logs every request at INFO
    level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        werkzeug.setLevel(level)


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict[str, Any]:
    """storage_options that point the S3 backend at the moto server."""
    return {"endpoint_url": s3_endpoint}


@pytest.fixture
def s3_client(s3_endpoint: str) -> Iterator[Any]:
    """A plain boto3 client on the moto server, to set up and inspect buckets behind our back."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    yield client
    client.close()


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A fresh, empty bucket."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_uri(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/run"


@pytest.fixture
def memory_uri() -> Iterator[str]:
    """A fresh ``memory://`` root; removed from fsspec's process-global memory store after."""
    import fsspec

    name = f"test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    for key in [k for k in fs.store if k.startswith(f"/{name}/")]:
        fs.store.pop(key, None)
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not d.startswith(f"/{name}")]


@pytest.fixture(params=BACKENDS)
def backend_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """``(uri, storage_options)`` of an empty store on each backend in turn.

    S3 uses 5 MiB parts (the minimum) so a write of a few MiB runs the parallel multipart path.
    """
    if request.param == "local":
        return str(tmp_path / "store"), {}
    if request.param == "memory":
        return request.getfixturevalue("memory_uri"), {}
    options = {**request.getfixturevalue("s3_options"), "part_size": 5 * MiB}
    return request.getfixturevalue("s3_uri"), options


@pytest.fixture
def store_uri(backend_uri: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """``(uri, storage_options)`` of an empty store, on each backend in turn."""
    return backend_uri


@pytest.fixture
def store(backend_uri: tuple[str, dict[str, Any]]) -> Iterator[Any]:
    """An empty CheckpointStore, on each backend in turn."""
    from ckptstore import CheckpointStore

    uri, options = backend_uri
    with CheckpointStore(uri, storage_options=options) as opened:
        yield opened


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Make nodes in namespaces of their own, all at one path (harness/nodes.py); skipped,
    saying why, where the machine refuses namespaces."""
    reason = refused()
    if reason is not None:
        pytest.skip(reason)
    made: list[Cluster] = []

    def make(nodes: int, ranks_per_node: int = 2) -> Cluster:
        made.append(Cluster(tmp_path / f"cluster{len(made)}", nodes, ranks_per_node))
        return made[-1]

    yield make
    for each in made:
        each.close()
