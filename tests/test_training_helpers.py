"""CheckpointCallback and resume: saves at the right steps, resumes bit-identically."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointError, CheckpointStore, ConfigError
from ckptstore.integrations.training import CheckpointCallback, resume


class Run:
    """A small model trained on data drawn from every global RNG, so that a resume which
    misses any RNG state, or any optimizer or scheduler state, diverges."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.7)

    def step(self) -> None:
        x = torch.randn(16, 4) + random.random() + float(np.random.rand())
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": (torch.get_rng_state(), random.getstate(), np.random.rand()),
        }


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def assert_identical(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_identical(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_identical(a, b)
    else:
        assert got == want


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_the_callback_saves_every_save_freq_steps(tmp_path: Path) -> None:
    run = Run(0)
    with CheckpointStore(str(tmp_path), keep_last=2) as store:
        callback = CheckpointCallback(store, save_freq=3, preemption_signals=())
        handles = [callback.on_step(step, run.model, run.optimizer) for step in range(1, 11)]
        store.wait()
        assert [h is not None for h in handles] == [s % 3 == 0 for s in range(1, 11)]
        assert [i.step for i in store.list()] == [6, 9]  # the store's retention applied


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_continues_bit_identically(tmp_path: Path, async_save: bool) -> None:
    seed_all(1)
    straight = Run(0)
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(
            store, save_freq=5, async_save=async_save, preemption_signals=()
        )
        for step in range(1, 9):  # saves step 5, then goes on without saving
            straight.step()
            callback.on_step(step, straight.model, straight.optimizer, straight.scheduler, {"k": 1})
    for _ in range(9, 12):
        straight.step()
    want = straight.snapshot()

    seed_all(99)  # a restarted job: other weights, other RNG states
    resumed = Run(123)
    extra: dict[str, Any] = {}
    with CheckpointStore(str(tmp_path), takeover=True) as store:
        start = resume(store, resumed.model, resumed.optimizer, resumed.scheduler, extra=extra)
    assert start == 5 and extra == {"k": 1}
    for _ in range(start + 1, 12):
        resumed.step()
    assert_identical(resumed.snapshot(), want)


def test_an_empty_store_starts_at_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Run(0)
    with CheckpointStore(str(tmp_path)) as store, caplog.at_level(logging.INFO, "ckptstore"):
        assert resume(store, run.model, run.optimizer) == 0
    assert "holds no checkpoint; starting from step 0" in caplog.text


def test_a_missing_bucket_raises_instead_of_starting_over(
    s3_options: dict[str, Any], s3_client: Any
) -> None:
    run = Run(0)
    with (
        CheckpointStore("s3://no-such-bucket-here/run", storage_options=s3_options) as store,
        pytest.raises(CheckpointError, match="bucket 'no-such-bucket-here' does not exist"),
    ):
        resume(store, run.model, run.optimizer)


def test_a_corrupt_latest_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(0)
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(store, save_freq=2, async_save=False, preemption_signals=())
        for step in range(1, 5):
            run.step()
            callback.on_step(step, run.model, run.optimizer, run.scheduler)
            if step == 2:
                want = run.snapshot()
        entry = store.info(4).manifest.file("model-00000.safetensors")
        store.backend.write(entry.key(4), [b"\0" * entry.size])
        resumed = Run(7)
        with caplog.at_level(logging.WARNING, "ckptstore"):
            assert resume(store, resumed.model, resumed.optimizer, resumed.scheduler) == 2
    assert "step 4 failed verification" in caplog.text
    got = resumed.snapshot()
    assert_identical(got["model"], want["model"])
    assert_identical(got["optimizer"], want["optimizer"])
    assert_identical(got["scheduler"], want["scheduler"])


def test_a_step_saved_otherwise_is_a_clear_error(tmp_path: Path) -> None:
    run = Run(0)
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"weights": run.model.state_dict()})
        with pytest.raises(ConfigError, match="not saved by CheckpointCallback"):
            resume(store, run.model, run.optimizer)


