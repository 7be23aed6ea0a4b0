"""``python -m ckptstore.integrations.verl_main {ppo,one_step_off,fully_async} [overrides]``:
verl 0.9.1's own entry points, with ckptstore's trainer subclasses (verl_trainers.py) in the
trainers that never call ``trainer.checkpoint_callback_class``.

verl's ``run_ppo(config, task_runner_class=...)`` is its hook for changing the TaskRunner, but
its TaskRunners build the trainer by the name their module imported (``RayPPOTrainer``,
``OneStepOffRayTrainer``, ``FullyAsyncTrainer``). So this runs verl's own ``main`` (its Hydra
config, its checks) with a TaskRunner that subclasses verl's and, inside its own process and
for the length of its ``run``, binds that name to ckptstore's subclass. verl's files are not
changed, and nothing outside the runner's ``run`` sees the binding. ``ppo`` with
``trainer.use_v1=true`` (verl's default) is verl's v1 trainer, which takes the callback; its
runner gets verl's registered class with ckptstore's resume at load (``get_trainer_cls``
returns :func:`~ckptstore.integrations.verl_trainers.v1_trainer_cls`'s), so each node pulls
only its ranks' share there too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ray

from ckptstore.errors import ConfigError
from ckptstore.integrations import verl_trainers


@dataclass(frozen=True)
class Runner:
    """One of verl's TaskRunners: its module and name (where verl's ``main`` finds it), and the
    names to bind inside its ``run``: ``(module, name, value)``."""

    module: str
    name: str
    binds: tuple[tuple[str, str, Any], ...]


@dataclass(frozen=True)
class Entry:
    """One of verl's entry points: the module of its ``main`` and the TaskRunners it runs."""

    main: str
    runners: tuple[Runner, ...]


_V0 = "verl.trainer.main_ppo_v0"
_ONE_STEP = "verl.experimental.one_step_off_policy.main_ppo"
_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
ENTRIES = {
    "ppo": Entry(
        "verl.trainer.main_ppo",
        (
            Runner(
                _V0, "TaskRunner", ((_V0, "RayPPOTrainer", verl_trainers.CkptstoreRayPPOTrainer),)
            ),
            Runner(
                "verl.trainer.main_ppo",
                "TaskRunnerV1",
                (("verl.trainer.ppo.v1", "get_trainer_cls", verl_trainers.v1_trainer_cls),),
            ),
        ),
    ),
    "one_step_off": Entry(
        _ONE_STEP,
        (
            Runner(
                _ONE_STEP,
                "OneStepTaskRunner",
                ((_ONE_STEP, "OneStepOffRayTrainer", verl_trainers.CkptstoreOneStepOffRayTrainer),),
            ),
        ),
    ),
    "fully_async": Entry(
        _ASYNC,
        (
            Runner(
                _ASYNC,
                "FullyAsyncTaskRunner",
                ((_ASYNC, "FullyAsyncTrainer", verl_trainers.CkptstoreFullyAsyncTrainer),),
            ),
        ),
    ),
}


@contextmanager
def bound(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block, and what it was after."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def task_runner(runner: Runner) -> Any:
    """verl's TaskRunner (a Ray actor class, with verl's options) whose ``run`` builds
    ckptstore's trainer: ``runner.binds`` hold inside it, in the runner's own process."""
    remote = getattr(importlib.import_module(runner.module), runner.name)
    base: Any = remote.__ray_actor_class__

    class CkptstoreTaskRunner(base):  # type: ignore[misc]
        def run(self, config: Any) -> Any:
            with ExitStack() as stack:
                for module, name, value in runner.binds:
                    stack.enter_context(bound(importlib.import_module(module), name, value))
                return super().run(config)

    CkptstoreTaskRunner.__name__ = CkptstoreTaskRunner.__qualname__ = f"Ckptstore{runner.name}"
    options = dict(remote._default_options)  # verl's: num_cpus, max_concurrency, ...
    if not options:  # verl's bare @ray.remote
        return ray.remote(CkptstoreTaskRunner)
    return ray.remote(**options)(CkptstoreTaskRunner)


def main(argv: list[str] | None = None) -> None:
    """Run verl's entry point named by the first argument; the rest are Hydra's overrides."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ENTRIES:
        raise ConfigError(
            "usage: python -m ckptstore.integrations.verl_main "
            f"{{{','.join(ENTRIES)}}} [hydra overrides...]; got {args[:1] or 'nothing'}"
        )
    entry = ENTRIES[args.pop(0)]
    sys.argv = [sys.argv[0], *args]  # what verl's Hydra main parses
    with ExitStack() as stack:  # verl's main finds ckptstore's TaskRunners
        for runner in entry.runners:
            module = importlib.import_module(runner.module)
            stack.enter_context(bound(module, runner.name, task_runner(runner)))
        importlib.import_module(entry.main).main()


if __name__ == "__main__":
    main()
