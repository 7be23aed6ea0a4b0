"""Retention: the policies as tables of plain values (no storage), then on real stores.

The safety rules (never latest, a pinned step, or a step newer than latest; nothing without a
pointer) are checked against every kind of policy, including user policies that answer
garbage, because they sit outside the policies.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.domain import layout
from ckptstore.domain.manifest import KIND_STATE, Manifest
from ckptstore.domain.retention import (
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLast,
    RetentionPolicy,
    StepRecord,
    metric_value,
    steps_to_delete,
)
from ckptstore.errors import ConfigError
from ckptstore.protocol.step_index import StepIndex
from counting import CountingBackend
from parts import committer_for

STEPS = [10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "latest", "pinned", "deleted"),
    [
        (None, None, 60, [], []),  # no policy keeps everything
        (3, None, 60, [], [10, 20, 30]),
        (1, None, 60, [], [10, 20, 30, 40, 50]),
        (10, None, 60, [], []),
        (None, 20, 60, [], [10, 30, 50]),  # milestones only (latest is a multiple)
        (2, 30, 60, [], [10, 20, 40]),  # union: last two plus multiples of 30
        (2, None, 60, [20], [10, 30, 40]),  # pins survive
        (1, None, 40, [], [10, 20, 30]),  # never latest, never newer than latest
        (1, None, 10, [], []),  # everything newer than latest is someone's in-flight work
        (2, None, None, [], []),  # no latest: cannot tell what a writer needs, keep all
        (1, None, 60, [10, 20, 30, 40, 50], []),
    ],
)
def test_steps_to_delete(
    keep_last: int | None,
    keep_every: int | None,
    latest: int | None,
    pinned: list[int],
    deleted: list[int],
) -> None:
    policy = RetentionPolicy(keep_last, keep_every)
    assert steps_to_delete(policy, STEPS, latest=latest, pinned=pinned) == deleted


def test_latest_pinned_and_newer_are_never_deleted_whatever_the_policy() -> None:
    for keep_last in (1, 2, 5):
        for keep_every in (None, 7, 20):
            for latest in STEPS:
                policy = RetentionPolicy(keep_last, keep_every)
                doomed = steps_to_delete(policy, STEPS, latest=latest, pinned=[30])
                assert latest not in doomed
                assert 30 not in doomed
                assert all(step < latest for step in doomed)


def test_policies_compose_as_plain_values() -> None:
    assert KeepLast(2).keep([1, 2, 3]) == {2, 3}
    assert KeepEvery(2).keep([1, 2, 3, 4]) == {2, 4}
    assert RetentionPolicy(2, 5) == RetentionPolicy(keep_last=2, keep_every=5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_bad_retention_values_are_config_errors(bad: object) -> None:
    with pytest.raises(ConfigError, match="keep_last must be a positive integer"):
        RetentionPolicy(keep_last=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep_every must be a positive integer"):
        RetentionPolicy(keep_every=bad)  # type: ignore[arg-type]


# -- rules that judge records: keep_best, keep_every_seconds, user policies ----------------


def rec(step: int, time: float | None = None, **metadata: Any) -> StepRecord:
    return StepRecord(step, float(step) if time is None else time, metadata)


def best(n: int, mode: str = "min", **options: Any) -> RetentionPolicy:
    return RetentionPolicy(keep_best=n, best_metric="loss", best_mode=mode, **options)


LOSSES = {10: 0.5, 20: 0.2, 30: 0.9, 40: 0.1, 50: 0.4, 60: 0.3}
RECORDS = [rec(step, loss=loss) for step, loss in LOSSES.items()]


@pytest.mark.parametrize(
    ("n", "mode", "latest", "pinned", "deleted"),
    [
        (2, "min", 60, [], [10, 30, 50]),  # the best: 40 (0.1), 20 (0.2); 60 is latest
        (2, "max", 60, [], [20, 40, 50]),  # the best: 30 (0.9), 10 (0.5)
        (1, "min", 30, [], [10, 20]),  # latest 30 is the worst: kept; 40-60 are newer
        (1, "max", 10, [], []),  # latest is the oldest: everything else is newer
        (1, "min", 60, [30], [10, 20, 50]),  # the pinned worst survives
        (10, "min", 60, [], []),
        (1, "min", None, [], []),  # no pointer: nothing
    ],
)
def test_keep_best(
    n: int, mode: str, latest: int | None, pinned: list[int], deleted: list[int]
) -> None:
    assert steps_to_delete(best(n, mode), RECORDS, latest=latest, pinned=pinned) == deleted
    shuffled = random.Random(n).sample(RECORDS, len(RECORDS))
    assert steps_to_delete(best(n, mode), shuffled, latest=latest, pinned=pinned) == deleted


def test_steps_without_a_usable_metric_are_never_among_the_best_and_are_kept() -> None:
    records = [
        rec(1, loss=0.1),
        rec(2),  # no metric at all
        rec(3, loss=math.nan),
        rec(4, loss="0.05"),  # a string, not a number
        rec(5, loss=True),  # a bool is not a score
        rec(6, loss=None),
        rec(7, loss=[0.0]),
        rec(8, loss=0.5),
        rec(9, loss=0.3),
    ]
    rule = KeepBest(1, "loss", "min")
    assert rule.best(records) == {1}
    assert rule.keep(records) == {1, 2, 3, 4, 5, 6, 7}
    assert steps_to_delete(best(1), records, latest=9) == [8]
    # keep_unscored=False leaves them to the other rules (like orbax's
    # keep_checkpoints_without_metrics=False): here keep_last=1 alone
    strict = RetentionPolicy(keep_last=1, custom=(KeepBest(1, "loss", "min", keep_unscored=False),))
    assert steps_to_delete(strict, records, latest=9) == [2, 3, 4, 5, 6, 7, 8]
    # a store where no step has the metric: keep_best deletes nothing
    assert steps_to_delete(best(1), [rec(s) for s in (1, 2, 3)], latest=3) == []


def test_metric_values_and_infinities() -> None:
    meta = {"i": 3, "f": 0.5, "inf": math.inf, "nan": math.nan, "b": False, "s": "1", "n": None}
    assert [metric_value(meta, k) for k in ("i", "f", "inf")] == [3.0, 0.5, math.inf]
    assert [metric_value(meta, k) for k in ("nan", "b", "s", "n", "missing")] == [None] * 5
    records = [rec(1, loss=math.inf), rec(2, loss=0.5), rec(3, loss=-math.inf)]
    assert KeepBest(1, "loss", "min").best(records) == {3}
    assert KeepBest(1, "loss", "max").best(records) == {1}


def test_ties_go_to_the_newer_step_whatever_the_mode() -> None:
    records = [rec(1, loss=0.5), rec(2, loss=0.5), rec(3, loss=0.5), rec(4, loss=0.7)]
    assert KeepBest(2, "loss", "min").best(records) == {2, 3}
    assert KeepBest(2, "loss", "max").best(records) == {3, 4}
    assert KeepBest(1, "loss", "min").best([rec(5, loss=1), rec(6, loss=1.0)]) == {6}
    assert KeepBest(2, "loss", "min").best(records[::-1]) == {2, 3}  # input order is no matter


def test_keep_every_seconds_keeps_one_step_per_interval_from_the_oldest() -> None:
    times = {1: 0, 2: 30, 3: 59, 4: 60, 5: 100, 6: 125, 7: 400}
    records = [rec(step, time) for step, time in times.items()]
    assert KeepEverySeconds(60).keep(records) == {1, 4, 6, 7}
    assert KeepEverySeconds(60).keep(records[::-1]) == {1, 4, 6, 7}
    assert KeepEverySeconds(1000).keep(records) == {1}
    policy = RetentionPolicy(keep_every_seconds=60)
    assert steps_to_delete(policy, records, latest=7) == [2, 3, 5]


def test_pruning_as_steps_come_agrees_with_pruning_once() -> None:
    """Deleting what a time or best rule does not keep never changes what it keeps."""
    policy = RetentionPolicy(
        keep_last=2, keep_every_seconds=60, keep_best=2, best_metric="loss", best_mode="min"
    )
    rng = random.Random(3)
    everything = [rec(step, step * 7.0, loss=rng.random()) for step in range(1, 60)]
    present: list[StepRecord] = []
    for record in everything:
        present.append(record)
        doomed = set(steps_to_delete(policy, present, latest=record.step))
        present = [r for r in present if r.step not in doomed]
    latest = everything[-1].step
    once = set(steps_to_delete(policy, everything, latest=latest))
    assert {r.step for r in present} >= {r.step for r in everything} - once
    assert steps_to_delete(policy, present, latest=latest) == []
    chain = KeepEverySeconds(60).keep(everything)
    assert chain <= {r.step for r in present}


class Returns:
    """A user policy that answers whatever it was given."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def keep(self, steps: list[StepRecord]) -> Any:
        return self.answer


