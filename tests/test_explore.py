"""The deterministic interleaving explorer (harness.explore) and its self-tests.

Each scenario runs at its CI bound (scenarios.py: 2 preemptions for most, 1 for the larger
ones; at most one crash everywhere) and must hold every invariant while exploring at least a
known number of schedules, so the test cannot pass by exploring nothing (the defects the
scenarios found are regression tests in test_explorer_findings.py).
The self-tests feed the explorer deliberately broken actors and check that it names the
invariant they break (those between a store's two tiers included), that its bound counts what
it says, that ``after`` orders actors, that a crash stops cleanup code from touching storage,
and that runs are reproducible.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import json
import re
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest

from ckptstore.domain import layout
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.environment import current_environment
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry, Manifest, encode_tombstone
from ckptstore.protocol.lease_record import LeaseRecord, Process
from ckptstore.protocol.step_index import StepIndex
from harness import explore as ex
from harness.cleanup import rolled_forward
from harness.invariants import closed_left_durable, payload_key
from harness.scenarios import SCENARIOS, Scenario, World
from harness.scheduled_backend import ScheduledBackend
from harness.scheduler import (
    Actor,
    Choice,
    ExplorerError,
    InlineExecutor,
    Scheduler,
    explorer_pool,
)

MIN_SCHEDULES = {
    "same-step": 400,
    "two-steps": 300,
    "prune": 500,
    "gc": 150,
    "gc-leased": 250,
    "zombie": 700,
    "takeover-release": 100,
    "removal": 350,
    "coordinated": 500,
    "coordinated-discard": 800,
    "takeover-gc": 800,
    "fenced-gc": 700,
    "tiers": 35,
}
"""Well below today's counts (4170, 3305, 2769, 573, 736, 5132, 456, 2458, 2057, 2122, 2599,
2889 and 57): the code under test may gain or lose an operation, but a run that explores far
fewer is not the one CI needs ("all" is test_explore_all.py's)."""


def _check(name: str) -> None:
    result = ex.explore(name)
    assert not result.failures, "\n\n".join(f.render() for f in result.failures)
    assert not result.truncated
    assert result.schedules >= MIN_SCHEDULES[name], result.schedules


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "all"])
def test_scenario_holds_every_invariant(name: str) -> None:
    _check(name)


def test_cli_prints_counts_and_the_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert ex.main(["--scenario", "gc", "--preemptions", "0"]) == 0
    out = capsys.readouterr().out
    count = re.search(r"^gc +(\d+) schedules", out, re.MULTILINE)
    assert count is not None and int(count.group(1)) > 0, out
    assert re.search(
        rf"^explored {count.group(1)} schedules of 1 scenario "
        r"\(preemption bound 0, <=1 crash\): all invariants held$",
        out,
        re.MULTILINE,
    ), out


# -- self-tests: broken toy actors are caught, under the invariant they break --------------------


def _toy(
    actors: Callable[[World], list[Actor]], prepare: Callable[[World], None] | None = None
) -> Scenario:
    return Scenario("toy", "a deliberately broken actor", actors, prepare)


def _committed_step_1(w: World) -> None:
    w.setup_save(w.store(lease=False), 1, {"step": 1})


def _manifest_before_payload(w: World) -> list[Actor]:
    data = b"payload"
    crc = Crc32c()
    crc.update(data)
    entry = FileEntry("blob.bin", len(data), crc.hexdigest())
    env = current_environment(world_size=1)
    manifest = Manifest(5, 0.0, KIND_DIRECTORY, (entry,), env, "toy")

    def sloppy() -> None:
        w.backend.create(layout.manifest_path(5), manifest.encode())
        w.backend.write(payload_key(5, entry), [data])

    return [Actor("sloppy", sloppy)]


def _gc_deleting_a_manifest(w: World) -> list[Actor]:
    return [Actor("gc", lambda: w.backend.delete([layout.manifest_path(1)]), role="gc")]


def _writer_deleting_a_step(w: World) -> list[Actor]:
    return [Actor("writer", lambda: w.backend.delete([layout.manifest_path(1)]))]


def _pointer(w: World, **changes: object) -> bytes:
    body = json.loads(w.backend.read(layout.LATEST_NAME))
    return json.dumps({**body, **changes}).encode()


def _pointer_backwards(w: World) -> list[Actor]:
    w.setup_save(w.store(lease=False), 2, {"step": 2})
    back = _pointer(w, step=1, manifest=layout.manifest_path(1))
    return [Actor("writer", lambda: w.backend.write(layout.LATEST_NAME, [back]))]


