"""Checkpointing for a plain PyTorch training loop: a save policy, preemption, resume.

::

    from ckptstore import CheckpointStore
    from ckptstore.integrations.training import CheckpointCallback, resume

    store = CheckpointStore("s3://bucket/run-1", keep_last=3, takeover=True)
    start = resume(store, model, optimizer, scheduler)  # 0 on an empty store
    with CheckpointCallback(store, save_freq=500, save_interval_seconds=1800) as callback:
        for step in range(start + 1, total_steps + 1):
            loss = train_one_step(model, optimizer, scheduler)
            callback.on_step(step, model, optimizer, scheduler, metrics={"loss": loss})
            if callback.preempted:  # SIGTERM: the step is committed, exit cleanly
                break
    store.close()

A step number counts completed optimizer steps: ``on_step(step, ...)`` runs after update
``step``, and ``resume`` returns the step of the checkpoint it restored, so the loop goes on at
``step + 1`` (and starts at 1 on an empty store).

**When to save.** Every ``save_freq`` steps, every ``save_interval_seconds`` (whichever comes
first), and whenever a ``should_save(step, metrics)`` hook says so: it returns True to force a
save, False to veto a scheduled one, None to follow the schedule. Each manifest's metadata
holds the metrics passed to ``on_step`` and a ``reason`` (``schedule``, ``should_save``,
``preempted``, ``end``, ``manual``).

**Preemption is handled by default.** Schedulers (Kubernetes, Slurm, spot reclaimers) send
SIGTERM, then SIGKILL after a grace period. Python's default is to die at once, losing every
step since the last save, so the callback installs a handler (opt out with
``preemption_signals=()``; add ``SIGUSR1`` for Slurm's ``--signal``). The handler only sets a
flag: a save from inside a signal handler could run in the middle of an optimizer step. The
next ``on_step`` saves synchronously (``reason: "preempted"``), waits for the commit, and sets
``preempted``. A loop that does not check ``preempted`` is not left running until SIGKILL:
its next ``on_step`` hands the signal to the previous handler (by default: the process dies,
now with its work committed), and so does a second signal before the save. ``close()`` puts
the previous handler back.

**The end of training.** ``on_train_end(step, ...)``, or leaving the ``with`` block without an
exception, saves the last step unless it is already committed, and waits for it.

A job restarted after preemption should open its store with ``takeover=True``: the killed job
may still hold the writer lease, which would otherwise refuse the first save until it expires.

What a step holds and how ``resume`` restores it is training_state.py's. This is for one
process; multi-rank jobs use ``ckptstore.integrations.distributed`` or the DCP integration.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptstore.errors import CheckpointError, ConfigError
from ckptstore.integrations.failed_saves import FailedSaves
from ckptstore.integrations.preemption import PreemptionSignals
from ckptstore.integrations.training_state import (
    Stateful,
    resume,
    rng_state,
    set_rng_state,
    training_state,
)

if TYPE_CHECKING:
    from ckptstore.data.background import SaveHandle
    from ckptstore.domain.info import CheckpointInfo
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

ShouldSave = Callable[[int, Mapping[str, Any]], "bool | None"]
"""``should_save(step, metrics)``: True forces a save, False vetoes one, None: the schedule."""
_Objects = tuple["Stateful", "Stateful", "Stateful | None", "Mapping[str, Any] | None"]


class CheckpointCallback:
    """Saves model, optimizer, scheduler, RNG states and ``extra`` when the policy says so.

    Scheduled saves run in the background by default (the loop waits only for the copy of the
    tensors; with ``overlap=True``, only for the part of that copy not done when the optimizer
    next steps, see ``CheckpointStore.save_async``). A save that fails (or times out: the
    store's ``save_timeout``) does not stop training: it is logged and counted (the store's
    observer and metrics see it), and the next save goes ahead; ``max_failed_saves`` failures
    in a row raise, at a step boundary, so a scheduler sees the job fail.
    Preemption and end-of-training saves are synchronous. The store's retention applies after
    each commit. See the module docstring for the policy.
    """

    def __init__(
        self,
        store: CheckpointStore,
        save_freq: int | None = None,
        *,
        async_save: bool = True,
        overlap: bool = False,
        save_interval_seconds: float | None = None,
        should_save: ShouldSave | None = None,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        clock: Callable[[], float] = time.monotonic,
        max_failed_saves: int = 3,
    ) -> None:
        _check_positive("save_freq", save_freq, "steps", int)
        _check_positive("save_interval_seconds", save_interval_seconds, "seconds", (int, float))
        _check_positive("max_failed_saves", max_failed_saves, "saves", int)
        self.store = store
        self.max_failed_saves = max_failed_saves
        self._failures = FailedSaves(
            store.uri,
            max_failed_saves,
            headline="saves in a row failed",
            hint="ckptstore verify, the endpoint, credentials, free space",
        )
        self._in_flight: SaveHandle[CheckpointInfo] | None = None
        self.save_freq = save_freq
        self.save_interval_seconds = save_interval_seconds
        self.should_save = should_save
        self.async_save = async_save
        self.overlap = overlap
        self.clock = clock
        self.preempted = False
        """True once a preemption signal arrived and its step is committed: exit the loop."""
        self.last_saved_step: int | None = None
        self._last_save_time = clock()
        self._last_call: tuple[Any, ...] | None = None
        self.signals = PreemptionSignals(preemption_signals)
        """The preemption handler (preemption.py): the signal received, the handler installed."""

    # -- the loop's calls ----------------------------------------------------------------

    def on_step(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle[CheckpointInfo] | CheckpointInfo | None:
        """Call after update ``step``; saves when the policy (or a preemption) says so.

        Returns the save's handle (async) or info (sync), or None when nothing was saved.
        """
        self._last_call = (step, model, optimizer, scheduler, extra, metrics)
        if self.preempted and not self.signals.passed_on:
            self.signals.pass_on()  # the loop did not stop: do what the signal did before us
        elif self.signals.received is not None and not self.preempted:
            return self._save_preempted(step, model, optimizer, scheduler, extra, metrics)
        reason = self._reason(step, metrics)
        if reason is None:
            return None
        return self._save(step, (model, optimizer, scheduler, extra), metrics, reason, sync=False)

    def on_train_end(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo | None:
        """Save ``step`` and wait for its commit, unless it is committed already (None)."""
        self._hear_of_the_save_in_flight()
        if self._already_saved(step):
            return None
        return self._sync(step, (model, optimizer, scheduler, extra), metrics, "end")

    def save(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle[CheckpointInfo] | CheckpointInfo | None:
        """Save now, whatever the policy (``reason: "manual"``)."""
        return self._save(step, (model, optimizer, scheduler, extra), metrics, "manual", False)

    def close(self) -> None:
        """Put the previous signal handlers back, then wait for the save in flight."""
        self.signals.uninstall()
        self.store.wait()

    def __enter__(self) -> CheckpointCallback:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        """On a clean exit, save the step last passed to ``on_step`` unless it is saved."""
        try:
            if kind is None and self._last_call is not None:
                step, model, optimizer, scheduler, extra, metrics = self._last_call
                self.on_train_end(step, model, optimizer, scheduler, extra, metrics=metrics)
        finally:
            self.close()

    # -- the policy ----------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the schedule (``save_freq``, ``save_interval_seconds``) wants ``step``."""
        if self.save_freq is not None and step % self.save_freq == 0:
            return True
        interval = self.save_interval_seconds
        return interval is not None and self.clock() - self._last_save_time >= interval

    def _reason(self, step: int, metrics: Mapping[str, Any] | None) -> str | None:
        due = self.due(step)
        if self.should_save is None:
            return "schedule" if due else None
        verdict = self.should_save(step, dict(metrics or {}))
        if verdict is None:
            return "schedule" if due else None
        if not isinstance(verdict, bool):
            raise ConfigError(
                f"should_save must return True (save), False (skip) or None (follow the "
                f"schedule), got {verdict!r} for step {step}"
            )
        if verdict:
            return "schedule" if due else "should_save"
        return None

    # -- saving --------------------------------------------------------------------------

    def _save(
        self,
        step: int,
        objects: _Objects,
        metrics: Mapping[str, Any] | None,
        reason: str,
        sync: bool,
    ) -> SaveHandle[CheckpointInfo] | CheckpointInfo | None:
        self._hear_of_the_save_in_flight()
        if sync or not self.async_save:
            return self._sync(step, objects, metrics, reason)
        overlap: bool | torch.optim.Optimizer = False
        if self.overlap and isinstance(objects[1], torch.optim.Optimizer):
            overlap = objects[1]  # a Stateful of another kind: the blocking copy
        handle = self._in_flight = self.store.save_async(
            step, training_state(*objects), _metadata(metrics, reason), overlap=overlap
        )
        self._saved(step)
        return handle

    @property
    def failed_saves(self) -> int:
        """Saves that failed in a row (reset by a save that commits)."""
        return self._failures.count

    def _hear_of_the_save_in_flight(self) -> None:
        """How the last background save ended: counted if it failed (module docstring)."""
        handle, self._in_flight = self._in_flight, None
        if handle is None:
            return
        try:
            handle.wait()
        except CheckpointError as e:
            self._failures.failed(handle.step, e)
        else:
            self._failures.succeeded()

    def _sync(
        self, step: int, objects: _Objects, metrics: Mapping[str, Any] | None, reason: str
    ) -> CheckpointInfo | None:
        state, meta = training_state(*objects), _metadata(metrics, reason)
        last = reason in ("end", "preempted")
        try:
            # the last save reaches the durable tier, whatever persist_every says
            info = self.store.save(step, state, meta, persist=last)
        except CheckpointError as e:
            self._failures.failed(step, e)
            if last:
                raise  # the last save of the run: nothing comes after to make up for it
            return None
        self._failures.succeeded()
        self._saved(step)
        return info

    def _saved(self, step: int) -> None:
        self.last_saved_step = step
        self._last_save_time = self.clock()

    def _already_saved(self, step: int) -> bool:
        """Whether ``step`` is committed (waiting for the save in flight first); a step behind
        ``latest`` counts as saved, with a warning, since saving it would go backwards."""
        self.store.wait()
        if self.last_saved_step == step:
            return True
        latest = self.store.latest()
        if latest is None or latest.step < step:
            return False
        if latest.step > step:
            log.warning(
                "%s: not saving step %d, older than the latest step %d",
                self.store.uri,
                step,
                latest.step,
            )
        return True

    def _save_preempted(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None,
        extra: Mapping[str, Any] | None,
        metrics: Mapping[str, Any] | None,
    ) -> CheckpointInfo | None:
        signal_number = self.signals.received
        log.warning(
            "%s: preempted (signal %s); saving step %d", self.store.uri, signal_number, step
        )
        try:
            self.store.wait()
        except CheckpointError as e:  # the grace period is for this save: report, go on
            log.error("%s: the save before the preemption failed: %s", self.store.uri, e)
        info = None
        if not self._already_saved(step):
            info = self._sync(step, (model, optimizer, scheduler, extra), metrics, "preempted")
        self.preempted = True
        return info


def _check_positive(name: str, value: object, unit: str, kind: type | tuple[type, ...]) -> None:
    """ConfigError unless ``value`` is None or a positive number of ``kind``."""
    if value is None:
        return
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and isinstance(value, kind)
        and value > 0
    ):
        raise ConfigError(f"{name} must be a positive number of {unit}, got {value!r}")


def _metadata(metrics: Mapping[str, Any] | None, reason: str) -> dict[str, Any]:
    return {**plain_metrics(metrics), "reason": reason}


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metrics`` as JSON values for a manifest: one-element tensors and NumPy scalars become
    Python numbers, and NaN or infinities the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON
    cannot hold them, and a diverged loss must not make the save fail)."""
    result: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        value = _number(value)
        if isinstance(value, float) and not math.isfinite(value):
            value = repr(value)
        result[str(key)] = value
    return result


def _number(value: Any) -> Any:
    """A one-element tensor or NumPy value as a Python number; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (np.generic, np.ndarray)) and value.size == 1:
        return value.item()
    return value


__all__ = [
    "CheckpointCallback",
    "ShouldSave",
    "Stateful",
    "plain_metrics",
    "resume",
    "rng_state",
    "set_rng_state",
    "training_state",
]
