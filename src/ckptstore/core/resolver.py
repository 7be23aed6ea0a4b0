"""Which step a load starts from: the one resolver under every face.

``store.load``, ``pull``, ``load_distributed``, the DCP reader and the verl resume all ask this
module, so each rule below is written once:

* Manifests are the truth and ``latest.json`` a fast path: the pointer's step, unless one
  listing finds a newer committed step (a writer died between its commit and the pointer), or
  a listing of every step when the pointer is missing or broken.
* A step committed by a writer after it lost the lease (pointer.py) is never latest and never
  a fallback; it loads only when asked for by number.
* A manifest of a newer schema than this ckptstore reads is a CompatibilityError ("upgrade
  ckptstore") wherever it would have been chosen: skipping it would resume an older step.
* A step that fails verification is skipped with a warning for the newest older good one.
* Only an empty store means "nothing to resume from" (NotFoundError). A store whose steps all
  fail raises, counting the refused steps and saying why (refusal.py), so no job restarts
  from step 0 because of a wrong key or a corrupt bucket.

* A store with a local tier (tiers/local.py) is resolved as one: the newest step either tier holds,
  the local copy of a step before the durable copy, and the durable copy of a step that
  failed locally before any older step. Fences are the durable pointer's, for both tiers.

The order a load tries steps in, and the error that ends a load with none left, are a
:class:`~ckptstore.core.search.Search` (search.py), made by :meth:`Resolver.search` over a
resolver that reads the durable pointer once for the whole search (:meth:`Resolver.pinned`).
``resolve`` runs it in this process; a multi-rank load runs the same Search on its coordinator
and reports every rank's verdict on each offered step back into it (distributed.py).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from ckptstore.core.refusal import refusal
from ckptstore.core.search import Search
from ckptstore.deadline import Deadline, bounded, submit, within
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.domain.step_index import Head
from ckptstore.errors import (
    CheckpointError,
    CompatibilityError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
    bad_copy,
)
from ckptstore.protocol.catalog import Catalog, fenced
from ckptstore.protocol.pointer import Pointer

log = logging.getLogger(__name__)
T = TypeVar("T")
LOCAL, DURABLE = "local", "durable"
"""The tier a step was found in (``CheckpointInfo.tier``), in a store with a local tier."""

VERIFY_ERRORS = (CorruptCheckpointError, IncompleteCheckpointError)
"""What makes a step fall back to an older one (UntrustedCheckpointError is a corruption)."""


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """What ``resolve`` found: the step, the action's result, and the newer steps skipped."""

    info: CheckpointInfo
    value: T
    skipped: tuple[int, ...] = ()
    """Steps newer than ``info`` that failed verification (a resume may replace them)."""


