"""``save_async``: snapshot the state, then write it through the store's StepWriter in its
one background worker (background.py).

The snapshot copies tensors into host buffers reused from save to save (snapshot.py). With
``overlap``, the copy of what only an update changes is deferred to the worker as well, and
an :class:`~ckptstore.snapshot.UpdateGuard` makes the next update wait for what is left.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptstore import layout
from ckptstore.background import Abandon, SaveHandle
from ckptstore.info import CheckpointInfo
from ckptstore.manifest import KIND_STATE, check_metadata
from ckptstore.saving import StepWriter, step_of

if TYPE_CHECKING:
    from ckptstore.snapshot import Snapshotter, UpdateGuard


class AsyncSaver:
    """The snapshot buffers and update guard of one store's async saves."""

    def __init__(self, writer: StepWriter) -> None:
        self.writer = writer
        self.snapshotter: Snapshotter | None = None
        """Host buffers for snapshots, reused from save to save."""
        self.guard: UpdateGuard | None = None
        """Makes updates wait for an overlapped snapshot's copy."""
        self.committed: int | None = None
        """The last step an async save of this store committed."""

    def save_async(
        self,
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
        refused by the background save, before anything is uploaded, as a rerun is."""
        writer = self.writer
        step = layout.check_step(step)
        user_metadata = check_metadata(metadata)
        writer.background.drain()
        if not allow_older and (self.committed is None or step <= self.committed):
            writer.check_not_behind(step, step_of(writer.catalog.pointer_or_none()))
        started = time.perf_counter()
        from ckptstore.serialize import encode_state
        from ckptstore.snapshot import Snapshotter, UpdateGuard, deferral

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
                [replace(f, chunks=abandon.checked(f.chunks)) for f in encoded.files()],
                KIND_STATE,
                user_metadata,
                blocked=blocked + copy.waited_seconds,
                files_by_key=encoded.files_by_key,
                allow_older=allow_older,
                abandon=abandon,
            )
            self.committed = step
            return info

        return writer.background.submit(
            step, work, blocked, uri=writer.uri, snapshot_done=guard.before_update
        )

    def before_update(self) -> None:
        """Wait for the copy of an overlapped snapshot (before changing a saved tensor)."""
        if self.guard is not None:
            self.guard.before_update()

    def close(self) -> None:
        """Finish the save in flight (raising its error); unhook the optimizers."""
        try:
            self.writer.background.close()
        finally:
            if self.guard is not None:
                self.guard.close()