class Raises:
    def keep(self, steps: list[StepRecord]) -> set[int]:
        raise KeyError("val_loss")


class Meddles:
    """Empties the list it is given, then tries to change a step's metadata."""

    def keep(self, steps: list[StepRecord]) -> set[int]:
        steps.clear()
        return set()


class Scribbles:
    def keep(self, steps: list[StepRecord]) -> set[int]:
        steps[0].metadata["loss"] = 0.0  # type: ignore[index]
        return set()


@pytest.mark.parametrize(
    ("answer", "deleted"),
    [
        (set(), [10, 20, 30, 40]),  # keeps nothing: all but latest and newer go
        ({10, 999, -5}, [20, 30, 40]),  # steps that do not exist are ignored
        (set(range(-100, 1000)), []),  # keeps everything
        ([20, 30], [10, 40]),  # any iterable of step numbers
        ((s for s in (10, 40)), [20, 30]),
    ],
)
def test_user_policy_answers(answer: Any, deleted: list[int]) -> None:
    policy = RetentionPolicy(custom=(Returns(answer),))
    assert steps_to_delete(policy, RECORDS, latest=50) == deleted


@pytest.mark.parametrize(
    "answer", [None, 42, {"10"}, {10.0}, {True}, "10", {None}, {10: "yes"}.values()]
)
def test_a_user_policy_answering_garbage_deletes_nothing(answer: Any) -> None:
    policy = RetentionPolicy(keep_last=1, custom=(Returns(answer),))
    with pytest.raises(ConfigError, match=r"retention policy Returns .*nothing was deleted"):
        steps_to_delete(policy, RECORDS, latest=60)


