"""What a training-loop checkpoint holds, and ``resume``, which restores it all or nothing.

``resume`` checks that the step holds everything it restores, and that each part fits its
model and optimizer (keys, shapes, parameter groups), before it restores anything: an error
leaves every object as it was. Restoring the RNGs (torch CPU, CUDA when available, Python
``random``, NumPy's global generator) makes a resumed run draw the same dropout masks and
shuffles as an uninterrupted one. The safe format holds no ndarrays, so NumPy's state travels
as a tensor and JSON values. Import these from ``ckptstore.integrations.training``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ckptstore.domain import layout
from ckptstore.errors import ConfigError, ErrorContext, NotFoundError

if TYPE_CHECKING:
    from ckptstore.domain.info import CheckpointInfo, Loaded
    from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: models, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


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
    rng: bool = True,
    strict: bool = True,
) -> int:
    """Restore the latest checkpoint into the given objects; returns its step (0 if none).

    Only an empty store means "start from 0" (logged at INFO); any other failure (a wrong
    URI, a missing bucket, bad credentials) raises, so a job never silently restarts from
    scratch. A latest step that fails verification is skipped with a warning for the newest
    good one. ``extra``, if given, is updated with the ``extra`` saved by ``on_step``.

    Every part is checked before any is restored; a ConfigError leaves all objects unchanged.
    ``rng=False`` keeps this process's RNG states; ``strict=False`` restores the parts the step
    holds (the model at least) and logs the ones it lacks, e.g. for a step saved by a plain
    ``store.save(step, {"model": ..., "optimizer": ...})``.
    """
    with store.resolver.loading():  # one load, by the store's load_timeout
        loaded = _load_or_none(store)
    if loaded is None:
        log.info("%s holds no checkpoint; starting from step 0", store.uri)
        return 0
    state, info = loaded.state, loaded.info
    parts: dict[str, Stateful | None] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        parts["scheduler"] = scheduler
    if rng:
        parts["rng"] = None
    missing = [k for k in parts if not isinstance(state, dict) or state.get(k) is None]
    if missing and (strict or "model" in missing):
        raise ConfigError(_missing_message(info, missing, strict), **_step_context(info))
    if missing:
        log.warning("%s: restoring without %s, which it lacks", info.uri, ", ".join(missing))
    present = {k: v for k, v in parts.items() if k not in missing}
    for key, target in present.items():
        _check_fits(key, target, state[key], info)
    for key, target in present.items():
        if target is None:
            set_rng_state(state[key])
        else:
            target.load_state_dict(state[key])
    if extra is not None and state.get("extra") is not None:
        extra.update(state["extra"])
    log.info("resumed from %s", info.uri)
    return info.step


def _load_or_none(store: CheckpointStore) -> Loaded | None:
    """The latest step that verifies, or None for an empty store: any other NotFoundError (a
    missing bucket, a file deleted under the step) raises."""
    try:
        return store.load(with_info=True)
    except NotFoundError:
        if store.latest() is not None:  # something else is missing: not an empty store
            raise
        return None


def _missing_message(info: CheckpointInfo, missing: Sequence[str], strict: bool) -> str:
    if "model" in missing:
        fix = "load it with store.load() and restore it yourself"
    elif missing == ["rng"]:
        fix = "pass rng=False to keep this process's RNG states"
    else:
        fix = "pass strict=False to restore only what it holds"
    return (
        f"{info.uri} (step {info.step}) lacks {', '.join(repr(k) for k in missing)}, which "
        f"resume() restores: it was not saved by CheckpointCallback. Nothing was restored; {fix}"
    )


def _check_fits(key: str, target: Stateful | None, saved: Any, info: CheckpointInfo) -> None:
    """Raise ConfigError if ``saved`` would fail (half-way) to load into ``target``: the checks
    ``load_state_dict`` makes after it has already changed some of the object."""
    problem = None
    if target is None:
        problem = _rng_problem(saved)
    elif isinstance(target, torch.nn.Module):
        problem = _module_problem(target, saved)
    elif isinstance(target, torch.optim.Optimizer):
        problem = _optimizer_problem(target, saved)
    elif not isinstance(saved, Mapping):
        problem = f"a {type(saved).__name__}, not a state dict"
    if problem is not None:
        raise ConfigError(
            f"{info.uri} (step {info.step}): its {key!r} does not fit ({problem}). Nothing was "
            "restored; build the same model and optimizer as the run that saved it",
            **_step_context(info),
        )


def _module_problem(model: torch.nn.Module, saved: Any) -> str | None:
    if not isinstance(saved, Mapping):
        return f"a {type(saved).__name__}, not a state dict"
    own = model.state_dict()
    lacking, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    if lacking or unexpected:
        return f"missing keys {lacking[:5]}, unexpected keys {unexpected[:5]}"
    for name, tensor in own.items():
        other = saved[name]
        if isinstance(tensor, torch.Tensor) and (
            not isinstance(other, torch.Tensor) or other.shape != tensor.shape
        ):
            shape = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other).__name__
            return f"{name!r} is {shape} in the checkpoint, {tuple(tensor.shape)} in the model"
    return None


def _optimizer_problem(optimizer: torch.optim.Optimizer, saved: Any) -> str | None:
    try:
        groups = [len(g["params"]) for g in saved["param_groups"]]
        saved["state"].items()
    except (KeyError, TypeError, AttributeError):
        return "not an optimizer state dict"
    own = [len(g["params"]) for g in optimizer.param_groups]
    if groups != own:
        return f"parameters per group {groups} in the checkpoint, {own} in the optimizer"
    return None


def _rng_problem(saved: Any) -> str | None:
    try:
        _rng_values(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"unreadable RNG states: {e!r}"
    return None


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


def _rng_values(state: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ``set_rng_state`` sets, checked without setting anything (ValueError etc.)."""
    own = torch.get_rng_state()
    cpu = state["torch"]
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != own.dtype or cpu.shape != own.shape:
        raise ValueError("the torch RNG state has the wrong type or size")
    cuda = list(state["cuda"])
    version, internal, gauss = state["python"]
    python = (version, tuple(internal), gauss)
    random.Random().setstate(python)  # raises on a malformed state
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    generator = (numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    np.random.RandomState().set_state(generator)
    return cpu, cuda, python, generator


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    cpu, cuda, python, generator = _rng_values(state)
    torch.set_rng_state(cpu)
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
    random.setstate(python)
    np.random.set_state(generator)
