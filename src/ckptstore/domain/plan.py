"""What a participant of a coordinated save is handed (coordination.py): a :class:`Plan`, a
picklable value cut per participant so that none reads the pointer or the manifest."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ckptstore.domain.manifest import FileEntry
from ckptstore.protocol.commit import Previous


@dataclass(frozen=True)
class Plan:
    """What a participant needs to stage its files of ``step``; sent by the coordinator."""

    step: int
    kind: str
    epoch: int
    """The writer lease epoch the coordinator holds (recorded in each attempt's marker)."""
    previous: Previous
    """``latest``'s step and the files of it this participant may copy instead of upload."""
    save: str | None = None
    """This save's id, in each participant's attempt marker: a discard removes this save's
    attempts and nobody else's (a new lease holder saving the same step, say)."""
    due: bool = False
    """With local tiers: the step will be due for the durable tier once committed, so each
    participant persists its share as soon as it staged it (node_tier.py)."""
    seconds: float | None = None
    """What was left of the save's deadline when the plan was cut: each participant stages
    by then (None: no deadline)."""

    def only(self, prefix: str) -> Plan:
        """This plan with the previous files under ``prefix`` (a folder with its ``/``)."""
        return replace(self, previous=self.previous.only(prefix))

    def among(self, paths: Iterable[str]) -> Plan:
        """This plan with the previous files of ``paths`` (a node's share)."""
        return replace(self, previous=self.previous.among(paths))

    def split(self, folders: Sequence[str]) -> list[Plan]:
        """One plan per folder (``rank_00003``), each with the previous files under it, in one
        pass over the previous step's files."""
        index = {folder: i for i, folder in enumerate(folders)}
        files: list[list[FileEntry]] = [[] for _ in folders]
        for entry in self.previous.files:
            i = index.get(entry.path.split("/", 1)[0])
            if i is not None:
                files[i].append(entry)
        return [replace(self, previous=Previous(self.previous.step, tuple(f))) for f in files]
