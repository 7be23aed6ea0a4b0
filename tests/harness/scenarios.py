"""What the explorer explores: scenarios of actors over one in-memory store, and their world.

A :class:`World` is one schedule's universe (a fresh scheduled backend, a second one for a
local tier, the stores opened on them, the states written); a :class:`Scenario` builds its
actors (writers, a pruner, gc, a zombie writer and its replacement, a tiered writer killed
while persisting and the next one) and optionally a setup restored before each schedule. Kept
apart from explore.py, which only enumerates schedules, so adding a scenario touches nothing
else.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

from ckptstore.backends.base import Backend
from ckptstore.data.background import Abandon
from ckptstore.data.payload import SourceFile
from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import FencedError
from ckptstore.store import CheckpointStore
from harness.cleanup import Final, rolled_forward
from harness.invariants import closed_left_durable, same_state
from harness.jobs import CoordinatedJob
from harness.scheduled_backend import ScheduledBackend
from harness.scheduler import Actor, Scheduler


class World:
    """One schedule's universe: a backend, its scheduler, stores, and the states saved; and a
    second backend, the local tier a tiered store (:meth:`tiered_store`) puts in front of it
    (every node's, as though one node's disk: whoever opens the store there sees the same)."""

    def __init__(self) -> None:
        self.scheduler = Scheduler()
        self.backend = ScheduledBackend(self.scheduler)
        self.local = ScheduledBackend(self.scheduler, "local")
        """The local tier's storage, untouched unless a scenario opens a tiered store."""
        self.saved: dict[int, list[Any]] = {}
        """Every state some writer saves, by step: what a resume may return."""
        self.stores: list[CheckpointStore] = []
        """Kept alive for the run: a store that is collected releases its lease, a call."""
        self.resumed: list[CheckpointInfo] = []
        """The steps writers resumed from (``load()``), judged at the end of the run."""

    def restore(self, other: World) -> None:
        """Start from ``other``'s storage, logical time and saved states."""
        for mine, theirs in ((self.backend, other.backend), (self.local, other.local)):
            mine.objects = dict(theirs.objects)
            mine.versions = theirs.versions
        self.scheduler.time = other.scheduler.time
        self.saved = {step: list(states) for step, states in other.saved.items()}

    def store(self, **options: Any) -> CheckpointStore:
        """A store on this backend and logical clock, with no lease heartbeat thread."""
        options.setdefault("lease_ttl", math.inf)
        store = CheckpointStore(
            self.backend.uri, backend=self.backend, clock=self.scheduler.clock, **options
        )
        _skip_idle_costs(store)
        self.stores.append(store)
        return store

    def tiered_store(self, **options: Any) -> CheckpointStore:
        """A store with :attr:`local` as its local tier (``local=`` names it; the store opens
        it through the backend registry, which hands it this world's backend)."""
        from ckptstore import wiring

        def open_local(uri: str, storage_options: Any = None) -> Backend:
            assert uri == self.local.uri, uri
            return self.local

        with mock.patch.object(wiring, "open_backend", open_local):
            return self.store(local=self.local.uri, **options)

    def expect(self, step: int, state: Any) -> Any:
        """Record that some writer saves ``state`` as ``step``."""
        self.saved.setdefault(step, []).append(state)
        return state

    def saver(self, store: CheckpointStore, step: int, state: Any) -> Callable[[], object]:
        """An actor that saves ``state`` as ``step``."""
        self.expect(step, state)
        return lambda: store.save(step, state).step

    def setup_save(self, store: CheckpointStore, step: int, state: Any) -> None:
        self.saver(store, step, state)()


_ENVIRONMENT: list[Any] = []


