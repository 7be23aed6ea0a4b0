"""What must hold in a store after its writer was SIGKILLed at any moment, checked afresh.

The checker opens new CheckpointStore objects (no state carried over from the killed writer)
and looks twice: through the store (``latest``, ``list``, ``load``), and underneath it, at every
file or object and every unfinished multipart upload, straight from the disk or the S3 server,
so a stray the store's own listings hide still counts. Rules, from docs/design.md's invariants:

* ``latest`` resolves to a committed step that loads, verifies and holds what was saved; it is
  at least every step the saver recorded as committed, and never behind the previous check's;
* every recorded step is still committed, or ``keep_last`` newer committed steps exist (only
  retention may delete it);
* after ``gc(older_than=0)`` nothing is left but ``latest.json``, the lease, pins, lock files
  and the files of committed steps: no uncommitted step directory, no unlisted file, no
  unfinished multipart upload, and in a store that uses the writer lease no tombstone either
  (a store without leases keeps gc's tombstones a day: nothing proves a committer dead).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckptstore.backends.local import LOCK_PREFIX
from ckptstore.domain import layout
from ckptstore.domain.manifest import is_tombstone
from ckptstore.domain.step_index import HEAD_NAME, segment_path
from ckptstore.errors import CheckpointError, NotFoundError
from ckptstore.protocol.pointer import Pointer
from ckptstore.protocol.step_index import StepIndex
from harness.killsaver import make_state, same_state


class RawView(Protocol):
    """The store's storage seen without the store: every file, every unfinished upload."""

    def files(self) -> Iterator[str]: ...

    def step_dirs(self) -> Iterator[str]: ...

    def uploads(self) -> Iterator[str]: ...


class LocalView:
    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def files(self) -> Iterator[str]:
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                yield os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")

    def step_dirs(self) -> Iterator[str]:
        if self.root.is_dir():
            yield from (p.name for p in self.root.iterdir() if p.is_dir())

    def uploads(self) -> Iterator[str]:
        return iter(())  # temp files are files: files() reports them


class S3View:
    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/") + "/"

    def files(self) -> Iterator[str]:
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", ()):
                yield str(obj["Key"])[len(self.prefix) :]

    def step_dirs(self) -> Iterator[str]:
        return iter(())  # S3 has no directories, only keys: files() covers them

    def uploads(self) -> Iterator[str]:
        found = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        for upload in found.get("Uploads", ()):
            yield f"unfinished multipart upload of {upload['Key']} ({upload['UploadId']})"


@dataclass
class Findings:
    """What one check found; empty lists mean the store is sound."""

    latest: int | None = None
    lost: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    """Anything else: latest behind, unresolvable, or a pointer to an uncommitted step."""

    @property
    def problems(self) -> list[str]:
        return [*self.broken, *self.lost, *self.corrupt, *self.strays]


def check(
    store: Any,
    raw: RawView,
    *,
    seed: int,
    keep_last: int,
    recorded: list[int],
    previous_latest: int | None,
) -> Findings:
    """Run every rule on ``store`` (a fresh CheckpointStore) and ``raw``; gc runs in between."""
    found = Findings()
    listed = [info.step for info in store.list()]  # through the step index
    committed = [m.step for m in store._catalog.scan()[0]]  # the manifests: the truth
    if listed != committed:
        found.broken.append(f"the step index lists {listed}, the manifests say {committed}")
    for step in committed:
        try:
            if not same_state(store.load(step), make_state(seed, step)):
                found.corrupt.append(f"step {step} loads, but not what was saved")
        except CheckpointError as e:
            found.corrupt.append(f"step {step} does not load: {e}")
    _check_latest(store, found, committed, recorded, previous_latest)
    for step in sorted(set(recorded)):
        newer = sum(s > step for s in committed)
        if step not in committed and newer < keep_last:
            found.lost.append(f"step {step} was committed, is gone, with {newer} newer steps")
    store.gc(older_than=0)
    found.strays = strays(store, raw)
    return found


def _check_latest(
    store: Any,
    found: Findings,
    committed: list[int],
    recorded: list[int],
    previous_latest: int | None,
) -> None:
    try:
        pointer = Pointer.decode(store.backend.read(layout.LATEST_NAME), layout.LATEST_NAME)
    except NotFoundError:
        pointer = None
    if pointer is not None and pointer.step is None:
        pointer = None  # stamped by a takeover (its fences) before any step was committed
    if pointer is not None and pointer.step not in committed:
        found.broken.append(f"latest.json points at step {pointer.step}, which is not committed")
    latest = store.latest()
    found.latest = latest.step if latest is not None else None
    if latest is None:
        if recorded or committed:
            found.broken.append(f"latest is None, but steps {committed} are committed")
        return
    if latest.step not in committed:
        found.broken.append(f"latest is step {latest.step}, which is not committed")
    if recorded and latest.step < max(recorded):
        found.broken.append(f"latest is {latest.step}, behind committed step {max(recorded)}")
    if previous_latest is not None and latest.step < previous_latest:
        found.broken.append(f"latest went back from {previous_latest} to {latest.step}")


def strays(store: Any, raw: RawView) -> list[str]:
    """Everything in the storage that no committed step, pointer, lease or pin explains."""
    keep = {layout.LATEST_NAME, layout.LEASE_NAME, HEAD_NAME}
    head, _ = StepIndex(store.backend).read_head()
    keep.update(segment_path(n) for n in (head.segments if head is not None else ()))
    committed = set()
    for info in store.list():
        committed.add(layout.step_dir(info.step))
        keep.add(layout.manifest_path(info.step))
        keep.update(f.key(info.step) for f in info.files)
        keep.update(
            layout.attempt_marker_path(info.step, f.attempt) for f in info.files if f.attempt
        )
    uses_lease = layout.LEASE_NAME in set(raw.files())
    found = []
    for path in raw.files():
        name = path.rsplit("/", 1)[-1]
        if path in keep or path.startswith(layout.PINS_DIR + "/") or name.startswith(LOCK_PREFIX):
            continue
        if (
            name == layout.MANIFEST_NAME
            and not uses_lease
            and is_tombstone(store.backend.read(path))
        ):
            continue  # a store without leases cannot prove a committer dead: kept a day
        found.append(f"stray file {path}")
    found += [
        f"uncommitted step directory {d}"
        for d in raw.step_dirs()
        if _stray_dir(d, committed) and (uses_lease or not _tombstoned(store, d))
    ]
    found += list(raw.uploads())
    return found


def _tombstoned(store: Any, step_dir: str) -> bool:
    step = layout.parse_step_dir(step_dir)
    try:
        return step is not None and is_tombstone(store.backend.read(layout.manifest_path(step)))
    except NotFoundError:
        return False


def _stray_dir(name: str, committed: set[str]) -> bool:
    return layout.parse_step_dir(name) is not None and name not in committed
