"""A stateful property test: the public API, driven at random, against a model of what must hold.

Hypothesis' rule-based state machine runs sequences of save, save_async (then wait), load,
prune, rm (delete), pin/unpin, gc, takeover and kill on one local store, and after every rule
compares the store with a model small enough to be obviously right: the steps committed and
the state each was saved with, and the pins. What must be true, whatever the sequence:

* ``list()`` shows exactly the model's steps; ``latest()`` is the newest of them (no fenced
  step can arise in a sequential run, so the newest committed step is the newest unfenced one);
* every committed step loads bit-exact what was saved (dtype, shape, bytes);
* retention (after a save, or ``prune``) never deletes latest, a pinned step, a step newer than
  latest, or one of the ``keep_last`` newest;
* after a takeover the old store is fenced: its save raises FencedError, moves nothing, and
  its ``close()`` leaves the new holder's lease record alone; the lease epoch never goes back;
* gc never deletes a committed step, and ``gc(older_than=0)`` with no live writer leaves only
  committed steps' objects (in a store that uses the lease);
* a kill (the writer's backend dies at its n-th next mutating call, as after a SIGKILL, and the
  store object is abandoned) commits the step whole or not at all and loses no step retention
  would not delete; the next writer takes over.

:class:`TieredStoreModel` runs save, load, wait, close and reopen, and kills (also during a
copy, and with the local tier lost) on a store with a local tier, against a model of where
each step is (its docstring).

Deterministic (``derandomize=True``, no example database) and bounded so it runs in a few
seconds in CI; ``CKPTSTORE_MODEL_EXAMPLES`` raises the number of examples for a longer hunt.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ckptstore import CheckpointStore
from ckptstore.backends.registry import open_backend
from ckptstore.domain.environment import current_environment
from ckptstore.domain.manifest import Environment, Manifest
from ckptstore.errors import (
    CheckpointError,
    ConflictError,
    FencedError,
    StepBehindLatestError,
)
from ckptstore.protocol.lease_record import read_lease
from faults import FaultyBackend, InjectedFault
from harness.cleanup import committed_objects, index_paths
from harness.invariants import same_state
from harness.scheduler import inline_thread_pools

KEEP_LAST = 3
EXAMPLES = int(os.environ.get("CKPTSTORE_MODEL_EXAMPLES", "60"))
STEPS_PER_EXAMPLE = 30
SHRINK = os.environ.get("CKPTSTORE_MODEL_SHRINK") == "1"
"""Shrinking a failing 30-rule sequence can outlast CI's per-test timeout, which would hide the
failure itself; by default a failure is reported at once, unshrunk."""


def state_of(step: int, variant: int) -> dict[str, Any]:
    """A small state with three dtypes (bit-exactness is checked per dtype) and plain values."""
    generator = torch.Generator().manual_seed(step * 100 + variant)
    return {
        "w": torch.randn(16, generator=generator),
        "h": torch.randn(4, generator=generator).to(torch.bfloat16),
        "i": torch.arange(step, step + 5, dtype=torch.int64),
        "step": step,
        "variant": variant,
    }


def check_retention(
    before: set[int], after: set[int], *, latest: int, pinned: set[int], keep: int
) -> None:
    """Steps in ``before`` but not ``after`` went by retention (``keep_last=keep``): it may
    delete none that is latest, newer, pinned, or one of the ``keep`` newest."""
    newest = set(sorted(before)[-keep:])
    for step in before - after:
        assert step < latest, f"retention deleted step {step}, not below latest {latest}"
        assert step not in pinned, f"retention deleted pinned step {step}"
        assert step not in newest, f"retention deleted step {step}, one of {sorted(newest)}"


class KillSwitch(FaultyBackend):
    """A backend that dies at its n-th mutating call, writing one file at a time: so the
    n-th call is the same call in every run, and a kill replays exactly."""

    @property
    def parallel_writes(self) -> int:
        return 1


class StoreModel(RuleBasedStateMachine):
    """One store, its current writer, its fenced and dead writers, and the model."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="ckpt-model-"))
        self.uri = str(self.root / "run")
        self.saved: dict[int, Any] = {}
        """The model: every committed step and the state it was saved with."""
        self.pinned: set[int] = set()
        self.epoch = 0
        """The highest lease epoch seen: it never goes back."""
        self.reader = CheckpointStore(self.uri, lease=False)
        """A view of the store of its own, as a job elsewhere resuming from the URI has; it
        forgets the manifests it read before each look (:meth:`_truth`)."""
        self.loaded: dict[int, Manifest] = {}
        """The manifest of each step whose state was last loaded and found as saved."""
        self.zombies: list[CheckpointStore] = []
        """Writers taken over (fenced, closed), kept referenced like the killed ones."""
        self.dead: list[CheckpointStore] = []
        """Killed writers, kept referenced: a collected store would try to release its lease."""
        self.writer, self.switch = self._open()

    def _open(self, *, takeover: bool = False) -> tuple[CheckpointStore, FaultyBackend]:
        """A writer on a backend that can be killed (``fail_at``), using the lease (no
        heartbeat thread: ``lease_ttl=inf``, so nothing runs between rules)."""
        switch = KillSwitch(open_backend(self.uri), fail_at=None, mode="crash")
        store = CheckpointStore(
            self.uri, backend=switch, keep_last=KEEP_LAST, lease_ttl=math.inf, takeover=takeover
        )
        return store, switch

    def _latest(self) -> int | None:
        return max(self.saved, default=None)

    def _next(self, delta: int) -> int:
        return (self._latest() or 0) + delta

    def teardown(self) -> None:
        """Close every writer while the store exists. A killed one's backend comes back to
        life first, so its release runs now (and, its lease taken over, writes nothing)
        rather than failing at interpreter exit."""
        for store in self.dead:
            switch = store.backend
            assert isinstance(switch, FaultyBackend)
            switch.fail_at, switch.fired = None, False
        for store in [self.writer, *self.dead]:
            with contextlib.suppress(CheckpointError):
                store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _retention(
        self, before: set[int], latest: int, after: set[int], keep: int = KEEP_LAST
    ) -> None:
        check_retention(before, after, latest=latest, pinned=self.pinned, keep=keep)

    def _truth(self) -> CheckpointStore:
        """The reader, with no manifest remembered. A long-lived store keeps listing a step
        that another process half removed (its tombstone stands) for as long as the step's
        directory is there (catalog.py): the model is judged against storage, not that."""
        self.reader.reload()
        return self.reader

    def _steps(self) -> set[int]:
        return {i.step for i in self._truth().list()}

    # -- saving ----------------------------------------------------------------------------

    @initialize()
    def first_step(self) -> None:
        self._saved(1, state_of(1, 0), self.writer.save(1, state_of(1, 0)).step)

    def _saved(self, step: int, state: Any, committed: int) -> None:
        assert committed == step
        before = set(self.saved)
        after = self._steps()
        assert step in after, f"step {step} was saved but is not listed"
        assert after <= before | {step}, f"steps {after - before - {step}} appeared"
        self._retention(before | {step}, step, after)
        self.saved = {s: self.saved.get(s, state) for s in after}

    @rule(delta=st.integers(1, 3), variant=st.integers(0, 3))
    def save(self, delta: int, variant: int) -> None:
        step = self._next(delta)
        state = state_of(step, variant)
        self._saved(step, state, self.writer.save(step, state).step)

    @rule(delta=st.integers(1, 3), variant=st.integers(0, 3))
    def save_async(self, delta: int, variant: int) -> None:
        """The snapshot is taken at the call: changing the tensors afterwards changes nothing
        that is saved."""
        step = self._next(delta)
        state = state_of(step, variant)
        expected = copy.deepcopy(state)
        handle = self.writer.save_async(step, state)
        state["w"].add_(1.0)
        self._saved(step, expected, handle.wait().step)

    @precondition(lambda self: self._latest() is not None and self._latest() > 1)
    @rule(data=st.data())
    def save_behind_latest_is_refused(self, data: st.DataObject) -> None:
        """A step behind latest is refused before anything is uploaded: a committed one as
        committed, another as behind latest, also where a kill left ``latest.json`` behind
        latest() (test_explorer_findings.py)."""
        latest = self._latest()
        assert latest is not None
        step = data.draw(st.integers(0, latest - 1), label="older step")
        error = ConflictError if step in self.saved else StepBehindLatestError
        with pytest.raises(error):
            self.writer.save(step, state_of(step, 9))

    # -- reading ---------------------------------------------------------------------------

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.saved)), label="step")
        assert same_state(self.writer.load(step), self.saved[step]), f"step {step} differs"
        latest = self._latest()
        assert latest is not None
        assert same_state(self.reader.load(), self.saved[latest]), "latest differs"

    # -- retention, removal, pins ----------------------------------------------------------

    @rule(keep=st.integers(1, KEEP_LAST), dry_run=st.booleans())
    def prune(self, keep: int, dry_run: bool) -> None:
        """An operator's prune (a store opened for maintenance, no lease), perhaps stricter
        than the writer's retention; ``dry_run`` deletes nothing."""
        before = set(self.saved)
        latest = self._latest()
        deleted = CheckpointStore(self.uri, lease=False, keep_last=keep).prune(dry_run)
        after = self._steps()
        assert after == (before if dry_run else before - set(deleted)), (deleted, after)
        if latest is not None:  # what a dry run would delete obeys the same rules
            self._retention(before, latest, before - set(deleted), keep)
        self.saved = {s: self.saved[s] for s in after}

    def _removable(self) -> list[int]:
        """Steps ``delete`` takes without ``force``: neither pinned nor latest (latest(), also
        where a kill left ``latest.json`` behind it)."""
        return sorted(set(self.saved) - self.pinned - {self._latest()})

    @precondition(lambda self: bool(self._removable()))
    @rule(data=st.data())
    def rm(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(self._removable()), label="step")
        self.writer.delete(step)
        del self.saved[step]

    @precondition(lambda self: self._latest() is not None)
    @rule()
    def rm_latest(self) -> None:
        """Deleting latest needs ``force``; with it, latest goes back to the newest left."""
        latest = self._latest()
        assert latest is not None
        with pytest.raises(ConflictError):
            self.writer.delete(latest)
        self.writer.delete(latest, force=True)
        del self.saved[latest]
        self.pinned.discard(latest)

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.saved)), label="step")
        self.writer.pin(step)
        self.pinned.add(step)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.pinned)), label="step")
        assert self.writer.unpin(step)
        self.pinned.discard(step)

    # -- gc --------------------------------------------------------------------------------

    @rule()
    def gc_beside_the_writer(self) -> None:
        """gc with a live writer deletes no committed step (the invariants check the rest)."""
        self.reader.gc(older_than=0)

    @rule()
    def gc_with_no_live_writer(self) -> None:
        """The writer closes (releasing the lease); then gc(older_than=0) leaves committed
        steps and nothing else; then a new writer opens, no takeover needed."""
        self.writer.close()
        reader = self._truth()
        reader.gc(older_than=0)
        manifests = {i.step: i.manifest for i in reader.list()}
        kept = committed_objects(manifests) | index_paths(reader.backend)
        left = {o.path for o in reader.backend.list("")} - kept
        assert not left, f"gc(older_than=0) with no live writer left {sorted(left)}"
        self.writer, self.switch = self._open()

    # -- writers come and go ---------------------------------------------------------------

    @rule(delta=st.integers(1, 2))
    def takeover(self, delta: int) -> None:
        """A new job takes the store over from a live holder; the old one is fenced for good.
        (A store that never held the lease is not fenced but refused: LeaseHeldError.)"""
        zombie = self.writer
        zombie.hold_lease()
        self.writer, self.switch = self._open(takeover=True)
        before = (self._steps(), self.reader.latest())
        step = self._next(delta)
        with pytest.raises(FencedError):
            zombie.save(step, state_of(step, 7))
        zombie.close()  # a fenced writer's release writes nothing
        after = (self._steps(), self.reader.latest())
        assert after == before, "a fenced writer changed the store"
        record, _, _ = read_lease(self.writer.backend)
        assert record is not None and record.holder == self.writer.writer
        assert not record.released
        self.zombies.append(zombie)

    def _killed(self) -> tuple[set[int], set[int]]:
        """The writer died: abandon it, let a new one take over; the steps before and after."""
        self.dead.append(self.writer)
        self.writer, self.switch = self._open(takeover=True)
        return set(self.saved), self._steps()

    @rule(calls=st.integers(1, 10), delta=st.integers(1, 2))
    def kill_saving(self, calls: int, delta: int) -> None:
        """The writer dies at its ``calls``-th next mutating backend call of a save (nothing
        after it reaches storage, its cleanup included): the step is committed whole or not
        at all, and only retention's victims may be gone."""
        step = self._next(delta)
        state = state_of(step, 5)
        self.switch.fail_at = self.switch.count + calls
        with contextlib.suppress(InjectedFault):
            self.writer.save(step, state)
        before, after = self._killed()
        assert after - before <= {step}, f"steps {after - before - {step}} appeared"
        if before | after:
            self._retention(before | (after - before), max(before | after), after)
        self.saved = {s: self.saved.get(s, state) for s in after}

    @precondition(lambda self: len(self.saved) > 1)
    @rule(calls=st.integers(1, 6), keep=st.integers(1, 2))
    def kill_pruning(self, calls: int, keep: int) -> None:
        """The writer's process dies while it prunes: only retention's victims may be gone."""
        self.switch.fail_at = self.switch.count + calls
        pruner = CheckpointStore(self.uri, backend=self.switch, lease=False, keep_last=keep)
        with contextlib.suppress(InjectedFault):
            pruner.prune()
        before, after = self._killed()
        assert after <= before
        self._retention(before, max(before), after, keep)
        self.saved = {s: self.saved[s] for s in after}

    @precondition(lambda self: bool(self._removable()))
    @rule(calls=st.integers(1, 5), data=st.data())
    def kill_removing(self, calls: int, data: st.DataObject) -> None:
        """The writer dies during an rm: the step is committed whole or gone, nothing else."""
        step = data.draw(st.sampled_from(self._removable()), label="step")
        self.switch.fail_at = self.switch.count + calls
        with contextlib.suppress(InjectedFault):
            self.writer.delete(step)
        before, after = self._killed()
        assert before - after <= {step} and after <= before, f"{before} -> {after}"
        self.saved = {s: self.saved[s] for s in after}

    # -- after every rule ------------------------------------------------------------------

    @invariant()
    def listing_and_latest_match_the_model(self) -> None:
        reader = self._truth()
        assert [i.step for i in reader.list()] == sorted(self.saved)
        latest = reader.latest()
        assert (latest.step if latest is not None else None) == self._latest()
        assert set(reader.pins()) == self.pinned

    @invariant()
    def the_lease_epoch_never_goes_back(self) -> None:
        record, _, _ = read_lease(self.writer.backend)
        if record is not None:
            assert record.epoch >= self.epoch, f"lease epoch {self.epoch} -> {record.epoch}"
            self.epoch = record.epoch

    @invariant()
    def every_committed_step_loads_what_was_saved(self) -> None:
        """Each committed step loads bit-exact once (per manifest: a step number saved anew
        is loaded anew); after that, one listing shows every file it lists still there, the
        same size. Nothing ckptstore does rewrites a file in place, so that is enough."""
        reader = self._truth()
        sizes = {o.path: o.size for o in reader.backend.list("")}
        for info in reader.list():
            if self.loaded.get(info.step) != info.manifest:
                assert same_state(reader.load(info.step), self.saved[info.step]), info.step
                self.loaded[info.step] = info.manifest
            for entry in info.files:
                key = entry.key(info.step)
                assert sizes.get(key) == entry.size, f"step {info.step}: {key} is gone or cut"


