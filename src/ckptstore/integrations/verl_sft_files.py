"""Which files of a verl SFT step belong to which rank: pure rules over listings, no I/O.

verl 0.9.1's SFT trainer (``verl.trainer.sft_trainer``, torchrun SPMD) saves a step with its
engine's checkpoint manager, every rank into ``default_local_dir/global_step_N`` on its own
node: ``model_``, ``optim_`` and ``extra_state_world_size_W_rank_R.pt`` for each rank R,
``fsdp_config.json`` and ``huggingface/`` from rank 0, then ``data_D.pt`` (the
``StatefulDataLoader``'s state) from the rank that outputs data-parallel rank D. So a file is
either one rank's own (its rank files, its ``data_D.pt``) or shared (everything else): each
rank uploads and pulls its own, and the shared ones once per node (:class:`RankFiles`). On one
node or shared storage every rank sees the others' files; it never offers them.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptstore.domain import layout
from ckptstore.errors import IncompleteCheckpointError
from ckptstore.integrations.verl_steps import RANK_FILE, check_ranks

DATA_FILE = re.compile(r"^data_(?P<dp>\d+)\.pt$")
"""The dataloader state ``CheckpointHandler`` saves per data-parallel rank."""


@dataclass(frozen=True)
class RankFiles:
    """One rank of an SFT job: its rank, the world size, and its dataloader file
    (``data_D.pt``, or None on a rank that outputs no data: sequence-parallel peers)."""

    rank: int
    world_size: int
    data_file: str | None

    def owner(self, path: str) -> bool | None:
        """True for this rank's own file, False for another rank's, None for a shared one."""
        match = RANK_FILE.match(path)  # the top level only: SFT has no role folders
        if match:
            return int(match["rank"]) == self.rank and int(match["world"]) == self.world_size
        if DATA_FILE.match(path):
            return path == self.data_file
        return None

    def offers(self, held: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """What this rank may upload of the files it sees: its own and the shared ones (a
        shared one goes to one of the ranks that hold it: verl_steps.assign_files)."""
        return [(path, size) for path, size in held if self.owner(path) is not False]

    def pulls(self, paths: Iterable[str], *, shared: bool) -> list[str]:
        """What this rank downloads of a step: its own files, and the shared ones when it
        pulls for its node (``shared``)."""
        return [p for p in paths if self.owner(p) or (shared and self.owner(p) is None)]


def include_patterns(paths: Sequence[str]) -> list[str]:
    """``pull_dir`` include patterns that take exactly ``paths``."""
    return [glob.escape(p) for p in paths]


def check_sft_complete(paths: Sequence[str], step: int, data_files: Sequence[str]) -> None:
    """Refuse to commit an SFT step that lacks what verl needs to resume from it: every rank's
    ``model_`` file (and every rank of each other kind), and every ``data_D.pt``."""
    where = layout.step_dir(step)
    present = set(paths)
    if not any(RANK_FILE.match(p) and p.startswith("model_") for p in present):
        raise IncompleteCheckpointError(
            f"{where} has no model_world_size_W_rank_R.pt on any rank: the engine saved no "
            "model there (checkpoint.save_contents must include model); nothing was committed",
            step=step,
        )
    check_ranks(present, step)
    missing = sorted(set(data_files) - present)
    if missing:
        raise IncompleteCheckpointError(
            f"{where}: the dataloader state {', '.join(missing)} was found on no rank; a resume "
            "would restart the data from the beginning, so nothing was committed",
            step=step,
        )


def saved_world_size(paths: Iterable[str]) -> int | None:
    """The world size whose ``model_`` files a step holds at its top level (where the SFT
    trainer saves them; the PPO trainer saves under ``actor/``), or None if it holds none."""
    sizes = {int(m["world"]) for p in paths if (m := RANK_FILE.match(p)) and m["kind"] == "model"}
    return max(sizes) if sizes else None
