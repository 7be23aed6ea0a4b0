"""Every save ends, committed or failed, within its deadline (invariant 15), whatever the
server does: sync, async and 2-rank (gloo) saves through the fault proxy in front of moto,
with the store's ``save_timeout``.

For each fault mode that never clears by itself, on the step's payload only (so the lease and
``latest`` still work): the save fails by the deadline plus :data:`MARGIN` with
SaveTimeoutError naming the file (and the rank), nothing is committed, no multipart upload
stays open, and the next save, the fault switched off, commits and loads bit-exact. A brownout
shorter than the deadline is ridden out. The training callback goes on after a failed save and
stops after ``max_failed_saves`` in a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointError, CheckpointStore, DistributedCheckpointError
from ckptstore.errors import SaveTimeoutError
from ckptstore.integrations.training import CheckpointCallback
from ranks import run_ranks
from s3faults.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.wallclock  # timed assertions: run on a quiet machine

MiB = 1 << 20
SAVE_TIMEOUT = 2.0
MARGIN = 3.0
"""Seconds past the deadline a failure may take here (a shared, noisy machine)."""
PAYLOAD_OF_STEP_2 = "*/global_step_2/.attempt-*/*"

FAULTS: dict[str, Callable[[], Fault]] = {
    "stall": lambda: Fault.stall(glob=PAYLOAD_OF_STEP_2),
    "stall-after-bytes": lambda: Fault.stall(
        after=256 << 10, direction="request", glob=PAYLOAD_OF_STEP_2
    ),
    "trickle": lambda: Fault.trickle(2048, direction="request", glob=PAYLOAD_OF_STEP_2),
    "reset": lambda: Fault.reset(after=64 << 10, direction="request", glob=PAYLOAD_OF_STEP_2),
    "brownout": lambda: Fault.brownout(60, status=503, glob=PAYLOAD_OF_STEP_2),
    "refuse": lambda: Fault.refuse(SAVE_TIMEOUT + 0.5),  # new connections, any request
}


def state_for(step: int, mib: int = 6) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * MiB // 4, generator=gen), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    started = FaultProxy(s3_endpoint).start()
    yield started
    started.stop()


def options(proxy: FaultProxy) -> dict[str, Any]:
    """5 MiB parts (a 6 MiB file is a 2-part upload); stalls given up after half a second."""
    return {"endpoint_url": proxy.endpoint_url, "part_size": 5 * MiB, "stall_timeout": 0.5}


def open_uploads(s3_client: Any, bucket: str) -> list[Any]:
    return list(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.parametrize(
    ("mode", "how"),
    [(mode, "sync") for mode in FAULTS] + [(m, "async") for m in ("stall", "trickle")],
)
def test_a_save_the_server_never_finishes_fails_by_its_deadline_and_the_next_commits(
    proxy: FaultProxy, s3_uri: str, s3_client: Any, s3_bucket: str, mode: str, how: str
) -> None:
    with CheckpointStore(s3_uri, storage_options=options(proxy), save_timeout=SAVE_TIMEOUT) as s:
        s.save(1, state_for(1))
        fault = proxy.add_fault(FAULTS[mode]())
        started = time.monotonic()
        save: Callable[[], Any] = lambda: s.save(2, state_for(2))  # noqa: E731
        if how == "async":
            save = lambda: s.save_async(2, state_for(2)).wait()  # noqa: E731
        with pytest.raises(SaveTimeoutError) as caught:
            save()
        assert time.monotonic() - started < SAVE_TIMEOUT + MARGIN
        assert fault.fired > 0
        error = caught.value
        assert error.step == 2, error
        if mode != "refuse":  # a refused connection may be any request's
            assert "global_step_2/.attempt-" in (error.path or ""), error  # the file it was at
        assert "save_timeout" in str(error) or "deadline" in str(error)
        assert [i.step for i in s.list()] == [1]  # nothing half-committed
        assert open_uploads(s3_client, s3_bucket) == []
        fault.off()
        s.save(3, state_for(3))
        assert same(s.load(3), state_for(3)) and s.latest().step == 3  # type: ignore[union-attr]


def test_a_brownout_shorter_than_the_deadline_is_ridden_out(proxy: FaultProxy, s3_uri: str) -> None:
    with CheckpointStore(s3_uri, storage_options=options(proxy), save_timeout=20) as store:
        proxy.add_fault(Fault.brownout(1.5, status=503))  # every request, for 1.5 s
        store.save(1, state_for(1))
        assert same(store.load(), state_for(1))


# -- two ranks over gloo: one rank's uploads stall --------------------------------------------


def _rank_saves(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    from ckptstore.integrations.distributed import load_distributed, save_distributed

    out: dict[str, Any] = {}
    with CheckpointStore(
        uri, storage_options=opts, lease=rank == 0, save_timeout=SAVE_TIMEOUT
    ) as s:
        save_distributed(s, 1, state_for(10 + rank))
        started = time.monotonic()
        try:
            save_distributed(s, 2, state_for(20 + rank))
            out["step2"] = "committed"
        except DistributedCheckpointError as e:
            out["step2"] = str(e)
            out["failures"] = dict(e.failures)
        out["seconds"] = time.monotonic() - started
        save_distributed(s, 3, state_for(30 + rank))  # the fault matches step 2's keys only
        out["loaded"] = same(load_distributed(s), state_for(30 + rank))
    return out


def test_a_rank_whose_upload_stalls_fails_every_rank_by_the_deadline(
    proxy: FaultProxy, s3_uri: str, s3_client: Any, s3_bucket: str, tmp_path: Path
) -> None:
    stall = proxy.add_fault(Fault.stall(glob="*/global_step_2/.attempt-*/rank_00001/*"))
    results = run_ranks(_rank_saves, 2, tmp_path / "ranks", s3_uri, options(proxy))
    assert stall.fired > 0
    for rank, out in enumerate(results):
        assert out["step2"] != "committed", rank
        assert out["seconds"] < SAVE_TIMEOUT + MARGIN, (rank, out)
        assert "SaveTimeoutError" in out["failures"][1], out  # rank 1 named, with its file
        assert "rank_00001/" in out["failures"][1], out
        assert out["loaded"], rank
    with CheckpointStore(s3_uri, storage_options=options(proxy), lease=False) as store:
        assert [i.step for i in store.list()] == [1, 3]
    assert open_uploads(s3_client, s3_bucket) == []


# -- training goes on -------------------------------------------------------------------------


class Flaky:
    """A store whose next saves fail on demand (the failure a timeout turns into)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.failing = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def save(self, step: int, *args: Any, **kwargs: Any) -> Any:
        if self.failing:
            self.failing -= 1
            raise SaveTimeoutError(f"save of step {step} timed out (injected)", step=step)
        return self.store.save(step, *args, **kwargs)


