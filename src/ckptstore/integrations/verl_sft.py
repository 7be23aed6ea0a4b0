"""verl's SFT trainer on a store: every rank's share of each save committed as one step, and a
job on another cluster resumes from the store's URI alone.

verl 0.9.1's SFT trainer (``verl.trainer.sft_trainer``, torchrun SPMD) has no checkpoint
callback: it saves through ``verl.utils.checkpoint.CheckpointHandler``, where every rank writes
its files to ``default_local_dir`` and rank 0 alone copies the whole step folder to
``default_hdfs_dir`` (on a multi-node run it holds only its own node's shards), and it resumes
from the local directory only. The trainer builds its handler in ``_build_ckpt_handler`` and
loads right after, so a thin subclass of the trainer that builds :class:`StoreCheckpointHandler`
is the whole integration, run by this module's entry point (docs/verl.md)::

    torchrun --nproc_per_node 8 -m ckptstore.integrations.verl_sft \\
        +trainer.ckptstore.uri=s3://bucket/sft-run ...   # verl's SFT overrides

* **Save**: verl's own save first (every rank's files, its ``data_D.pt``, the tracker), then
  one coordinated save over the job's process group (distributed.py): each rank lists what it
  holds of the step, rank 0 decides who uploads what (each rank its own files, each shared
  file once, by a rank that holds it: verl_sft_files.py) and checks the step is whole, every
  rank uploads its share in parallel, and rank 0 commits one manifest after every rank
  reported. Nothing is committed if any rank fails.
* **Resume** (``resume_mode=auto``): before verl loads, rank 0 picks the step (the store's
  latest, falling back past steps that fail verification, unless every rank's local copy is at
  least as new), every rank pulls its own files of it, verified, and one rank per node the
  shared ones (verl_sft_pull.py); then each node's tracker names the step and verl's own
  ``load_checkpoint`` loads model, optimizer, lr scheduler, RNG and dataloader states from it.
  A step saved on another world size is pulled whole by each node's leader and resharded for
  this job first (verl_reshard: the SFT step's top level is its role folder, its ``data_D.pt``
  rewritten for the new data-parallel size).

The ``trainer.ckptstore`` keys are the PPO integration's (verl_config.py): retention, the
writer lease (rank 0 holds it), ``persist_every``, a ``local`` tier, timeouts,
``max_failed_saves``; the signing key comes from the environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import torch.distributed as dist
from verl.trainer.sft_trainer import SFTTrainer
from verl.utils.checkpoint import CheckpointHandler, OrchestrationMode
from verl.utils.device import auto_set_device
from verl.utils.distributed import destroy_global_process_group, initialize_global_process_group

from ckptstore.core.collectives import Collectives
from ckptstore.core.reports import describe
from ckptstore.core.resolver import VERIFY_ERRORS
from ckptstore.core.search import Search
from ckptstore.data.payload import SourceFile, file_reader
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.manifest import KIND_DIRECTORY, FileEntry
from ckptstore.domain.plan import Plan
from ckptstore.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.distributed import save_coordinated
from ckptstore.integrations.failed_saves import FailedSaves
from ckptstore.integrations.verl_config import SECTION, VerlStoreConfig
from ckptstore.integrations.verl_nodes import NodeAgent
from ckptstore.integrations.verl_sft_files import RankFiles, check_sft_complete, saved_world_size
from ckptstore.integrations.verl_sft_pull import SFTPulls
from ckptstore.integrations.verl_steps import assign_files
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

Work = tuple[Plan, list[str]]
"""A rank's part of a save: its cut of the plan and the paths it uploads."""


