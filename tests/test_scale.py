"""The scale harness (scale) at CI size: a 1,024-rank simulated save against
the throttling S3 costs exactly the requests of the README's model, and the operations on a
store of many steps cost the same whatever the number of steps (except gc, reported)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scale import (
    Phase,
    Rig,
    SaveConfig,
    StepsRow,
    list_pages,
    measure_steps,
    save_table,
    simulate_save,
    stage_model,
    steps_table,
)

from ranks import run_ranks
from s3faults.throttle import Throttle

RANKS = 1024
WORKERS = 16


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with Rig(Throttle.scaled(25)) as rig:
        yield rig


def admitted(phase: Phase) -> Counter[str]:
    """The requests that reached the server: a SlowDown answer is followed by one more try."""
    return phase.requests - phase.slowdowns


def by_name(phases: list[Phase]) -> dict[str, Phase]:
    return {p.name.split(" ")[0]: p for p in phases}


@pytest.mark.slow
def test_a_1024_rank_save_costs_what_the_model_says(rig: Rig) -> None:
    config = SaveConfig(
        ranks=RANKS, files=1, file_size=64, workers=WORKERS, steps=1, incremental=False
    )
    [report] = simulate_save(rig, config)  # every rank's file is read back and compared
    assert report.failed_ranks == 0, report.error
    phases = by_name(report.phases)
    assert admitted(phases["stage"]) == stage_model(RANKS, 1)
    # the commit grows with ranks only by the LIST pages that confirm the payload (and, the
    # first commit to a store without a step index, one listing of its step directories)
    commit = admitted(phases["commit"])
    assert commit["ListObjects"] == list_pages(RANKS, 1) + 1 == 4
    assert sum(commit.values()) - commit["ListObjects"] <= 6 + 2, commit  # + the index head
    load = admitted(phases["load"])
    assert load["GetObject"] == RANKS + 3, load  # each file; the pointer, index head, manifest
    assert report.manifest_bytes > RANKS * 100
    table = save_table([report], "ci")
    assert "| 1 | stage (all ranks) |" in table and "manifest" in table


def test_the_model_counts_a_save_per_rank() -> None:
    assert stage_model(4, 8) == Counter({"PutObject": 4 * 9})
    assert stage_model(4, 8, unchanged=8) == Counter(
        {"PutObject": 4, "HeadObject": 4 * 8, "CopyObject": 32}
    )
    assert list_pages(1024, 8) == 10


def test_a_ranks_staging_costs_the_same_at_any_number_of_ranks(rig: Rig) -> None:
    """Steady state, incremental: the requests per rank at 4 and at 32 ranks are the same: no
    rank reads anything, the coordinator reads latest and its manifest once."""
    per_rank = []
    for ranks in (4, 32):
        config = SaveConfig(ranks=ranks, files=2, file_size=64, workers=4, steps=2)
        reports = simulate_save(rig, config)
        assert [r.failed_ranks for r in reports] == [0, 0], reports[-1].error
        stage = admitted(by_name(reports[1].phases)["stage"])
        assert stage == stage_model(ranks, 2), stage
        per_rank.append(Counter({op: n // ranks for op, n in stage.items()}))
        prepare = admitted(by_name(reports[1].phases)["prepare"])
        assert prepare["GetObject"] == 2, prepare  # latest and its manifest, once
    assert per_rank[0] == per_rank[1] == Counter({"PutObject": 3})


def requests_of(rows: list[StepsRow]) -> dict[str, int]:
    return {r.operation: sum(r.requests.values()) for r in rows}


def test_operations_on_many_steps_cost_what_is_new_not_the_step_count(rig: Rig) -> None:
    small, large = requests_of(measure_steps(rig, 10)), requests_of(measure_steps(rig, 30))
    for bounded in ("latest() (new process)", "ls (again)", "prune, nothing to delete"):
        assert small[bounded] == large[bounded], (bounded, small, large)
    save = "save, keep_last=3 (after a listing)"
    assert small[save] == large[save], (small, large)
    # pointer, the step index's head (absent: the steps were seeded as an older writer wrote
    # them, README "Long runs"), one LIST past the pointer, one manifest
    assert large["latest() (new process)"] == 4
    assert large["ls (again)"] == 1
    # a first listing reads every manifest once; gc of clean steps costs its LIST pages only
    # (and writes the step index it built: its head and a segment, once)
    assert large["ls (new process)"] == small["ls (new process)"] + (30 - 10)
    assert large["ls (new process)"] <= 30 + 10
    assert small["gc, nothing to collect"] == large["gc, nothing to collect"] < 30
    assert "| ls (again) |" in steps_table(measure_steps(rig, 1), 1)


# -- the same per-rank cost with real processes over gloo ----------------------------------

WORLD = 8


def _save_twice(rank: int, world: int, uri: str, options: dict[str, Any]) -> list[Any]:
    """Two saves through save_distributed; each rank's own S3 requests, counted by its client
    (every attempt), and its number of files."""
    import torch

    from ckptstore import CheckpointStore
    from ckptstore.integrations.distributed import rank_dir, save_distributed

    counts: Counter[str] = Counter()

    def count(event_name: str, **_: Any) -> None:
        counts[event_name.rsplit(".", 1)[-1]] += 1

    out = []
    with CheckpointStore(uri, storage_options=options, lease=rank == 0) as store:
        store.backend.client.meta.events.register("before-send.s3", count)  # type: ignore[attr-defined]
        for step in (1, 2):
            info = save_distributed(store, step, {"w": torch.full((64,), float(rank + step))})
            mine = [f for f in info.files if f.path.startswith(rank_dir(rank) + "/")]
            copied = sum(1 for f in mine if f.copied_from is not None)
            out.append((dict(counts), len(mine), copied))
            counts.clear()
    return out


def test_gloo_ranks_cost_what_the_simulation_models(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """8 real processes over gloo: every rank but the coordinator makes exactly the requests
    ``stage_model`` predicts for one rank, first save and steady state alike: no read at all
    (rank 0 began the save, reading ``latest`` and the previous manifest once, and scattered
    each rank its plan) and no capability probe (a rank that only stages never writes
    conditionally)."""
    results = run_ranks(_save_twice, WORLD, tmp_path / "ranks", s3_uri, s3_options)
    for rank, ((first, files, _), (steady, files2, copied)) in enumerate(results):
        assert files == files2 >= 2, (rank, files, files2)
        if rank == 0:
            continue  # the coordinator also takes the lease and commits
        assert Counter(first) == stage_model(1, files), (rank, first)
        assert Counter(steady) == stage_model(1, files, unchanged=copied), (rank, steady, copied)
        for counts in (first, steady):
            assert "GetObject" not in counts and "DeleteObjects" not in counts, (rank, counts)
            assert counts["PutObject"] + counts.get("CopyObject", 0) == files + 1, counts
    coordinator = Counter(results[0][1][0]) - stage_model(
        1, results[0][1][1], unchanged=results[0][1][2]
    )
    assert coordinator["ListObjectsV2"] == list_pages(WORLD, results[0][1][1]), coordinator
    assert sum(coordinator.values()) <= 10, coordinator
