"""CheckpointCallback's save policy: metrics, time intervals, the should_save hook, preemption
by SIGTERM and the final save."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, ConfigError
from ckptstore.integrations.training import CheckpointCallback, plain_metrics


class Tiny:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self) -> None:
        self.model(torch.randn(4, 3)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder() -> Iterator[list[int]]:
    """SIGTERM's handler before the callback's: records the signals passed on to it."""
    received: list[int] = []

    def handler(number: int, frame: FrameType | None) -> None:
        received.append(number)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def reasons(store: CheckpointStore) -> dict[int, Any]:
    return {i.step: i.metadata.get("reason") for i in store.list()}


def test_metrics_become_json_metadata(tmp_path: Path) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(store, save_freq=1, preemption_signals=())
        metrics = {
            "loss": torch.tensor(0.25),
            "acc": np.float32(0.5),
            "tokens": np.int64(7),
            "lr": torch.tensor([0.125]),
            "diverged": float("nan"),
            "name": "warmup",
        }
        callback.on_step(1, run.model, run.optimizer, metrics=metrics)
        callback.close()
        assert store.info(1).metadata == {
            "loss": 0.25,
            "acc": 0.5,
            "tokens": 7,
            "lr": 0.125,
            "diverged": "nan",
            "name": "warmup",
            "reason": "schedule",
        }


def test_plain_metrics_keeps_what_json_holds() -> None:
    assert plain_metrics(None) == {}
    assert plain_metrics({"a": float("-inf"), "b": [1, 2], 3: True}) == {
        "a": "-inf",
        "b": [1, 2],
        "3": True,
    }


def test_time_interval_saves_and_resets_after_each_save(tmp_path: Path) -> None:
    run, clock = Tiny(), FakeClock()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(
            store, save_interval_seconds=10, clock=clock, async_save=False, preemption_signals=()
        )
        saved = []
        for step, now in enumerate([1005, 1009.9, 1010, 1015, 1019.9, 1020, 1031], start=1):
            clock.now = now
            if callback.on_step(step, run.model, run.optimizer) is not None:
                saved.append(step)
        assert saved == [3, 6, 7]  # at 1010, then 10 s after that save, then 11 s after
        callback.close()


def test_steps_and_time_together_save_when_either_is_due(tmp_path: Path) -> None:
    run, clock = Tiny(), FakeClock()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(
            store, 4, save_interval_seconds=60, clock=clock, preemption_signals=()
        )
        for step in range(1, 10):
            clock.now += 25 if step == 6 else 1  # step 6 comes 60 s after step 4's save
            callback.on_step(step, run.model, run.optimizer)
        callback.close()
        assert [i.step for i in store.list()] == [4, 8]
        clock.now += 100
        callback.on_step(10, run.model, run.optimizer)
        callback.close()
        assert [i.step for i in store.list()] == [4, 8, 10]


def test_should_save_forces_vetoes_or_defers(tmp_path: Path) -> None:
    run = Tiny()
    verdicts = {2: True, 4: False, 6: None}
    seen: list[tuple[int, Mapping[str, Any]]] = []

    def should_save(step: int, metrics: Mapping[str, Any]) -> bool | None:
        seen.append((step, metrics))
        return verdicts.get(step)

    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(
            store, save_freq=2, should_save=should_save, preemption_signals=()
        )
        for step in range(1, 8):
            callback.on_step(step, run.model, run.optimizer, metrics={"loss": step})
        callback.close()
        # 2: forced (and due), 4: vetoed, 6: deferred to the schedule, odd steps: not due
        assert reasons(store) == {2: "schedule", 6: "schedule"}
        assert seen[0] == (1, {"loss": 1})

        callback = CheckpointCallback(
            store, should_save=lambda step, m: step == 9, preemption_signals=()
        )
        callback.on_step(8, run.model, run.optimizer)
        callback.on_step(9, run.model, run.optimizer)
        callback.close()
        assert reasons(store) == {2: "schedule", 6: "schedule", 9: "should_save"}


def test_should_save_must_answer_a_bool_or_none(tmp_path: Path) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(
            store,
            should_save=lambda s, m: "yes",
            preemption_signals=(),  # type: ignore[arg-type,return-value]
        )
        with pytest.raises(ConfigError, match="should_save must return True"):
            callback.on_step(1, run.model, run.optimizer)
        callback.close()


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), True, "60"])
def test_save_interval_must_be_positive(tmp_path: Path, bad: Any) -> None:
    with CheckpointStore(str(tmp_path)) as store, pytest.raises(ConfigError, match="interval"):
        CheckpointCallback(store, save_interval_seconds=bad)


def test_sigterm_saves_at_the_next_step_and_is_passed_on(
    store_uri: tuple[str, dict[str, Any]], recorder: list[int]
) -> None:
    uri, options = store_uri
    run = Tiny()
    with CheckpointStore(uri, storage_options=options) as store:
        callback = CheckpointCallback(store, save_freq=2)
        assert signal.getsignal(signal.SIGTERM) == callback.signals.handle
        for step in (1, 2, 3):
            run.step()
            callback.on_step(step, run.model, run.optimizer, metrics={"loss": 0.5})
        signal.raise_signal(signal.SIGTERM)  # between steps: the handler only sets a flag
        assert not callback.preempted and recorder == []
        store.wait()
        assert [i.step for i in store.list()] == [2]
        run.step()
        weights = run.model.weight.detach().clone()
        info = callback.on_step(4, run.model, run.optimizer, metrics={"loss": 0.25})
        assert callback.preempted
        assert info is not None and not hasattr(info, "wait")  # synchronous: committed already
        assert store.latest() is not None and store.latest().step == 4  # type: ignore[union-attr]
        assert store.info(4).metadata == {"loss": 0.25, "reason": "preempted"}
        assert torch.equal(store.load(4)["model"]["weight"], weights)
        assert recorder == []
        callback.on_step(5, run.model, run.optimizer)  # the loop went on: the signal is passed on
        assert recorder == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) != callback.signals.handle
        callback.on_step(6, run.model, run.optimizer)  # passed on once; the schedule goes on
        callback.close()
        assert recorder == [signal.SIGTERM]
        assert reasons(store) == {2: "schedule", 4: "preempted", 6: "schedule"}


def test_a_second_signal_is_passed_on_at_once_and_the_save_still_happens(
    tmp_path: Path, recorder: list[int]
) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(store, save_freq=100)
        signal.raise_signal(signal.SIGTERM)
        assert recorder == []
        signal.raise_signal(signal.SIGTERM)
        assert recorder == [signal.SIGTERM]
        callback.on_step(1, run.model, run.optimizer)
        assert callback.preempted and reasons(store) == {1: "preempted"}
        callback.on_step(2, run.model, run.optimizer)
        callback.close()
        assert recorder == [signal.SIGTERM]  # not passed on twice


def test_a_due_step_is_saved_once_when_preempted(tmp_path: Path, recorder: list[int]) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        with CheckpointCallback(store, save_freq=2) as callback:
            callback.on_step(1, run.model, run.optimizer)
            signal.raise_signal(signal.SIGTERM)
            callback.on_step(2, run.model, run.optimizer)
            assert callback.preempted
        assert reasons(store) == {2: "preempted"}  # and the exit's final save skipped it
        handler = signal.getsignal(signal.SIGTERM)
        assert handler not in (callback.signals.handle, signal.SIG_DFL)


def test_a_failed_save_before_preemption_does_not_prevent_its_save(
    tmp_path: Path, recorder: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        store.save(2, {"other": 1})
        callback = CheckpointCallback(store, save_freq=2)
        callback.on_step(2, run.model, run.optimizer)  # fails in the background: 2 is taken
        signal.raise_signal(signal.SIGTERM)
        with caplog.at_level(logging.ERROR, "ckptstore"):
            info = callback.on_step(3, run.model, run.optimizer)
        callback.close()
        assert callback.preempted and info is not None and info.step == 3
        assert reasons(store) == {2: None, 3: "preempted"}
    assert "the save before the preemption failed: step 2 is already committed" in caplog.text


def test_close_restores_the_previous_handler(tmp_path: Path, recorder: list[int]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointStore(str(tmp_path)) as store:
        first = CheckpointCallback(store, 5)
        second = CheckpointCallback(store, 5)
        first.close()  # out of order: the newer handler stays
        assert signal.getsignal(signal.SIGTERM) == second.signals.handle
        second.close()
        assert signal.getsignal(signal.SIGTERM) == first.signals.handle  # what second found
        signal.raise_signal(signal.SIGTERM)  # the closed one forwards to what it found
        assert recorder == [signal.SIGTERM] and not first.preempted
        CheckpointCallback(store, 5, preemption_signals=()).close()
    assert before is not None


def test_a_callback_outside_the_main_thread_installs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointStore(str(tmp_path)) as store, caplog.at_level(logging.WARNING, "ckptstore"):
        made: list[CheckpointCallback] = []
        thread = threading.Thread(target=lambda: made.append(CheckpointCallback(store, 5)))
        thread.start()
        thread.join()
        made[0].close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert "outside the main thread" in caplog.text


LOOP_IGNORING_PREEMPTION = """
import os, signal, sys, torch
from ckptstore import CheckpointStore
from ckptstore.integrations.training import CheckpointCallback