def _skip_idle_costs(store: CheckpointStore) -> None:
    """Spare each store the environment probe (tens of ms, the same answer for every store in
    this process) and the backoff sleeps after lost races (they cannot change who runs next);
    the waits for a tombstone being dropped run on the logical clock."""
    own = vars(store)
    if own.get("_environment", False) is None:
        if not _ENVIRONMENT:
            from ckptstore.domain.environment import current_environment

            _ENVIRONMENT.append(current_environment(world_size=1))
        own["_environment"] = _ENVIRONMENT[0]
    local = own.get("_local")  # a local tier's engines too (tiers/local.py)
    for committer, catalog in (
        (own.get("_committer"), own.get("_catalog")),
        (getattr(local, "committer", None), getattr(local, "catalog", None)),
    ):
        remover = getattr(committer, "remover", None)
        tombstones = getattr(remover, "tombstones", None)
        for helper in (committer, catalog, remover, tombstones):
            if helper is not None and "sleep" in vars(helper):
                vars(helper)["sleep"] = lambda seconds: None
        if remover is not None:  # a tombstone's drop window on the logical clock (tombstones.py)
            remover.monotonic = remover.tombstones.monotonic = remover.clock


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    build: Callable[[World], list[Actor]]
    """Creates the actors (and any setup that needs their stores): not explored."""
    prepare: Callable[[World], None] | None = None
    """Setup that leaves only storage behind: run once, restored for each schedule."""
    preemptions: int = 2
    """The preemption bound CI runs it with."""
    final: tuple[Final, ...] = ()
    """Checks of the run's outcome that only this scenario's actors make meaningful
    (cleanup.py); gc-leaves-only-committed and the resume check apply to every scenario."""


def _state(step: int, tag: int) -> dict[str, Any]:
    return {"step": step, "tag": tag}


def _tensor_state(step: int, tag: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((2,), float(tag)), "step": step}  # two files: a shard, a skeleton


def _one_step(w: World) -> None:
    w.setup_save(w.store(lease=False), 1, _state(1, 0))


def _two_steps_one_pinned(w: World) -> None:
    setup = w.store(lease=False)
    w.setup_save(setup, 1, _state(1, 0))
    w.setup_save(setup, 2, _state(2, 0))
    setup.pin(1)


def _writer(w: World, name: str, step: int, role: str = "writer", **options: Any) -> Actor:
    """A writer with ``keep_last`` applies retention after its save: it has a pruner's role."""
    store = w.store(**{"lease": False, **options})
    return Actor(name, w.saver(store, step, _state(step, len(w.stores))), role)


def _pruner(w: World) -> Actor:
    return Actor("pruner", w.store(lease=False, keep_last=1).prune, role="pruner")


def _collector(w: World) -> Actor:
    store = w.store(lease=False)
    return Actor("gc", lambda: store.gc(older_than=0), role="gc")


def _steps_released(*steps: int) -> Callable[[World], None]:
    """Setup: a job that used the lease saved ``steps`` and closed (its lease released)."""

    def prepare(w: World) -> None:
        with w.store() as job:
            for step in steps:
                w.setup_save(job, step, _state(step, 0))

    return prepare


SCENARIOS: dict[str, Scenario] = {}


def _scenario(
    name: str,
    title: str,
    prepare: Callable[[World], None] | None = None,
    preemptions: int = 2,
    final: tuple[Final, ...] = (),
) -> Callable[[Callable[[World], list[Actor]]], Callable[[World], list[Actor]]]:
    def register(build: Callable[[World], list[Actor]]) -> Callable[[World], list[Actor]]:
        SCENARIOS[name] = Scenario(name, title, build, prepare, preemptions, final)
        return build

    return register


@_scenario("same-step", "2 writers (lease=False), same step")
def _same_step(w: World) -> list[Actor]:
    return [Actor(f"w{i}", w.saver(w.store(lease=False), 1, _tensor_state(1, i))) for i in (1, 2)]


@_scenario("two-steps", "2 writers (lease=False), steps 1 and 2")
def _two_steps(w: World) -> list[Actor]:
    return [_writer(w, "w1", 1), _writer(w, "w2", 2)]


@_scenario("prune", "writer (keep_last=1) + pruner, step 1 pinned", _two_steps_one_pinned)
def _prune(w: World) -> list[Actor]:
    return [_writer(w, "writer", 3, "pruner", keep_last=1), _pruner(w)]


