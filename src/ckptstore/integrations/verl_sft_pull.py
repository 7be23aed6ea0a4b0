"""A step of verl's SFT trainer put on one rank's disk, where verl's own load looks for it.

The SFT handler (verl_sft.py) decides on rank 0 which step a job resumes from; each rank then
fetches its part of it with :class:`SFTPulls`: its own files and, on the node's leader, the
shared ones (verl_sft_files.py says which are which), each verified, into a directory of the
rank's own first, so ranks that share a node pull side by side, then moved into
``global_step_N``. verl's engine loads only files of its own world size, so a step saved on
another one is pulled whole by each node's leader and resharded for this job
(verl_reshard.py) into a directory that becomes ``global_step_N`` only once it is complete.
"""

from __future__ import annotations

import logging
import os
import shutil

from ckptstore.backends.fsutil import temp_name
from ckptstore.domain.info import CheckpointInfo
from ckptstore.integrations.verl_nodes import NodeAgent
from ckptstore.integrations.verl_reshard import reshard_dir
from ckptstore.integrations.verl_sft_files import RankFiles, include_patterns, saved_world_size
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)


class SFTPulls:
    """One SFT rank's files of the store's steps, on its node's disk (``agent``'s directory).

    ``files`` is the rank (its number, the world size, its ``data_D.pt``), ``leader`` whether
    it pulls the shared files for its node, ``data_ranks`` the job's number of ``data_D.pt``.
    """

    def __init__(
        self,
        store: CheckpointStore,
        agent: NodeAgent,
        files: RankFiles,
        *,
        leader: bool,
        data_ranks: int,
    ) -> None:
        self.store = store
        self.agent = agent
        self.files = files
        self.leader = leader
        self.data_ranks = data_ranks

    def local_step(self) -> int | None:
        """The step this rank's tracker names, if this rank's own files of it are there."""
        step = self.agent.tracked_step()
        if step is None:
            return None
        root = self.agent.step_dir(step)
        mine = [f"model_world_size_{self.files.world_size}_rank_{self.files.rank}.pt"]
        if self.files.data_file is not None:
            mine.append(self.files.data_file)
        return step if all((root / name).is_file() for name in mine) else None

    def pull(self, info: CheckpointInfo) -> None:
        """Download this rank's files of ``info`` (and the shared ones, on the node's leader)
        into ``global_step_N``, each verified: first into a directory of this rank's own, so
        ranks that share a node pull side by side. A step saved on another world size is
        pulled whole by each node's leader and resharded for this job (verl's engine loads
        only its own world size's files)."""
        saved = saved_world_size(f.path for f in info.files)
        if saved != self.files.world_size:
            if self.leader:
                self._pull_resharded(info, saved)
            return
        paths = self.files.pulls((f.path for f in info.files), shared=self.leader)
        if not paths:
            return
        local_dir = self.agent.local_dir
        local_dir.mkdir(parents=True, exist_ok=True)
        tmp = local_dir / temp_name(f"pull-{info.step}-rank-{self.files.rank}")
        try:
            self.store.pull_dir(
                tmp, step=info.step, fallback=False, exclude="*", include=include_patterns(paths)
            )
            target = self.agent.step_dir(info.step)
            for path in paths:
                (target / path).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / path, target / path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _pull_resharded(self, info: CheckpointInfo, saved: int | None) -> None:
        """Node leader: the whole step, verified, resharded for this job's ranks and data
        files (verl_reshard) into ``global_step_N``, which appears only once complete."""
        local_dir = self.agent.local_dir
        local_dir.mkdir(parents=True, exist_ok=True)
        pulled = local_dir / temp_name(f"pull-{info.step}-whole")
        resharded = local_dir / temp_name(f"reshard-{info.step}")
        aside = local_dir / temp_name(f"old-{info.step}")
        world_size = self.files.world_size
        try:
            self.store.pull_dir(pulled, step=info.step, fallback=False)
            reshard_dir(pulled, resharded, world_size, data_ranks=self.data_ranks)
            target = self.agent.step_dir(info.step)
            if target.exists():
                os.replace(target, aside)
            os.replace(resharded, target)
            log.warning(
                "ckptstore: step %d of %s was saved on %s ranks; resharded for this job's %d. "
                "Model and optimizer state are exact; RNG states are those of rank r mod %s",
                info.step,
                self.store.uri,
                saved,
                world_size,
                saved,
            )
        finally:
            for tmp in (pulled, resharded, aside):
                shutil.rmtree(tmp, ignore_errors=True)