def _fenced_pointer_move(w: World) -> list[Actor]:
    stale = _pointer(w, epoch=1)

    def zombie() -> None:
        w.backend.write(layout.LEASE_NAME, [_lease(2, "b")])
        w.backend.write(layout.LATEST_NAME, [stale])

    return [Actor("zombie", zombie)]


@pytest.mark.parametrize(
    ("actors", "prepare", "invariant"),
    [
        (_manifest_before_payload, None, "committed-step-whole"),
        (_gc_deleting_a_manifest, _committed_step_1, "gc-spares-committed"),
        (_writer_deleting_a_step, _committed_step_1, "retention-deletes-safely"),
        (_pointer_backwards, _committed_step_1, "latest-moves-forward"),
        (_fenced_pointer_move, _committed_step_1, "fenced-writer-never-moves-latest"),
    ],
)
def test_a_broken_actor_is_caught(
    actors: Callable[[World], list[Actor]],
    prepare: Callable[[World], None] | None,
    invariant: str,
) -> None:
    result = ex.explore(_toy(actors, prepare), ex.Bounds(preemptions=0, crashes=0))
    assert [f.violation.invariant for f in result.failures] == [invariant]
    failure = result.failures[0]
    assert f"<== {invariant}" in "\n".join(failure.trace)
    again = ex.replay(_toy(actors, prepare), failure.choices)
    assert again is not None and again.violation == failure.violation


# -- self-tests: the lease, removal and cleanup invariants of issue 19 --------------------------


def _lease(epoch: int, holder: str, *, released: bool = False) -> bytes:
    record = LeaseRecord.new(epoch, f"host:1:{holder}", Process("host", 1), 0.0, 60.0)
    return replace(record, released=released).encode()


def _lease_at_epoch_3(w: World) -> None:
    w.backend.write(layout.LEASE_NAME, [_lease(3, "a")])


def _older_epoch(w: World) -> list[Actor]:
    return [Actor("late", lambda: w.backend.write(layout.LEASE_NAME, [_lease(2, "b")]))]


def _fenced_release(w: World) -> list[Actor]:
    def takeover_then_release() -> None:
        w.backend.write(layout.LEASE_NAME, [_lease(4, "b")])  # b takes the lease from a
        w.backend.write(layout.LEASE_NAME, [_lease(3, "a", released=True)])  # a "releases"

    return [Actor("two-jobs", takeover_then_release)]


def _leased_step_1(w: World) -> None:
    with w.store() as job:  # step 1 committed under lease epoch 1
        w.setup_save(job, 1, {"step": 1})


def _pointer_fencing_latest(w: World) -> list[Actor]:
    fenced = _pointer(w, epoch=2, fences=[[2, 0]])  # epoch 2 fences epoch 1's steps above 0
    return [Actor("stamper", lambda: w.backend.write(layout.LATEST_NAME, [fenced]))]


def _committed_steps_1_2_3(w: World) -> None:
    store = w.store(lease=False)
    for step in (1, 2, 3):
        w.setup_save(store, step, {"step": step})


def _half_removal(w: World) -> list[Actor]:
    tombstone = encode_tombstone("rm", 0.0, ["0" * 16], committed=True)
    return [
        Actor("rm", lambda: w.backend.write(layout.manifest_path(2), [tombstone]), "pruner"),
        Actor("pruner", lambda: None, "pruner", after=("rm",)),  # a finisher that did nothing
    ]


def _stray_object_then_gc(w: World) -> list[Actor]:
    return [
        Actor("writer", lambda: w.backend.write("global_step_9/stray.bin", [b"x"])),
        Actor("gc", lambda: None, "gc", after=("writer",)),  # a gc that removed nothing
    ]


@pytest.mark.parametrize(
    ("actors", "prepare", "invariant"),
    [
        (_older_epoch, _lease_at_epoch_3, "lease-epoch-never-goes-back"),
        (_fenced_release, _lease_at_epoch_3, "fenced-writer-never-writes-lease"),
        (_pointer_fencing_latest, _leased_step_1, "latest-never-fenced"),
        (_stray_object_then_gc, _leased_step_1, "gc-leaves-only-committed"),
    ],
)
def test_a_broken_lease_or_cleanup_is_caught(
    actors: Callable[[World], list[Actor]],
    prepare: Callable[[World], None],
    invariant: str,
) -> None:
    result = ex.explore(_toy(actors, prepare), ex.Bounds(preemptions=0, crashes=0))
    assert [f.violation.invariant for f in result.failures] == [invariant]


