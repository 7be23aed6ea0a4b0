"""One resolution's candidates, newest first, and what failed on the way.

The resolver (resolver.py) knows what each tier holds and which step is latest; a
:class:`Search` turns that into the order a load tries steps in, and into the error that ends
a load with none left, so each rule is written once:

* Latest first, then (with ``fallback``) the older committed steps, newest first; each step is
  offered once per tier that holds it, fastest first, and the other tiers' copies of a step
  before any older step. Steps other nodes' local tiers hold (``also``) come first when newer
  than latest and not fenced.
* A step that fails verification is skipped with a warning for the next copy or the newest
  older step; the steps skipped are reported with the one that loads.
* Only an empty store means "nothing to resume from" (NotFoundError); a store whose steps
  all failed raises, counting the refused steps and saying why (refusal.py).

Candidates are read only once needed, so a load whose latest verifies reads nothing older.
``Resolver.resolve`` runs a Search in this process; a multi-rank load runs the same Search on
its coordinator and reports every rank's verdict on each offered step back into it
(distributed.py), finding latest first (:meth:`Search.prime`) while the other ranks look at
their local tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Protocol

from ckptstore.core.refusal import refusal
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import CheckpointError, NotFoundError, bad_copy
from ckptstore.protocol.catalog import Catalog, fenced
from ckptstore.protocol.pointer import Pointer

log = logging.getLogger(__name__)


class Source(Protocol):
    """What a Search reads steps through: the pinned resolver that made it (resolver.py),
    which reads the durable pointer once for the whole search."""

    faster: tuple[Catalog, ...]
    """The tiers in front of the durable one (a local tier), fastest first."""

    @property
    def uri(self) -> str: ...

    def latest(self) -> CheckpointInfo | None: ...

    def copies(self, step: int) -> list[CheckpointInfo]: ...

    def older(self, than: int) -> Iterator[CheckpointInfo]: ...

    def durable_fences(self) -> Pointer | None: ...


class Search:
    """One resolution: candidates newest first, read only once needed, and what failed."""

    def __init__(
        self,
        resolver: Source,
        step: int | None,
        *,
        fallback: bool,
        newer_than: int | None,
        also: Sequence[CheckpointInfo] = (),
    ) -> None:
        self.resolver = resolver
        self.also = tuple(also)
        self.explicit = step is not None
        self.fallback = fallback and step is None
        self.newer_than = newer_than
        self._candidates = self._generate(step)
        self._failures: dict[int, CheckpointError] = {}
        self._offered = 0
        self._latest: tuple[CheckpointInfo | None] | Exception | None = None

    def prime(self) -> None:
        """Find latest now, before ``also`` is known (distributed.py reads it while the other
        ranks look at their local tiers); an error is raised by :meth:`next`, as unprimed."""
        if self._latest is None and not self.explicit:
            try:
                self._latest = (self.resolver.latest(),)
            except Exception as e:
                self._latest = e

    def _find_latest(self) -> CheckpointInfo | None:
        self.prime()
        if isinstance(self._latest, Exception):
            raise self._latest
        assert self._latest is not None
        return self._latest[0]

    def _generate(self, step: int | None) -> Iterator[CheckpointInfo]:
        resolver = self.resolver
        if step is not None:
            yield from resolver.copies(layout.check_step(step))
            return
        latest = self._find_latest()
        yield from self._elsewhere(latest)
        if latest is None or not self._wanted(latest.step):
            return
        yield latest
        if resolver.faster:  # the same step in the other tiers, before any older step
            yield from (i for i in resolver.copies(latest.step) if i.tier != latest.tier)
        if self.fallback:
            for info in resolver.older(latest.step):
                if not self._wanted(info.step):
                    return
                yield info

    def _elsewhere(self, latest: CheckpointInfo | None) -> Iterator[CheckpointInfo]:
        """Steps of ``also`` newer than ``latest``, newest first, one each, fenced ones
        left out."""
        fences = self.resolver.durable_fences() if self.also else None
        newer = {
            i.step: i
            for i in self.also
            if (latest is None or i.step > latest.step) and not fenced(fences, i)
        }
        for step in sorted(newer, reverse=True):
            if self._wanted(step):
                yield newer[step]

    def _wanted(self, step: int) -> bool:
        return self.newer_than is None or step > self.newer_than

    def next(self) -> CheckpointInfo | None:
        """The next step to try; None when no candidate is left (then :meth:`exhausted`).
        Without fallback, only other tiers' copies of the one step are left after a
        failure."""
        info = next(self._candidates, None)
        if info is not None:
            self._offered += 1
        return info

    def failed(self, info: CheckpointInfo, error: CheckpointError) -> None:
        """``info`` failed verification; the search goes on with an older step (or, without
        fallback, ends with this error)."""
        self._failures[info.step] = error
        if self.resolver.faster:
            log.warning(
                "step %d: its copy in %s failed verification (%s); trying the next copy",
                info.step,
                info.uri,
                bad_copy(error),
            )
        elif self.fallback:
            log.warning("step %d failed verification (%s); trying an older step", info.step, error)

    @property
    def skipped(self) -> tuple[int, ...]:
        """The steps that failed so far, newest first."""
        return tuple(sorted(self._failures, reverse=True))

    def skipped_before(self, chosen: CheckpointInfo) -> tuple[int, ...]:
        """The steps that failed, newest first, but ``chosen`` (whose copy in another tier
        failed, when a later copy loads)."""
        return tuple(s for s in self.skipped if s != chosen.step)

    def exhausted(self) -> CheckpointError:
        """The error that ends a search with no step left: the failure itself for one step;
        NotFoundError when there was nothing to try (an empty store, or nothing newer than
        ``newer_than``); else a count of the steps refused and why."""
        uri = self.resolver.uri
        if self._failures and not self.fallback:
            return next(iter(self._failures.values()))
        if not self._failures:
            newer = f" newer than step {self.newer_than}" if self.newer_than is not None else ""
            return NotFoundError(
                f"{uri} holds no committed step{newer}: nothing to resume from. Check the URI "
                "(and endpoint), or save a step first",
                uri=uri,
            )
        return refusal(uri, self._failures)
