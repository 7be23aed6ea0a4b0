"""StoreCheckpointIO with the real Lightning Trainer, on S3 (moto on 127.0.0.1)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckptstore import CheckpointStore, ConflictError, NotFoundError, SerializationError
from ckptstore.integrations.lightning import StoreCheckpointIO

SCORES = [3.0, 1.0, 2.0, 0.5, 0.1, 0.05]
"""val_loss per epoch: decides which checkpoints save_top_k=2 keeps."""
STEPS_PER_EPOCH = 4


class Tiny(LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(SCORES[self.current_epoch]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Config:
    """A hyper-parameter the safe format cannot hold."""

    lr = 0.1


class Weights(Callback):
    """The model's weights when training starts (after any resume)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_start = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.step_at_start = trainer.global_step


def trainer(
    tmp_path: Path, io: StoreCheckpointIO, epochs: int, *extra: Callback
) -> tuple[Trainer, ModelCheckpoint]:
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val_loss", mode="min", save_top_k=2, save_last=True
    )
    made = Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[best, io, *extra],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return made, best


def fit(made: Trainer, model: LightningModule, ckpt_path: str | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_workers, small datasets
        made.fit(model, loader(), loader(), ckpt_path=ckpt_path)


def test_checkpoints_land_in_the_store_and_a_new_trainer_resumes(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any]
) -> None:
    io = StoreCheckpointIO(s3_uri, storage_options=s3_options)
    first, best = trainer(tmp_path, io, epochs=4)
    fit(first, Tiny())
    # top-2 by val_loss: epochs 1 (1.0) and 3 (0.5). Step 4 went when epoch 2 displaced it;
    # step 12 when epoch 3 displaced it *and* last.ckpt (which still named it) moved to 16
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        infos = {i.step: i.metadata for i in store.list()}
        assert sorted(infos) == [8, 16]
        assert {Path(p).name for p in best.best_k_models} == {
            "epoch=1-step=8.ckpt",
            "epoch=3-step=16.ckpt",
        }
        assert infos[16]["lightning_path"] == best.best_model_path
        assert infos[16]["val_loss"] == 0.5 and infos[16]["epoch"] == 3
        assert isinstance(infos[16]["train_loss"], float)  # logged metrics, via the callback
        saved = store.load(16)
    assert not (tmp_path / "ckpts").exists() or not any((tmp_path / "ckpts").iterdir())
    assert saved["global_step"] == 16 and saved["hyper_parameters"] == {"width": 4}

    # a new process: nothing in memory, the path Lightning handed back names the step
    weights = Weights()
    io = StoreCheckpointIO(s3_uri, storage_options=s3_options)
    second, best = trainer(tmp_path, io, 6, weights)
    model = Tiny()
    fit(second, model, ckpt_path=str(tmp_path / "ckpts" / "epoch=3-step=16.ckpt"))
    assert weights.step_at_start == 16
    assert weights.at_start.keys() == saved["state_dict"].keys()
    for key, value in saved["state_dict"].items():
        assert torch.equal(weights.at_start[key], value), key
    assert second.global_step == 24
    # epoch 4 (0.1) displaced step 8, saved by the first process; epoch 5 (0.05) displaced
    # step 16, which Lightning never removes: the second trainer resumed from it
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        assert [i.step for i in store.list()] == [16, 20, 24]
        assert torch.equal(store.load(24)["state_dict"]["layer.weight"], model.layer.weight)


@pytest.mark.parametrize("async_save", [False, True])
def test_latest_resumes_from_the_newest_step(tmp_path: Path, async_save: bool) -> None:
    uri = str(tmp_path / "store")
    first, _ = trainer(tmp_path / "a", StoreCheckpointIO(uri, async_save=async_save), epochs=2)
    fit(first, Tiny())
    weights = Weights()
    second, _ = trainer(tmp_path / "b", StoreCheckpointIO(uri), 3, weights)
    fit(second, Tiny(), ckpt_path="latest")
    assert weights.step_at_start == 8
    with CheckpointStore(uri) as store:
        # another dirpath: Lightning does not take over the first run's top-k, removes nothing
        assert [i.step for i in store.list()] == [4, 8, 12]
        assert torch.equal(
            weights.at_start["layer.bias"], store.load(8)["state_dict"]["layer.bias"]
        )


def test_unknown_paths_and_empty_stores_are_clear_errors(tmp_path: Path) -> None:
    io = StoreCheckpointIO(str(tmp_path / "store"))
    with pytest.raises(NotFoundError, match="holds no checkpoint to resume from"):
        io.load_checkpoint("latest")
    io.save_checkpoint({"global_step": 3, "state_dict": {}}, "/x/epoch=0-step=3.ckpt")
    with pytest.raises(NotFoundError, match=r"no step was saved as '/x/other.ckpt' \(it holds"):
        io.load_checkpoint("/x/other.ckpt")
    assert io.step_of("3") == 3 and io.step_of(f"{io.store.uri}/global_step_3") == 3
    assert io.load_checkpoint("/x/last.ckpt")["global_step"] == 3
    io.teardown()


def test_removal_keeps_latest_and_pinned_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    io = StoreCheckpointIO(str(tmp_path / "store"))
    for step in (1, 2, 3):
        io.save_checkpoint({"global_step": step}, f"/x/step={step}.ckpt")
    io.store.pin(1)
    with caplog.at_level(logging.INFO, "ckptstore"):
        io.remove_checkpoint("/x/step=1.ckpt")  # pinned
        io.remove_checkpoint("/x/step=3.ckpt")  # latest
        io.remove_checkpoint("/x/step=2.ckpt")
        io.remove_checkpoint("/x/never-saved.ckpt")
    assert [i.step for i in io.store.list()] == [1, 3]
    assert caplog.text.count("it is the latest or pinned") == 2
    io.teardown()


def test_a_rerun_that_forgot_to_resume_does_not_adopt_old_steps(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    io = StoreCheckpointIO(uri)
    io.save_checkpoint({"global_step": 4, "old": True}, "/x/epoch=0-step=4.ckpt")
    io.teardown()
    rerun = StoreCheckpointIO(uri)
    with pytest.raises(ConflictError, match="step 4"):  # the store refuses; nothing is skipped
        rerun.save_checkpoint({"global_step": 4, "old": False}, "/x/epoch=0-step=4.ckpt")
    rerun.teardown()
    with CheckpointStore(uri) as store:
        assert store.load(4)["old"] is True


def test_objects_the_safe_format_cannot_hold_need_allow_pickle(tmp_path: Path) -> None:
    checkpoint = {"global_step": 1, "hyper_parameters": {"config": Config()}}
    io = StoreCheckpointIO(str(tmp_path / "store"))
    with pytest.raises(SerializationError, match=r"\['hyper_parameters'\]\['config'\]"):
        io.save_checkpoint(checkpoint, "/x/a.ckpt")
    io.teardown()
    io = StoreCheckpointIO(str(tmp_path / "store"), allow_pickle=True)
    io.save_checkpoint(checkpoint, "/x/a.ckpt")
    assert io.load_checkpoint("/x/a.ckpt")["hyper_parameters"]["config"].lr == 0.1
    io.teardown()


def test_without_lightning_the_import_names_the_extra_to_install() -> None:
    hide = "import sys; sys.modules['lightning'] = None; "
    code = hide + "import ckptstore.integrations.lightning"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install 'ckptstore[lightning]'" in done.stderr, done.stderr