class Resolver:
    """Chooses steps to load from one store's catalogs: its durable tier's, and those of the
    tiers in front of it (tiers/local.py)."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        faster: Sequence[Catalog] = (),
        load_timeout: float | None = None,
    ) -> None:
        self.load_timeout = load_timeout
        """Seconds a load may take (the store's ``load_timeout``): :meth:`resolve` and the
        faces' own reads (:meth:`loading`) run by it."""
        self.catalog = catalog
        """The durable tier: its pointer's fences rule every tier."""
        self.faster = tuple(faster)
        """Tiers in front of it, fastest first (a local tier)."""
        self._pin = False
        self._pinned: tuple[Pointer | None] | CorruptCheckpointError | None = None
        self._head: Future[tuple[Head | None, str | None]] | None = None

    def pinned(self) -> Resolver:
        """A copy for one resolution that reads the durable pointer once: its fences judge
        every tier's steps, and each tier's check would read it again (a GET each on a
        bucket, the fixed cost of every load)."""
        copy = Resolver(self.catalog, faster=self.faster, load_timeout=self.load_timeout)
        copy._pin = True
        return copy

    def _durable_pointer(self) -> Pointer | None:
        """The durable tier's pointer (None when absent); a pinned resolver reads it once."""
        if not self._pin:
            return self.catalog.read_pointer()[0]
        if self._pinned is None:
            try:
                self._pinned = (self.catalog.read_pointer()[0],)
            except CorruptCheckpointError as e:
                self._pinned = e
        if isinstance(self._pinned, CorruptCheckpointError):
            raise self._pinned
        return self._pinned[0]

    def durable_fences(self) -> Pointer | None:
        """The durable pointer, whose fences judge every tier's steps; None when it is
        absent or unreadable (then nothing is fenced)."""
        try:
            return self._durable_pointer()
        except CorruptCheckpointError:
            return None

    @property
    def uri(self) -> str:
        return self.catalog.backend.uri

    @property
    def tiers(self) -> tuple[Catalog, ...]:
        return (*self.faster, self.catalog)

    @contextlib.contextmanager
    def loading(self, step: int | None = None) -> Iterator[Deadline | None]:
        """The load's deadline (the store's ``load_timeout``) in force for the block, one in
        force already kept: the one entry point every face's load runs under, whether it
        resolves (:meth:`resolve`), reads a step's files itself (distributed.py, the DCP
        reader) or does several of those as one load (a resume, a pull, an export). ``step``,
        once known, is named by the timeout's error."""
        with within(self.load_timeout, operation="load", store=self.uri) as deadline:
            if deadline is None or step is None or deadline.operation != "load":
                yield deadline
                return
            with bounded(deadline.of_step(step)) as named:
                yield named

    def _tagged(self, info: CheckpointInfo, catalog: Catalog) -> CheckpointInfo:
        """``info`` with the tier it was found in, in a store that has tiers."""
        if not self.faster:
            return info
        return replace(info, tier=DURABLE if catalog is self.catalog else LOCAL)

    def _fences(self, catalog: Catalog, own: Pointer | None) -> Pointer | None:
        """The pointer whose fences judge ``catalog``'s steps: the durable tier's."""
        return own if catalog is self.catalog else self.durable_fences()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed step a resume may start from, in any tier (module
        docstring); ``None`` only when no tier holds a committed step at all."""
        if not self._pin:
            return self.pinned().latest()
        self._read_head_ahead()
        best: CheckpointInfo | None = None
        refused: CheckpointError | None = None
        for catalog in self.tiers:
            try:
                info = self.latest_in(catalog, above=best.step if best is not None else None)
            except CompatibilityError:
                raise
            except CorruptCheckpointError as e:
                if not self.faster:
                    raise
                refused = refused or e  # another tier may still hold good steps
                continue
            if info is not None and (best is None or info.step > best.step):
                best = info
        if best is None and refused is not None:
            raise refused
        return best

    def _read_head_ahead(self) -> None:
        """In a store with tiers, start reading the durable tier's step index head on a
        thread while this one reads the pointers: latest needs both (:meth:`committed_after`),
        and on a bucket each is a request's round trip, which were waited for one after the
        other. Either order of the two reads is as good: a step committed between them is
        found by the later one, or left for the next load, as if the load had begun earlier.
        """
        if not self.faster or self._head is not None:
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-resolve")
        try:
            self._head = submit(pool, self.catalog.index.read_head)  # under the load's deadline
        finally:
            pool.shutdown(wait=False)

    def _durable_head(self, catalog: Catalog) -> Future[tuple[Head | None, str | None]] | None:
        """The head read ahead for ``catalog`` (the durable tier's), taken once."""
        if catalog is not self.catalog:
            return None
        ahead, self._head = self._head, None
        return ahead

    def latest_in(self, catalog: Catalog, *, above: int | None = None) -> CheckpointInfo | None:
        """The newest committed step of one tier, judged by the durable pointer's fences.
        With ``above`` (a faster tier's latest), None when the tier's pointer and step index
        show nothing newer than that: its manifest is then not read (a GET on a bucket)."""
        pointer = None
        try:
            durable = catalog is self.catalog
            pointer = self._durable_pointer() if durable else catalog.read_pointer()[0]
            if pointer is not None and pointer.step is not None:
                found = self.committed_after(pointer, catalog=catalog)
                if found is None and above is not None and pointer.step <= above:
                    return None
                found = found or catalog.info(pointer.step)
                if not fenced(self._fences(catalog, pointer), found):
                    return self._tagged(found, catalog)
                # a local tier's pointer moved by a writer fenced beside the new holder
                log.warning(
                    "%s: latest step %d is a fenced writer's; listing the others",
                    catalog.uri(""),
                    found.step,
                )
        except (NotFoundError, CorruptCheckpointError) as e:
            log.warning(
                "%s: latest pointer is unusable (%s); falling back to listing", catalog.uri(""), e
            )
        fences = self._fences(catalog, pointer)
        committed, broken = catalog.scan()
        infos = [catalog.info_of(m) for m in committed]
        readable = [i for i in infos if not fenced(fences, i)]
        newest = readable[-1].step if readable else -1
        self._refuse_newer_schema({s: e for s, e in broken.items() if s > newest})
        for step, error in broken.items():
            log.warning("step %d has an unreadable manifest: %s", step, error)
        if not readable and broken:
            raise refusal(catalog.uri(""), broken, fenced_count=len(infos))
        if readable and pointer is None:
            log.warning(
                "%s: no %s, but committed steps exist; using the newest, %d",
                catalog.uri(""),
                layout.LATEST_NAME,
                newest,
            )
        return self._tagged(readable[-1], catalog) if readable else None

    def committed_after(
        self, pointer: Pointer | None, *, catalog: Catalog | None = None
    ) -> CheckpointInfo | None:
        """The newest committed step past the pointer's (any, without one), if any: a writer
        killed between its commit and moving the pointer (one listing of ``catalog``, by
        default the durable tier's)."""
        catalog = catalog if catalog is not None else self.catalog
        fences = self._fences(catalog, pointer)
        step = pointer.step if pointer is not None and pointer.step is not None else -1
        for newer in reversed(newer_steps(catalog, step, self._durable_head(catalog))):
            try:
                info = catalog.info(newer)
            except NotFoundError:
                continue  # a save in flight, or garbage for gc
            except CorruptCheckpointError as e:  # CompatibilityError is raised: never skipped
                log.warning("step %d has an unreadable manifest: %s", newer, e)
                continue
            if fenced(fences, info):
                log.warning(
                    "%s: step %d was committed by %s after it lost the writer lease (epoch "
                    "%d); ignoring it (ckptstore rm removes it)",
                    catalog.uri(""),
                    newer,
                    info.writer,
                    info.lease_epoch,
                )
                continue
            log.warning(
                "%s: %s is at step %d, but step %d is committed (its writer stopped before "
                "moving the pointer); using %d",
                catalog.uri(""),
                layout.LATEST_NAME,
                step,
                newer,
                newer,
            )
            return info
        return None

    def _refuse_newer_schema(self, broken: dict[int, CheckpointError]) -> None:
        newest = [e for _, e in sorted(broken.items()) if isinstance(e, CompatibilityError)]
        if newest:
            raise newest[-1]

    def info(self, step: int) -> CheckpointInfo:
        """``step``'s info from the fastest tier that holds it committed; NotFoundError
        (the durable tier's) when none does."""
        return self.copies(step)[0]

    def copies(self, step: int) -> builtins.list[CheckpointInfo]:
        """``step`` as each tier holds it, fastest first; NotFoundError when none does."""
        found: builtins.list[CheckpointInfo] = []
        missing: NotFoundError | None = None
        for catalog in self.tiers:
            try:
                found.append(self._tagged(catalog.info(step), catalog))
            except NotFoundError as e:
                missing = e
            except CorruptCheckpointError as e:
                if not self.faster:
                    raise
                log.warning("step %d: %s; trying the next tier", step, bad_copy(e))
        if not found:
            assert missing is not None
            raise missing
        return found

    def search(
        self,
        step: int | None = None,
        *,
        fallback: bool = True,
        newer_than: int | None = None,
        also: Sequence[CheckpointInfo] = (),
    ) -> Search:
        """The candidates for loading ``step`` (one), or latest then, with ``fallback``, the
        older good steps; only steps above ``newer_than`` when given. Each step is offered
        once per tier that holds it, fastest first. ``also``: steps other nodes' local tiers
        hold (distributed.py), offered first when newer than latest and not fenced."""
        return Search(self.pinned(), step, fallback=fallback, newer_than=newer_than, also=also)

    def resolve(
        self,
        step: int | None,
        fallback: bool,
        action: Callable[[CheckpointInfo], T],
        *,
        newer_than: int | None = None,
    ) -> Resolved[T]:
        """Run ``action`` on the chosen step; on a verification failure, on the next
        candidate. Raises :meth:`Search.exhausted`'s error when none is left."""
        with self.loading():
            search = self.search(step, fallback=fallback, newer_than=newer_than)
            while (info := search.next()) is not None:
                try:
                    with self.loading(info.step):
                        value = action(info)
                    return Resolved(info, value, search.skipped_before(info))
                except VERIFY_ERRORS as e:
                    search.failed(info, e)
            raise search.exhausted()

    def older(self, than: int) -> Iterator[CheckpointInfo]:
        """Committed steps before ``than``, newest first (each tier's copy, fastest first),
        without fenced ones."""
        fences = self.durable_fences()
        found = [
            (info.step, index, self._tagged(info, catalog))
            for index, catalog in enumerate(self.tiers)
            for info in catalog.list()
            if info.step < than and not fenced(fences, info)
        ]
        for _, _, info in sorted(found, key=lambda f: (-f[0], f[1])):
            yield info

    def fenced_steps(self, infos: Iterable[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Committed steps (of ``infos``, default all of the durable tier) that a writer
        committed after it lost the writer lease."""
        pointer = self.catalog.pointer_or_none()
        chosen = self.catalog.list() if infos is None else infos
        return [i.step for i in chosen if fenced(pointer, i)]


def newer_steps(
    catalog: Catalog,
    step: int,
    ahead: Future[tuple[Head | None, str | None]] | None = None,
) -> builtins.list[int]:
    """Steps above ``step`` that may be committed: from the step index's head (one GET, or
    the one read ``ahead``) where it knows them all, else from one listing of step
    directories."""
    try:
        head, _ = ahead.result() if ahead is not None else catalog.index.read_head()
    except CorruptCheckpointError:
        head = None
    known = head.steps_after(step) if head is not None else None
    return known if known is not None else [s for s in catalog.step_dirs() if s > step]
