"""A coordinated multi-rank save as the explorer's actors: one per stage of the job.

``save_distributed`` (distributed.py), the DCP writer and the verl agents all run the same
three stages through the public API (coordination.py): the coordinator's ``begin_save``, each
rank's ``stage_files`` on a store opened with ``lease=False``, and the coordinator's
``conclude``. Here each stage is an actor, ordered by ``Actor.after`` the way collectives order
them in a real job: the ranks start once the plan is out, the commit once every rank reported.
So the explorer interleaves the ranks with each other and every stage with whatever else runs
(a takeover), and a crash can strike any stage.

What a dead stage means is what it means in a real job. A coordinator killed in ``begin``
sends no plan: the ranks stage nothing. A rank killed while staging never reports: the
coordinator waits at the gather until the process group's timeout and the job dies, so the
commit stage does nothing (the staged files are gc's). A rank whose staging *fails* (an error,
not a death) reports it, and the coordinator discards the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ckptstore.core.coordination import Coordinator
from ckptstore.core.reports import Staged
from ckptstore.data.payload import SourceFile
from ckptstore.domain.manifest import KIND_DIRECTORY
from ckptstore.domain.plan import Plan
from ckptstore.errors import BackendError
from ckptstore.integrations.distributed import rank_dir
from ckptstore.store import CheckpointStore
from harness.scheduler import Actor

FILE = "part.bin"
"""Each rank stages one file, ``rank_0000<r>/part.bin``."""


@dataclass
class CoordinatedJob:
    """One coordinated save of ``step`` by ``len(participants)`` ranks; the coordinator is
    rank 0 and stages through its own store, as in ``save_distributed``."""

    name: str
    coordinator: CheckpointStore
    participants: list[CheckpointStore]
    """Rank r's store (rank 0's is the coordinator's)."""
    step: int
    failing: frozenset[int] = frozenset()
    """Ranks whose staging raises half-way (a full disk, say): the coordinator discards."""
    begun: Coordinator | None = None
    plans: list[Plan] = field(default_factory=list)
    reports: dict[int, Staged] = field(default_factory=dict)

    def files(self, rank: int) -> dict[str, bytes]:
        """What rank ``rank`` stages: one file named after its folder."""
        return {f"{rank_dir(rank)}/{FILE}": f"{self.name} rank {rank}".encode()}

    def contents(self) -> dict[str, bytes]:
        """The files the committed step holds if this job commits it."""
        ranks = range(len(self.participants))
        return {path: data for r in ranks for path, data in self.files(r).items()}

    def actors(self) -> list[Actor]:
        """Rank 0 begins the save and stages its own files, then each other rank stages, then
        rank 0 concludes: one actor per stage, each after the one before."""
        names = [f"{self.name}-rank{r}" for r in range(len(self.participants))]
        first = self._stager(0)

        def begin_and_stage() -> object:
            self._begin()
            return first()

        actors = [Actor(names[0], begin_and_stage)]
        for rank in range(1, len(names)):
            actors.append(Actor(names[rank], self._stager(rank), after=(names[rank - 1],)))
        return [*actors, Actor(f"{self.name}-commit", self._conclude, after=(names[-1],))]

    def _begin(self) -> None:
        self.begun = self.coordinator.begin_save(self.step, kind=KIND_DIRECTORY)
        self.plans = self.begun.plan.split([rank_dir(r) for r in range(len(self.participants))])

    def _stager(self, rank: int) -> Callable[[], object]:
        def stage() -> object:
            if not self.plans:
                return "no plan: the coordinator failed in begin"
            store, plan = self.participants[rank], self.plans[rank]
            sources = [
                SourceFile(path, self._chunks(rank, data), len(data))
                for path, data in self.files(rank).items()
            ]
            report = Staged.of(
                rank, lambda: store.stage_files(plan.step, sources, plan=plan), node=store.node
            )
            self.reports[rank] = report
            return report.error or f"{len(report.entries)} entries"

        return stage

    def _chunks(self, rank: int, data: bytes) -> Callable[[], Iterator[bytes]]:
        def chunks() -> Iterator[bytes]:
            yield data[:4]
            if rank in self.failing:
                raise BackendError(f"rank {rank}: no space left on device")
            yield data[4:]

        return chunks

    def _conclude(self) -> object:
        if self.begun is None or not self.plans:
            return "no save begun"
        if len(self.reports) < len(self.participants):
            return "a rank died: the gather times out and the job dies"
        reports = [self.reports[r] for r in sorted(self.reports)]
        return self.begun.conclude(reports, world_size=len(self.participants)).step
