"""Lightning: every checkpoint a ``Trainer`` writes becomes a committed step in a store.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from ckptstore.integrations.lightning import StoreCheckpointIO

    io = StoreCheckpointIO("s3://bucket/run-1")
    best = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    trainer = Trainer(plugins=[io], callbacks=[best, io])  # as a callback: logged metrics too
    trainer.fit(model, ckpt_path="latest")  # the store's latest step, or none if it is empty

Lightning names a checkpoint by a local path (``.../epoch=3-step=16.ckpt``); the store names it
by a step. ``save_checkpoint`` commits the checkpoint as step ``global_step``, keeping the path
and the metrics in the manifest's metadata (``lightning_path``, ``epoch``, each
``ModelCheckpoint``'s monitored value, and, when the plug-in is also passed in ``callbacks``,
everything in ``trainer.callback_metrics``). A path names at most one step, as a file holds
one checkpoint: saving a path again points it at the new step, and the step it named before is
deleted once no path names it. ``remove_checkpoint`` (``save_top_k``) deletes the path's step
the same way; the store's ``latest`` and pinned steps are kept, with a log line.

Two paths for one ``global_step`` (``last.ckpt`` beside a top-k file) share one step: the
first save commits it, the second only names it. ``load_checkpoint`` (``ckpt_path=``) accepts
``"latest"``, a step number, a path this store saved (``best_model_path``, from this or an
earlier process: found in the metadata), and ``last.ckpt``-style names, which always mean the
latest step. Nothing is written to Lightning's local ``dirpath``.

Lightning checkpoints are plain containers of tensors, numbers and strings, which the safe
format holds. Hyper-parameters may hold other objects (a ``Namespace``, a config class): saving
those is a SerializationError naming where they sit, unless ``allow_pickle=True``, which pickles
only those objects and lets this plug-in load them back (so only for stores whose every writer
is trusted). Lightning calls ``save_checkpoint`` on global rank 0 only; strategies that write
sharded checkpoints (FSDP, DeepSpeed) bypass ``CheckpointIO`` and are not covered.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptstore.errors import ConfigError, NotFoundError

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as e:
    raise ConfigError(
        f"ckptstore.integrations.lightning needs Lightning ({e.name!r} is missing): "
        "pip install 'ckptstore[lightning]'"
    ) from e
from ckptstore.integrations.training import plain_metrics
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

PATH_KEY = "lightning_path"
"""The metadata key holding the Lightning path a step was saved under."""
_LAST_NAME = re.compile(r"^last(-v\d+)?(\.ckpt)?$")


class StoreCheckpointIO(CheckpointIO, Callback):
    """A Lightning ``CheckpointIO`` that reads and writes steps of a ckptstore store.

    ``store`` is a URI (opened on first use with ``store_options``, closed at ``teardown``) or
    an open :class:`CheckpointStore` (left open). ``async_save=True`` returns once the tensors
    are copied and commits in the background; a removal first waits for that commit.
    """

    def __init__(
        self,
        store: CheckpointStore | str,
        *,
        async_save: bool = False,
        allow_pickle: bool = False,
        **store_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(store, CheckpointStore) and store_options:
            raise ConfigError(
                f"store options {sorted(store_options)} apply only when StoreCheckpointIO "
                "opens the store from a URI; pass them to CheckpointStore instead"
            )
        self._uri = store if isinstance(store, str) else store.uri
        self._store = store if isinstance(store, CheckpointStore) else None
        self._owned = not isinstance(store, CheckpointStore)
        self._options = store_options
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self._paths: dict[str, int] | None = None
        self._metrics: dict[str, Any] = {}
        self._ours: set[int] = set()
        """Steps this object saved or loaded: a second path for one of them only names it.
        Any other committed step is not taken for this run's (a rerun that forgot to resume
        gets the store's error instead of silently keeping the old run's step)."""

    @property
    def store(self) -> CheckpointStore:
        """The store, opened on first use."""
        if self._store is None:
            self._store = CheckpointStore(self._uri, **self._options)
        return self._store

    # -- CheckpointIO ---------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Commit ``checkpoint`` as step ``global_step``, named ``path``."""
        if storage_options is not None:
            raise ConfigError(
                f"StoreCheckpointIO takes no storage_options per save (got {storage_options!r}); "
                "pass store options to StoreCheckpointIO itself"
            )
        name, step = str(path), _global_step(checkpoint, path)
        paths = self._known_paths()
        metrics, self._metrics = self._metrics, {}
        if step not in self._ours:  # else: a second path for a step this process holds
            metadata = {
                PATH_KEY: name,
                "epoch": checkpoint.get("epoch"),
                **_monitored(checkpoint),
                **metrics,
            }
            if self.async_save:
                self.store.save_async(step, checkpoint, metadata, allow_pickle=self.allow_pickle)
            else:
                self.store.save(step, checkpoint, metadata, allow_pickle=self.allow_pickle)
            self._ours.add(step)
        else:
            log.debug("%s: %s names step %d, committed already", self._uri, name, step)
        previous = paths.get(name)
        paths[name] = step
        if previous is not None and previous != step:
            self._delete_if_unnamed(previous, f"{name} now names step {step}")

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint ``path`` names (see :meth:`step_of`), verified; naming it and
        reading it are one load, by the store's ``load_timeout``."""
        with self.store.resolver.loading():
            step = self.step_of(path)
            state = self.store.load(step, fallback=False, allow_pickle=self.allow_pickle)
        if not isinstance(state, dict):
            raise ConfigError(
                f"{self._uri}: step {step} holds a {type(state).__name__}, not a Lightning "
                "checkpoint; load it with CheckpointStore.load",
                uri=self._uri,
                step=step,
            )
        self._known_paths().setdefault(str(path), step)
        self._ours.add(step)
        return _to_device(state, map_location) if map_location is not None else state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Forget ``path``; delete its step unless another path names it."""
        step = self._known_paths().pop(str(path), None)
        if step is None:
            log.debug("%s: %s names no step here; nothing to remove", self._uri, path)
            return
        self._delete_if_unnamed(step, f"Lightning removed {path}")

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Wait for the save in flight; close the store if this plug-in opened it.

        Both roles end here: ``CheckpointIO.teardown()`` and ``Callback.teardown(trainer,
        pl_module, stage)``; whichever comes second finds nothing left to do."""
        if self._store is None:
            return
        if self._owned:
            store, self._store, self._paths = self._store, None, None
            store.close()
        else:
            self._store.wait()

    # -- Callback: the logged metrics of each save ---------------------------------------

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep the metrics logged so far for the manifest of the save about to happen."""
        self._metrics = plain_metrics(trainer.callback_metrics)

    # -- paths and steps -----------------------------------------------------------------

    def step_of(self, path: str | os.PathLike[str]) -> int:
        """The step ``path`` names: ``"latest"``, a step number (or ``.../global_step_N``), a
        path this store saved, or a ``last.ckpt``-style name (the latest step)."""
        name = str(path)
        known = self._known_paths()
        if name == "latest" or _is_last(name):
            latest = self.store.latest()
            if latest is None:
                raise NotFoundError(
                    f"{self._uri} holds no checkpoint to resume from ({name!r}); start "
                    "without ckpt_path",
                    uri=self._uri,
                )
            return latest.step
        if name in known:
            return known[name]
        number = re.fullmatch(r"(?:.*/global_step_)?(\d+)", name)
        if number is not None:
            return int(number.group(1))
        raise NotFoundError(
            f"{self._uri}: no step was saved as {name!r} (it holds steps "
            f"{[i.step for i in self.store.list()]}); pass 'latest', a step number, or a path "
            "this store saved (ModelCheckpoint.best_model_path)",
            uri=self._uri,
        )

    def _known_paths(self) -> dict[str, int]:
        """Path -> step, read from the manifests once, then kept up to date: the newest step
        saved under a path, and every ``last`` name for the latest step."""
        if self._paths is None:
            infos = self.store.list()
            self._paths = {}
            for info in infos:
                name = info.metadata.get(PATH_KEY)
                if isinstance(name, str) and not _is_last(name):
                    self._paths[name] = info.step
            latest = self.store.latest()
            if latest is not None:
                for info in infos:
                    name = info.metadata.get(PATH_KEY)
                    if isinstance(name, str) and _is_last(name):
                        self._paths[name] = latest.step
        return self._paths

    def _delete_if_unnamed(self, step: int, why: str) -> None:
        """Delete ``step`` unless a path still names it, it is ``latest``, or it is pinned."""
        if step in self._known_paths().values():
            return
        store = self.store
        store.wait()  # never delete before the save that replaces the step has committed
        latest = store.latest()
        if (latest is not None and latest.step == step) or step in store.pins():
            log.info("%s: keeping step %d (%s): it is the latest or pinned", self._uri, step, why)
            return
        try:
            store.delete(step)
        except NotFoundError:
            log.debug("%s: step %d is gone already (retention)", self._uri, step)
            return
        log.info("%s: deleted step %d (%s)", self._uri, step, why)


def _global_step(checkpoint: Mapping[str, Any], path: object) -> int:
    step = checkpoint.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(
            f"the checkpoint for {path} has no valid 'global_step' ({step!r}); "
            "StoreCheckpointIO saves Trainer checkpoints"
        )
    return step


def _monitored(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Each ModelCheckpoint's monitored metric and its value at this save."""
    found = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        if (
            isinstance(state, Mapping)
            and isinstance(state.get("monitor"), str)
            and state.get("current_score") is not None
        ):
            found[state["monitor"]] = state["current_score"]
    return plain_metrics(found)


def _is_last(name: str) -> bool:
    return _LAST_NAME.match(Path(name).name) is not None


def _to_device(value: Any, location: Any) -> Any:
    if not isinstance(location, (str, torch.device)):
        raise ConfigError(
            f"StoreCheckpointIO maps a checkpoint to a device (a str or torch.device), not "
            f"{location!r}; load it on the CPU (map_location=None) and move it yourself"
        )
    if isinstance(value, torch.Tensor):
        return value.to(location)
    if isinstance(value, dict):
        return {k: _to_device(v, location) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, location) for v in value)
    return value
