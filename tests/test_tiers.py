"""A local tier in front of a durable store (S3 over HTTP on moto, and a local directory):
saves land locally at once and reach the store in the background, a kill during a copy is
resumed, a wiped or corrupt local tier falls back to the durable copy, and local retention
never drops a step before it is durable (invariant 17)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ConfigError, CorruptCheckpointError
from ckptstore.cli.main import run as cli_run
from ckptstore.domain import layout
from ckptstore.domain.step_index import HEAD_NAME
from faults import FaultyBackend, Gate, InjectedFault
from keys import file_key


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(n)), "b": torch.arange(n + 1)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(params=["s3", "dir"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "s3":
        return request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")
    return str(tmp_path / "durable"), {}


def durable_steps(uri: str, options: dict[str, Any]) -> list[int]:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


def test_saves_land_locally_and_due_steps_reach_the_store(
    durable: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    uri, options = durable
    local = tmp_path / "local"
    store = CheckpointStore(uri, storage_options=options, local=str(local), persist_every=2)
    for step in range(1, 6):
        info = store.save(step, state(step))
        assert info.uri.startswith(str(local))  # committed in the local tier
    store.wait()
    assert durable_steps(uri, options) == [2, 4]
    tiers = {i.step: i.tier for i in store.list()}
    assert tiers == {2: "durable", 4: "local+durable", 5: "local"}  # local keeps the last 2
    loaded = store.load(with_info=True)
    assert loaded.step == 5 and same(loaded.state, state(5))
    store.close()  # the last step is always made durable
    assert durable_steps(uri, options) == [2, 4, 5]
    with CheckpointStore(uri, storage_options=options) as other_cluster:
        assert same(other_cluster.load(), state(5))
        manifest = other_cluster.info(5).manifest
    with CheckpointStore(str(local), lease=False) as local_tier:
        assert local_tier.info(5).manifest == manifest  # the same bytes, the same manifest


def test_persist_true_forces_a_copy_and_save_async_goes_through_the_local_tier(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "durable")
    with CheckpointStore(uri, local=str(tmp_path / "local"), persist_every=100) as store:
        store.save(1, state(1))
        store.save_async(2, state(2), persist=True).wait()
        store.wait()
        assert durable_steps(uri, {}) == [2]
        assert store.latest().step == 2  # type: ignore[union-attr]


def test_local_retention_never_drops_a_step_before_it_is_durable(tmp_path: Path) -> None:
    from ckptstore.backends.local import LocalBackend

    uri = str(tmp_path / "durable")
    gate = Gate(LocalBackend(uri, {}))
    store = CheckpointStore(
        uri, backend=gate, local=str(tmp_path / "local"), local_keep_last=1, lease=False
    )
    for step in range(1, 5):
        store.save(step, state(step))  # every save is due; none can be copied yet
    tiers = {i.step: i.tier for i in store.list()}
    assert set(tiers) == {1, 2, 3, 4}, tiers  # keep_last=1 would have left only step 4
    assert all(t.startswith("local") for t in tiers.values()), tiers
    gate.open.set()
    store.wait()
    assert durable_steps(uri, {}) == [1, 2, 3, 4]
    with CheckpointStore(str(tmp_path / "local"), lease=False) as local_tier:
        # once durable, local retention applies (it ran after each copy)
        assert [i.step for i in local_tier.list()] == [4]
    store.close()


def test_a_copy_killed_half_way_resumes_when_the_store_is_opened_again(
    durable: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    uri, options = durable
    local = str(tmp_path / "local")
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        crashing = FaultyBackend(plain.backend, fail_at=3, mode="crash")  # dies mid-copy
        store = CheckpointStore(uri, backend=crashing, local=local, persist_every=1, lease=False)
        store.save(1, state(1))
        with pytest.raises(InjectedFault):
            store.wait()
        assert durable_steps(uri, options) == []  # nothing half-committed
        assert {i.step: i.tier for i in store.list()} == {1: "local"}
        # the process dies here: no close, no final copy; the next run resumes and saves
        again = CheckpointStore(uri, storage_options=options, local=local, lease=False)
        assert again.load(with_info=True).step == 1  # from the local tier
        again.save(2, state(2))
        again.wait()
        assert durable_steps(uri, options) == [1, 2]
        assert same(CheckpointStore(uri, storage_options=options, lease=False).load(1), state(1))
        again.close()


def test_a_wiped_local_tier_resumes_from_the_durable_step(
    durable: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    uri, options = durable
    local = tmp_path / "local"
    with CheckpointStore(uri, storage_options=options, local=str(local)) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
    shutil.rmtree(local)  # the node was replaced
    with CheckpointStore(uri, storage_options=options, local=str(local)) as store:
        loaded = store.load(with_info=True)
        assert loaded.step == 3 and same(loaded.state, state(3))
        assert store.last_loaded is not None and store.last_loaded.uri.startswith(uri)


def test_a_corrupt_local_copy_falls_back_to_the_durable_copy_of_the_same_step(
    durable: tuple[str, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, options = durable
    local = tmp_path / "local"
    with CheckpointStore(uri, storage_options=options, local=str(local)) as store:
        for step in (1, 2):
            store.save(step, state(step))
    with CheckpointStore(str(local), lease=False) as local_tier:
        largest = max(local_tier.info(2).files, key=lambda f: f.size).path
        path = local / file_key(local_tier, 2, largest)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with CheckpointStore(uri, storage_options=options, local=str(local)) as store:
        loaded = store.load(with_info=True)
        assert loaded.step == 2 and same(loaded.state, state(2))  # step 2 still, not step 1
        assert store.last_loaded is not None and not store.last_loaded.uri.startswith(str(local))
    assert "trying the next copy" in caplog.text


def _two_steps_in_both_tiers(tmp_path: Path) -> tuple[str, str]:
    """A durable store and its local tier, steps 1 and 2 committed in both: their URIs."""
    uri, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with CheckpointStore(uri, local=local, persist_every=1) as store:
        for step in (1, 2):
            store.save(step, state(step))
    return uri, local


def test_a_load_from_the_local_tier_reads_the_durable_pointer_once_and_no_durable_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read of the durable tier is a GET on a bucket: a load's fixed cost. Its pointer
    (whose fences judge both tiers) is read once per load, and the manifest of a step the
    local tier holds too is not read there."""
    uri, local = _two_steps_in_both_tiers(tmp_path)
    with CheckpointStore(uri, local=local) as store:
        backend = store.resolver.catalog.backend
        reads: list[str] = []
        for method in ("read", "read_versioned"):
            real = getattr(backend, method)
            monkeypatch.setattr(
                backend, method, lambda path, _real=real: reads.append(path) or _real(path)
            )
        loaded = store.load(with_info=True)
        assert loaded.step == 2 and same(loaded.state, state(2))
        assert store.last_loaded is not None and store.last_loaded.uri.startswith(local)
    assert reads.count(layout.LATEST_NAME) == 1, reads
    assert not [r for r in reads if r.endswith(layout.MANIFEST_NAME)], reads


