"""One resolver under every face: the same fenced-writer, fallback and refusal cases through
``store.load``, ``load_distributed``, the DCP reader and the verl resume (invariants 11, 14,
16). Each face saves with its own writer, so the coordinated save is exercised too.

* fenced: a zombie whose last renewal landed just before a takeover commits step 3 after it;
  every face resumes from step 2, never from the zombie's step.
* fallback: a file of latest fails verification; every face resumes from the step before.
* refused: every step is signed with another key; every face raises, saying how many steps
  were refused and why, instead of starting from scratch.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore
from ckptstore.domain.layout import VERL_TRACKER_NAME
from ckptstore.integrations.dcp import METADATA_FILE, CkptStoreReader, CkptStoreWriter
from ckptstore.integrations.distributed import load_distributed, save_distributed
from ckptstore.integrations.verl import commit_step, prepare_resume
from ckptstore.integrations.verl_nodes import LocalFleet, NodeAgent
from keys import file_key

KEY_A = "a" * 64
KEY_B = "b" * 64


def tensor_of(step: int) -> torch.Tensor:
    return torch.full((16,), float(step))


@dataclass
class Face:
    """How one face saves a step, which file of it a corruption targets, and how it resumes
    (returning the step it resumed from)."""

    name: str
    save: Callable[[CheckpointStore, int, Path], Any]
    target: Callable[[CheckpointStore, int], str]
    resume: Callable[[CheckpointStore, Path], int | None]


def _largest(store: CheckpointStore, step: int) -> str:
    return max(store.info(step).files, key=lambda f: f.size).path


def _store_save(store: CheckpointStore, step: int, _: Path) -> Any:
    return store.save(step, {"w": tensor_of(step)})


def _store_resume(store: CheckpointStore, _: Path) -> int:
    loaded = store.load(with_info=True)
    assert torch.equal(loaded.state["w"], tensor_of(loaded.step))
    return loaded.step


def _dist_save(store: CheckpointStore, step: int, _: Path) -> Any:
    return save_distributed(store, step, {"w": tensor_of(step)})


def _dist_resume(store: CheckpointStore, _: Path) -> int | None:
    state = load_distributed(store)
    assert store.last_loaded is not None
    assert torch.equal(state["w"], tensor_of(store.last_loaded.step))
    return store.last_loaded.step


def _dcp_save(store: CheckpointStore, step: int, _: Path) -> Any:
    return dcp.save({"w": tensor_of(step)}, storage_writer=CkptStoreWriter(store, step))


def _dcp_resume(store: CheckpointStore, _: Path) -> int | None:
    reader = CkptStoreReader(store)
    state = {"w": torch.zeros(16)}
    dcp.load(state, storage_reader=reader)
    assert reader.info is not None and torch.equal(state["w"], tensor_of(reader.info.step))
    return reader.info.step


def _verl_config(local: Path, uri: str) -> dict[str, Any]:
    return {
        "trainer": {
            "default_local_dir": str(local),
            "resume_mode": "auto",
            "nnodes": 1,
            "n_gpus_per_node": 1,
            "ckptstore": {"uri": uri},
        },
    }


def _verl_save(store: CheckpointStore, step: int, scratch: Path) -> Any:
    """What verl writes for one step on one rank, committed by the driver."""
    local = scratch / "saver"
    actor = local / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    for kind in ("model", "optim", "extra_state"):
        (actor / f"{kind}_world_size_1_rank_0.pt").write_bytes(f"{kind} {step}".encode() * 40)
    (local / f"global_step_{step}" / "data.pt").write_bytes(f"data {step}".encode())
    (local / VERL_TRACKER_NAME).write_text(str(step))
    fleet = LocalFleet({"node": NodeAgent(str(local), store.uri, store=store)})
    return commit_step(store, fleet, step, world_size=1)


def _verl_resume(store: CheckpointStore, scratch: Path) -> int | None:
    local = scratch / f"resumer-{len(list(scratch.iterdir()))}"
    fleet = LocalFleet({"node": NodeAgent(str(local), store.uri, store=store)})
    resumed = prepare_resume(_verl_config(local, store.uri), store=store, fleet=fleet)
    if resumed.step is not None:
        data = (local / f"global_step_{resumed.step}" / "data.pt").read_bytes()
        assert data == f"data {resumed.step}".encode()
    return resumed.step


FACES = [
    Face("store.load", _store_save, _largest, _store_resume),
    Face("load_distributed", _dist_save, _largest, _dist_resume),
    Face("dcp", _dcp_save, lambda store, step: METADATA_FILE, _dcp_resume),
    Face("verl", _verl_save, lambda store, step: "data.pt", _verl_resume),
]


@pytest.fixture(params=FACES, ids=[f.name for f in FACES])
def face(request: pytest.FixtureRequest) -> Face:
    face: Face = request.param
    return face


def test_a_fenced_writers_step_is_never_resumed_from(
    face: Face, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, scratch = str(tmp_path / "store"), tmp_path / "scratch"
    scratch.mkdir()
    zombie = CheckpointStore(uri)
    for step in (1, 2):
        face.save(zombie, step, scratch)
    assert zombie.lease is not None
    epoch = zombie.hold_lease()
    replacement = CheckpointStore(uri, takeover=True)
    # the zombie's last renewal landed just before the takeover: it commits step 3 after it
    monkeypatch.setattr(zombie.lease, "hold", lambda: epoch)
    with pytest.raises(BaseException, match="newer writer lease"):  # DCP: a BaseException
        face.save(zombie, 3, scratch)
    assert zombie.backend.stat("global_step_3/ckptstore.manifest.json") is not None
    assert replacement.fenced_steps() == [3]
    assert face.resume(replacement, scratch) == 2
    replacement.close()


def test_a_latest_that_fails_verification_falls_back_to_the_step_before(
    face: Face, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, scratch = str(tmp_path / "store"), tmp_path / "scratch"
    scratch.mkdir()
    with CheckpointStore(uri) as store:
        for step in (1, 2):
            face.save(store, step, scratch)
        path = Path(uri) / file_key(store, 2, face.target(store, 2))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))
    with CheckpointStore(uri, lease=False) as store:
        assert face.resume(store, scratch) == 1
    assert "trying an older step" in caplog.text


def test_a_store_whose_steps_are_all_refused_raises_instead_of_starting_fresh(
    face: Face, tmp_path: Path
) -> None:
    uri, scratch = str(tmp_path / "store"), tmp_path / "scratch"
    scratch.mkdir()
    with CheckpointStore(uri, signing_key=KEY_A) as store:
        for step in (1, 2, 3):
            face.save(store, step, scratch)
    with (
        CheckpointStore(uri, lease=False, signing_key=KEY_B) as store,
        pytest.raises(BaseException) as caught,  # DCP wraps ours in a BaseException
    ):
        face.resume(store, scratch)
    text = "".join(traceback.format_exception(caught.value))
    assert "3 steps refused: the manifest is signed with another key" in text, text