class StoreCheckpointHandler(CheckpointHandler):
    """verl's ``CheckpointHandler`` (SPMD) that also commits each save to the store of
    ``trainer.ckptstore`` and resumes from it. Build it on every rank, as verl builds its own.

    ``settings`` is the parsed ``trainer.ckptstore`` section, ``total_steps`` the trainer's
    last step (always committed), ``names`` what each step's metadata records besides the step.
    """

    def __init__(
        self,
        *args: Any,
        settings: VerlStoreConfig,
        total_steps: int | None = None,
        names: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_what_cannot_be_stored(settings, kwargs)
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.total_steps = total_steps
        self.names = dict(names or {})
        self.comm = Collectives()
        self.local_dir = Path(os.path.abspath(self.default_local_dir))
        data_file = f"data_{self.dp_rank}.pt" if self.is_mp_src_rank_with_outputs else None
        self.files = RankFiles(self.comm.rank, self.comm.size, data_file)
        seen = self.comm.all_gather((data_file, socket.gethostname(), str(self.local_dir)))
        self.data_files = sorted(d for d, _, _ in seen if d is not None)
        here = (socket.gethostname(), str(self.local_dir))
        self.node_leader = min(r for r, (_, *where) in enumerate(seen) if tuple(where) == here)
        """The lowest rank saving into this rank's directory on this host: it pulls the
        shared files and writes the tracker there."""
        self.store = self._open()
        self.agent = NodeAgent(str(self.local_dir), self.store.uri, store=self.store)
        self.pulls = SFTPulls(
            self.store,
            self.agent,
            self.files,
            leader=self.comm.rank == self.node_leader,
            data_ranks=len(self.data_files),
        )
        """This rank's files of the step it resumes from, pulled onto its disk."""
        self._saves_since = 0
        self._failures = FailedSaves(
            self.store.uri,
            self.settings.max_failed_saves,
            headline="verl SFT saves in a row could not be committed",
            hint=f"endpoint, credentials, {SECTION}.save_timeout",
        )
        self.resumed: int | None = None
        """The store's step this job pulled to resume from, if it did."""
        self.skipped: set[int] = set()
        """Newer steps of the store that failed verification at resume: replaced when this
        job saves those step numbers again."""

    def _open(self) -> CheckpointStore:
        """Rank 0 holds the writer lease (taken now, so a second live job fails at start);
        the other ranks only stage and read. A failure is every rank's."""
        options = self.settings.options
        if self.comm.rank != 0:
            options = dataclasses.replace(options, lease=False, takeover=False)
        error: CheckpointError | None = None
        store: CheckpointStore | None = None
        try:
            store = CheckpointStore(self.settings.uri, options=options)
            if self.comm.rank == 0:
                store.hold_lease()
        except Exception as e:  # sent to every rank, which raises it
            error = e if isinstance(e, CheckpointError) else CheckpointError(describe(e))
        errors = self.comm.all_gather(error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            if store is not None:
                store.close()
            raise first
        assert store is not None
        return store

    # -- saving ---------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> None:
        super().save_checkpoint(step)  # type: ignore[no-untyped-call]  # verl's own save
        if self.comm.rank == self.node_leader and self.comm.rank != 0:
            self.agent.write_tracker(step)  # verl writes it on rank 0's node only
        self._saves_since += 1
        last = self.total_steps is not None and step >= self.total_steps
        tiered = self.store.tiers is not None  # every save commits locally; the store persists
        if not tiered and not self.settings.persist_policy.due(
            self._saves_since, None, forced=last
        ):
            if self.comm.rank == 0:
                log.info(
                    "ckptstore: step %d stays local (persist_every=%s)",
                    step,
                    self.settings.persist_every,
                )
            return
        try:
            info = self.commit(step, persist=last)
        except CheckpointError as e:  # the same error on every rank
            self._failures.failed(step, e, log_it=self.comm.rank == 0)
            return
        self._failures.succeeded()
        self._saves_since = 0
        if self.comm.rank == 0:
            log.info("ckptstore: committed %s", info.uri)

    def commit(self, step: int, *, persist: bool = False) -> CheckpointInfo:
        """Commit this job's ``global_step_<step>`` as one step; call it on every rank."""
        step = layout.check_step(step)
        held: list[tuple[str, int]] | CheckpointError
        try:
            held = self.files.offers(self.agent.list_step(step))
            if step in self.skipped and self.comm.rank == 0:
                self._drop_skipped(step)
        except Exception as e:  # sent, not raised: every rank reaches every collective
            held = CheckpointError(f"rank {self.comm.rank}: {describe(e)}", step=step)
        self.skipped.discard(step)
        listings = self.comm.gather(held)

        def cut(plan: Plan, size: int) -> list[Work]:
            assert listings is not None  # rank 0 only
            held_by: dict[str, list[tuple[str, int]]] = {}
            for rank, listing in enumerate(listings):
                if isinstance(listing, CheckpointError):
                    raise listing
                held_by[str(rank)] = listing
            shares = assign_files(held_by, step)
            check_sft_complete([p for ps in shares.values() for p in ps], step, self.data_files)
            return [(plan.among(shares[str(r)]), shares[str(r)]) for r in range(size)]

        def stage(work: Work, rank: int) -> list[FileEntry]:
            plan, paths = work
            root = self.agent.step_dir(step)
            files = [SourceFile(p, file_reader(root / p), (root / p).stat().st_size) for p in paths]
            return self.store.stage_files(step, files, plan=plan, rank=rank)

        meta = {"framework": "verl", "trainer": "sft", "global_step": step, **self.names}
        return save_coordinated(
            self.store, step, cut, stage, kind=KIND_DIRECTORY, metadata=meta, persist=persist
        )

    def _drop_skipped(self, step: int) -> None:
        """Rank 0: delete the store's ``step``, which failed verification at resume, so this
        job's save of it takes its place."""
        log.warning(
            "replacing step %d in %s, which failed verification at resume", step, self.store.uri
        )
        if any(i.step == step for i in self.store.list()):
            self.store.delete(step, force=True)

    # -- resuming -------------------------------------------------------------------------

    def load_checkpoint(self) -> int:
        if self.settings.resume and self.resume_mode == "auto" and self.resume_from_path is None:
            self.resumed = self._pull_for_resume()
        return int(super().load_checkpoint())  # type: ignore[no-untyped-call]

    def _pull_for_resume(self) -> int | None:
        """Pull the step to resume from onto every rank and name it in each node's tracker;
        the step pulled, or None when verl resumes from its local copy or starts afresh."""
        views = self.comm.all_gather(self.pulls.local_step())
        local = views[0] if len(set(views)) == 1 else None  # a copy every rank holds
        search = self.store.resolver.search(None, fallback=True) if self.comm.rank == 0 else None
        while True:
            offer: CheckpointInfo | CheckpointError | str | None = None
            if search is not None:
                offer = self._offer(search, local)
            offer = self.comm.broadcast(offer)
            if offer == "local" or offer == "fresh":
                if self.comm.rank == 0:
                    said = (
                        f"{self.store.uri} is empty: from step 0"
                        if offer == "fresh"
                        else (f"verl resumes from its local step {local}")
                    )
                    log.info("ckptstore: %s", said)
                return None
            if not isinstance(offer, CheckpointInfo):
                raise (
                    offer
                    if isinstance(offer, CheckpointError)
                    else CheckpointError(f"{self.store.uri}: rank 0 offered no step to resume from")
                )
            status: tuple[str, str] | None = None
            try:
                self.pulls.pull(offer)
            except VERIFY_ERRORS as e:
                status = ("corrupt", describe(e))
            except Exception as e:  # sent, not raised: every rank reaches every collective
                status = ("error", describe(e))
            statuses = self.comm.all_gather(status)
            bad = {r: s for r, s in enumerate(statuses) if s is not None}
            if not bad:
                if self.comm.rank == self.node_leader:
                    self.agent.write_tracker(offer.step)
                self.comm.all_gather(None)  # every node's tracker names it before verl looks
                if self.comm.rank == 0:
                    log.info("ckptstore: resuming from step %d of %s", offer.step, self.store.uri)
                return offer.step
            listed = "; ".join(f"rank {r}: {text}" for r, (_, text) in sorted(bad.items()))
            if any(kind == "error" for kind, _ in bad.values()):
                raise DistributedCheckpointError(
                    f"step {offer.step} of {self.store.uri} could not be pulled: {listed}",
                    {r: text for r, (_, text) in bad.items()},
                    uri=offer.uri,
                    step=offer.step,
                )
            self.skipped.add(offer.step)
            if search is not None:
                search.failed(offer, CorruptCheckpointError(listed, uri=offer.uri, step=offer.step))

    def _offer(self, search: Search, local: int | None) -> CheckpointInfo | CheckpointError | str:
        """Rank 0: the store's next step to try, ``local`` when the local copy is as new, or
        ``fresh`` when there is nothing to resume from at all."""
        try:
            info = search.next()
            if local is not None and (info is None or info.step <= local):
                return "local"
            if info is None:
                error = search.exhausted()
                if isinstance(error, NotFoundError):
                    return "fresh"
                return error
            saved = saved_world_size(f.path for f in info.files)
            if saved is None:
                return ConfigError(
                    f"{info.uri} is not a step of verl's SFT trainer (no model_world_size_W_"
                    "rank_R.pt at its top level); give the SFT job a store of its own",
                    uri=info.uri,
                    step=info.step,
                )
            return info
        except Exception as e:  # sent to every rank, which raises it
            return e if isinstance(e, CheckpointError) else CheckpointError(describe(e))

    def close(self) -> None:
        """Release the writer lease and let a local tier's due steps reach the store."""
        self.store.close()


class StoreSFTTrainer(SFTTrainer):
    """verl's SPMD ``SFTTrainer`` whose checkpoint handler is :class:`StoreCheckpointHandler`
    (verl's ``_build_ckpt_handler``, with the same arguments, and the store's section)."""

    def _build_ckpt_handler(self) -> None:
        trainer = self.config.trainer
        default_hdfs_dir = getattr(trainer, "default_hdfs_dir", None)
        self.ckpt_handler = StoreCheckpointHandler(
            engine=self.engine,
            train_dataloader=self.train_dataloader,
            default_local_dir=trainer.default_local_dir,
            max_ckpt_to_keep=getattr(trainer, "max_ckpt_to_keep", None),
            default_hdfs_dir=default_hdfs_dir,
            resume_mode=getattr(trainer, "resume_mode", "auto"),
            resume_from_path=getattr(trainer, "resume_from_path", None),
            lora_train_meta=self._get_lora_train_meta(),  # type: ignore[no-untyped-call]
            settings=VerlStoreConfig.from_verl(self.config),
            total_steps=self.total_training_steps,
            names={k: getattr(trainer, k, None) for k in ("project_name", "experiment_name")},
        )

    def close(self) -> None:
        """Release the store (the writer lease on rank 0); verl has no end-of-training hook."""
        handler = self.ckpt_handler
        if isinstance(handler, StoreCheckpointHandler):
            handler.close()


def run_sft(config: Any, trainer_cls: type[StoreSFTTrainer] = StoreSFTTrainer) -> None:
    """verl's ``run_sft`` with :class:`StoreSFTTrainer` (and a process group the caller set
    up, if it did)."""
    if not dist.is_initialized():
        initialize_global_process_group()  # type: ignore[no-untyped-call]
    trainer = trainer_cls(config=config)
    try:
        trainer.fit()  # type: ignore[no-untyped-call]
    finally:
        trainer.close()
    destroy_global_process_group()  # type: ignore[no-untyped-call]


@hydra.main(
    config_path="pkg://verl.trainer.config", config_name="sft_trainer_engine", version_base=None
)
def main(config: Any) -> None:
    """``python -m verl.trainer.sft_trainer``'s main, with the store (docs/verl.md)."""
    auto_set_device(config)
    run_sft(config)


def _refuse_what_cannot_be_stored(settings: VerlStoreConfig, kwargs: Mapping[str, Any]) -> None:
    """ConfigError for a trainer setup whose steps the store could not hold whole."""
    if kwargs.get("default_hdfs_dir"):
        raise ConfigError(
            "trainer.default_hdfs_dir is set: verl's rank 0 would copy the whole step folder "
            f"there, which on several nodes holds only its own node's shards. {SECTION}.uri "
            "stores every rank's files; set trainer.default_hdfs_dir=null",
            uri=settings.uri,
        )
    if kwargs.get("mode", OrchestrationMode.SPMD) != OrchestrationMode.SPMD:
        raise ConfigError(
            "StoreCheckpointHandler runs in verl's SPMD SFT trainer (torchrun); the Ray SFT "
            "trainer is not supported (docs/verl.md, 'The SFT trainer')",
            uri=settings.uri,
        )
    if settings.upload == "driver":
        raise ConfigError(
            f"{SECTION}.upload=driver: in the SFT trainer every rank uploads its own files "
            "(no process sees every node's disk); leave upload unset",
            uri=settings.uri,
        )


if __name__ == "__main__":
    main()