@_scenario("gc", "writer (lease=False) + gc(older_than=0)", _one_step)
def _gc(w: World) -> list[Actor]:
    return [_writer(w, "writer", 2), _collector(w)]


@_scenario("gc-leased", "writer (leased) + gc(older_than=0)", _one_step)
def _gc_leased(w: World) -> list[Actor]:
    return [_writer(w, "writer", 2, lease=True), _collector(w)]


@_scenario("zombie", "zombie (epoch 2) + replacement (takeover), step 2", _steps_released(1))
def _zombie(w: World) -> list[Actor]:
    zombie = w.store()
    zombie.hold_lease()  # takes the lease a job released after step 1: epoch 2
    theirs = w.expect(2, _state(2, 2))

    def take_over_and_save() -> object:  # opening with takeover=True may write already
        return w.store(takeover=True).save(2, theirs).step

    return [
        Actor("zombie", w.saver(zombie, 2, _state(2, 1))),
        Actor("replacement", take_over_and_save),
    ]


@_scenario("all", "2 writers + pruner + gc", _one_step, preemptions=1)
def _all(w: World) -> list[Actor]:
    return [_writer(w, "w1", 2), _writer(w, "w2", 3), _pruner(w), _collector(w)]


# -- issue 19: takeovers against a live holder, removals rolled forward, coordinated saves --------


def _closing(store: CheckpointStore, run: Callable[[], object]) -> Callable[[], object]:
    """``run``, then ``close()`` whatever happened: a job ends by releasing its lease."""

    def job() -> object:
        try:
            return run()
        finally:
            store.close()

    return job


def _taking_over(w: World, step: int, state: Any) -> Callable[[], object]:
    """Open a store with ``takeover=True`` (which writes already), save, close."""
    w.expect(step, state)

    def job() -> object:
        store = w.store(takeover=True)
        return _closing(store, lambda: store.save(step, state).step)()

    return job


@_scenario(
    "takeover-release",
    "holder saves and releases + takeover saves and releases, step 2",
    _steps_released(1),
    preemptions=1,
)
def _takeover_release(w: World) -> list[Actor]:
    holder = w.store()
    holder.hold_lease()  # a live holder (epoch 2) when the exploration starts
    return [
        Actor("holder", _closing(holder, w.saver(holder, 2, _state(2, 1)))),
        Actor("replacement", _taking_over(w, 2, _state(2, 2))),
    ]


@_scenario(
    "removal",
    "rm step 2 + prune (keep_last=2) + gc, a crash anywhere",
    _steps_released(1, 2, 3),
    preemptions=1,
    final=(rolled_forward(2, ["pruner", "gc"]),),
)
def _removal(w: World) -> list[Actor]:
    remover, pruner = w.store(lease=False), w.store(lease=False, keep_last=2)
    return [
        Actor("rm", lambda: remover.delete(2), role="pruner"),
        Actor("pruner", pruner.prune, role="pruner"),
        _collector(w),
    ]


def _killed_while_staging(w: World) -> None:
    """Setup: a job (lease epoch 1) committed step 1 and died staging step 2."""
    job = w.store()
    w.setup_save(job, 1, _state(1, 0))
    coordinator = job.begin_save(2)
    job.stage_files(2, [SourceFile("partial.bin", lambda: [b"half a save"])], plan=coordinator.plan)


@_scenario(
    "takeover-gc",
    "takeover saves the step a killed job staged + gc(older_than=0)",
    _killed_while_staging,
)
def _takeover_gc(w: World) -> list[Actor]:
    return [Actor("replacement", _taking_over(w, 2, _state(2, 2))), _collector(w)]


class _TakeoverBeforeTheMarker(Abandon):
    """A check that runs right after the coordinator's last renewal and right before its
    manifest: a takeover there is the window a fenced writer's late step comes from."""

    def __init__(self, w: World, step: int) -> None:
        super().__init__(step, w.backend.uri)
        self.world = w

    def check(self) -> None:
        self.world.store(takeover=True)  # fences latest and takes the lease: epoch 2