def test_a_plain_save_is_refused_before_anything_is_restored(tmp_path: Path) -> None:
    saved, fresh = Run(0), Run(1)
    saved.step()
    seed_all(5)
    before = fresh.snapshot()
    with CheckpointStore(str(tmp_path)) as store:
        store.save(
            3, {"model": saved.model.state_dict(), "optimizer": saved.optimizer.state_dict()}
        )
        with pytest.raises(ConfigError) as caught:
            resume(store, fresh.model, fresh.optimizer)
        message = str(caught.value)
        assert f"{store.uri}/global_step_3 (step 3) lacks 'rng'" in message
        assert "Nothing was restored; pass rng=False" in message
        assert caught.value.step == 3
        seed_all(5)
        assert_identical(fresh.snapshot(), before)  # model, optimizer and RNGs untouched

        assert resume(store, fresh.model, fresh.optimizer, rng=False) == 3
    assert_identical(fresh.snapshot()["model"], saved.snapshot()["model"])
    assert_identical(fresh.snapshot()["optimizer"], saved.snapshot()["optimizer"])


def test_strict_false_restores_what_the_step_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved, fresh = Run(0), Run(1)
    optimizer_before = fresh.snapshot()["optimizer"]
    with CheckpointStore(str(tmp_path)) as store:
        store.save(2, {"model": saved.model.state_dict()})
        with pytest.raises(
            ConfigError, match=r"lacks 'optimizer', 'scheduler', 'rng'.*strict=False"
        ):
            resume(store, fresh.model, fresh.optimizer, fresh.scheduler)
        with caplog.at_level(logging.WARNING, "ckptstore"):
            assert resume(store, fresh.model, fresh.optimizer, fresh.scheduler, strict=False) == 2
    assert "restoring without optimizer, scheduler, rng" in caplog.text
    assert_identical(fresh.snapshot()["model"], saved.snapshot()["model"])
    assert_identical(fresh.snapshot()["optimizer"], optimizer_before)


def test_without_a_model_even_strict_false_refuses(tmp_path: Path) -> None:
    run = Run(0)
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, torch.zeros(3))
        with pytest.raises(ConfigError, match=r"lacks 'model'.*store.load"):
            resume(store, run.model, run.optimizer, strict=False)


class Wider(Run):
    def __init__(self, seed: int, hidden: int = 8, extra_layer: bool = False) -> None:
        super().__init__(seed)
        layers = [torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)]
        if extra_layer:
            layers.append(torch.nn.Linear(1, 1))
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": list(self.model.parameters())[:2]},
                {"params": list(self.model.parameters())[2:]},
            ]
        )
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2)


@pytest.mark.parametrize(
    ("other", "problem"),
    [
        (lambda: Wider(1, hidden=16), r"'0.weight' is \(8, 4\) in the checkpoint, \(16, 4\) in"),
        (lambda: Wider(1, extra_layer=True), r"missing keys \['3.bias', '3.weight'\]"),
        (lambda: Run(1), r"missing keys \['3.bias'.*unexpected keys \['2.bias'"),
    ],
)
def test_a_state_that_does_not_fit_changes_nothing(
    tmp_path: Path, other: Any, problem: str
) -> None:
    saved = Wider(0)
    saved.step()
    with CheckpointStore(str(tmp_path)) as store:
        CheckpointCallback(store, 1, async_save=False, preemption_signals=()).on_step(
            1, saved.model, saved.optimizer, saved.scheduler
        )
        fresh = other()
        seed_all(3)
        before = fresh.snapshot()
        with pytest.raises(ConfigError, match=problem):
            resume(store, fresh.model, fresh.optimizer, fresh.scheduler)
        seed_all(3)
        assert_identical(fresh.snapshot(), before)


def test_an_optimizer_with_other_groups_changes_nothing(tmp_path: Path) -> None:
    saved = Wider(0)
    with CheckpointStore(str(tmp_path)) as store:
        CheckpointCallback(store, 1, async_save=False, preemption_signals=()).on_step(
            1, saved.model, saved.optimizer
        )
        fresh = Wider(1)
        fresh.optimizer = torch.optim.AdamW(fresh.model.parameters())  # one group, not two
        before = fresh.snapshot()
        with pytest.raises(
            ConfigError, match=r"parameters per group \[2, 2\] in the checkpoint, \[4\]"
        ):
            resume(store, fresh.model, fresh.optimizer)
        assert_identical(fresh.snapshot()["model"], before["model"])


def test_save_freq_must_be_positive(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ConfigError, match="save_freq"):
                CheckpointCallback(store, bad)  # type: ignore[arg-type]
