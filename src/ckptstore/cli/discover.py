"""Finding stores below a URI that is not one: ``ckptstore ls s3://bucket/``.

People point ``ls`` at a bucket or a parent directory the way they would with ``aws s3 ls``;
answering "holds no committed step" there is true and useless. So ``ls`` walks down instead and
lists the stores it finds. A directory is a store if it holds a step directory
(``global_step_N``), ckptstore's ``.ckptstore/`` directory, or a ``latest.json``; the walk does not
go into a store, a step directory or a hidden directory.

The walk lists one directory level per request (a delimiter listing on S3), never the whole
tree, because a bucket of checkpoints holds millions of objects. It is bounded twice:
:data:`SEARCH_DEPTH` levels below the URI and :data:`MAX_LISTINGS` directory listings; the
answer says when a bound cut it short. Each store found is then opened and listed like ``ls``
does, several at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptstore.backends.base import Backend, join
from ckptstore.cli.format import format_table, human_size, iso_time, plural
from ckptstore.domain import layout
from ckptstore.errors import CheckpointError
from ckptstore.store import CheckpointStore

SEARCH_DEPTH = 3
"""Directory levels below the URI that are searched: ``s3://bucket/team/project/run``."""
MAX_LISTINGS = 500
"""Directory listings one search may make (one request each on S3)."""
WORKERS = 8
"""Listings or stores read at once: each is a few small requests, so latency bounds them."""


@dataclass(frozen=True)
class StoresFound:
    """Where stores were found (paths relative to the URI searched), and whether a bound
    (depth or listings) stopped the search before it had looked everywhere."""

    found: tuple[str, ...]
    truncated: bool


@dataclass(frozen=True)
class FoundStore:
    """One store found by a search, summarized as ``ls`` would total it."""

    uri: str
    latest: int | None
    steps: int
    size: int
    time: float | None
    """Commit time of the latest step."""
    error: str | None = None
    """Why the store could not be read (the search goes on past it)."""

    def record(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "latest": self.latest,
            "steps": self.steps,
            "size": self.size,
            "time": iso_time(self.time) if self.time is not None else None,
            "error": self.error,
        }


def is_store(names: Sequence[str]) -> bool:
    """Whether subdirectory ``names`` mark their parent as a store (``latest.json`` aside)."""
    return layout.META_DIR in names or any(layout.parse_step_dir(n) is not None for n in names)


def find_stores(
    backend: Backend, *, depth: int = SEARCH_DEPTH, max_listings: int = MAX_LISTINGS
) -> StoresFound:
    """The stores below ``backend``'s root, breadth first, in path order per level.

    The root itself is not reported: the caller asks because it holds no committed step.
    """

    def look(prefix: str) -> tuple[str, list[str], bool]:
        names = backend.list_dirs(prefix)
        store = bool(prefix) and (
            is_store(names) or backend.stat(f"{prefix}/{layout.LATEST_NAME}") is not None
        )
        return prefix, names, store

    found: list[str] = []
    level, listings, truncated = [""], 0, False
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="ckpt-find") as pool:
        for current in range(depth + 1):
            if listings + len(level) > max_listings:
                level, truncated = level[: max_listings - listings], True
            listings += len(level)
            below = []
            for prefix, names, store in pool.map(look, level):
                if store:
                    found.append(prefix)
                    continue
                children = [join(prefix, n) if prefix else n for n in names if _walkable(n)]
                if children and current == depth:
                    truncated = True  # directories left unlooked-at below the depth bound
                below += children
            level = below
            if not level:
                break
    return StoresFound(tuple(found), truncated)


def _walkable(name: str) -> bool:
    return not name.startswith(".") and layout.parse_step_dir(name) is None


def summarize(
    uris: Sequence[str], open_store: Callable[[str], CheckpointStore]
) -> list[FoundStore]:
    """Each store's latest step, committed steps and total size. Stores are opened here, in
    turn (``open_store`` may register them for closing), then read several at once."""

    def one(uri: str, store: CheckpointStore | CheckpointError) -> FoundStore:
        try:
            if isinstance(store, CheckpointError):
                raise store
            infos = store.list()
            latest = store.latest() if infos else None
        except CheckpointError as e:  # one unreadable store must not hide the others
            return FoundStore(uri, None, 0, 0, None, error=str(e))
        return FoundStore(
            store.uri,
            latest.step if latest is not None else None,
            len(infos),
            sum(i.size for i in infos),
            latest.time if latest is not None else None,
        )

    stores: list[CheckpointStore | CheckpointError] = []
    for uri in uris:
        try:
            stores.append(open_store(uri))
        except CheckpointError as e:
            stores.append(e)
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="ckpt-summary") as pool:
        return list(pool.map(one, uris, stores))


def stores_text(uri: str, stores: Sequence[FoundStore], search: StoresFound, depth: int) -> str:
    """The human view: a heading, one row per store, a total and what to run next."""
    rows = [
        [
            s.uri,
            "-" if s.latest is None else s.latest,
            s.steps,
            human_size(s.size),
            "-" if s.time is None else iso_time(s.time),
            s.error or "",
        ]
        for s in stores
    ]
    headers = ["STORE", "LATEST", "STEPS", "SIZE", "LATEST TIME (UTC)", "ERROR"]
    if not any(s.error for s in stores):
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    cut = "; the search was cut short, give a deeper URI to see more" if search.truncated else ""
    return "\n".join(
        [
            f"{uri} is not a store; {plural(len(stores), 'store')} below it "
            f"(searched {plural(depth, 'level')} down{cut}):",
            format_table(headers, rows),
            f"total: {plural(len(stores), 'store')}, {plural(sum(s.steps for s in stores), 'step')}"
            f", {human_size(sum(s.size for s in stores))}; "
            "run `ckptstore ls STORE` for a store's steps",
        ]
    )