def _fenced_step_2(w: World) -> None:
    """Setup: a zombie (epoch 1) committed step 1, then step 2 in the round trip after its
    last renewal, while a takeover (epoch 2) fenced it: step 2 is committed and fenced."""
    zombie = w.store()
    w.setup_save(zombie, 1, _state(1, 0))
    begun = zombie.begin_save(2)
    entries = begun.stage_here([SourceFile("late.bin", lambda: [b"a zombie's late step"])])
    with contextlib.suppress(FencedError):  # committed, but it may not move latest
        begun.commit(entries, abandon=_TakeoverBeforeTheMarker(w, 2))


@_scenario(
    "fenced-gc",
    "takeover saves over a fenced writer's step 2 (removing it) + gc(older_than=0)",
    _fenced_step_2,
)
def _fenced_gc(w: World) -> list[Actor]:
    return [Actor("replacement", _taking_over(w, 2, _state(2, 3))), _collector(w)]


def _coordinated(w: World, failing: frozenset[int]) -> list[Actor]:
    coordinator = w.store()
    coordinator.hold_lease()  # the job holds the lease (epoch 2) before the takeover
    ranks = [coordinator, w.store(lease=False)]
    job = CoordinatedJob("job", coordinator, ranks, 2, failing)
    if not failing:
        w.expect(2, job.contents())
    return [*job.actors(), Actor("replacement", _taking_over(w, 2, _state(2, 2)))]


@_scenario(
    "coordinated",
    "2-rank coordinated save (begin, ranks, conclude) + takeover, step 2",
    _steps_released(1),
    preemptions=1,
)
def _coordinated_fenced(w: World) -> list[Actor]:
    return _coordinated(w, frozenset())


@_scenario(
    "coordinated-discard",
    "2-rank coordinated save, rank 1 fails (discard) + takeover, step 2",
    _steps_released(1),
    preemptions=1,
)
def _coordinated_discard(w: World) -> list[Actor]:
    return _coordinated(w, frozenset({1}))


# -- a local tier in front of the store (tiers/local.py) -------------------------------------------

TIERED = {"persist_every": 2, "local_keep_last": 2}
"""Every second local save is due for the durable tier; the local tier keeps 2 steps."""


def _tiered_step_1(w: World) -> None:
    """Setup: a job with a local tier saved step 1 and closed: step 1 in both tiers, the
    lease released."""
    with w.tiered_store(**TIERED) as job:
        w.setup_save(job, 1, _state(1, 0))


def _resuming(w: World, tag: int, **options: Any) -> Callable[[], object]:
    """Open a tiered store, resume from its latest (which must load a state some writer
    saved as that step), save the next step due for the durable tier, close."""

    def job() -> object:
        store = w.tiered_store(**TIERED, **options)

        def resume_and_save() -> int:
            loaded = store.load(with_info=True)
            w.resumed.append(loaded.info)
            step = loaded.info.step
            if not any(same_state(loaded.state, s) for s in w.saved.get(step, ())):
                raise AssertionError(f"resumed from step {step}: {loaded.state!r}, never saved")
            following = step + 1
            state = w.expect(following, _state(following, tag))
            return store.save(following, state, persist=True).step

        return _closing(store, resume_and_save)()

    return job


@_scenario(
    "tiers",
    "tiered writer saves 2, 3 (3 due, persisting), killed anywhere + next writer takes over, "
    "resumes, saves, closes",
    _tiered_step_1,
    final=(closed_left_durable("next"),),
)
def _tiers(w: World) -> list[Actor]:
    first = w.tiered_store(**TIERED)

    def save_and_persist() -> object:
        w.saver(first, 2, _state(2, 1))()  # local only: not due
        w.saver(first, 3, _state(3, 1))()  # due: pinned, its copy queued
        first.wait()  # the copy in flight; a kill anywhere, and the job never closes
        return 3

    return [
        Actor("first", save_and_persist),
        Actor("next", _resuming(w, 2, takeover=True), after=("first",)),
    ]
