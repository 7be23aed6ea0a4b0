"""The few object collectives the multi-process protocols need (distributed.py, the DCP
reader, peers.py), over one torch.distributed process group, or a world of one without it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ckptstore.errors import ConfigError

T = TypeVar("T")
_TIMED_GROUPS: dict[tuple[tuple[int, ...], float, str], dist.ProcessGroup] = {}


def _timed_group(group: dist.ProcessGroup | None, timeout: float, use: str) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks whose collectives give up after ``timeout`` s, for
    one ``use`` (peer copies run in a thread of their own: they never share a group with the
    save's collectives), made once per process by the members only (every member asks for it
    at the same point; ``use_local_synchronization``: the processes outside a subgroup need
    not call, as torch otherwise requires of every process of the job)."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (ranks, timeout, use)
    if key not in _TIMED_GROUPS:
        with _names_of_our_own(key):
            made = dist.new_group(
                list(ranks),
                timeout=timedelta(seconds=timeout),
                backend="gloo",
                use_local_synchronization=True,
            )
        # every rank of the group is a member, so it gets the group, not what a non-member
        # gets (None before torch 2.14, GroupMember.NON_GROUP_MEMBER, -100, since)
        assert isinstance(made, dist.ProcessGroup), made
        _TIMED_GROUPS[key] = made
    return _TIMED_GROUPS[key]


_SALT_BASE = 1 << 48
"""Far above any count of groups a job makes: our salts never meet torch's own."""


@contextmanager
def _names_of_our_own(key: tuple[tuple[int, ...], float, str]) -> Iterator[None]:
    """Name a members-only group from ``key`` and leave torch's group counter as it was.

    Since torch 2.14 a members-only group (``use_local_synchronization``) is named from the
    job-wide group counter and advances it, on the members alone: after ckptstore made its
    timed group over a subgroup, the members' next ``new_group`` (the user's, over the whole
    world) would take another name than the other ranks' and wait for them forever. The
    counter is set, for this one creation, to a salt every member derives from ``key`` (so
    the members agree and two of our groups over the same ranks differ), then restored.
    Before 2.14 the name came from the registered groups, not the counter: this is a no-op.
    """
    world = distributed_c10d._world
    before = world.group_count
    digest = hashlib.sha1(repr(key).encode(), usedforsecurity=False).hexdigest()
    world.group_count = _SALT_BASE + int(digest[:12], 16)
    try:
        yield
    finally:
        world.group_count = before


class Collectives:
    """The few object collectives the save and load protocols need, over one process group.

    Without an initialized process group it stands for a world of one, so the same code runs
    (and is tested) in a single process.
    """

    MARGIN = 30.0
    """Seconds the collectives of a face with a deadline wait past it (:meth:`past`)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        use: str = "protocol",
    ) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active and group is not None:
            raise ConfigError("a process group was given, but torch.distributed is not initialized")
        if self.active and timeout is not None:
            group = _timed_group(group, timeout, use)
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.size = dist.get_world_size(group) if self.active else 1
        self.root = dist.get_global_rank(group, 0) if self.active and group is not None else 0
        """The global rank of the group's rank 0 (collectives address global ranks)."""

    @classmethod
    def past(cls, group: dist.ProcessGroup | None, deadline: float | None) -> Collectives:
        """The collectives of a face whose every rank works by ``deadline`` seconds (a save's
        or a load's): they give up :attr:`MARGIN` seconds after it, so a rank that failed at
        its deadline (and cleaned up) still reaches them, and a rank that never does (hung
        outside ckptstore's I/O, or not called) fails the others that much later. Without a
        deadline, the process group's own timeout."""
        return cls(group, timeout=None if deadline is None else deadline + cls.MARGIN)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj``, on every rank."""
        if not self.active or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def scatter(self, objs: list[T] | None) -> T:
        """Rank r's item of rank 0's ``objs`` (one per rank; ``None`` on other ranks)."""
        if not self.active or self.size == 1:
            assert objs is not None and len(objs) == self.size
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs, src=self.root, group=self.group)
        return out[0]  # type: ignore[no-any-return]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj``, in rank order, on rank 0; ``None`` elsewhere."""
        if not self.active or self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.root, group=self.group)
        return out

    def send(self, obj: object, to: int) -> None:
        """Send ``obj`` to group rank ``to`` (it calls :meth:`receive`)."""
        dist.send_object_list([obj], dst=self.global_rank(to), group=self.group)

    def receive(self, source: int) -> Any:
        """What group rank ``source`` sends this rank."""
        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.global_rank(source), group=self.group)
        return box[0]

    def global_rank(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (point-to-point calls address those)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active or self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