def test_an_unfinished_removal_is_caught() -> None:
    toy = Scenario(
        "toy", "a removal nobody finishes", _half_removal, _committed_steps_1_2_3,
        final=(rolled_forward(2, ["pruner"]),),
    )  # fmt: skip
    result = ex.explore(toy, ex.Bounds(preemptions=0, crashes=0))
    assert [f.violation.invariant for f in result.failures] == ["removal-rolled-forward"]
    assert "the removal's tombstone" in result.failures[0].violation.message


def test_gc_is_judged_only_where_it_ran_last_with_no_live_writer() -> None:
    """The same stray object, but gc may start before the writer ends: only the schedule
    that runs gc last is judged; with a live lease, none is."""

    def concurrent(w: World) -> list[Actor]:
        return [replace(a, after=()) for a in _stray_object_then_gc(w)]

    result = ex.explore(_toy(concurrent, _leased_step_1), ex.Bounds(1, 0), keep_going=True)
    assert [f.violation.invariant for f in result.failures] == ["gc-leaves-only-committed"]
    assert result.schedules == 3  # gc first, gc between the writer's start and write, gc last
    assert result.failures[0].schedule == ("writer", "writer", "gc")

    def live(w: World) -> None:
        _leased_step_1(w)
        w.store().hold_lease()

    result = ex.explore(_toy(_stray_object_then_gc, live), ex.Bounds(0, 0))
    assert result.failures == []


def test_a_resume_that_loads_a_state_nobody_saved_is_caught() -> None:
    def forgetful(w: World) -> list[Actor]:  # step 1 holds a state no writer saved
        w.saved[1] = [{"step": 1, "tag": "never saved"}]
        return []

    result = ex.explore(_toy(forgetful, _committed_step_1), ex.Bounds(0, 0))
    assert [f.violation.invariant for f in result.failures] == ["resume-loads-a-saved-state"]


# -- self-tests: the invariants between a store's two tiers (scenario tiers) ----------------------


def _tiered_step_1(w: World) -> None:
    with w.tiered_store() as job:  # step 1 in both tiers, the lease released
        w.setup_save(job, 1, {"step": 1})


def _empty_step(step: int, writer: str, epoch: int = 0) -> Manifest:
    """A committed directory step with no files: whole wherever its manifest is."""
    env = current_environment(world_size=1)
    return Manifest(step, 0.0, KIND_DIRECTORY, (), env, writer, lease_epoch=epoch)


def _two_manifests(w: World) -> list[Actor]:
    w.expect(2, {})

    def commit_twice() -> None:  # each announced in its tier's step index, as writers do
        StepIndex(w.local).announce(2, "local-writer")
        w.local.create(layout.manifest_path(2), _empty_step(2, "local-writer").encode())
        StepIndex(w.backend).announce(2, "durable-writer")
        w.backend.create(layout.manifest_path(2), _empty_step(2, "durable-writer").encode())

    return [Actor("sloppy", commit_twice)]


def _persisted_then_fenced(w: World) -> list[Actor]:
    w.expect(2, {})
    manifest = _empty_step(2, "host:1:zombie", epoch=1).encode()

    def persist_then_fence() -> None:  # step 2 committed locally, persisted, then fenced
        w.local.create(layout.manifest_path(2), manifest)
        w.backend.create(layout.manifest_path(2), manifest)
        fenced = _pointer(w, epoch=5, fences=[[5, 1, "host:1:zombie"]])
        w.backend.write(layout.LATEST_NAME, [fenced])

    return [Actor("stamper", persist_then_fence)]


def _local_step_nobody_saved(w: World) -> list[Actor]:
    step = _empty_step(2, "host:1:a").encode()
    return [Actor("sloppy", lambda: w.local.create(layout.manifest_path(2), step))]


def _closed_with_a_local_step(w: World) -> list[Actor]:
    w.expect(2, {})
    step = _empty_step(2, "host:1:a").encode()
    return [Actor("next", lambda: w.local.create(layout.manifest_path(2), step))]


@pytest.mark.parametrize(
    ("actors", "invariant"),
    [
        (_two_manifests, "tier-copies-identical"),
        (_persisted_then_fenced, "persisted-never-fenced"),
        (_local_step_nobody_saved, "tiered-latest"),
        (_closed_with_a_local_step, "closed-writer-left-its-step-durable"),
    ],
)
def test_a_broken_tier_is_caught(actors: Callable[[World], list[Actor]], invariant: str) -> None:
    toy = Scenario(
        "toy", "a deliberately broken tier", actors, _tiered_step_1,
        final=(closed_left_durable("next"),),
    )  # fmt: skip
    result = ex.explore(toy, ex.Bounds(preemptions=0, crashes=0))
    assert [f.violation.invariant for f in result.failures] == [invariant]


