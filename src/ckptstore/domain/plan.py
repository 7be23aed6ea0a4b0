"""What a participant of a coordinated save is handed (coordination.py): a :class:`Plan`, a
picklable value cut per participant so that none reads the pointer or the manifest, with the
:class:`Previous` step it may copy files from (the commit protocol reads it too)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ckptstore.domain.manifest import FileEntry, Manifest


@dataclass(frozen=True)
class Previous:
    """The step ``latest`` named when a save began, and those of its files a stager may copy
    instead of uploading. A coordinator reads the pointer and the manifest once and hands each
    rank the entries under its own folder, so a rank's staging costs the same at 8 ranks as at
    1,024 (README "Scale")."""

    step: int | None
    """``latest``'s step (None: no step yet); a save of an older step is refused."""
    files: tuple[FileEntry, ...] = ()
    """Entries of ``step`` (empty: nothing to copy, e.g. not incremental or another kind)."""

    @classmethod
    def of(cls, manifest: Manifest | None, latest: int | None = None) -> Previous:
        """All of ``manifest``'s files; without one, only the pointer's step."""
        if manifest is None:
            return cls(latest)
        return cls(manifest.step, manifest.files)

    def only(self, prefix: str) -> Previous:
        """The files under ``prefix`` (a folder, with its trailing ``/``)."""
        return Previous(self.step, tuple(f for f in self.files if f.path.startswith(prefix)))

    def among(self, paths: Iterable[str]) -> Previous:
        """The files of these ``paths`` (a node's share of a directory step)."""
        wanted = set(paths)
        return Previous(self.step, tuple(f for f in self.files if f.path in wanted))


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