def test_a_user_policy_that_raises_or_scribbles_deletes_nothing() -> None:
    with pytest.raises(ConfigError, match=r"Raises failed \(KeyError: 'val_loss'\)"):
        steps_to_delete(RetentionPolicy(custom=(Raises(),)), RECORDS, latest=60)
    with pytest.raises(ConfigError, match="Scribbles failed"):
        steps_to_delete(RetentionPolicy(custom=(Scribbles(),)), RECORDS, latest=60)
    assert RECORDS[0].metadata == {"loss": 0.5}
    # a policy that empties its list leaves the other rules theirs
    policy = RetentionPolicy(keep_last=2, custom=(Meddles(),))
    assert steps_to_delete(policy, RECORDS, latest=60) == [10, 20, 30, 40]


def test_no_policy_can_delete_latest_a_pinned_or_a_newer_step() -> None:
    rng = random.Random(11)
    for _ in range(500):
        steps = sorted(rng.sample(range(1, 200), rng.randint(0, 15)))
        records = [
            rec(s, rng.uniform(0, 1e4), loss=rng.choice([rng.random(), math.nan, None, "x"]))
            for s in steps
        ]
        latest = rng.choice([None, *steps])
        pinned = rng.sample(steps, min(len(steps), rng.randint(0, 3)))
        answer = set(rng.sample(range(-5, 250), rng.randint(0, 30)))
        options: dict[str, Any] = {"keep_last": rng.choice([None, 1, 3])}
        if rng.random() < 0.5:
            options.update(keep_best=rng.randint(1, 3), best_metric="loss")
            options["best_mode"] = rng.choice(["min", "max"])
        options["keep_every_seconds"] = rng.choice([None, 1.0, 500.0])
        policy = RetentionPolicy(**options, custom=(Returns(answer),))
        doomed = steps_to_delete(policy, records, latest=latest, pinned=pinned)
        if latest is None:
            assert doomed == []
            continue
        assert set(doomed) <= set(steps) - answer - set(pinned)
        assert all(step < latest for step in doomed)


