"""A CPU platform for verl 0.9.1, so its SFT trainer runs in the tests on machines without GPUs.

verl registers CUDA and NPU platforms only and falls back to CUDA when neither is there, so its
SFT trainer asks for ``torch.cuda`` memory stats, NCCL and CUDA devices. ``set_platform`` is
verl's own way to plug in another platform: this one names the CPU device, gloo and a device
module of ``torch.cpu`` with the memory calls verl makes answered by zeros. verl's FSDP engine is
registered for ``cuda`` and ``npu`` only; ``VERL_ENGINE_DEVICE=cuda`` (verl's own override) picks
it, and it runs on CPU with ``engine.strategy=fsdp2`` (FSDP1 asks for a CUDA device). Importing
this module installs the platform; import it before anything of verl's trainer.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import set_platform

os.environ["VERL_ENGINE_DEVICE"] = "cuda"


class _CPUModule(types.ModuleType):
    """``torch.cpu`` with the memory calls verl's profiling helpers make."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def memory_reserved(self, *args: Any) -> int:
        return 0

    def memory_allocated(self, *args: Any) -> int:
        return 0

    def max_memory_allocated(self, *args: Any) -> int:
        return 0

    def max_memory_reserved(self, *args: Any) -> int:
        return 0

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        return (0, 0)

    def reset_peak_memory_stats(self, *args: Any) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, *args: Any) -> str:
        return "CPU"

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)  # verl's load sets the "cpu" state again through the device


class PlatformCPU(PlatformBase):  # type: ignore[misc]
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPUModule("verl_cpu_device")

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # what verl passes to .to(device=...)

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        pass

    def synchronize(self, device_index: Any = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


set_platform(PlatformCPU())
