"""Checkpointing for a plain PyTorch training loop: save every N steps, resume from latest.

::

    from ckptstore import CheckpointStore
    from ckptstore.integrations.training import CheckpointCallback, resume

    store = CheckpointStore("s3://bucket/run-1", keep_last=3, takeover=True)
    start = resume(store, model, optimizer, scheduler)  # 0 on an empty store
    callback = CheckpointCallback(store, save_freq=500)
    for step in range(start + 1, total_steps + 1):
        train_one_step(model, optimizer, scheduler)
        callback.on_step(step, model, optimizer, scheduler)
    store.close()  # waits for the last async save

A step number counts completed optimizer steps: ``on_step(step, ...)`` runs after update
``step``, and ``resume`` returns the step of the checkpoint it restored, so the loop goes on at
``step + 1`` (and starts at 1 on an empty store).

A job restarted after preemption should open its store with ``takeover=True``: the killed job
may still hold the writer lease, which would otherwise refuse the first save until it expires.

Restoring the RNGs (torch CPU, CUDA when available, Python ``random``, NumPy's global
generator) makes a resumed run draw the same dropout masks and shuffles as an uninterrupted
one. The safe format holds no ndarrays, so NumPy's state travels as a tensor and JSON values.
This is for one process; multi-rank jobs use ``ckptstore.distributed`` or the DCP integration.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ckptstore import layout
from ckptstore.errors import ConfigError, ErrorContext, NotFoundError

if TYPE_CHECKING:
    from ckptstore.background import SaveHandle
    from ckptstore.info import CheckpointInfo
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: models, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class CheckpointCallback:
    """Saves model, optimizer, scheduler, RNG states and ``extra`` every ``save_freq`` steps.

    Saves run in the background by default (the loop waits only for the copy of the tensors);
    a failed save is raised by the next one, or by ``store.wait()`` / ``store.close()``.
    The store's retention applies after each commit.
    """

    def __init__(self, store: CheckpointStore, save_freq: int, *, async_save: bool = True) -> None:
        if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
            raise ConfigError(f"save_freq must be a positive number of steps, got {save_freq!r}")
        self.store = store
        self.save_freq = save_freq
        self.async_save = async_save

    def on_step(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> SaveHandle[CheckpointInfo] | CheckpointInfo | None:
        """Call after update ``step``; saves when ``step`` is a multiple of ``save_freq``."""
        if step % self.save_freq:
            return None
        return self.save(step, model, optimizer, scheduler, extra)

    def save(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Stateful | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> SaveHandle[CheckpointInfo] | CheckpointInfo:
        """Save now, whatever the step (at the end of training, say)."""
        state = training_state(model, optimizer, scheduler, extra)
        if self.async_save:
            return self.store.save_async(step, state)
        return self.store.save(step, state)


def training_state(
    model: Stateful,
    optimizer: Stateful,
    scheduler: Stateful | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``CheckpointCallback`` saves (and ``resume`` restores)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        "extra": dict(extra) if extra is not None else None,
    }


def resume(
    store: CheckpointStore,
    model: Stateful,
    optimizer: Stateful,
    scheduler: Stateful | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> int:
    """Restore the latest checkpoint into the given objects; returns its step (0 if none).

    Only an empty store means "start from 0" (logged at INFO); any other failure (a wrong
    URI, a missing bucket, bad credentials) raises, so a job never silently restarts from
    scratch. A latest step that fails verification is skipped with a warning for the newest
    good one. ``extra``, if given, is updated with the ``extra`` saved by ``on_step``.
    """
    try:
        state = store.load()
    except NotFoundError:
        if store.latest() is not None:  # something else is missing: not an empty store
            raise
        log.info("%s holds no checkpoint; starting from step 0", store.uri)
        return 0
    info = store.last_loaded
    if info is None:  # load() always sets it; keeps the type checker honest
        raise NotFoundError(f"{store.uri}: loaded a state but not its step", uri=store.uri)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            if state["scheduler"] is None:
                raise ConfigError(
                    f"{info.uri} was saved without a scheduler; pass none", **_step_context(info)
                )
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
    except (KeyError, TypeError) as e:
        raise ConfigError(
            f"{info.uri} was not saved by CheckpointCallback (missing {e}); load it with "
            "store.load() and restore it yourself",
            **_step_context(info),
        ) from e
    if extra is not None and state["extra"] is not None:
        extra.update(state["extra"])
    log.info("resumed from %s", info.uri)
    return info.step


def _step_context(info: CheckpointInfo) -> ErrorContext:
    """``uri``, ``step``, ``path`` of an error about a whole committed step: its directory's."""
    return {"uri": info.uri, "step": info.step, "path": layout.step_dir(info.step)}


def rng_state() -> dict[str, Any]:
    """Every global RNG's state, in values the safe format holds."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    cuda = list(state["cuda"])
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "saved %d CUDA RNG states, but %d devices are visible; restoring what fits",
                len(cuda),
                torch.cuda.device_count(),
            )
        for device, cuda_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    elif cuda:
        log.warning("saved CUDA RNG states, but no CUDA device is visible; not restored")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    )