def _fenced_writers_local_step_removed(w: World, *, fence: bool) -> list[Actor]:
    """A writer fenced beside the new holder commits step 2 in the local tier and moves its
    ``latest`` there; the new holder (``fence``: whose takeover fenced it) removes it."""
    zombie = "host:1:zombie"
    step = _empty_step(2, zombie, epoch=1).encode()
    body = json.loads(w.local.read(layout.LATEST_NAME))
    moved = json.dumps({**body, "step": 2, "manifest": layout.manifest_path(2)}).encode()

    def run() -> None:
        if fence:
            w.backend.write(layout.LATEST_NAME, [_pointer(w, epoch=5, fences=[[5, 1, zombie]])])
        w.local.create(layout.manifest_path(2), step)
        w.local.write(layout.LATEST_NAME, [moved])
        w.local.delete([layout.manifest_path(2)])

    return [Actor("holder", run)]


@pytest.mark.parametrize(
    ("fence", "invariants"), [(True, []), (False, ["retention-deletes-safely"])]
)
def test_a_local_tier_is_fenced_by_the_durable_pointer(fence: bool, invariants: list[str]) -> None:
    """The local tier has no fences of its own: a fenced writer's step there (which its
    ``latest`` may name) is judged by the durable pointer's, and its removal is no prune."""
    build = functools.partial(_fenced_writers_local_step_removed, fence=fence)
    toy = Scenario("toy", "a fenced writer's local step", build, _tiered_step_1)
    result = ex.explore(toy, ex.Bounds(preemptions=0, crashes=0))
    assert [f.violation.invariant for f in result.failures] == invariants


def test_a_local_tiers_protocol_is_judged_by_its_own_checker() -> None:
    """A manifest committed in the local tier before its files breaks committed-step-whole
    there, named as the local tier's; the same paths in the store's would be judged there."""
    result = ex.explore(_toy(_local_manifest_before_payload), ex.Bounds(0, 0))
    assert [f.violation.invariant for f in result.failures] == ["committed-step-whole"]
    failure = result.failures[0]
    assert failure.violation.message.startswith("in the local tier: step 5")
    assert "local:global_step_5/ckptstore.manifest.json" in "\n".join(failure.trace)


def _local_manifest_before_payload(w: World) -> list[Actor]:
    data = b"payload"
    crc = Crc32c()
    crc.update(data)
    entry = FileEntry("blob.bin", len(data), crc.hexdigest())
    manifest = Manifest(5, 0.0, KIND_DIRECTORY, (entry,), current_environment(world_size=1), "t")

    def sloppy() -> None:
        w.local.create(layout.manifest_path(5), manifest.encode())
        w.local.write(payload_key(5, entry), [data])

    return [Actor("sloppy", sloppy)]


def test_a_background_copy_runs_when_its_store_waits() -> None:
    """The persister's thread, during an exploration: its task runs in the thread that waits
    for it, after the tasks queued before it, and never if nobody waits."""
    ran: list[int] = []
    pool = explorer_pool(1, thread_name_prefix="ckpt-persist")
    first, second = (pool.submit(ran.append, n) for n in (1, 2))
    pool.submit(ran.append, 3)
    assert ran == []
    second.result()
    assert ran == [1, 2] and first.done()
    assert isinstance(explorer_pool(4, thread_name_prefix="ckpt-write"), InlineExecutor)


# -- self-tests: the bound, crashes, determinism ---------------------------------------------------


def _two_writers_of_two_objects(w: World) -> list[Actor]:
    def writer(name: str) -> Callable[[], None]:
        def run() -> None:
            for i in range(2):
                w.backend.write(f"{name}/{i}", [b"x"])

        return run

    return [Actor("a", writer("a")), Actor("b", writer("b"))]


@pytest.mark.parametrize(
    ("preemptions", "schedules"), [(0, 2), (1, 6), (2, 14), (3, 18), (4, 20), (5, 20)]
)
def test_the_preemption_bound_counts_involuntary_switches_only(
    preemptions: int, schedules: int
) -> None:
    """Two actors, each a start and two writes: of the 20 interleavings, 2 need no
    preemption, 4 one, 8 two, 4 three and 2 four; switching when an actor has finished is
    free."""
    scenario = _toy(_two_writers_of_two_objects)
    result = ex.explore(scenario, ex.Bounds(preemptions=preemptions, crashes=0))
    assert (result.schedules, result.failures) == (schedules, [])


