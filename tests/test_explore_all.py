"""The explorer's largest scenario ("all": two writers, a pruner, gc and a crash; over 10,000
schedules), in a file of its own so that the suite's workers run it beside the other scenarios
(test_explore.py) rather than after them."""

from __future__ import annotations

import pytest

from test_explore import _check


@pytest.mark.slow
def test_two_writers_pruner_gc_and_a_crash_hold_every_invariant() -> None:
    _check("all")
