"""The rank side of test_verl_sft's handler test: verl 0.9.1's ``CheckpointHandler`` (SPMD) as
ckptstore's ``StoreCheckpointHandler`` on two gloo ranks, each saving into ``<root>/node<r>``.

The engine is the one stand-in: it writes the files verl's FSDP engine writes (each rank its
``model_``, ``optim_`` and ``extra_state_world_size_2_rank_R.pt``, rank 0 ``fsdp_config.json``
and ``huggingface/``) and records what verl asks it to load; rank 1 "loses" its model file at
the steps in ``LOST``. The real trainer runs in test_verl_sft's torchrun test. What each rank
saw goes to ``<root>/result-<rank>.json``. Ranks start from a forkserver that has imported
torch and verl once (verl_launch.py), so a rank costs a fork, not the seconds those imports take.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

LOST = {4, 7, 8}
"""Steps whose save loses rank 1's model file (a rank whose write did not land)."""


class FileEngine:
    """The part of verl's engine ``CheckpointHandler`` calls, writing real files."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.loaded: list[str] = []

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def save_checkpoint(self, local_path: str, global_step: int = 0, **kwargs: Any) -> None:
        import torch

        root = Path(local_path)
        root.mkdir(parents=True, exist_ok=True)
        for kind in ("model", "optim", "extra_state"):
            if kind == "model" and self.rank == 1 and global_step in LOST:
                continue
            state = {"w": torch.full((4,), float(global_step * 10 + self.rank))}
            torch.save(state, root / f"{kind}_world_size_2_rank_{self.rank}.pt")
        if self.rank == 0:
            (root / "huggingface").mkdir(exist_ok=True)
            (root / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
            (root / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 2}')

    def load_checkpoint(self, local_path: str, **kwargs: Any) -> None:
        self.loaded.append(Path(local_path).name)


def run_rank(rank: int, world: int, root: str, uri: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{root}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        result = _main(rank, Path(root), uri, options)
        (Path(root) / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _handler(rank: int, root: Path, uri: str, options: dict[str, Any]) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore.integrations.verl_config import VerlStoreConfig
    from ckptstore.integrations.verl_sft import StoreCheckpointHandler

    section = {"uri": uri, "persist_every": 2, "max_failed_saves": 2, "storage_options": options}
    return StoreCheckpointHandler(
        FileEngine(rank),
        StatefulDataLoader(list(range(8)), batch_size=2),
        default_local_dir=str(root / f"node{rank}"),
        settings=VerlStoreConfig.from_verl({"trainer": {"ckptstore": section}}),
        total_steps=10,
    )


def _main(rank: int, root: Path, uri: str, options: dict[str, Any]) -> dict[str, Any]:
    from ckptstore.errors import CheckpointError

    result: dict[str, Any] = {}
    # Job 1: an empty store starts from step 0; saves 1 to 8, persist_every=2.
    first = _handler(rank, root, uri, options)
    result["start"] = first.load_checkpoint()
    committed: list[list[int]] = []
    for step in range(1, 9):
        try:
            first.save_checkpoint(step)
        except CheckpointError as e:
            result["stopped"] = [step, str(e)]
            break
        committed.append([i.step for i in first.store.list()])
    result["committed"] = committed
    first.close()
    # Job 2, same directories: rank 1 lacks its model file of the tracked step 8, so the
    # store's latest is pulled onto both ranks.
    second = _handler(rank, root, uri, options)
    result["second"] = [second.load_checkpoint(), second.resumed, second.engine.loaded]
    second.close()
    # Job 3: both ranks hold step 5 whole, as new as the store's latest: nothing is pulled.
    third = _handler(rank, root, uri, options)
    result["third"] = [third.load_checkpoint(), third.resumed, third.engine.loaded]
    third.close()
    return result