def test_rules_that_judge_records_need_records() -> None:
    with pytest.raises(TypeError, match="pass StepRecords"):
        steps_to_delete(best(1), [10, 20], latest=20)
    assert not RetentionPolicy(keep_last=1, keep_every=2).needs_records
    assert best(1).needs_records
    assert RetentionPolicy(keep_every_seconds=5).needs_records
    assert RetentionPolicy(custom=(Returns(set()),)).needs_records
    assert KeepLast(2).keep(RECORDS) == {50, 60}  # the step rules take records too
    assert KeepEvery(20).keep(RECORDS) == {20, 40, 60}
    nested = RetentionPolicy(custom=(RetentionPolicy(keep_last=1),))  # itself a policy
    assert steps_to_delete(nested, RECORDS, latest=60) == [10, 20, 30, 40, 50]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keep_best": 2}, "keep_best needs best_metric"),
        ({"keep_best": 2, "best_metric": "loss"}, "keep_best needs best_mode"),
        ({"best_metric": "loss"}, "only apply with keep_best"),
        ({"best_mode": "min"}, "only apply with keep_best"),
        ({"keep_best": 2, "best_metric": "loss", "best_mode": "lowest"}, "best_mode must be 'min'"),
        (
            {"keep_best": 0, "best_metric": "loss", "best_mode": "min"},
            "keep_best must be a positive",
        ),
        ({"keep_best": 2.5, "best_metric": "loss", "best_mode": "max"}, "keep_best must be"),
        ({"keep_best": True, "best_metric": "loss", "best_mode": "max"}, "keep_best must be"),
        ({"keep_best": 1, "best_metric": "", "best_mode": "max"}, "best_metric must be"),
        ({"keep_best": 1, "best_metric": 3, "best_mode": "max"}, "best_metric must be"),
        ({"keep_every_seconds": 0}, "keep_every_seconds must be a positive number"),
        ({"keep_every_seconds": -1.5}, "keep_every_seconds must be"),
        ({"keep_every_seconds": math.inf}, "keep_every_seconds must be"),
        ({"keep_every_seconds": math.nan}, "keep_every_seconds must be"),
        ({"keep_every_seconds": "60"}, "keep_every_seconds must be"),
        ({"keep_every_seconds": True}, "keep_every_seconds must be"),
        ({"keep_last": 0, "keep_every_seconds": 5}, "keep_last must be"),
        ({"retention": Returns}, r"pass Returns\(...\), not the class"),
        ({"retention": 3}, "retention must be a policy"),
        ({"retention": [Returns(set()), "keep"]}, "retention must be a policy"),
        ({"retention": lambda steps: set()}, "retention must be a policy"),
    ],
)
def test_bad_retention_options_fail_when_the_store_opens(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointStore(str(tmp_path / "store"), **options)
    assert not (tmp_path / "store").exists()


# -- on stores -------------------------------------------------------------------------------


def save(store: CheckpointStore, step: int, **metadata: Any) -> None:
    store.save(step, {"w": torch.full((4,), float(step))}, metadata)


def steps_of(store: CheckpointStore) -> list[int]:
    return [info.step for info in store.list()]


def test_keep_best_keeps_the_best_the_latest_the_pinned_and_the_unscored(tmp_path: Path) -> None:
    store = CheckpointStore(
        str(tmp_path / "s"), keep_best=2, best_metric="val_loss", best_mode="min", lease=False
    )
    for step, loss in [(1, 0.9), (2, 0.3), (3, None), (4, 0.5), (5, 0.1), (6, 0.2), (7, 0.95)]:
        save(store, step, **({} if loss is None else {"val_loss": loss}))
    # the best two are 5 and 6; 3 has no val_loss; 7 is the worst but latest
    assert steps_of(store) == [3, 5, 6, 7]
    store.pin(7)
    save(store, 8, val_loss=0.15)
    assert steps_of(store) == [3, 5, 7, 8]  # 6 left the best two; pinned 7 stays
    store.unpin(7)
    assert store.prune(dry_run=True) == [7]
    assert steps_of(store) == [3, 5, 7, 8]
    assert store.prune() == [7]
    assert steps_of(store) == [3, 5, 8]


def test_keep_best_max_and_keep_last_compose_by_union(tmp_path: Path) -> None:
    store = CheckpointStore(
        str(tmp_path / "s"),
        keep_last=2,
        keep_best=1,
        best_metric="acc",
        best_mode="max",
        lease=False,
    )
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.4), (4, 0.6), (5, 0.7)]:
        save(store, step, acc=acc)
    assert steps_of(store) == [2, 4, 5]


