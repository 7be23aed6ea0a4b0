"""Overlapped snapshots: ``save_async(overlap=...)`` copies in the background while training
goes on, and nothing saved ever mixes values from two steps.

The schedules are deterministic: a gate holds the save's worker before its copy, so a test
decides whether the optimizer's pre-hook or the worker copies each piece."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.data import snapshot as snapshot_module
from ckptstore.data.background import BACKGROUND_NICENESS, BackgroundSaver
from ckptstore.data.snapshot import BackgroundCopy
from ckptstore.domain import layout
from ckptstore.errors import ConfigError
from ckptstore.integrations.training import CheckpointCallback


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 64)
    )


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 64)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _copy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy(v) for v in state]
    return state


def _assert_equal(got: Any, expected: Any, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), f"{where} differs from the state at the save"
    elif isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            _assert_equal(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_equal(g, e, f"{where}[{i}]")
    else:
        assert got == expected, where


@pytest.fixture
def held_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The save's worker waits at this gate before its copy; set it to let it go."""
    gate = threading.Event()
    run = BackgroundCopy.run

    def gated(self: BackgroundCopy) -> None:
        assert gate.wait(30), "the test never opened the gate"
        run(self)

    monkeypatch.setattr(BackgroundCopy, "run", gated)
    yield gate
    gate.set()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_step(model, optimizer)  # the optimizer has state
    return model, optimizer


def test_an_update_right_after_the_pre_hook_never_reaches_the_saved_step(
    store: CheckpointStore, held_worker: threading.Event
) -> None:
    """The worker has copied nothing when the optimizer steps: the pre-hook copies it all,
    then a hook of ours, registered after it, changes every tensor at once."""
    model, optimizer = _trained()
    expected = _copy(_state(model, optimizer))
    handle = store.save_async(1, _state(model, optimizer), overlap=optimizer)

    def vandal(*_: object) -> None:  # runs right after ckptstore's pre-hook
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for state in optimizer.state.values():
                for value in state.values():
                    value.add_(1.0)

    optimizer.register_step_pre_hook(vandal)
    _train_step(model, optimizer)
    held_worker.set()
    handle.wait()
    _assert_equal(store.load(1), expected)


def test_the_call_returns_before_the_copy_and_the_update_waits_only_for_the_rest(
    tmp_path: Any, held_worker: threading.Event
) -> None:
    model, optimizer = _trained()
    store = CheckpointStore(str(tmp_path))
    handle = store.save_async(1, _state(model, optimizer), overlap=optimizer)
    copy = store._async.guard._copy  # type: ignore[union-attr]
    assert copy is not None and not copy.done, "the parameters were copied in the call"
    _train_step(model, optimizer)
    assert copy.done, "the optimizer stepped before the copy was done"
    assert copy.waited_seconds > 0
    held_worker.set()
    info = handle.wait()
    assert info.stats is not None and info.stats.blocked_seconds >= copy.waited_seconds
    store.close()


def test_tensors_no_optimizer_owns_are_copied_in_the_call(
    tmp_path: Any, held_worker: threading.Event
) -> None:
    """BatchNorm's running statistics change during forward, which no pre-hook precedes."""
    model, optimizer = _trained()
    extra = torch.arange(10.0)
    state = {**_state(model, optimizer), "extra": extra}
    expected = _copy(state)
    store = CheckpointStore(str(tmp_path))
    handle = store.save_async(1, state, overlap=optimizer)
    model(torch.randn(16, 64))  # forward only: running_mean and running_var move
    extra.mul_(3)
    held_worker.set()
    handle.wait()
    _assert_equal(store.load(1), expected)
    store.close()


def test_overlap_true_defers_everything_until_before_update(
    tmp_path: Any, held_worker: threading.Event
) -> None:
    weights = torch.randn(1000, 100)
    view = weights.t()  # a non-contiguous view of it, copied whole
    state = {"weights": weights, "transposed": view, "empty": torch.empty(0), "n": 3}
    expected = _copy(state)
    store = CheckpointStore(str(tmp_path))
    handle = store.save_async(1, state, overlap=True)
    handle.snapshot_done()
    weights.zero_()
    store.before_update()  # again: nothing left, returns at once
    held_worker.set()
    handle.wait()
    _assert_equal(store.load(1), expected)
    store.close()


