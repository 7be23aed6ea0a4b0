"""The rank side of test_verl_reshard's real-verl test: verl 0.9.1's FSDPCheckpointManager on
FSDP2 (``fully_shard``), gloo ranks on CPU.

:func:`save_rank` trains a tiny Llama two steps and saves ``global_step_1`` on W ranks, then
gathers the full model and optimizer state (``full_tensor()`` on every DTensor) for the test
to compare against. :func:`resume_rank` builds the model afresh on W' ranks, lets verl's own
``load_checkpoint`` read the resharded files, gathers the full state again, checks it is
bit-identical, and trains one more step.

Ranks start from a forkserver that has imported torch, transformers and verl once
(verl_launch.py), so a rank costs a fork, not the seconds those imports take.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager


def save_rank(rank: int, world: int, root: str, step_dir: str) -> None:
    _init(rank, world, root, "save")
    try:
        model, opt, sched, manager = _build(seed=0)
        for step in range(2):
            _train(model, opt, sched, seed=10 * step + rank)
        manager.save_checkpoint(os.path.join(step_dir, "actor"), None, 1)
        full = _full_state(model, opt)
        if rank == 0:
            torch.save({**full, "last_epoch": sched.last_epoch}, Path(root) / "full.pt")
    finally:
        dist.destroy_process_group()


def resume_rank(rank: int, world: int, root: str, local_dir: str) -> None:
    _init(rank, world, root, f"resume-{world}")
    try:
        model, opt, sched, manager = _build(seed=1234)
        folder = find_latest_ckpt_path(local_dir)
        assert folder is not None and folder.endswith("global_step_1"), folder
        manager.load_checkpoint(os.path.join(folder, "actor"))  # verl's own load, on W' ranks
        full = _full_state(model, opt)
        if rank == 0:
            saved = torch.load(Path(root) / "full.pt", weights_only=True)
            assert sched.last_epoch == saved["last_epoch"]
            _assert_same(full["model"], saved["model"], "model")
            _assert_same(full["optimizer"], saved["optimizer"], "optimizer")
        loss = _train(model, opt, sched, seed=99 + rank)  # and training goes on
        assert torch.isfinite(loss)
        (Path(root) / f"resumed-{world}-{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _init(rank: int, world: int, root: str, name: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root}/rendezvous-{name}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )


def _build(seed: int) -> tuple[Any, Any, Any, Any]:
    """Dimensions that 3 and 4 ranks split unevenly (66 rows on 4, 16 on 3)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=66,
            hidden_size=16,
            intermediate_size=36,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    )
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, FSDPCheckpointManager(model, opt, sched)


def _train(model: Any, opt: Any, sched: Any, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 66, (2, 8), generator=torch.Generator().manual_seed(seed))
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.detach()


def _full_state(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor whole (a collective: all ranks call it)."""

    def full(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: full(v) for k, v in value.items()}
        return value

    return {"model": full(model.state_dict()), "optimizer": full(opt.state_dict()["state"])}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs after resharding"
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where
