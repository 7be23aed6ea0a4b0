"""Hugging Face transformers: each ``checkpoint-N`` a ``Trainer`` writes becomes step ``N``.

::

    from ckptstore.integrations.hf_trainer import StoreCallback, pull_checkpoint

    pull_checkpoint("s3://bucket/run-1", args.output_dir)  # latest step -> checkpoint-N
    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[StoreCallback("s3://bucket/run-1", async_push=True)])
    trainer.train(resume_from_checkpoint=True)  # finds checkpoint-N, if the store had a step

The Trainer keeps writing its checkpoints to ``output_dir`` as usual (model, optimizer,
scheduler, RNG and trainer state files); ``on_save`` commits the directory it just wrote with
the store's streaming ``push_dir``, with the newest entries of ``state.log_history`` (loss,
learning rate, eval metrics) as metadata. ``save_total_limit`` then prunes the local copies
while the store keeps its own retention, so local disk can stay small.

``async_push=True`` pushes in a background thread, one directory at a time and in order, so
training goes on during the upload. The Trainer deletes old ``checkpoint-*`` directories
(``save_total_limit``) at its next save, before it calls ``on_save``: so whenever a save is
about to happen (``on_step_end``, ``on_epoch_end`` with ``should_save``, and ``on_evaluate``,
which precedes a ``save_strategy="best"`` save) the callback first waits for the push in
flight. A failed push is raised there, or at ``on_train_end``, which waits for every push.

Resuming is a pull: :func:`pull_checkpoint` downloads the store's latest step (verified,
falling back past a corrupt one) into ``output_dir/checkpoint-N``, where
``resume_from_checkpoint=True`` looks. Only the world's process zero pushes: multi-node jobs
whose ranks write files onto disks of their own are not covered.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import ConfigError, NotFoundError
from ckptstore.integrations.training import plain_metrics
from ckptstore.store import CheckpointStore

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:
    raise ConfigError(
        f"ckptstore.integrations.hf_trainer needs transformers ({e.name!r} is missing): "
        "pip install 'ckptstore[transformers]'"
    ) from e

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
"""The Trainer's checkpoint directory names: ``checkpoint-{global_step}``."""


class StoreCallback(TrainerCallback):
    """A ``TrainerCallback`` that commits each checkpoint directory to a store.

    ``store`` is a URI (opened on first use with ``store_options``, closed at the end of
    training) or an open :class:`CheckpointStore` (left open).
    """

    def __init__(
        self, store: CheckpointStore | str, *, async_push: bool = False, **store_options: Any
    ) -> None:
        self._opener = _Opener(store, store_options)
        self.async_push = async_push
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[CheckpointInfo]] = []

    @property
    def store(self) -> CheckpointStore:
        return self._opener.store

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Commit ``output_dir/checkpoint-{global_step}`` as step ``global_step``."""
        if not state.is_world_process_zero:
            return
        step = state.global_step
        directory = Path(args.output_dir or "trainer_output") / f"{CHECKPOINT_PREFIX}-{step}"
        if not directory.is_dir():
            raise NotFoundError(
                f"{directory}: the Trainer reported a save of step {step}, but this directory "
                "does not exist (hyper-parameter search runs save elsewhere: not supported)",
                path=str(directory),
                step=step,
            )
        metadata = {
            **latest_metrics(state.log_history, step),
            "hf_checkpoint": directory.name,
            "epoch": state.epoch,
        }
        store = self.store
        if not self.async_push:
            store.push_dir(step, directory, metadata)
            return
        self.wait()  # in order, one at a time
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-push")
        self._pending.append(self._executor.submit(store.push_dir, step, directory, metadata))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if control.should_save:  # the save about to happen prunes old checkpoint dirs
            self.wait()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if control.should_save:
            self.wait()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self.wait()  # a save_strategy="best" save may follow

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Wait for every push; close the store if this callback opened it."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._opener.close()

    def wait(self) -> None:
        """Wait for the pushes in flight; raise the first one's error."""
        pending, self._pending = self._pending, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors:
            raise errors[0]


def latest_metrics(log_history: Sequence[Mapping[str, Any]], step: int) -> dict[str, Any]:
    """The entries the Trainer logged at the newest step up to ``step``, merged (training
    loss and evaluation metrics are separate entries), without ``step`` itself."""
    entries = [e for e in log_history if isinstance(e.get("step"), int) and e["step"] <= step]
    if not entries:
        return {}
    newest = max(e["step"] for e in entries)
    merged: dict[str, Any] = {}
    for entry in entries:
        if entry["step"] == newest:
            merged.update(entry)
    merged.pop("step", None)
    return plain_metrics(merged)


def pull_checkpoint(
    store: CheckpointStore | str,
    output_dir: str | os.PathLike[str],
    step: int | None = None,
    **store_options: Any,
) -> Path | None:
    """Download ``step`` (default: the latest) into ``output_dir/checkpoint-N``; its path.

    ``None`` when the store is empty (start from scratch). A ``checkpoint-N`` directory that
    exists already is left as it is (the Trainer wrote it). The download is verified and lands
    whole or not at all, so ``resume_from_checkpoint=True`` never finds half a checkpoint,
    and by the store's ``load_timeout``, choosing the step included.
    """
    opener = _Opener(store, store_options)
    try:
        opened = opener.store
        with opened.resolver.loading():  # one load, by the store's load_timeout
            info = opened.latest() if step is None else opened.info(step)
            if info is None:
                log.info("%s holds no checkpoint; the Trainer starts from scratch", opened.uri)
                return None
            target = Path(output_dir) / f"{CHECKPOINT_PREFIX}-{info.step}"
            if target.is_dir() and any(target.iterdir()):
                log.info("%s exists; not pulling step %d again", target, info.step)
                return target
            # Into a name the Trainer ignores, then renamed to the step that passed verification
            # (an older one if latest is corrupt): checkpoint-N never holds another step's files.
            staging = Path(output_dir) / f".ckptstore-pull-{os.getpid()}"
            if staging.exists():
                shutil.rmtree(staging)
            staging.parent.mkdir(parents=True, exist_ok=True)
            pulled = opened.pull_dir(staging, step, fallback=step is None)
            target = target.with_name(f"{CHECKPOINT_PREFIX}-{pulled.step}")
            if target.is_dir() and any(target.iterdir()):
                shutil.rmtree(staging)
                return target
            if target.is_dir():
                target.rmdir()
            staging.rename(target)
            log.info("pulled step %d of %s into %s", pulled.step, opened.uri, target)
            return target
    finally:
        opener.close()


class _Opener:
    """A store given as an object (left open) or a URI (opened on first use, closed)."""

    def __init__(self, store: CheckpointStore | str, options: Mapping[str, Any]) -> None:
        if isinstance(store, CheckpointStore) and options:
            raise ConfigError(
                f"store options {sorted(options)} apply only when ckptstore opens the store from "
                "a URI; pass them to CheckpointStore instead"
            )
        self._given = store if isinstance(store, CheckpointStore) else None
        self._uri = store if isinstance(store, str) else store.uri
        self._options = dict(options)
        self._opened: CheckpointStore | None = None

    @property
    def store(self) -> CheckpointStore:
        if self._given is not None:
            return self._given
        if self._opened is None:
            self._opened = CheckpointStore(self._uri, **self._options)
        return self._opened

    def close(self) -> None:
        if self._opened is not None:
            opened, self._opened = self._opened, None
            opened.close()