def test_an_actor_starts_only_after_those_it_runs_after() -> None:
    """``c`` runs after ``a``: of the 2 actors' 20 interleavings with ``b``... ``c`` is
    offered only once ``a`` ended, in every schedule, and never counts as a preemption."""
    ended: list[str] = []

    def ordered(w: World) -> list[Actor]:
        ended.clear()
        toys = _two_writers_of_two_objects(w)

        def a() -> None:
            toys[0].run()
            ended.append("a")

        def c() -> None:
            if "a" not in ended:
                raise AssertionError("c started before a ended")
            w.backend.write("c", [b"x"])

        return [Actor("a", a), toys[1], Actor("c", c, after=("a",))]

    result = ex.explore(_toy(ordered), ex.Bounds(preemptions=0, crashes=0))
    assert result.failures == []
    assert result.schedules == 3  # a b c, b a c, a c b: whole actors, c never before a ends


def test_an_actor_after_an_unknown_one_is_an_error() -> None:
    def unordered(w: World) -> list[Actor]:
        return [Actor("c", lambda: None, after=("a",)), Actor("a", lambda: None)]

    with pytest.raises(ExplorerError, match="not listed before it"):
        ex.explore(_toy(unordered), ex.Bounds(preemptions=0, crashes=0))


def test_a_crash_can_strike_before_each_write_of_each_actor() -> None:
    """No preemption: 2 orders; each order has 4 writes to crash before (a crash before an
    actor's first write also leaves the other to run alone)."""
    result = ex.explore(_toy(_two_writers_of_two_objects), ex.Bounds(preemptions=0, crashes=1))
    assert (result.schedules, result.failures) == (2 + 2 * 4, [])


def test_a_crashed_actor_cannot_clean_up() -> None:
    scheduler = Scheduler()
    backend = ScheduledBackend(scheduler)

    def careful() -> None:
        backend.write("a", [b"1"])
        try:
            backend.write("b", [b"2"])
        except BaseException:
            backend.delete(["a"])  # a SIGKILL runs no cleanup: neither may this
            raise

    choices = iter([Choice("x"), Choice("x"), Choice("x", crash=True)])  # start, a, b
    scheduler.run([Actor("x", careful)], lambda enabled, last: next(choices))
    assert set(backend.objects) == {"a"}
    assert [(e.op, e.outcome) for e in scheduler.events] == [
        ("start", ""),
        ("write", "1"),
        ("write", "killed"),
        ("end", "killed"),
    ]


def test_exploring_twice_explores_the_same_schedules() -> None:
    first, second = (ex.explore("two-steps", ex.Bounds(preemptions=1)) for _ in range(2))
    assert first.schedules == second.schedules > 0
    broken = _toy(_gc_deleting_a_manifest, _committed_step_1)
    runs = [ex.explore(broken, ex.Bounds(preemptions=1), keep_going=True) for _ in range(2)]
    assert runs[0].schedules == runs[1].schedules
    assert [f.choices for f in runs[0].failures] == [f.choices for f in runs[1].failures]


def test_a_run_that_depends_on_more_than_the_choices_is_an_error() -> None:
    calls = itertools.count()

    def moody(w: World) -> list[Actor]:
        writes = 2 - next(calls) % 2  # two writes in one run, one in the next

        def run() -> None:
            for i in range(writes):
                w.backend.write(f"m/{i}", [b"x"])

        return [Actor("moody", run), Actor("steady", lambda: w.backend.write("s", [b"x"]))]

    with pytest.raises(ExplorerError, match="diverged"):
        ex.explore(_toy(moody), ex.Bounds(preemptions=2, crashes=0))


def test_store_thread_pools_are_real_again_after_exploring() -> None:
    ex.explore("gc", ex.Bounds(preemptions=0, crashes=0))
    pools = {
        name: vars(module).get("ThreadPoolExecutor")
        for name, module in list(sys.modules.items())
        if name.startswith("ckptstore.") and "ThreadPoolExecutor" in vars(module)
    }
    assert pools["ckptstore.protocol.commit"] is concurrent.futures.ThreadPoolExecutor
    assert {name for name, pool in pools.items() if pool is InlineExecutor} == set()