def model_settings(examples: int, steps: int) -> settings:
    """Deterministic runs (no database, derandomized), unshrunk unless CKPTSTORE_MODEL_SHRINK."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=tuple(Phase) if SHRINK else (Phase.explicit, Phase.reuse, Phase.generate),
    )


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = model_settings(EXAMPLES, STEPS_PER_EXAMPLE)


# -- the same store with a local tier in front of it (tiers/local.py) ------------------------------

PERSIST_EVERY = 2
LOCAL_KEEP_LAST = 2
TIERED_EXAMPLES = max(1, EXAMPLES // 4)
TIERED_STEPS = 20
FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
"""tmpfs where there is one: the local backend's fsyncs cost nothing there."""


_ENVIRONMENT: list[Environment] = []


def _described(store: CheckpointStore) -> CheckpointStore:
    """Spare the store its environment probe (the same answer for every store here)."""
    if not _ENVIRONMENT:
        _ENVIRONMENT.append(current_environment(world_size=1))
    vars(store)["_environment"] = _ENVIRONMENT[0]
    return store


class TieredStoreModel(RuleBasedStateMachine):
    """One store with a local tier (``persist_every=2``, ``local_keep_last=2``), its writer
    and its killed writers, against a model of where each step is.

    The store's background thread (its copies to the durable tier) runs the copies when the
    store waits for them (``wait()``, ``close()``: harness.scheduler.DeferredExecutor), so
    the model knows which copies ran: none between two waits, all of them at a wait (or
    those before the kill, where the writer dies at its n-th durable write of a wait). Its
    other pools run each task at submission, as in the explorer: one order, no thread to
    start. What must hold, whatever the sequence:

    * ``latest()`` (of a fresh store over both tiers) is the newest step saved, and
      ``load()`` returns it; every step either tier holds loads what was saved as it;
    * a save commits in the local tier; it is due, and pinned there, when ``persist=True``
      or every second save of a writer; the local tier keeps its 2 newest steps plus the
      pinned ones (exactly: the model predicts each tier's steps and the pins);
    * after ``wait()`` every due step is durable (those a killed writer left pinned once
      the next writer wrote), its pin gone, the durable ``latest`` the newest durable step;
    * after ``close()`` of a writer (one that saved, or holds the lease by a takeover), the
      pins a kill left and its last step are durable and ``latest`` there; the local tier
      holds at most 2 steps plus the pinned ones (none);
    * a kill (the store abandoned, perhaps dying at its n-th durable write while copying)
      loses no step that was durable and no local one retention would keep: the next
      writer (``takeover=True``) persists what the kill left pinned; a lost local tier
      (a node replaced) leaves the durable steps;
    * a step both tiers hold has the same manifest in both, and no step is fenced.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pools = contextlib.ExitStack()
        self.pools.enter_context(inline_thread_pools())
        self.root = Path(tempfile.mkdtemp(prefix="ckpt-tiers-", dir=FAST_TMP))
        self.uri, self.local_dir = str(self.root / "durable"), str(self.root / "local")
        self.states: dict[int, Any] = {}
        """The state each step was saved with."""
        self.local: set[int] = set()
        self.durable: set[int] = set()
        self.pinned: set[int] = set()
        """The model: the steps each tier holds committed, and the local tier's pins."""
        self.queued: list[int] = []
        """Copies the writer queued that have not run (they run at its next wait)."""
        self.due: set[int] = set()
        """Steps judged due (by any writer) and committed locally: durable after a wait."""
        self.since = 0
        """The writer's saves since its last due one (``persist_every`` counts them)."""
        self.started = False
        """Whether the writer wrote (its first write persists the pins a kill left)."""
        self.holds = False
        """Whether the writer holds the lease without a write (opened with takeover=True):
        its close() persists the pins a kill left and its newest local step."""
        self.loaded: dict[int, Manifest] = {}
        self.dead: list[CheckpointStore] = []
        self.writer, self.switch = self._open()
        self.durable_reader = _described(CheckpointStore(self.uri, lease=False))
        self.local_reader = _described(CheckpointStore(self.local_dir, lease=False))
        """The local tier read as a store of its own (it has a store's layout)."""
        self.tiered_reader = _described(
            CheckpointStore(self.uri, local=self.local_dir, lease=False)
        )
        """Views of the store of their own, as a job resuming elsewhere has; each forgets
        the manifests it read before each look (:meth:`_readers`)."""

    def _open(self, *, takeover: bool = False) -> tuple[CheckpointStore, FaultyBackend]:
        switch = KillSwitch(open_backend(self.uri), fail_at=None, mode="crash")
        store = CheckpointStore(
            self.uri, backend=switch, local=self.local_dir, persist_every=PERSIST_EVERY,
            local_keep_last=LOCAL_KEEP_LAST, lease_ttl=math.inf, takeover=takeover,
        )  # fmt: skip
        return _described(store), switch

    def _reopen(self, *, takeover: bool) -> None:
        self.writer, self.switch = self._open(takeover=takeover)
        self.queued, self.since, self.started = [], 0, False
        self.holds = takeover

    def teardown(self) -> None:
        for store in self.dead:
            switch = store.backend
            assert isinstance(switch, FaultyBackend)
            switch.fail_at, switch.fired = None, False
        for store in [self.writer, *self.dead]:
            with contextlib.suppress(CheckpointError):
                store.close()
        self.pools.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _latest(self) -> int | None:
        return max(self.local | self.durable, default=None)

    def _readers(self) -> tuple[CheckpointStore, CheckpointStore, CheckpointStore]:
        """The durable tier's reader, the local tier's and the tiered one, each with no
        manifest remembered."""
        readers = (self.durable_reader, self.local_reader, self.tiered_reader)
        for reader in readers:
            reader.reload()
        return readers

    def _truth(self) -> tuple[set[int], set[int], set[int]]:
        """The durable tier's committed steps, the local tier's, and the local pins."""
        durable, local, _ = self._readers()
        return (
            {i.step for i in durable.list()},
            {i.step for i in local.list()},
            set(local.pins()),
        )

    def _retain_locally(self) -> None:
        """The local tier's retention: its 2 newest steps and the pinned ones stay."""
        self.local &= set(sorted(self.local)[-LOCAL_KEEP_LAST:]) | self.pinned

    def _copies_ran(self) -> None:
        """Every queued copy ran and succeeded: durable, unpinned, then local retention."""
        if not self.queued:
            return
        self.durable |= set(self.queued)
        self.pinned -= set(self.queued)
        self.queued = []
        self._retain_locally()

    # -- saving ----------------------------------------------------------------------------

    @initialize()
    def first_step(self) -> None:
        self.save(1, 0, persist=True)
        self.wait()

    @rule(delta=st.integers(1, 3), variant=st.integers(0, 3))
    def save(self, delta: int, variant: int, persist: bool = False) -> None:
        step = (self._latest() or 0) + delta
        state = state_of(step, variant)
        if not self.started:  # the first write: the pins a kill left are persisted
            self.started = True
            self.pinned &= self.local
            self.pinned -= self.durable
            self.queued += sorted(self.pinned - set(self.queued))
        assert self.writer.save(step, state, persist=persist).step == step
        due = persist or self.since + 1 >= PERSIST_EVERY
        self.since = 0 if due else self.since + 1
        self.states[step] = state
        self.local.add(step)
        if due:
            self.pinned.add(step)
            self.queued.append(step)
            self.due.add(step)
        self._retain_locally()

    @rule(delta=st.integers(1, 3), variant=st.integers(0, 3))
    def save_persisting(self, delta: int, variant: int) -> None:
        """``persist=True`` (a final or a preemption save): due whatever the count says."""
        self.save(delta, variant, persist=True)

    @rule()
    def wait(self) -> None:
        self.writer.wait()
        self._copies_ran()
        durable, _, pins = self._truth()
        if self.started:
            assert self.due <= durable, f"due steps {sorted(self.due - durable)} not durable"
            assert not pins, f"steps {sorted(pins)} still pinned after wait()"
        latest = self.durable_reader.latest()
        assert (latest.step if latest else None) == max(durable, default=None)

    # -- reading ---------------------------------------------------------------------------

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.local | self.durable)), label="step")
        assert same_state(self.writer.load(step), self.states[step]), f"step {step} differs"
        latest = self._latest()
        assert latest is not None
        assert same_state(self.writer.load(), self.states[latest]), "latest differs"

    # -- writers come and go ---------------------------------------------------------------

    @rule()
    def close_reopen(self) -> None:
        """close() makes a writer's pinned steps and last step durable (one that saved or
        holds the lease, as one opened with ``takeover=True`` after a kill does; a store
        opened and closed without either persists nothing) and waits for every copy."""
        newest = max(self.local, default=None)
        writing = self.started or self.holds
        if writing and not self.started:  # never saved: close persists the pins a kill left
            self.pinned &= self.local
            self.pinned -= self.durable
            self.queued += sorted(self.pinned - set(self.queued))
        self.writer.close()
        if writing and newest is not None:
            if newest not in self.durable | set(self.queued):
                self.pinned.add(newest)
                self.queued.append(newest)
            self._copies_ran()
            durable, local, pins = self._truth()
            assert newest in durable, f"closed, yet its last step {newest} is not durable"
            latest = self.durable_reader.latest()
            assert latest is not None and latest.step == newest
            assert len(local - pins) <= LOCAL_KEEP_LAST, f"the local tier keeps {sorted(local)}"
        self._reopen(takeover=False)

    def _killed(self) -> None:
        """The writer is abandoned (never closed, its lease held); the next one takes over."""
        self.dead.append(self.writer)
        self._reopen(takeover=True)

    @rule(lose_local_tier=st.booleans())
    def kill(self, lose_local_tier: bool) -> None:
        """Killed between two waits: the copies it queued never ran; their pins stay. Or
        the node is replaced (``lose_local_tier``): its local tier is gone, and the next
        writer resumes from the durable tier; the local steps past it are lost. The new node's
        disk is empty when the next writer starts there (it claims it: tiers/identity.py)."""
        if lose_local_tier:
            shutil.rmtree(self.local_dir, ignore_errors=True)
            self.local, self.pinned = set(), set()
            self.due &= self.durable
        self._killed()

    @rule(calls=st.integers(1, 12), delta=st.integers(1, 3))
    def kill_persisting(self, calls: int, delta: int) -> None:
        """The writer dies at its ``calls``-th durable write of a wait (nothing after it
        reaches the durable tier), after a ``persist=True`` save if it had no copy queued:
        each queued step is durable or still pinned, nothing durable is lost, the local tier
        loses only what retention would drop."""
        if not self.queued:
            self.save(delta, 5, persist=True)
        before = (set(self.durable), set(self.local), set(self.pinned), set(self.queued))
        self.switch.fail_at = self.switch.count + calls
        with contextlib.suppress(CheckpointError):
            self.writer.wait()
        self._killed()
        durable, local, pins = self._truth()
        was_durable, was_local, was_pinned, queued = before
        assert was_durable <= durable <= was_durable | queued, (was_durable, durable, queued)
        assert pins <= was_pinned and was_pinned - pins <= durable, (was_pinned, pins)
        assert local <= was_local, (was_local, local)
        assert set(sorted(was_local)[-LOCAL_KEEP_LAST:]) | pins <= local, (was_local, local)
        self.durable, self.local, self.pinned = durable, local, pins

    # -- after every rule ------------------------------------------------------------------

    @invariant()
    def the_tiers_hold_what_the_model_says(self) -> None:
        durable, local, pins = self._truth()
        assert (durable, local, pins) == (self.durable, self.local, self.pinned), (
            f"durable {sorted(durable)} local {sorted(local)} pins {sorted(pins)}; the model: "
            f"{sorted(self.durable)}, {sorted(self.local)}, {sorted(self.pinned)}"
        )

    @invariant()
    def latest_is_the_newest_step_of_either_tier(self) -> None:
        _, _, reader = self._readers()
        latest, newest = reader.latest(), self._latest()
        assert (latest.step if latest else None) == newest
        if newest is not None and self.loaded.get(-1) != reader.info(newest).manifest:
            assert same_state(reader.load(), self.states[newest]), "latest() loads otherwise"
            self.loaded[-1] = reader.info(newest).manifest

    @invariant()
    def copies_are_identical_and_none_is_fenced(self) -> None:
        durable, local, _ = self._readers()
        here = {i.step: i.manifest for i in local.list()}
        for info in durable.list():
            if info.step in here:
                assert info.manifest == here[info.step], f"step {info.step}: two manifests"
        assert durable.fenced_steps() == []

    @invariant()
    def every_durable_step_loads_what_was_saved(self) -> None:
        durable, _, _ = self._readers()
        for info in durable.list():
            if self.loaded.get(info.step) != info.manifest:
                assert same_state(durable.load(info.step), self.states[info.step]), info.step
                self.loaded[info.step] = info.manifest


TestTieredStoreModel = TieredStoreModel.TestCase
TestTieredStoreModel.settings = model_settings(TIERED_EXAMPLES, TIERED_STEPS)