def test_pieces_are_shared_between_the_worker_and_the_updating_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker copies the first piece, then stalls until the update copied the rest."""
    monkeypatch.setattr(snapshot_module, "PIECE_BYTES", 4096)
    copied_by: list[str] = []
    first_done, release = threading.Event(), threading.Event()
    copy_piece = snapshot_module.copy_piece

    def traced(*piece: Any) -> None:
        copy_piece(*piece)
        copied_by.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("ckpt-save") and not first_done.is_set():
            first_done.set()
            assert release.wait(30)
        elif copied_by.count(threading.main_thread().name) == 63:
            release.set()

    monkeypatch.setattr(snapshot_module, "copy_piece", traced)
    weights = torch.randn(64, 1024)  # 256 KiB: 64 pieces
    expected = weights.clone()
    store = CheckpointStore(str(tmp_path))
    handle = store.save_async(1, {"w": weights}, overlap=True)
    assert first_done.wait(30)
    store.before_update()  # copies 63 pieces, then waits for the worker's one
    weights.fill_(7.0)
    handle.wait()
    assert len(copied_by) == 64
    assert copied_by.count(threading.main_thread().name) == 63
    assert torch.equal(store.load(1)["w"], expected)
    store.close()


def test_a_failed_copy_fails_the_save_not_the_training_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, held_worker: threading.Event
) -> None:
    def broken(*piece: Any) -> None:
        raise RuntimeError("the copy broke")

    monkeypatch.setattr(snapshot_module, "copy_piece", broken)
    model, optimizer = _trained()
    store = CheckpointStore(str(tmp_path))
    handle = store.save_async(1, _state(model, optimizer), overlap=optimizer)
    _train_step(model, optimizer)  # the pre-hook's copy fails; the step goes on
    held_worker.set()
    with pytest.raises(RuntimeError, match="the copy broke"):
        handle.wait()
    assert store.latest() is None
    assert not list(store.backend.list(layout.step_dir(1))), "a failed copy staged files"
    store.close()


def test_steps_saved_every_update_are_each_exact(tmp_path: Any) -> None:
    """No gate: the worker and the updates race as in training, over several saves."""
    model, optimizer = _trained()
    store = CheckpointStore(str(tmp_path), keep_last=10)
    expected = {}
    for step in range(1, 6):
        expected[step] = _copy(_state(model, optimizer))
        store.save_async(step, _state(model, optimizer), overlap=optimizer)
        _train_step(model, optimizer)
    store.wait()
    for step, state in expected.items():
        _assert_equal(store.load(step), state, f"step {step}")
    store.close()


def test_bad_overlap_values_are_refused_by_name(tmp_path: Any) -> None:
    store = CheckpointStore(str(tmp_path))
    for bad in ("yes", [], [object()], torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match=r"overlap must be True, False, a torch\.optim"):
            store.save_async(1, {"x": torch.ones(2)}, overlap=bad)  # type: ignore[arg-type]
    assert store.latest() is None
    store.close()


def test_closing_unhooks_the_optimizer_and_an_unclosed_store_is_still_collected(
    tmp_path: Any,
) -> None:
    model, optimizer = _trained()
    store = CheckpointStore(str(tmp_path / "a"))
    store.save_async(1, _state(model, optimizer), overlap=[optimizer]).wait()
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    store.save_async(2, _state(model, optimizer), overlap=optimizer).wait()
    assert len(optimizer._optimizer_step_pre_hooks) == 1, "one hook per optimizer"
    store.close()
    assert not optimizer._optimizer_step_pre_hooks
    forgotten = CheckpointStore(str(tmp_path / "b"))
    forgotten.save_async(1, _state(model, optimizer), overlap=optimizer).wait()
    ref = weakref.ref(forgotten)
    del forgotten
    gc.collect()
    assert ref() is None, "the optimizer's hook keeps the store alive"
    _train_step(model, optimizer)  # the orphaned hook is harmless


def test_the_callback_overlaps_with_its_optimizer(tmp_path: Any) -> None:
    model, optimizer = _trained()
    store = CheckpointStore(str(tmp_path), keep_last=5)
    expected = {}
    with CheckpointCallback(store, save_freq=1, overlap=True, preemption_signals=()) as callback:
        for step in range(1, 4):
            _train_step(model, optimizer)
            expected[step] = _copy(_state(model, optimizer))
            handle = callback.on_step(step, model, optimizer)
            assert handle is not None
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    store.wait()
    for step, state in expected.items():
        loaded = store.load(step)
        _assert_equal(loaded["model"], state["model"], f"step {step} model")
        _assert_equal(loaded["optimizer"], state["optimizer"], f"step {step} optimizer")
    store.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_background_worker_runs_below_the_caller() -> None:
    saver: BackgroundSaver[int] = BackgroundSaver()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def niceness_in_a_thread_it_starts() -> int:
        seen: list[int] = []
        thread = threading.Thread(
            target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        )
        thread.start()
        thread.join()
        return seen[0]

    worker = saver.submit(1, lambda _: os.getpriority(os.PRIO_PROCESS, 0), 0.0).wait()
    child = saver.submit(2, lambda _: niceness_in_a_thread_it_starts(), 0.0).wait()
    saver.close()
    assert worker == child == min(19, mine + BACKGROUND_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_parameters_copy_on_a_side_stream_into_reused_pinned_buffers(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.randn(64, 512, device="cuda")).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    store = CheckpointStore(str(tmp_path), keep_last=5)
    expected = {}
    for n in (1, 2, 3):
        expected[n] = {k: v.cpu() for k, v in model.state_dict().items()}
        handle = store.save_async(n, {"model": model.state_dict()}, overlap=optimizer)
        step()  # the compute stream waits for the copy's event
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # queued right behind it
        handle.wait()
    buffers = store._async.snapshotter._buffers  # type: ignore[union-attr]
    assert buffers and all(b.is_pinned() for b in buffers)
    for n, state in expected.items():
        _assert_equal(store.load(n)["model"], state, f"step {n}")
    store.close()
