"""verl FSDP2 steps written without verl or a process group, for test_verl_reshard.

:func:`fsdp2_step` lays out what ``FSDPCheckpointManager.save_checkpoint`` writes on W ranks
for given full tensors: DTensor ``Shard(0)`` shards in ``torch.chunk``'s split on a 1-D mesh of
W ranks, the optimizer's Adam moments sharded the same way and its step counters replicated,
per-rank extra state, ``fsdp_config.json``, ``huggingface/`` and the driver's ``data.pt``.
:func:`gather` reads any such folder back into full tensors.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ckptstore.integrations.verl_reshard_tensors import SAFE_GLOBALS

# Unpickling a DeviceMesh where no process group exists warns each time; these files are
# meant to be read that way.
logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters whose first dimensions divide by no world size tried, some smaller than it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layer.q.weight": torch.randn(7, 3, generator=g),
        "layer.norm.weight": torch.randn(5, generator=g),
        "layer.tiny": torch.randn(2, 4, generator=g),
        "head.weight": torch.randn(13, 6, generator=g).to(torch.bfloat16),
    }


def mesh(world: int, rank: int) -> DeviceMesh:
    m = DeviceMesh("cpu", torch.arange(world, dtype=torch.int), _init_backend=False, _rank=rank)
    m._dim_group_names = ["0"]
    return m


def shard(full: torch.Tensor, world: int, rank: int, on: DeviceMesh) -> DTensor:
    chunks = torch.chunk(full, world)
    local = chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(
        local, on, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def fsdp2_step(
    root: Path, world: int, params: dict[str, torch.Tensor], *, role: str = "actor"
) -> Path:
    """Write ``global_step_1``-like files for ``world`` ranks under ``root``; returns ``root``."""
    folder = root / role
    folder.mkdir(parents=True, exist_ok=True)
    moments = {n: (p.float() * 0.5, p.float().abs()) for n, p in params.items()}
    for rank in range(world):
        m = mesh(world, rank)
        model = {n: shard(p, world, rank, m) for n, p in params.items()}
        state = {
            i: {
                "step": torch.tensor(3.0),
                "exp_avg": shard(moments[n][0], world, rank, m),
                "exp_avg_sq": shard(moments[n][1], world, rank, m),
            }
            for i, n in enumerate(params)
        }
        groups = [{"lr": 0.005, "betas": (0.9, 0.999), "params": list(range(len(params)))}]
        torch.save(model, folder / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(
            {"state": state, "param_groups": groups},
            folder / f"optim_world_size_{world}_rank_{rank}.pt",
        )
        random.seed(rank)
        np.random.seed(rank)
        rng = {
            "cpu": torch.manual_seed(rank).get_state(),
            "numpy": np.random.get_state(),
            "random": random.getstate(),
        }
        extra = {"lr_scheduler": {"last_epoch": 3, "base_lrs": [0.01]}, "rng": rng}
        torch.save(extra, folder / f"extra_state_world_size_{world}_rank_{rank}.pt")
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    (folder / "huggingface").mkdir(exist_ok=True)
    (folder / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
    (root / "data.pt").write_bytes(b"dataloader state")
    return root


def load(path: Path) -> Any:
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(path, weights_only=True)


def gather(folder: Path, world: int) -> dict[str, Any]:
    """The full model and optimizer state of a folder saved on ``world`` ranks."""
    models = [load(folder / f"model_world_size_{world}_rank_{r}.pt") for r in range(world)]
    optims = [load(folder / f"optim_world_size_{world}_rank_{r}.pt") for r in range(world)]
    model = {n: _cat([m[n] for m in models]) for n in models[0]}
    state = {
        i: {k: _cat([o["state"][i][k] for o in optims]) for k in optims[0]["state"][i]}
        for i in optims[0]["state"]
    }
    return {"model": model, "state": state, "param_groups": optims[0]["param_groups"]}


def _cat(parts: list[Any]) -> torch.Tensor:
    if isinstance(parts[0], DTensor):
        return torch.cat([p._local_tensor for p in parts])
    return parts[0]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested states (``torch.equal`` and dtype on every tensor)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where
