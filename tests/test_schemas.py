"""Frozen stores of every manifest schema load as they were saved; a store written by a newer
ckptstore is refused as such ("upgrade ckptstore"), never read as corrupt, and a resume never
falls back past it to an older step (invariant 14).

``store_v2`` was written by the code before schema 3 (no state index), ``store_v3`` by the
code of schema 3, and ``store_future`` is ``store_v3`` with a step 30 whose manifest says
schema 4 and carries a field this ckptstore does not know, as a newer version would write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, CompatibilityError, CorruptCheckpointError
from ckptstore.cli.main import run as cli_run
from ckptstore.domain.manifest import SCHEMA_VERSION

FIXTURES = Path(__file__).parent / "fixtures"
SAVED = {
    10: {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "step": 10},
    20: {"model": {"w": torch.ones(2, 3)}, "step": 20},
}


def copy_of(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    return root


@pytest.mark.parametrize("schema", ["store_v2", "store_v3"])
def test_a_frozen_store_of_each_schema_loads_bit_exact(schema: str, tmp_path: Path) -> None:
    root = copy_of(schema, tmp_path)
    with CheckpointStore(str(root), lease=False) as store:
        assert [i.step for i in store.list()] == [10, 20]
        for step, expected in SAVED.items():
            loaded = store.load(step)
            assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
            assert loaded["step"] == step
        assert store.load(with_info=True).step == 20
        partial = store.load(20, keys=["model"])
        assert list(partial) == ["model"] and torch.equal(partial["model"]["w"], torch.ones(2, 3))
        assert all(report.ok for report in store.verify_all())


def test_a_manifest_of_a_newer_schema_is_a_compatibility_error_naming_both(
    tmp_path: Path,
) -> None:
    root = copy_of("store_future", tmp_path)
    with CheckpointStore(str(root), lease=False) as store:
        for read in (store.latest, store.load, lambda: store.info(30)):
            with pytest.raises(CompatibilityError) as caught:
                read()
            message = str(caught.value)
            assert "schema_version 4" in message and f"up to {SCHEMA_VERSION}" in message
            assert "upgrade ckptstore" in message
            assert not isinstance(caught.value, CorruptCheckpointError)
        assert store.load(20)["step"] == 20  # an older step, asked for by number, still loads


def test_a_newer_step_past_the_pointer_is_not_skipped_for_an_older_one(tmp_path: Path) -> None:
    """The newer writer died before moving latest: its step is still the newest committed,
    so resuming from step 20 would go back in time."""
    root = copy_of("store_future", tmp_path)
    pointer = json.loads((root / "latest.json").read_text())
    pointer.update(step=20, manifest="global_step_20/ckptstore.manifest.json")
    (root / "latest.json").write_text(json.dumps(pointer))
    with CheckpointStore(str(root), lease=False) as store:
        for read in (store.load, store.latest):
            with pytest.raises(CompatibilityError, match="upgrade ckptstore"):
                read()


def test_the_cli_says_upgrade_and_exits_non_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_of("store_future", tmp_path)
    assert cli_run(["show", str(root), "latest"]) != 0
    assert "upgrade ckptstore" in capsys.readouterr().err
