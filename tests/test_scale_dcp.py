"""The DCP writer reads the previous step once, on the coordinator: each rank's plan carries the
entry of its own file, so no rank reads ``latest`` or the previous manifest (README "Scale")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.integrations.dcp import METADATA_FILE, CkptStoreReader, CkptStoreWriter
from counting import CountingBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_dcp_save_reads_the_previous_step_once_and_copies_an_unchanged_rank(
    tmp_path: Path,
) -> None:
    backend = CountingBackend(LocalBackend(str(tmp_path), {}))
    state = {"t": torch.arange(6, dtype=torch.float32)}
    with CheckpointStore(str(tmp_path), backend=backend) as store:
        dcp.save(state, storage_writer=CkptStoreWriter(store, 1))
        backend.take()
        dcp.save(state, storage_writer=CkptStoreWriter(store, 2))
        # one read of the previous step for every rank and for .metadata, when the save
        # begins; latest: that read and the move's swap
        calls = backend.take()
        assert (calls["manifest GET"], calls["pointer GET"]) == (1, 2), calls
        files = {f.path: f.copied_from for f in store.info(2).files}
        assert files == {"__0_0.distcp": 1, METADATA_FILE: None}  # a new save_id each save
        loaded = {"t": torch.zeros(6)}
        dcp.load(loaded, storage_reader=CkptStoreReader(store, 2))
        assert torch.equal(loaded["t"], state["t"])
