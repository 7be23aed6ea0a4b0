"""Save figures as Prometheus metrics, for dashboards and alerts on a training fleet.

``CheckpointStore(uri, observer=PrometheusMetrics())`` counts every save and failure and
records its bytes, wall time and the time the trainer was blocked, labelled with the store's
URI (which never holds credentials). ``ckptstore_last_commit_timestamp_seconds`` is the one to
alert on: a job whose checkpoints stopped landing shows a growing ``time() - ...``. Serving the
registry (``prometheus_client.start_http_server``) is left to the training job, which usually
has an exporter already. Needs ``pip install ckptstore[metrics]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ckptstore.core.observer import PersistStats
    from ckptstore.domain.info import SaveStats

_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class PrometheusMetrics:
    """A :class:`~ckptstore.core.observer.SaveObserver` that records into a Prometheus registry.

    Create one per process and pass it to every store: the metric names can be registered only
    once per registry (``registry`` defaults to prometheus_client's global one).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        try:
            from prometheus_client import REGISTRY, Counter, Gauge, Histogram
        except ImportError as e:
            raise ConfigError(
                "Prometheus metrics need the prometheus_client package: "
                "pip install 'ckptstore[metrics]'"
            ) from e
        # every metric is labelled by store and lives in the same registry
        common: dict[str, Any] = {
            "labelnames": ["store"],
            "registry": registry if registry is not None else REGISTRY,
        }
        timing = {**common, "buckets": _SECONDS_BUCKETS}
        self.saves = Counter("ckptstore_saves", "Steps committed", **common)
        self.failures = Counter(
            "ckptstore_save_failures", "Saves that raised instead of returning", **common
        )
        self.bytes = Counter("ckptstore_save_bytes", "Bytes of committed steps", **common)
        self.uploaded = Counter(
            "ckptstore_save_uploaded_bytes",
            "Bytes uploaded (not copied from the previous step)",
            **common,
        )
        self.seconds = Histogram(
            "ckptstore_save_seconds", "Wall time of a save, first byte to latest moved", **timing
        )
        self.blocked = Histogram(
            "ckptstore_save_blocked_seconds",
            "Time the trainer was blocked by a save (the snapshot of an async save)",
            **timing,
        )
        self.last_step = Gauge("ckptstore_last_committed_step", "Step of the last commit", **common)
        self.last_commit = Gauge(
            "ckptstore_last_commit_timestamp_seconds", "Unix time of the last commit", **common
        )

        self.persisted_total = Counter(
            "ckptstore_persisted", "Steps a tiered store copied to its durable tier", **common
        )
        self.persist_failures = Counter(
            "ckptstore_persist_failures", "Copies to the durable tier that failed", **common
        )
        self.to_durable = Histogram(
            "ckptstore_time_to_durable_seconds",
            "From a step's commit in the local tier to its commit in the durable one",
            **timing,
        )
        self.durable_step = Gauge(
            "ckptstore_durable_step", "The newest step copied to the durable tier", **common
        )
        self.lag_steps = Gauge(
            "ckptstore_durable_lag_steps", "Local steps not (yet) in the durable tier", **common
        )
        self.lag_seconds = Gauge(
            "ckptstore_durable_lag_seconds",
            "Age of the oldest local step not in the durable tier: what a lost node loses",
            **common,
        )

    def _known(self, uri: str) -> None:
        """Counters of a store start at 0, so ``rate()`` and alerts see the first failure."""
        for counter in (self.saves, self.failures, self.bytes, self.uploaded):
            counter.labels(uri)

    def saved(self, uri: str, stats: SaveStats) -> None:
        self._known(uri)
        self.saves.labels(uri).inc()
        self.bytes.labels(uri).inc(stats.bytes_total)
        self.uploaded.labels(uri).inc(stats.bytes_uploaded)
        self.seconds.labels(uri).observe(stats.seconds)
        self.blocked.labels(uri).observe(stats.blocked_seconds)
        self.last_step.labels(uri).set(stats.step)
        self.last_commit.labels(uri).set_to_current_time()

    def failed(self, uri: str, step: int, error: BaseException) -> None:
        self._known(uri)
        self.failures.labels(uri).inc()

    def persisted(self, uri: str, stats: PersistStats) -> None:
        """A tiered store's step reached its durable tier ``uri`` (tiers/local.py)."""
        self.persisted_total.labels(uri).inc()
        self.to_durable.labels(uri).observe(stats.seconds_to_durable)
        self.durable_step.labels(uri).set(stats.step)
        self.lag_steps.labels(uri).set(stats.lag_steps)
        self.lag_seconds.labels(uri).set(stats.lag_seconds)

    def persist_failed(self, uri: str, step: int, error: BaseException) -> None:
        self.persist_failures.labels(uri).inc()
