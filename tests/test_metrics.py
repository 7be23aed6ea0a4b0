"""Save observers and the Prometheus metrics built on them, against real stores."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from ckptstore import CheckpointStore
from ckptstore.domain.info import SaveStats
from ckptstore.integrations.prometheus import PrometheusMetrics
from faults import FaultyBackend, InjectedFault


def state(seed: int, frozen: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(256, 256)}, "ref": {"w": frozen}, "step": seed}


def sample(registry: CollectorRegistry, name: str, uri: str) -> float:
    value = registry.get_sample_value(name, {"store": uri})
    assert value is not None, f"{name} was not recorded for {uri}"
    return value


def test_prometheus_metrics_record_every_committed_save(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    registry = CollectorRegistry()
    uri, options = store_uri
    frozen = torch.randn(512, 512)
    with CheckpointStore(
        uri, storage_options=options, observer=PrometheusMetrics(registry)
    ) as store:
        first = store.save(1, state(1, frozen))
        second = store.save_async(2, state(2, frozen)).wait()
    stats = [first.stats, second.stats]
    assert all(isinstance(s, SaveStats) for s in stats)
    total = sum(s.bytes_total for s in stats if s)
    uploaded = sum(s.bytes_uploaded for s in stats if s)
    assert uploaded < total  # the frozen part was copied, not uploaded, the second time
    uri = store.uri
    assert sample(registry, "ckptstore_saves_total", uri) == 2
    assert sample(registry, "ckptstore_save_bytes_total", uri) == total
    assert sample(registry, "ckptstore_save_uploaded_bytes_total", uri) == uploaded
    assert sample(registry, "ckptstore_save_seconds_count", uri) == 2
    assert sample(registry, "ckptstore_save_blocked_seconds_count", uri) == 2
    assert second.stats is not None and second.stats.blocked_seconds > 0
    assert sample(registry, "ckptstore_save_blocked_seconds_sum", uri) == pytest.approx(
        second.stats.blocked_seconds
    )
    assert sample(registry, "ckptstore_last_committed_step", uri) == 2
    assert sample(registry, "ckptstore_last_commit_timestamp_seconds", uri) > 0
    assert sample(registry, "ckptstore_save_failures_total", uri) == 0


def test_a_failed_save_is_counted_and_commits_nothing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    raw = CheckpointStore(str(tmp_path / "s")).backend
    store = CheckpointStore(
        raw.uri,
        backend=FaultyBackend(raw, fail_at=1, mode="error"),
        observer=PrometheusMetrics(registry),
    )
    frozen = torch.randn(64, 64)
    with pytest.raises(InjectedFault):
        store.save_async(1, state(1, frozen)).wait()
    assert store.list() == []
    assert sample(registry, "ckptstore_save_failures_total", store.uri) == 1
    assert sample(registry, "ckptstore_saves_total", store.uri) == 0
    store.save(2, state(2, frozen))
    assert sample(registry, "ckptstore_saves_total", store.uri) == 1
    assert sample(registry, "ckptstore_last_committed_step", store.uri) == 2


class Broken:
    def saved(self, uri: str, stats: SaveStats) -> None:
        raise RuntimeError("exporter is down")

    def failed(self, uri: str, step: int, error: BaseException) -> None:
        raise RuntimeError("exporter is down")


def test_an_observer_that_raises_never_fails_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(str(tmp_path / "s"), observer=Broken())
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        info = store.save(1, state(1, torch.zeros(4)))
    assert store.latest() == info
    assert "the save observer raised RuntimeError('exporter is down'); ignored" in caplog.text
    assert torch.equal(store.load()["model"]["w"], state(1, torch.zeros(4))["model"]["w"])


def test_one_registry_serves_several_stores(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    a = CheckpointStore(str(tmp_path / "a"), observer=metrics)
    b = CheckpointStore(str(tmp_path / "b"), observer=metrics)
    a.save(5, state(5, torch.zeros(4)))
    b.save(7, state(7, torch.zeros(4)))
    assert sample(registry, "ckptstore_last_committed_step", a.uri) == 5
    assert sample(registry, "ckptstore_last_committed_step", b.uri) == 7
