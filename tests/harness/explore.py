"""Deterministic exploration of interleavings: the real store code, every backend call a choice.

::

    python -m harness.explore [--preemptions K] [--crashes C] [--scenario NAME]

Tests that race threads hit a window by luck. Here the real committer, lease, retention and gc
run as actors over :class:`~harness.scheduled_backend.ScheduledBackend`, where each
backend call parks its actor until the explorer picks who goes next. A schedule is the sequence
of picks. The explorer enumerates a scenario's (scenarios.py) schedules depth first, replaying
each one from scratch (fresh backend and stores, the scenario's setup restored), and checks the
protocol's invariants after every operation (invariants.py, lease_checks.py) and, at the end of
each schedule, what must be left (cleanup.py) and what a fresh store resumes from. A world's
local tier (a second scheduled backend) has a checker of its own; where a run used it, the two
tiers are judged together at its end (``check_tiers``). A store's background thread (a local
tier's copies to the durable tier) runs its copies in its store's actor, when the store waits
for them (scheduler.py's DeferredExecutor).

The bound, CHESS-style (Musuvathi and Qadeer, "Iterative context bounding", PLDI 2007):

* at most K *preemptions* per schedule: switching away from an actor that could go on. An
  actor's start is a point too (what it does before its first call, like gc reading the clock
  for its cutoff, happens when it is picked). Switching when the running actor has finished is
  free, so every actor runs to its end in every schedule: K = 0 covers every order of whole
  actors, K = 1 also every point where one actor can cut into another, and so on. Most
  concurrency bugs need one or two.
* at most C crashes per schedule: an actor killed before one of its writes (the running actor
  at any write, any actor at a free switch); that write and all its later calls raise
  ``Crashed`` and do nothing, as after a SIGKILL. Killing before a read is not offered: it
  leaves the storage that killing before the next write leaves. A killed actor never resumes.

Within the bound the search is exhaustive; no two schedules are merged. Replays must be
deterministic (the same choices offer the same options), or the explorer stops with an error.
A failure prints the invariant, the schedule (the picks) and a trace of the operations.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from ckptstore.domain.manifest import Manifest
from ckptstore.protocol.lease_record import Process
from harness.cleanup import Final, index_agrees, only_committed_left
from harness.invariants import (
    READS,
    WRITES,
    Checker,
    Failure,
    Violation,
    check_tiers,
    forget_decoded,
    in_local_tier,
    short,
    trace,
)
from harness.scenarios import SCENARIOS, Scenario, World
from harness.scheduler import (
    Abandoned,
    Choice,
    Crashed,
    Event,
    ExplorerError,
    inline_thread_pools,
)


@dataclass(frozen=True)
class Bounds:
    """The size of the explored space (see the module docstring)."""

    preemptions: int = 2
    crashes: int = 1
    max_schedules: int = 1_000_000
    """A safety net: stop (``truncated``) after this many schedules."""

    def describe(self) -> str:
        return f"preemption bound {self.preemptions}, <={self.crashes} crash"


@dataclass
class ScenarioResult:
    scenario: str
    bounds: Bounds
    schedules: int = 0
    seconds: float = 0.0
    truncated: bool = False
    failures: list[Failure] = field(default_factory=list)
    """The shortest failing schedule per invariant violated (only the first, by default)."""


class _Replay:
    """One schedule: the given choices first, then always option 0 (keep the running actor)."""

    def __init__(self, prefix: Sequence[int], expected: Sequence[int], bounds: Bounds) -> None:
        self.prefix, self.expected, self.bounds = prefix, expected, bounds
        self.taken: list[int] = []
        self.widths: list[int] = []
        self.labels: list[str] = []
        self.preemptions = self.crashes = 0

    def options(self, enabled: Mapping[str, str], last: str | None) -> list[Choice]:
        """Keep the last actor running, first; then, within the bounds, switch, or crash."""
        keeps = last is not None and last in enabled
        free = [last] if keeps and last is not None else list(enabled)
        runs = [Choice(a) for a in free]
        if keeps and self.preemptions < self.bounds.preemptions:
            runs += [Choice(a) for a in enabled if a != last]
        if self.crashes >= self.bounds.crashes:
            return runs
        return runs + [Choice(a, crash=True) for a in free if enabled[a] in WRITES]

    def choose(self, enabled: Mapping[str, str], last: str | None) -> Choice:
        options = self.options(enabled, last)
        depth = len(self.taken)
        if depth < len(self.expected) and self.expected[depth] != len(options):
            raise ExplorerError(
                f"replay diverged at choice {depth}: {len(options)} options, earlier "
                f"{self.expected[depth]} (schedule {' '.join(self.labels)}): the run depends "
                "on more than the choices (a thread of its own, wall-clock time, randomness)"
            )
        index = self.prefix[depth] if depth < len(self.prefix) else 0
        choice = options[index]
        if choice.crash:
            self.crashes += 1
        elif last in enabled and choice.actor != last:
            self.preemptions += 1
        self.taken.append(index)
        self.widths.append(len(options))
        self.labels.append(choice.label())
        return choice

    def next_prefix(self) -> list[int] | None:
        """The next schedule in depth-first order, or None when the tree is done."""
        for depth in reversed(range(len(self.taken))):
            if self.taken[depth] + 1 < self.widths[depth]:
                return [*self.taken[:depth], self.taken[depth] + 1]
        return None


def explore(
    scenario: Scenario | str, bounds: Bounds | None = None, *, keep_going: bool = False
) -> ScenarioResult:
    """Run every schedule of ``scenario`` within ``bounds`` (default: its CI bound, one crash).

    Stops at the first violation unless ``keep_going``, which keeps the shortest failing
    schedule per invariant.
    """
    scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    bounds = bounds or Bounds(preemptions=scenario.preemptions)
    result = ScenarioResult(scenario.name, bounds)
    started = time.perf_counter()
    prefix: list[int] = []
    expected: list[int] = []
    shortest: dict[str, Failure] = {}
    prepared: dict[str, World] = {}
    with _exploring():
        while True:
            replay = _Replay(prefix, expected, bounds)
            failure = _run(scenario, replay, prepared)
            result.schedules += 1
            if failure is not None:
                name = failure.violation.invariant
                if name not in shortest or failure.ops < shortest[name].ops:
                    shortest[name] = failure
                if not keep_going:
                    break
            following = replay.next_prefix()
            if following is None:
                break
            if result.schedules >= bounds.max_schedules:
                result.truncated = True
                break
            prefix, expected = following, replay.widths[: len(following)]
    result.failures = sorted(shortest.values(), key=lambda f: f.ops)
    result.seconds = time.perf_counter() - started
    return result


def replay(
    scenario: Scenario | str, choices: Sequence[int], bounds: Bounds | None = None
) -> Failure | None:
    """Run one schedule (a Failure's choices, under the bounds it was found with)."""
    scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    with _exploring():
        bounds = bounds or Bounds(preemptions=scenario.preemptions)
        return _run(scenario, _Replay(choices, [], bounds), {})


def _run(scenario: Scenario, replay: _Replay, prepared: dict[str, World]) -> Failure | None:
    world = World()
    checker, local = Checker(world.backend), Checker(world.local, tier="local")
    checker.faster = (local,)  # the local tier's own protocol, judged by its own checker
    local.fenced_by = checker  # by the durable pointer's fences (the local tier has none)
    world.scheduler.observers += [checker.observe, local.observe]
    if scenario.prepare is not None:
        if scenario.name not in prepared:
            prepared[scenario.name] = ready = World()
            scenario.prepare(ready)
        world.restore(prepared[scenario.name])
    actors = scenario.build(world)
    checker.roles.update({a.name: a.role for a in actors})
    local.roles.update({a.name: in_local_tier(a.role) for a in actors})
    setup, first = world.scheduler.time, len(world.scheduler.events)
    world.scheduler.run(actors, replay.choose)
    events = world.scheduler.events[first:]
    violation = (
        checker.violation or local.violation or _after_run(world, checker, scenario.final, events)
    )
    world.scheduler.observers.clear()
    if violation is None:
        return None
    ran = [e.seq for e in events if e.op in READS | WRITES and e.outcome != "killed"]
    if violation.seq >= 0:
        ran = [seq for seq in ran if seq <= violation.seq]
    return Failure(
        scenario.name,
        violation,
        tuple(replay.taken),
        (replay.bounds.preemptions, replay.bounds.crashes),
        tuple(replay.labels),
        trace(events, violation, setup),
        len(ran),
    )


def _after_run(
    world: World, checker: Checker, finals: Sequence[Final], events: Sequence[Event]
) -> Violation | None:
    error = world.scheduler.internal_error
    if isinstance(error, ExplorerError):
        raise error
    if error is not None:
        raise ExplorerError(f"the invariant checker failed: {error!r}") from error
    for actor, failure in world.scheduler.failures.items():
        return Violation("actors-fail-cleanly", f"{actor} raised {short(repr(failure))}", -1)
    for final in (*finals, only_committed_left):
        found = final(checker, events)
        if found is not None:
            return found
    world.scheduler.phase = "resume"
    found = checker.check_resume(world.store(lease=False), world.saved)
    if found is None and world.local.objects:
        tiered, plain = world.tiered_store(lease=False), world.store(lease=False)
        found = check_tiers(
            checker, checker.faster[0], events, tiered, plain, world.saved, world.resumed
        )
    # last: an actor that writes a manifest by hand (a deliberately broken one) breaks the
    # step index too, and what it broke first is the finding
    return found or index_agrees(checker, events)


@contextlib.contextmanager
def _exploring() -> Iterator[None]:
    """Inline thread pools; quiet logs (thousands of runs log their warnings); no report of a
    killed actor's store failing to release its lease when it is collected; this process
    described once (each leased store and each gc would read ``/proc`` for the same answer);
    each manifest's bytes decoded once (:func:`_decoded_once`); and the objects alive before
    the exploration (torch's modules among them) left out of the cyclic garbage collector's
    passes, which the runs' many short-lived objects set off thousands of times."""
    logger = logging.getLogger("ckptstore")
    level, hook = logger.level, sys.unraisablehook
    this_process = Process.current()

    def unraisable(report: Any) -> None:
        if not isinstance(report.exc_value, (Crashed, Abandoned)):
            hook(report)

    logger.setLevel(logging.CRITICAL + 1)
    sys.unraisablehook = unraisable
    described = mock.patch.object(Process, "current", return_value=this_process)
    decoded = mock.patch.object(Manifest, "decode", _decoded_once(Manifest.decode))
    gc.collect()
    gc.freeze()
    try:
        with inline_thread_pools(), described, decoded:
            yield
    finally:
        gc.unfreeze()
        forget_decoded()
        logger.setLevel(level)
        sys.unraisablehook = hook


def _decoded_once(decode: Callable[..., Manifest]) -> classmethod[Manifest, ..., Manifest]:
    """``Manifest.decode`` remembering what each (bytes, where) decoded to: a manifest is
    immutable and decoding is a pure function of its bytes, so every schedule's reads of the
    same bytes get the same object, its canonical encoding (which a listing digests) computed
    once. Errors (a tombstone, garbage) are raised afresh each time."""
    known: dict[tuple[bytes, str], Manifest] = {}

    def decode_once(cls: type[Manifest], data: bytes, *, where: str) -> Manifest:
        key = (bytes(data), where)
        found = known.get(key)
        if found is None:
            found = known[key] = decode(data, where=where)
        return found

    return classmethod(decode_once)


def summary(results: Sequence[ScenarioResult]) -> str:
    """The last line: how many schedules, under which bound, and the verdict."""
    ks = sorted({r.bounds.preemptions for r in results}, reverse=True) or [0]
    text = f"preemption bound {ks[0]}" + "".join(
        f" ({k} for {', '.join(r.scenario for r in results if r.bounds.preemptions == k)})"
        for k in ks[1:]
    )
    crashes = max((r.bounds.crashes for r in results), default=0)
    failed = sum(len(r.failures) for r in results)
    verdict = f"{failed} invariant(s) violated" if failed else "all invariants held"
    scenarios = f"{len(results)} scenario{'s' if len(results) != 1 else ''}"
    return (
        f"explored {sum(r.schedules for r in results)} schedules of {scenarios} "
        f"({text}, <={crashes} crash): {verdict}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.explore", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preemptions", type=int, help="K (default: each scenario's CI bound)")
    parser.add_argument("--crashes", type=int, default=1, help="crashes per schedule (1)")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    parser.add_argument("--keep-going", action="store_true", help="shortest failure per invariant")
    parser.add_argument("--replay", help="run the schedule a failure printed (one --scenario)")
    args = parser.parse_args(argv)
    names = args.scenario or list(SCENARIOS)

    def bounds(name: str) -> Bounds:
        k = SCENARIOS[name].preemptions if args.preemptions is None else args.preemptions
        return Bounds(preemptions=k, crashes=args.crashes)

    if args.replay is not None:
        choices = [int(c) for c in args.replay.split(",") if c]
        failure = replay(names[0], choices, bounds(names[0]))
        print(failure.render() if failure else "the schedule held every invariant")
        return 1 if failure else 0
    results = []
    for name in names:
        result = explore(name, bounds(name), keep_going=args.keep_going)
        results.append(result)
        print(
            f"{name:<10} {result.schedules:>6} schedules {result.seconds:6.1f} s  "
            f"({result.bounds.describe()})  {SCENARIOS[name].title}: "
            f"{'VIOLATION' if result.failures else 'ok'}",
            flush=True,
        )
        for failure in result.failures:
            print(failure.render(), flush=True)
    print(summary(results))
    return 0 if all(not r.failures and not r.truncated for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
