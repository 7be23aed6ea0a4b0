"""Retention as a table of plain values: no storage involved."""

from __future__ import annotations

import pytest

from ckptstore.errors import ConfigError
from ckptstore.retention import KeepEvery, KeepLast, RetentionPolicy, steps_to_delete

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
