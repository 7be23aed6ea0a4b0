"""``python -m ckptstore.integrations.verl_main {ppo,one_step_off,fully_async} [overrides]``:
verl 0.9.1's own entry points, with ckptstore's trainer subclasses (verl_trainers.py) in the
trainers that never call ``trainer.checkpoint_callback_class``.

verl's ``run_ppo(config, task_runner_class=...)`` is its hook for changing the TaskRunner, but
its TaskRunners build the trainer by the name their module imported (``RayPPOTrainer``,
``OneStepOffRayTrainer``, ``FullyAsyncTrainer``). So this runs verl's own ``main`` (its Hydra
config, its checks) with a TaskRunner that subclasses verl's and, inside its own process and
for the length of its ``run``, binds that name to ckptstore's subclass. verl's files are not
changed, and nothing outside the runner's ``run`` sees the binding. ``ppo`` with
``trainer.use_v1=true`` (verl's default) is verl's v1 trainer, which takes the callback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ray

from ckptstore.errors import ConfigError
from ckptstore.integrations import verl_trainers


@dataclass(frozen=True)
class Entry:
    """One of verl's entry points: the module of its ``main``, the module of its TaskRunner,
    the TaskRunner's name there, and the trainer name that TaskRunner builds."""

    main: str
    runner_module: str
    runner: str
    trainer: str
    ours: Any


ENTRIES = {
    "ppo": Entry("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0", "TaskRunner",
                 "RayPPOTrainer", verl_trainers.CkptstoreRayPPOTrainer),
    "one_step_off": Entry("verl.experimental.one_step_off_policy.main_ppo",
                          "verl.experimental.one_step_off_policy.main_ppo", "OneStepTaskRunner",
                          "OneStepOffRayTrainer", verl_trainers.CkptstoreOneStepOffRayTrainer),
    "fully_async": Entry("verl.experimental.fully_async_policy.fully_async_main",
                         "verl.experimental.fully_async_policy.fully_async_main",
                         "FullyAsyncTaskRunner", "FullyAsyncTrainer",
                         verl_trainers.CkptstoreFullyAsyncTrainer),
}  # fmt: skip


@contextmanager
def bound(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block, and what it was after."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def task_runner(entry: Entry) -> Any:
    """verl's TaskRunner for ``entry`` (a Ray actor class, with verl's options) whose ``run``
    builds ckptstore's trainer subclass instead of verl's class."""
    module = importlib.import_module(entry.runner_module)
    remote = getattr(module, entry.runner)
    base: Any = remote.__ray_actor_class__

    class CkptstoreTaskRunner(base):  # type: ignore[misc]
        def run(self, config: Any) -> Any:
            with bound(importlib.import_module(entry.runner_module), entry.trainer, entry.ours):
                return super().run(config)

    CkptstoreTaskRunner.__name__ = CkptstoreTaskRunner.__qualname__ = f"Ckptstore{entry.runner}"
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
    runner_module = importlib.import_module(entry.runner_module)
    with bound(runner_module, entry.runner, task_runner(entry)):
        importlib.import_module(entry.main).main()


if __name__ == "__main__":
    main()
