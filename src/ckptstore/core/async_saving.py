"""The save in flight: ``save_async`` snapshots the state, then writes it through the store's
Saver in one background worker (background.py). This object owns everything about that save
(the worker, the snapshot buffers, the update guard), and every other save of the store waits
for it first (``Saver.drain``).

The snapshot copies tensors into host buffers reused from save to save (snapshot.py). With
``overlap``, the copy of what only an update changes is deferred to the worker as well, and
an :class:`~ckptstore.data.snapshot.UpdateGuard` makes the next update wait for what is left.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptstore.core.save_target import check_not_behind
from ckptstore.core.saving import Saver
from ckptstore.data.background import Abandon, BackgroundSaver, SaveHandle
from ckptstore.deadline import Deadline, bounded
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_STATE, check_metadata

if TYPE_CHECKING:
    from ckptstore.data.snapshot import Snapshotter, UpdateGuard


class AsyncSaver:
    """One store's save in flight: its worker, snapshot buffers and update guard."""

    def __init__(self) -> None:
        self.background: BackgroundSaver[CheckpointInfo] = BackgroundSaver()
        self.snapshotter: Snapshotter | None = None
        """Host buffers for snapshots, reused from save to save."""
        self.guard: UpdateGuard | None = None
        """Makes updates wait for an overlapped snapshot's copy."""
        self.committed: int | None = None
        """The last step an async save of this store committed."""

    def drain(self) -> None:
        """Wait for the save in flight; raise its error if nobody heard of it."""
        self.background.drain()

    def save_async(
        self,
        writer: Saver,
        step: int,
        state: Any,
        metadata: Mapping[str, Any] | None,
        allow_pickle: bool,
        *,
        allow_older: bool = False,
        overlap: object = False,
    ) -> SaveHandle[CheckpointInfo]:
        """Snapshot ``state``, then write it in the background.

        A step behind ``latest`` is refused here, in the caller, before the snapshot. Once
        this store has committed a step and saves a later one, the call reads nothing (a GET
        less in the loop's time): a rival that moved ``latest`` past it meanwhile is then
        refused by the background save, before anything is uploaded, as a rerun is. That read
        runs under the store's ``save_timeout`` too: a storage that does not answer fails the
        call with SaveTimeoutError by then, instead of holding the training loop for as long as
        the retries last."""
        user_metadata = check_metadata(metadata)
        self.drain()
        if not allow_older and (self.committed is None or step <= self.committed):
            with bounded(Deadline.of(writer.save_timeout)):
                check_not_behind(writer, step, writer.latest_step())
        started = time.perf_counter()
        from ckptstore.data.serialize import encode_state
        from ckptstore.data.snapshot import Snapshotter, UpdateGuard, deferral

        deferred, optimizers = deferral(overlap)
        snapshotter = self.snapshotter = self.snapshotter or Snapshotter()
        snapshotter.begin(deferred)
        encoded = encode_state(
            state, shard_size=writer.shard_size, allow_pickle=allow_pickle, snapshot=snapshotter
        )
        copy = snapshotter.finish()
        guard = self.guard = self.guard or UpdateGuard()
        guard.watch(copy, optimizers)
        blocked = time.perf_counter() - started

        def work(abandon: Abandon) -> CheckpointInfo:
            copy.run()
            info = writer.write(
                step,
                lambda: [replace(f, chunks=abandon.checked(f.chunks)) for f in encoded.files()],
                KIND_STATE,
                user_metadata,
                blocked=blocked + copy.waited_seconds,
                files_by_key=encoded.files_by_key,
                allow_older=allow_older,
                abandon=abandon,
            )
            self.committed = step
            return info

        return self.background.submit(
            step, work, blocked, uri=writer.uri, snapshot_done=guard.before_update
        )

    def before_update(self) -> None:
        """Wait for the copy of an overlapped snapshot (before changing a saved tensor)."""
        if self.guard is not None:
            self.guard.before_update()

    def close(self) -> None:
        """Finish the save in flight (raising its error); unhook the optimizers."""
        try:
            self.background.close()
        finally:
            if self.guard is not None:
                self.guard.close()
