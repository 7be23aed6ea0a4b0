"""StoreCallback and pull_checkpoint with the real transformers Trainer, on S3 (moto)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from safetensors.torch import load_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ckptstore import CheckpointStore, CorruptCheckpointError
from ckptstore.integrations.hf_trainer import StoreCallback, latest_metrics, pull_checkpoint


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (32, 12), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class AtStart(TrainerCallback):
    """The weights and step when training starts, after any resume."""

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs["model"]
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.step = state.global_step


def train(
    output_dir: Path, steps: int, callback: StoreCallback, seed: int, resume: bool = False
) -> tuple[Trainer, AtStart]:
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        save_steps=2,
        save_total_limit=1,  # the Trainer prunes local copies; the store keeps every step
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    at_start = AtStart()
    trainer = Trainer(
        model=tiny_model(seed),
        args=args,
        train_dataset=Tokens(),
        callbacks=[callback, at_start],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer, at_start


@pytest.mark.parametrize("async_push", [False, True])
def test_checkpoints_are_committed_and_a_wiped_run_resumes(
    tmp_path: Path, s3_uri: str, s3_options: dict[str, Any], async_push: bool
) -> None:
    output = tmp_path / "out"
    callback = StoreCallback(s3_uri, async_push=async_push, storage_options=s3_options)
    first, _ = train(output, 4, callback, seed=0)
    saved = load_file(output / "checkpoint-4" / "model.safetensors")
    assert not (output / "checkpoint-2").exists()  # pruned locally by save_total_limit
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        infos = {i.step: i for i in store.list()}
        assert sorted(infos) == [2, 4]
        metadata = infos[4].metadata
        assert metadata["hf_checkpoint"] == "checkpoint-4" and metadata["epoch"] > 0
        assert metadata["loss"] == first.state.log_history[3]["loss"]
        assert "trainer_state.json" in {f.path for f in infos[4].manifest.files}

    shutil.rmtree(output)
    path = pull_checkpoint(s3_uri, output, storage_options=s3_options)
    assert path == output / "checkpoint-4"
    callback = StoreCallback(s3_uri, async_push=async_push, storage_options=s3_options)
    resumed, at_start = train(output, 6, callback, seed=123, resume=True)
    assert at_start.step == 4
    for name, tensor in saved.items():
        assert torch.equal(at_start.weights[name], tensor), name
    assert resumed.state.global_step == 6
    # the pulled trainer_state.json brought the history of steps 1-4; training added 5 and 6
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        assert [i.step for i in store.list()] == [2, 4, 6]


def test_pull_falls_back_past_a_corrupt_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        for step in (2, 4):
            source = tmp_path / f"src{step}"
            source.mkdir()
            (source / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
            store.push_dir(step, source)
        entry = store.info(4).manifest.file("trainer_state.json")
        store.backend.write(entry.key(4), [b"x" * entry.size])
    with caplog.at_level(logging.WARNING, "ckptstore"):
        path = pull_checkpoint(uri, tmp_path / "out")
    assert path == tmp_path / "out" / "checkpoint-2"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-2"]
    assert "step 4 failed verification" in caplog.text
    with pytest.raises(CorruptCheckpointError):
        pull_checkpoint(uri, tmp_path / "other", step=4)
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "other").iterdir())


def test_an_empty_store_means_from_scratch(tmp_path: Path) -> None:
    assert pull_checkpoint(str(tmp_path / "store"), tmp_path / "out") is None


def test_latest_metrics_merges_the_newest_step() -> None:
    history = [
        {"loss": 2.0, "step": 1, "epoch": 0.1},
        {"loss": 1.5, "learning_rate": 0.01, "step": 2, "epoch": 0.2},
        {"eval_loss": torch.tensor(1.25), "step": 2, "epoch": 0.2},
        {"loss": 1.0, "step": 3, "epoch": 0.3},
    ]
    assert latest_metrics(history, 2) == {
        "loss": 1.5,
        "learning_rate": 0.01,
        "eval_loss": 1.25,
        "epoch": 0.2,
    }
    assert latest_metrics(history, 0) == {}


def test_a_save_about_to_happen_waits_for_the_push_in_flight(tmp_path: Path) -> None:
    """The Trainer prunes old checkpoint dirs at its next save: the push of one must be done
    by then. A push held on an event shows the wait, and that a failed push is raised."""
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    release, pushed = threading.Event(), []

    def slow_push(step: int, directory: Path, metadata: Any) -> None:
        release.wait(timeout=30)
        pushed.append(step)
        raise OSError("disk went away")

    with CheckpointStore(str(tmp_path / "store")) as store:
        store.push_dir = slow_push  # type: ignore[method-assign]
        callback = StoreCallback(store, async_push=True)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
        state, control = TrainerState(global_step=2), TrainerControl()
        callback.on_save(args, state, control)  # returns at once
        callback.on_step_end(args, state, control)  # no save due: does not wait
        assert pushed == []
        control.should_save = True
        errors: list[str] = []

        def save_due() -> None:
            try:
                callback.on_step_end(args, state, control)
            except OSError as e:
                errors.append(str(e))

        waiter = threading.Thread(target=save_due)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive() and pushed == []  # blocked on the push
        release.set()
        waiter.join(timeout=30)
        assert pushed == [2] and errors == ["disk went away"]


def test_without_transformers_the_import_names_the_extra_to_install() -> None:
    hide = "import sys; sys.modules['transformers'] = None; "
    code = hide + "import ckptstore.integrations.hf_trainer"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install 'ckptstore[transformers]'" in done.stderr, done.stderr
