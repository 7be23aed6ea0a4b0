"""CUDA states through every save path: sync, async and overlapped saves of tensors on a GPU
load bit-exact, and a change made right after the call never leaks into the saved step.

Skipped without a CUDA device (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py tests/test_overlap.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _assert_bits(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        got = loaded[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(_bytes(got.cpu()), _bytes(tensor)), key


def test_sync_save_of_cuda_tensors_loads_bit_exact(tmp_path: Path) -> None:
    model, _ = _model()
    state = {
        "model": model.state_dict(),
        "bf16": torch.randn(1000, device="cuda").bfloat16(),
        "scalar": torch.tensor(3.5, device="cuda"),
        "view": torch.arange(100, device="cuda")[10:60:2],
    }
    expected = {
        **{f"model.{k}": v for k, v in _on_cpu(model.state_dict()).items()},
        "bf16": state["bf16"].cpu(),  # type: ignore[union-attr]
        "scalar": state["scalar"].cpu(),  # type: ignore[union-attr]
        "view": state["view"].cpu(),  # type: ignore[union-attr]
    }
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, state)
        loaded = store.load(1)
    flat = {f"model.{k}": v for k, v in loaded["model"].items()}
    flat.update({k: loaded[k] for k in ("bf16", "scalar", "view")})
    _assert_bits(flat, expected)


def test_async_save_of_cuda_tensors_ignores_changes_made_after_the_call(tmp_path: Path) -> None:
    model, optimizer = _model()
    with CheckpointStore(str(tmp_path), keep_last=10) as store:
        expected = {}
        for n in range(1, 4):
            expected[n] = _on_cpu(model.state_dict())
            handle = store.save_async(n, {"model": model.state_dict()})
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2.0)  # queued at once on the compute stream
            _step(model, optimizer)
            handle.wait()
        for n, state in expected.items():
            _assert_bits(store.load(n)["model"], state)


def test_overlapped_save_of_optimizer_state_on_cuda_is_the_state_at_the_call(
    tmp_path: Path,
) -> None:
    model, optimizer = _model()
    with CheckpointStore(str(tmp_path), keep_last=10) as store:
        expected = {}
        for n in range(1, 4):
            expected[n] = {
                f"{i}.{name}": value.detach().cpu().clone()
                for i, per_param in optimizer.state_dict()["state"].items()
                for name, value in per_param.items()
                if isinstance(value, torch.Tensor)
            }
            handle = store.save_async(n, {"optim": optimizer.state_dict()}, overlap=optimizer)
            _step(model, optimizer)  # the optimizer's pre-hook waits for the copy
            handle.wait()
        for n, state in expected.items():
            loaded = store.load(n)["optim"]["state"]
            flat = {
                f"{i}.{name}": value
                for i, per_param in loaded.items()
                for name, value in per_param.items()
                if isinstance(value, torch.Tensor)
            }
            _assert_bits(flat, state)
