"""What test_export and test_export_verl check an exported directory with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def exported(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, after checking its index names each shard it holds."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        shard_tensors = load_file(out / name)
        assert {n for n, f in index["weight_map"].items() if f == name} == set(shard_tensors)
        tensors |= shard_tensors
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]
