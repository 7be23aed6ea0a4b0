"""The backend contract (:mod:`ckptstore.testing.contract`) on every backend ckptstore ships:
a local directory, ``memory://`` through fsspec, and S3 on a real moto server over HTTP.

Each backend is opened through the registry, exactly as the store opens it. What each one
claims to guarantee is pinned here, per backend; the shared suite only reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.backends.base import Backend, Capabilities
from ckptstore.backends.registry import open_backend
from ckptstore.testing.contract import BackendContract, Reopen

MiB = 1 << 20


def opened(uri: str, options: dict[str, Any]) -> Iterator[Backend]:
    backend = open_backend(uri, options)
    yield backend
    backend.close()


class TestLocal(BackendContract):
    @pytest.fixture
    def root(self, tmp_path: Path) -> str:
        return str(tmp_path / "store")

    @pytest.fixture
    def backend(self, root: str) -> Iterator[Backend]:
        yield from opened(root, {})

    @pytest.fixture
    def reopen(self, root: str) -> Reopen:
        return lambda: open_backend(root, {})

    def test_uri_is_the_absolute_path(self, backend: Backend, root: str) -> None:
        assert backend.uri == root

    def test_capabilities(self, backend: Backend) -> None:
        assert backend.capabilities == Capabilities(
            atomic_create=True, atomic_swap=True, server_side_copy=True, parallel_writes=8
        )


class TestMemory(BackendContract):
    @pytest.fixture
    def backend(self, memory_uri: str) -> Iterator[Backend]:
        yield from opened(memory_uri, {})

    @pytest.fixture
    def reopen(self, memory_uri: str) -> Reopen:
        return lambda: open_backend(memory_uri, {})

    def test_uri_keeps_the_scheme(self, backend: Backend, memory_uri: str) -> None:
        assert backend.uri == memory_uri

    def test_capabilities(self, backend: Backend) -> None:
        assert backend.capabilities == Capabilities(
            atomic_create=False, atomic_swap=False, server_side_copy=True
        )


class TestS3(BackendContract):
    """5 MiB parts (the minimum), so a write of a few MiB runs the parallel multipart path."""

    @pytest.fixture
    def options(self, s3_options: dict[str, Any]) -> dict[str, Any]:
        return {**s3_options, "part_size": 5 * MiB}

    @pytest.fixture
    def backend(self, s3_uri: str, options: dict[str, Any]) -> Iterator[Backend]:
        yield from opened(s3_uri, options)

    @pytest.fixture
    def reopen(self, s3_uri: str, options: dict[str, Any]) -> Reopen:
        return lambda: open_backend(s3_uri, options)

    def test_uri_keeps_the_scheme(self, backend: Backend, s3_uri: str) -> None:
        assert backend.uri == s3_uri

    def test_capabilities(self, backend: Backend) -> None:
        # moto enforces If-None-Match and If-Match on PutObject; it echoes the CRC32C it is
        # sent without checking it, so the probe finds that the server does not verify them
        # and a save writes max_concurrency (8 by default) files at once, one PUT each
        assert backend.capabilities == Capabilities(
            atomic_create=True, atomic_swap=True, server_side_copy=True, parallel_writes=8
        )
