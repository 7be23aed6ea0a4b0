"""The rank side of test_verl_integration's real-verl test: verl 0.9.1 on two gloo ranks.

Each rank stands for one node of a cluster without shared storage: rank ``r`` saves into
``<root>/node<r>``. Rank 0 also plays verl's driver: it writes ``data.pt`` and the tracker the
way ``PPOTrainer._save_checkpoint`` does, then calls the callback that verl's own
``build_checkpoint_callback`` built from ``trainer.checkpoint_callback_class``. The callback's
two node agents run in rank 0's process and read each node's directory, as the Ray actors of a
real cluster would read their own disks. Ranks start from a forkserver that has imported torch,
transformers and verl once (verl_launch.py), so a rank costs a fork, not those imports.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptstore.integrations.verl import CkptstoreCallback
from ckptstore.integrations.verl_nodes import LocalFleet, NodeAgent

STEPS = 3


class TwoNodeCallback(CkptstoreCallback):
    """The integration's callback with one agent per node directory instead of Ray actors."""

    def __init__(self, config: Any = None) -> None:
        from omegaconf import OmegaConf

        root = Path(config.trainer.default_local_dir).parent
        section = config.trainer.ckptstore
        options = OmegaConf.to_container(section.storage_options)
        agents = {
            f"node{i}": NodeAgent(str(root / f"node{i}"), section.uri, options) for i in range(2)
        }
        super().__init__(config, fleet=LocalFleet(agents, driver="node0"))


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
        _main(rank, Path(root), uri, options)
        (Path(root) / f"done-{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _main(rank: int, root: Path, uri: str, options: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    nodes = [root / "node0", root / "node1"]
    mine = nodes[rank]
    config = OmegaConf.create(
        {
            "trainer": {
                "default_local_dir": str(nodes[0]),
                "resume_mode": "auto",
                "resume_from_path": None,
                "max_actor_ckpt_to_keep": 2,
                "nnodes": 2,
                "n_gpus_per_node": 1,
                "project_name": "tiny",
                "experiment_name": "gloo",
                "checkpoint_callback_class": "verl_ranks.TwoNodeCallback",
                "ckptstore": {"uri": uri, "keep_last": 2, "storage_options": options},
            },
            "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
        }
    )

    # -- the first job: three steps, each saved by verl and committed through the callback
    fsdp, opt, sched, manager = _build(seed=0)
    callback = build_checkpoint_callback(config) if rank == 0 else None
    if callback is not None:
        assert type(callback).__name__ == "TwoNodeCallback"
        assert callback.resume.source == "scratch"
    loader = _loader()
    batches = iter(loader)
    for step in range(1, STEPS + 1):
        ids = torch.randint(
            0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank)
        )
        fsdp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if rank == 0:
            next(batches)
        step_dir = mine / f"global_step_{step}"
        manager.save_checkpoint(str(step_dir / "actor"), None, step, max_ckpt_to_keep=2)
        if callback is not None:  # the tail of verl's PPOTrainer._save_checkpoint
            torch.save(loader.state_dict(), step_dir / "data.pt")
            (mine / "latest_checkpointed_iteration.txt").write_text(str(step))
            callback.on_save(
                trainer=None, global_step=step, checkpoint_dir=str(step_dir), async_save=False
            )
        dist.barrier()
    for node in nodes:  # local copies follow max_actor_ckpt_to_keep on every node
        assert sorted(p.name for p in node.glob("global_step_*")) == [
            "global_step_2",
            "global_step_3",
        ], f"{node}: {os.listdir(node)}"
    saved_params = [p.detach().clone() for p in fsdp.parameters()]
    saved_epoch = sched.last_epoch
    next_batch = next(batches) if rank == 0 else None
    shutil.copytree(mine / f"global_step_{STEPS}", root / f"ref{rank}")

    # -- another cluster: empty local disks, a fresh model, the job restarted after preemption
    dist.barrier()
    shutil.rmtree(mine)
    dist.barrier()
    fsdp, opt, sched, manager = _build(seed=1234)
    assert not all(torch.equal(p, s) for p, s in zip(fsdp.parameters(), saved_params, strict=True))
    config.trainer.ckptstore.takeover = True  # the dead job's writer lease has not expired
    resumed = build_checkpoint_callback(config) if rank == 0 else None
    if resumed is not None:
        assert (resumed.resume.step, resumed.resume.source) == (STEPS, "store")
    dist.barrier()

    # what verl's _load_checkpoint does: the tracker names the step, each rank loads its shards
    folder = find_latest_ckpt_path(str(mine))
    assert folder is not None
    assert folder.endswith(f"global_step_{STEPS}")
    pulled = _files(Path(folder))
    union = {**_files(root / "ref0"), **_files(root / "ref1")}
    assert pulled == union, "the pulled step differs from what the two nodes saved"
    manager.load_checkpoint(os.path.join(folder, "actor"))
    for p, s in zip(fsdp.parameters(), saved_params, strict=True):
        assert torch.equal(p, s)
    assert sched.last_epoch == saved_epoch
    if resumed is not None:  # trainer state: the step and the dataloader position
        assert int(folder.split("global_step_")[-1]) == STEPS
        loader = _loader()
        loader.load_state_dict(torch.load(os.path.join(folder, "data.pt"), weights_only=False))
        assert torch.equal(next(iter(loader)), next_batch)
        resumed.close()
    dist.barrier()


def _build(seed: int) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    manager = FSDPCheckpointManager(fsdp, opt, sched, processing_class=_tokenizer())
    return fsdp, opt, sched, manager


def _tokenizer() -> Any:
    """A word-level tokenizer built here: no hub download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _loader() -> Any:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(7)
    return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=generator)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


class PerNodeDirAgent(NodeAgent):
    """A Ray node agent whose disk is ``<local_dir>/<its node id>``: several Ray nodes on one
    machine then hold separate files, like the nodes of a cluster without shared storage."""

    def __init__(self, local_dir: str, uri: str, storage_options: Any = None) -> None:
        import ray

        node = str(ray.get_runtime_context().get_node_id())
        super().__init__(os.path.join(local_dir, node[:12]), uri, storage_options)


class PlacedWorker:
    """Stands in for one of verl's placed worker actors: Ray knows where it runs."""

    def ready(self) -> bool:
        return True