def test_keep_every_seconds_by_commit_time(tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    store = CheckpointStore(
        str(tmp_path / "s"), keep_every_seconds=3600, keep_last=1, lease=False, clock=lambda: now[0]
    )
    for step in range(1, 11):
        now[0] += 1000  # a save every 1000 s
        save(store, step)
    assert steps_of(store) == [1, 5, 9, 10]  # 1, then the first one 3600 s later, ...; latest


class KeepEvaluated:
    """A user policy: keep the steps whose metadata says they were evaluated."""

    def keep(self, steps: list[StepRecord]) -> set[int]:
        return {r.step for r in steps if r.metadata.get("evaluated")}


def test_a_user_policy_composes_with_keep_last(tmp_path: Path) -> None:
    store = CheckpointStore(
        str(tmp_path / "s"), keep_last=1, retention=KeepEvaluated(), lease=False
    )
    for step in range(1, 8):
        save(store, step, evaluated=step % 3 == 0)
    assert steps_of(store) == [3, 6, 7]
    both = CheckpointStore(
        str(tmp_path / "s"), retention=[KeepEvaluated(), Returns({7})], lease=False
    )
    assert both.prune() == []


def test_a_failing_user_policy_never_fails_a_save_and_deletes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(str(tmp_path / "s"), keep_last=1, retention=Raises(), lease=False)
    with caplog.at_level(logging.ERROR, logger="ckptstore"):
        for step in (1, 2, 3):
            save(store, step)
    assert steps_of(store) == [1, 2, 3]
    assert "retention policy Raises failed" in caplog.text
    with pytest.raises(ConfigError, match="Raises failed"):
        store.prune()
    garbage = CheckpointStore(str(tmp_path / "s"), retention=Returns({"1"}), lease=False)
    with pytest.raises(ConfigError, match="returned '1', not a step number"):
        garbage.prune()
    assert steps_of(store) == [1, 2, 3]


def write_manifest(root: Path, step: int, created: float, **metadata: Any) -> None:
    """A step committed by another writer, which has not moved ``latest`` to it (yet)."""
    environment = CheckpointStore(str(root), lease=False).environment
    manifest = Manifest(step, created, KIND_STATE, (), environment, "other", metadata=metadata)
    StepIndex(LocalBackend(str(root), {})).announce(step, "other")  # as a writer does, first
    target = root / layout.manifest_path(step)
    target.parent.mkdir(parents=True)
    target.write_bytes(manifest.encode())


@pytest.mark.parametrize(
    "options",
    [
        {"keep_best": 1, "best_metric": "loss", "best_mode": "min"},
        {"keep_every_seconds": 1e9},
        {"retention": Returns(set())},  # keeps nothing at all
    ],
)
def test_a_step_newer_than_latest_is_never_deleted(tmp_path: Path, options: dict[str, Any]) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(str(root), lease=False, **options)
    for step, loss in [(1, 0.1), (2, 0.2), (3, 0.3)]:
        save(store, step, loss=loss)
    write_manifest(root, 9, created=0.0, loss=99.0)  # the worst loss, the oldest time
    store.prune()
    assert 3 in steps_of(store) and 9 in steps_of(store)
    assert store.prune() == []


def test_metadata_rules_read_each_manifest_once_per_process(tmp_path: Path) -> None:
    """keep_best reads every manifest at its first prune, then only manifests it has not
    seen: a save reads its previous step's (incremental) and nothing that grows with the
    steps kept."""

    root = tmp_path / "s"
    steps = 200
    for n in range(1, steps + 1):
        write_manifest(root, n, created=float(n), loss=1 / n)
    committer_for(LocalBackend(str(root), {}), writer="seed").advance_latest(steps)
    backend = CountingBackend(LocalBackend(str(root), {}))
    options: dict[str, Any] = {"keep_best": 3, "best_metric": "loss", "best_mode": "min"}
    store = CheckpointStore(str(root), backend=backend, lease=False, keep_every=1, **options)
    assert store.prune() == []
    first = backend.take()
    # the pointer's step, then every announced step (its writer never added it: the first
    # reader does, from its manifest)
    assert first["manifest GET"] == 1 + steps and first["LIST dirs"] == 0, first
    assert store.prune() == []  # the next prune reads only the index
    again = backend.take()
    assert again == Counter({"pointer GET": 1, "index GET": 1, "LIST": 1}), again
    store.save(steps + 1, {"w": torch.ones(2)}, {"loss": 0.0})
    calls = backend.take()
    # the previous step's (incremental); the new one is remembered at its commit. The
    # process's first save also lists the steps once, for any committed past the pointer.
    assert calls["manifest GET"] == 1 and calls["LIST dirs"] == 0, calls


# -- on S3 (moto on 127.0.0.1, from conftest) ------------------------------------------------


def test_retention_by_metric_time_and_user_policy_over_s3(
    s3_uri: str, s3_options: dict[str, Any]
) -> None:
    now = [1_000_000_000.0]

    def opened(clock: Callable[[], float] = lambda: now[0]) -> CheckpointStore:
        return CheckpointStore(
            s3_uri,
            storage_options=s3_options,
            keep_best=1,
            best_metric="loss",
            best_mode="min",
            keep_every_seconds=3600,
            retention=KeepEvaluated(),
            clock=clock,
            lease=False,
        )

    store = opened()
    plan = [(1, 0, 0.5), (2, 1000, 0.2), (3, 2000, 0.9), (4, 4000, 0.3), (5, 5000, None)]
    for step, offset, loss in [*plan, (6, 6000, 0.8)]:
        now[0] = 1_000_000_000.0 + offset
        meta: dict[str, Any] = {"evaluated": step == 3}
        if loss is not None:
            meta["loss"] = loss
        save(store, step, **meta)
    # 1 and 4 are an hour apart, 2 is the best, 3 was evaluated, 5 has no loss, 6 is latest
    assert steps_of(store) == [1, 2, 3, 4, 5, 6]
    store.pin(1)
    fresh = opened()  # another process: reads every manifest once, agrees
    assert fresh.prune() == []
    evaluated_off = CheckpointStore(
        s3_uri,
        storage_options=s3_options,
        keep_best=1,
        best_metric="loss",
        best_mode="min",
        lease=False,
    )
    assert evaluated_off.prune() == [3, 4]  # 1 is pinned, 5 unscored, 6 latest
    assert steps_of(store) == [1, 2, 5, 6]
