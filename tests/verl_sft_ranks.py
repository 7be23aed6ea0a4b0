"""The rank side of test_verl_sft: verl 0.9.1's SFT trainer on gloo, under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 verl_sft_ranks.py ROOT JOB KILL_AT
OVERRIDES...`` runs ckptstore's SFT entry point (``ckptstore.integrations.verl_sft.run_sft``)
with verl's Hydra config and OVERRIDES, each rank saving into ``ROOT/JOB/node<rank>`` as on a
cluster without shared storage. Before every training step each rank records its state (its
shards of the model, the optimizer and lr scheduler states, the dataloader state and the batch
it is about to train on) in ``ROOT/JOB/pre-<step>-rank<r>.pt``, and after it ``post-<step>``;
with KILL_AT > 0 every rank kills itself with SIGKILL after recording ``post-KILL_AT``.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import verl_cpu  # noqa: F401  (first: verl's platform for CPU)
from ckptstore.integrations.verl_sft import StoreSFTTrainer, run_sft


def _local(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class RecordingTrainer(StoreSFTTrainer):
    """ckptstore's SFT trainer that records each rank's state around every training step."""

    out: Path
    kill_at: int

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.step = self.resume_global_step
        train = self.training_client.train_batch

        def recorded(data: Any) -> Any:
            self.step += 1
            self._record(f"pre-{self.step}", data)
            result = train(data=data)
            self._record(f"post-{self.step}", None)
            if self.step == self.kill_at:
                dist.barrier()  # every rank recorded before torchrun stops the others
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        self.training_client.train_batch = recorded

    def _record(self, tag: str, data: Any) -> None:
        engine = self.engine
        state = {
            "model": _local(engine.module.state_dict()),
            "optim": _local(engine.optimizer.state_dict()),
            "sched": engine.lr_scheduler.state_dict(),
            "loader": self.train_dataloader.state_dict(),
            "resumed": self.ckpt_handler.resumed,
        }
        if data is not None:
            ids = data["input_ids"]
            state["batch"] = (ids.values() if ids.is_nested else ids).clone()
        torch.save(state, self.out / f"{tag}-rank{dist.get_rank()}.pt")


def main() -> None:
    root, job, kill_at, *overrides = sys.argv[1:]
    rank = int(os.environ["RANK"])
    out = Path(root) / job
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose(
            "sft_trainer_engine",
            overrides=[*overrides, f"trainer.default_local_dir={out / f'node{rank}'}"],
        )
    RecordingTrainer.out = out
    RecordingTrainer.kill_at = int(kill_at)
    run_sft(config, RecordingTrainer)
    (out / f"done-{rank}").write_text("ok")


if __name__ == "__main__":
    main()
