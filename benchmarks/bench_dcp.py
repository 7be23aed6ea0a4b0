"""The ``ckptstore dcp.save`` rows: ``dcp.save`` through ``CkptStoreWriter`` into a store.

One process and no process group (``no_dist=True``), one store and a new step per run, as the
``ckptstore save`` rows. The row's extra RSS is what the writer holds beyond the state: its
bound is the S3 backend's part buffers plus 10% of the state, as for ``CheckpointStore.save``.
"""

from __future__ import annotations

from typing import Any

from bench_methods import Ckpt


class CkptDcpSave(Ckpt):
    """``dcp.save(state, storage_writer=CkptStoreWriter(store, step), no_dist=True)``."""

    def write(self, state: Any) -> None:
        self._save(state, 1)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self._save(state, i + 1)
        return None, {}

    def _save(self, state: Any, step: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        from ckptstore.integrations.dcp import CkptStoreWriter

        save(state, storage_writer=CkptStoreWriter(self.store, step), no_dist=True)