model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
store = CheckpointStore(sys.argv[1], lease=False)
callback = CheckpointCallback(store, save_freq=100)
for step in range(1, 10):
    callback.on_step(step, model, optimizer)
    print("step", step, flush=True)
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
print("survived", flush=True)
"""


def test_a_loop_that_ignores_preempted_still_dies_by_sigterm(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP_IGNORING_PREEMPTION))
    store_dir = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, str(script), str(store_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["step", "1", "step", "2", "step", "3", "step", "4"]
    with CheckpointStore(str(store_dir)) as store:
        assert reasons(store) == {4: "preempted"}


def test_the_final_save_happens_once(tmp_path: Path) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        callback = CheckpointCallback(store, save_freq=3, preemption_signals=())
        for step in range(1, 6):
            callback.on_step(step, run.model, run.optimizer)
        info = callback.on_train_end(5, run.model, run.optimizer, metrics={"loss": 1.0})
        assert info is not None and info.step == 5
        assert callback.on_train_end(5, run.model, run.optimizer) is None  # saved already
        callback.on_step(6, run.model, run.optimizer)  # due: async
        assert callback.on_train_end(6, run.model, run.optimizer) is None  # waits, then skips
        callback.close()
        assert reasons(store) == {3: "schedule", 5: "end", 6: "schedule"}
        assert store.info(5).metadata["loss"] == 1.0


def test_the_final_save_never_goes_behind_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        store.save(10, {"anything": 1})
        callback = CheckpointCallback(store, save_freq=3, preemption_signals=())
        assert callback.on_train_end(10, run.model, run.optimizer) is None  # another's step 10
        with caplog.at_level(logging.WARNING, "ckptstore"):
            assert callback.on_train_end(7, run.model, run.optimizer) is None
        callback.close()
        assert [i.step for i in store.list()] == [10]
    assert "not saving step 7, older than the latest step 10" in caplog.text


def test_the_context_manager_saves_the_last_step_on_a_clean_exit_only(tmp_path: Path) -> None:
    run = Tiny()
    with CheckpointStore(str(tmp_path)) as store:
        with CheckpointCallback(store, save_freq=4) as callback:
            for step in range(1, 7):
                run.step()
                callback.on_step(step, run.model, run.optimizer, metrics={"loss": step})
        assert reasons(store) == {4: "schedule", 6: "end"}
        assert store.info(6).metadata["loss"] == 6
        assert torch.equal(store.load(6)["model"]["weight"], run.model.weight)

        def failing_loop() -> None:
            with CheckpointCallback(store, save_freq=4) as callback:
                callback.on_step(7, run.model, run.optimizer)
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            failing_loop()
        assert reasons(store) == {4: "schedule", 6: "end"}  # no save of a half-done step