def test_the_callback_goes_on_after_a_failed_save_and_stops_after_three_in_a_row(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flaky = Flaky(CheckpointStore(str(tmp_path / "run")))
    callback = CheckpointCallback(
        flaky,  # type: ignore[arg-type]
        save_freq=1,
        async_save=False,
        preemption_signals=(),
    )
    flaky.failing = 2
    assert callback.on_step(1, model, optimizer) is None  # failed: training goes on
    assert callback.on_step(2, model, optimizer) is None
    assert callback.failed_saves == 2
    assert callback.on_step(3, model, optimizer) is not None  # commits: the count starts again
    assert callback.failed_saves == 0
    flaky.failing = 3
    for step in (4, 5):
        callback.on_step(step, model, optimizer)
    with pytest.raises(CheckpointError, match="3 saves in a row failed"):
        callback.on_step(6, model, optimizer)
    callback.close()
    assert [i.step for i in flaky.store.list()] == [3]
    flaky.store.close()


def test_cli_push_with_a_save_timeout_fails_by_it_and_commits_nothing(
    proxy: FaultProxy,
    s3_uri: str,
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ckptstore.cli.main import run

    folder = tmp_path / "global_step_2"
    folder.mkdir()
    (folder / "data.pt").write_bytes(b"x" * (6 * MiB))
    proxy.add_fault(Fault.stall(glob=PAYLOAD_OF_STEP_2))
    args = ["push", str(folder), s3_uri, "2", "--save-timeout", str(SAVE_TIMEOUT)]
    args += ["--endpoint-url", proxy.endpoint_url, "-o", "part_size=5242880"]
    args += ["-o", "stall_timeout=0.5"]
    started = time.monotonic()
    assert run(args) == 6  # a storage error: the storage was too slow for the deadline
    assert time.monotonic() - started < SAVE_TIMEOUT + MARGIN
    assert "deadline" in capsys.readouterr().err
    assert open_uploads(s3_client, s3_bucket) == []
    with CheckpointStore(s3_uri, storage_options={"endpoint_url": proxy.endpoint_url}) as store:
        assert store.list() == []


def test_cli_replicate_with_a_save_timeout_fails_by_it_and_the_next_pass_commits(
    proxy: FaultProxy,
    s3_uri: str,
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A step's copy into DST is a save there: it commits within DST's ``save_timeout`` or
    fails, committing nothing and leaving no upload open; the next pass finishes it."""
    from ckptstore.cli.main import run

    source = str(tmp_path / "src")
    with CheckpointStore(source) as src:
        for step in (1, 2):
            src.save(step, state_for(step))
    fault = proxy.add_fault(Fault.stall(glob=PAYLOAD_OF_STEP_2))
    args = ["replicate", source, s3_uri, "--save-timeout", str(SAVE_TIMEOUT)]
    args += ["--endpoint-url", proxy.endpoint_url, "-o", "part_size=5242880"]
    args += ["-o", "stall_timeout=0.5"]
    started = time.monotonic()
    assert run(args) == 6  # a storage error: the storage was too slow for the deadline
    assert time.monotonic() - started < SAVE_TIMEOUT + MARGIN
    assert fault.fired > 0
    assert "global_step_2" in capsys.readouterr().err  # names the file it was at
    assert open_uploads(s3_client, s3_bucket) == []
    endpoint = {"endpoint_url": proxy.endpoint_url}
    with CheckpointStore(s3_uri, storage_options=endpoint, lease=False) as dst:
        assert 2 not in [i.step for i in dst.list()]  # nothing half-committed
    fault.off()
    assert run(args) == 0
    with CheckpointStore(s3_uri, storage_options=endpoint, lease=False) as dst:
        assert [i.step for i in dst.list()] == [1, 2]
        assert same(dst.load(), state_for(2))
