"""The benchmark's state and the process-level probes every row shares.

The state is built the same way in every subprocess, from a fixed seed, so every method saves
and loads the same bytes: the ``state_dict`` of a small pre-LN transformer plus that of an Adam
optimizer (two moments per parameter, so the model is a third of the bytes). ``fingerprint``
lets a load prove it returned those bytes.

Memory is measured from ``/proc/self/status``: ``VmHWM`` (peak RSS) after resetting it through
``/proc/self/clear_refs``, so a row's peak covers only its timed runs, minus ``VmRSS`` before
them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import torch

SEED = 20240611
CHANGED_FRACTION = 0.10
"""The share of the bytes the incremental row changes between saves."""


def shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes whose float32 params + two Adam moments fill ``size_bytes``."""
    params = max(size_bytes // 12, 1 << 14)
    d = max(64, int(math.sqrt(params / 200)) // 64 * 64)  # about 16 layers
    layer = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.out.weight", (d, d)),
        ("attn.out.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.fc1.weight", (4 * d, d)),
        ("mlp.fc1.bias", (4 * d,)),
        ("mlp.fc2.weight", (d, 4 * d)),
        ("mlp.fc2.bias", (d,)),
    ]
    per_layer = sum(math.prod(s) for _, s in layer)
    layers = max(1, (params - 8 * d * d) // per_layer)
    vocab = max(8, (params - layers * per_layer - 2 * d) // (2 * d))
    out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    for i in range(layers):
        out += [(f"layers.{i}.{name}", shape) for name, shape in layer]
    return [*out, ("norm.weight", (d,)), ("norm.bias", (d,)), ("lm_head.weight", (vocab, d))]


def build_state(size_bytes: int) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` shaped like ``model.state_dict()`` and Adam's."""
    gen = torch.Generator().manual_seed(SEED)
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, (name, shape) in enumerate(shapes(size_bytes)):
        model[name] = torch.randn(shape, generator=gen)
        state[index] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(shape, generator=gen),
            "exp_avg_sq": torch.randn(shape, generator=gen).abs_(),
        }
    group = {
        "lr": 1e-4,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(state),
    }
    return {"model": model, "optimizer": {"state": state, "param_groups": [group]}}


def tensors(value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state with its path, in insertion order."""
    if isinstance(value, torch.Tensor):
        yield "", value
    elif isinstance(value, dict):
        for key, item in value.items():
            for path, tensor in tensors(item):
                yield f"{key}/{path}" if path else str(key), tensor
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            for path, tensor in tensors(item):
                yield f"{i}/{path}" if path else str(i), tensor


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors(state))


def fingerprint(state: Any) -> dict[str, str]:
    """CRC32C of every tensor's bytes by path (DCP gives keys back as strings)."""
    return {path: f"{crc32c.crc32c(_bytes(t)):08x}" for path, t in tensors(state)}


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def flat_bytes(state: Any) -> torch.Tensor:
    """All tensor bytes of ``state`` in one uint8 tensor: what the raw-limit rows move."""
    out = torch.empty(nbytes(state), dtype=torch.uint8)
    offset = 0
    for _, tensor in tensors(state):
        view = tensor.reshape(-1).view(torch.uint8)
        out[offset : offset + view.numel()] = view
        offset += view.numel()
    return out


def step(state: Any) -> None:
    """A training step's worth of change: every tensor gets new bytes."""
    for _, tensor in tensors(state):
        tensor.add_(1.0)


def changed_part(state: dict[str, Any]) -> list[torch.Tensor]:
    """The last parameters of the model (head, top layer...) with their Adam moments, as close
    to 10% of the bytes as whole parameters allow: training only the top of a model leaves the
    rest of a checkpoint as it was.
    """
    params, moments = list(state["model"].values()), state["optimizer"]["state"]
    budget, used, picked = CHANGED_FRACTION * nbytes(state), 0, []
    for index in reversed(range(len(params))):
        group = [params[index], *moments[index].values()]
        size = sum(t.numel() * t.element_size() for t in group)
        if used + size > budget and budget - used < used + size - budget:
            break
        picked += group
        used += size
        if used >= budget:
            break
    return picked


def clone(state: Any) -> Any:
    """A plain deep copy of the tensors: the reference for the async save's blocked time."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(clone(v) for v in state)
    return state


def empty_like(state: Any) -> Any:
    """Same structure, uninitialized tensors: the template in-place loaders (DCP) fill."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(empty_like(v) for v in state)
    return state


# -- process probes ---------------------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> int:
    return _status("VmHWM")


def evict(path: Path) -> None:
    """Drop the page cache of every file under ``path``, so reads come from the disk."""
    os.sync()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
