"""The explorer's largest scenario ("all": two writers, a pruner and gc), in a file of its own
so that the suite's workers run it beside the other scenarios (test_explore.py).

CI explores it as two spaces: every interleaving with one preemption and no crash, and a
crash at every point of every order of whole actors. Their product, a crash in every
one-preemption interleaving (17,983 schedules, about 90 s on 2 cores), is the scenario's full
bound: ``PYTHONPATH=tests python -m harness.explore --scenario all``. Each actor's crash
against every one- and two-preemption interleaving with one other actor is explored in CI by
the smaller scenarios (test_explore.py).
"""

from __future__ import annotations

import pytest

from harness import explore as ex

SPACES = {
    "one preemption, no crash": (ex.Bounds(preemptions=1, crashes=0), 1000),
    "a crash anywhere, whole actors": (ex.Bounds(preemptions=0, crashes=1), 300),
}
"""Each space's bound, and a floor well below today's count (1,295 and 372)."""


@pytest.mark.slow
@pytest.mark.parametrize("space", SPACES)
def test_two_writers_pruner_and_gc_hold_every_invariant(space: str) -> None:
    bounds, floor = SPACES[space]
    result = ex.explore("all", bounds)
    assert not result.failures, "\n\n".join(f.render() for f in result.failures)
    assert not result.truncated
    assert result.schedules >= floor, result.schedules
