"""Engine parts wired as a store wires them, for tests that drive one directly (a crashed or
rival writer behind a store's back)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptstore.backends.base import Backend
from ckptstore.domain.signing import Signer
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.removal import Remover


def committer_for(
    backend: Backend,
    *,
    writer: str = "test",
    clock: Callable[[], float] = time.time,
    signer: Signer | None = None,
) -> Committer:
    """A Committer over ``backend`` with a catalog and remover of its own."""
    catalog = Catalog(backend, signer=signer)
    remover = Remover(backend, writer=writer, catalog=catalog, clock=clock)
    return Committer(catalog, remover, writer=writer, clock=clock)


def pointer_step(backend: Backend) -> int | None:
    """The step ``latest`` itself names (not the listing a reader falls back to), read by a
    catalog of its own: what a save left in the pointer."""
    pointer, _ = Catalog(backend).read_pointer()
    return pointer.step if pointer is not None else None
