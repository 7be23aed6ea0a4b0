"""Gloo ranks for the real-verl tests, forked from one server that imported torch and verl once.

A rank started by ``mp.spawn`` imports torch, transformers and verl anew: seconds each. Ranks
fork instead from multiprocessing's forkserver, whose preload lists what every rank module of
these tests (verl_ranks, verl_reshard_ranks, verl_sft_handler_ranks, export_ranks) needs: a
process has one forkserver, started by whichever test launches first, so one list serves all.
Installed modules only: Python 3.11's forkserver does not get the tests' sys.path (the rank
module itself is imported in each rank).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

multiprocessing.get_context("forkserver").set_forkserver_preload(
    [
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "torchdata.stateful_dataloader",
        "transformers.models.llama.modeling_llama",
        "verl.utils.checkpoint.fsdp_checkpoint_manager",
        "verl.trainer.ppo.checkpoint_callback",
        "verl.trainer.sft_trainer",
        "boto3",
    ]
)


def launch(fn: Any, world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raises if any rank fails."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(world, *args), nprocs=world, join=True, start_method="forkserver")