def test_a_load_reads_the_durable_pointer_and_step_index_head_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding latest in a store with tiers needs the durable pointer (its fences) and the
    durable step index's head (steps past the pointer): two round trips on a bucket, which
    a load waited for one after the other. The pointer's read here waits for the head's to
    begin: it begins on a thread of its own meanwhile, or the wait times out (30 s: a loaded
    machine may start a thread late, never that late)."""
    uri, local = _two_steps_in_both_tiers(tmp_path)
    with CheckpointStore(uri, local=local) as store:
        backend = store.resolver.catalog.backend
        real = backend.read_versioned
        head_begun, overlapped = threading.Event(), []

        def read_versioned(path: str) -> tuple[bytes, str]:
            if path == HEAD_NAME:
                head_begun.set()
            elif path == layout.LATEST_NAME:
                overlapped.append(head_begun.wait(30))  # never, where read one after the other
            return real(path)

        monkeypatch.setattr(backend, "read_versioned", read_versioned)
        loaded = store.load(with_info=True)
        assert loaded.step == 2 and same(loaded.state, state(2))
    assert overlapped == [True]


def test_a_primed_search_raises_its_error_at_the_offer_not_before(tmp_path: Path) -> None:
    """load_distributed's rank 0 finds latest before the gather of the other ranks' steps:
    an unreadable store must reach every rank as the offer, not stop rank 0 before the
    collective that the others wait in."""
    uri, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with CheckpointStore(uri, local=local, persist_every=1) as store:
        store.save(1, state(1))
    for root in (uri, local):
        (Path(root) / layout.manifest_path(1)).write_text("{")
    with CheckpointStore(uri, local=local) as store:
        search = store.resolver.search()
        search.prime()  # no error yet
        with pytest.raises(CorruptCheckpointError, match="manifest"):
            search.next()


def test_ls_shows_the_tier_of_each_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with CheckpointStore(uri, local=local, persist_every=2) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
        store.wait()
        capsys.readouterr()
        assert cli_run(["ls", uri, "--local", local]) == 0
    out = capsys.readouterr().out
    assert "TIER" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] != []}
    assert "local+durable" in rows["2"] and "local" in rows["3"] and "durable" not in rows["3"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"persist_every": 2}, "persist_every only apply with local"),
        ({"local": "x", "persist_every": 0}, "persist_every must be a positive integer"),
        ({"local": "x", "persist_interval_seconds": -1}, "persist_interval_seconds must be"),
        ({"local": "x", "local_keep_last": 0}, "local_keep_last must be a positive integer"),
    ],
)
def test_bad_tier_options_fail_at_open(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointStore(str(tmp_path / "durable"), **options)


def test_persisted_steps_reach_the_metrics(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from ckptstore.integrations.prometheus import PrometheusMetrics

    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    uri = str(tmp_path / "durable")
    with CheckpointStore(uri, local=str(tmp_path / "local"), observer=metrics) as store:
        store.save(1, state(1))
        store.wait()
    assert registry.get_sample_value("ckptstore_persisted_total", {"store": uri}) == 1.0
    assert registry.get_sample_value("ckptstore_durable_step", {"store": uri}) == 1.0
    assert registry.get_sample_value("ckptstore_saves_total", {"store": str(tmp_path / "local")}
                                     ) == 1.0  # fmt: skip
