"""The deadline belongs to the core (docs/design.md, invariant 15): the coordinated save sets it
when it begins and every phase and participant runs by it, whichever face drives the save;
the resolver sets a load's; and a step whose manifest is written is reported committed even
when the pointer cannot be moved after it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.core.reports import Staged
from ckptstore.data.payload import SourceFile
from ckptstore.domain.layout import LATEST_NAME
from ckptstore.domain.manifest import KIND_DIRECTORY
from ckptstore.errors import BackendError, DistributedCheckpointError, SaveTimeoutError
from ckptstore.integrations.distributed import load_distributed, save_distributed
from slow import Slow


class RefusesDeletes(BackendProxy):
    """A bucket whose policy denies deletes to this writer."""

    def delete(self, paths: Sequence[str]) -> None:
        raise BackendError(f"{self.uri}: AccessDenied on DeleteObjects")


class MutePointer(BackendProxy):
    """A server that stopped answering right after the commit marker: every swap of
    ``latest.json`` fails."""

    def swap(self, path: str, data: bytes, expected: str | None) -> str:
        if path == LATEST_NAME:
            raise BackendError(f"{self.uri}/{path}: the server stopped answering", retryable=True)
        return super().swap(path, data, expected)


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32)}


def test_a_step_whose_pointer_cannot_move_is_reported_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri, lease=False) as first:
        first.save(1, state())
    mute = MutePointer(LocalBackend(uri, {}))
    with caplog.at_level(logging.WARNING), CheckpointStore(uri, backend=mute, lease=False) as s:
        info = s.save(2, state())  # no "nothing was committed" error: it is committed
    assert info.step == 2
    assert "step 2 is committed, but latest could not be moved" in caplog.text
    with CheckpointStore(uri, lease=False) as reader:
        assert reader.latest().step == 2  # type: ignore[union-attr]  # found by listing
        assert torch.equal(reader.load()["w"], state()["w"])


def test_participants_stage_by_the_deadline_the_coordinator_began(tmp_path: Path) -> None:
    """A participant's store has no save_timeout of its own: the plan carries what is left
    of the coordinator's, so the face cannot forget it."""
    uri = str(tmp_path / "store")
    coordinator_store = CheckpointStore(uri, save_timeout=0.5)
    participant = CheckpointStore(uri, backend=Slow(LocalBackend(uri, {}), 0.2), lease=False)
    coordinator = coordinator_store.begin_save(1, kind=KIND_DIRECTORY)
    assert coordinator.plan.seconds is not None and 0 < coordinator.plan.seconds <= 0.5
    chunks = [b"x" * 1024] * 20  # 4 s at 0.2 s a chunk
    source = SourceFile("big.bin", lambda: iter(chunks), 20 * 1024)
    started = time.monotonic()
    with pytest.raises(SaveTimeoutError, match=r"0\.\d+ s deadline"):
        participant.stage_files(1, [source], plan=coordinator.plan)
    assert time.monotonic() - started < 3.0
    coordinator.discard()
    coordinator_store.close()
    participant.close()


def test_a_failed_save_whose_files_cannot_be_removed_does_not_say_they_were(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "store")
    refusing = RefusesDeletes(LocalBackend(uri, {}))
    with CheckpointStore(uri, backend=refusing, lease=False) as store:
        coordinator = store.begin_save(1, kind=KIND_DIRECTORY)
        mine = coordinator.stage_here([SourceFile("rank_0/a.bin", lambda: [b"rank 0"])])
        failed = Staged.failure(1, OSError("rank 1: no space left on device"))
        with pytest.raises(DistributedCheckpointError) as caught:
            coordinator.conclude([Staged(0, tuple(mine)), failed])
    message = str(caught.value)
    assert "step 1 was not saved (nothing committed; removing its staged files failed (" in message
    assert "AccessDenied on DeleteObjects" in message and "staged files discarded" not in message
    assert "`ckptstore gc` removes what is left" in message and "rank 1: no space" in message
    with CheckpointStore(uri, lease=False) as store:
        assert store.list() == []
        report = store.gc(older_than=0)  # what the message promises
    assert any(path.endswith("rank_0/a.bin") for path in report.deleted)
    assert not list((tmp_path / "store").glob("global_step_1/.attempt-*"))  # a tombstone at most


def test_load_distributed_runs_by_the_load_timeout(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as writer:
        save_distributed(writer, 1, state())
    slow = Slow(LocalBackend(uri, {}), 0.3)
    with CheckpointStore(uri, backend=slow, lease=False, load_timeout=0.5) as reader:
        started = time.monotonic()
        with pytest.raises(DistributedCheckpointError, match="deadline") as caught:
            load_distributed(reader)
        assert time.monotonic() - started < 5.0
    assert "LoadTimeoutError" in str(caught.value)
    assert {(d.operation, d.seconds) for d in slow.deadlines} == {("load", 0.5)}
