"""What a failed coordinated save tells its participants to do with their files: remove them
only when the step is certainly not committed (``DistributedCheckpointError.discarded``). A
commit whose answer was lost may have committed the step: every participant's files, its
shares in the bucket included, must stay, or the step it committed loses files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.core.reports import Staged
from ckptstore.data.payload import SourceFile
from ckptstore.domain import layout
from ckptstore.domain.manifest import KIND_DIRECTORY
from ckptstore.errors import DistributedCheckpointError
from faults import InjectedFault


class LosesTheCommitsAnswer(BackendProxy):
    """The manifest is written, then the answer is lost (the call raises)."""

    def create(self, path: str, data: bytes) -> None:
        super().create(path, data)
        if path == layout.manifest_path(1):
            raise InjectedFault(f"connection reset after writing {path}")


def conclude(store: CheckpointStore, failing: bool) -> DistributedCheckpointError:
    coordinator = store.begin_save(1, kind=KIND_DIRECTORY)
    mine = coordinator.stage_here([SourceFile("rank_0/a.bin", lambda: [b"rank 0"])])
    reports = [Staged(0, tuple(mine), node=store.node)]
    if failing:
        reports.append(Staged.failure(1, OSError("rank 1: no space left on device")))
    with pytest.raises(DistributedCheckpointError) as caught:
        coordinator.conclude(reports, coordinator=0)
    return caught.value


def test_a_participant_failure_discards_the_step(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path / "store"), lease=False) as store:
        error = conclude(store, failing=True)
    assert error.discarded
    assert "was not saved" in str(error)


def test_a_commit_that_may_have_committed_keeps_every_file(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    backend = LosesTheCommitsAnswer(LocalBackend(uri, {}))
    with CheckpointStore(uri, backend=backend, lease=False) as store:
        error = conclude(store, failing=False)
    assert not error.discarded  # the participants keep their files
    assert "is committed, but rank 0 failed after committing it" in str(error)
    with CheckpointStore(uri, lease=False) as store:
        assert store.read_file(store.info(1), "rank_0/a.bin") == b"rank 0"
