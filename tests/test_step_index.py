"""The step index (protocol/step_index.py): listings of many steps in a few requests, kept
right by writers and repaired by readers, never trusted by a load.

Stores here are built through the commit protocol itself (tiny manifests, no payload) with
small segments, so a store of 2,500 steps has 25 of them and the tests stay fast.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.cli.main import run as cli_run
from ckptstore.domain import layout
from ckptstore.domain.manifest import KIND_STATE, Manifest
from ckptstore.domain.step_index import HEAD_NAME, Head, Summary
from ckptstore.errors import CompatibilityError, NotFoundError
from ckptstore.protocol.catalog import Catalog
from ckptstore.protocol.commit import Committer
from ckptstore.protocol.removal import Remover
from ckptstore.protocol.step_index import StepIndex
from counting import CountingBackend
from faults import FaultyBackend, InjectedFault

SEGMENT = 100


def parts(backend: Backend, writer: str = "w") -> tuple[Catalog, Committer]:
    catalog = Catalog(backend, segment_size=SEGMENT)
    remover = Remover(backend, writer=writer, catalog=catalog)
    return catalog, Committer(catalog, remover, writer=writer)


def commit(committer: Committer, step: int, **metadata: float) -> Manifest:
    environment = CheckpointStore(committer.backend.uri, lease=False).environment
    manifest = Manifest(step, float(step), KIND_STATE, (), environment, committer.writer,
                        metadata=metadata)  # fmt: skip
    return committer.commit(manifest)


def seed(root: Path, steps: int) -> None:
    """``steps`` committed steps (0 .. steps-1) written fast (no fsync), then indexed as
    ``ckptstore index --rebuild`` does: a large store for listings."""
    environment = CheckpointStore(str(root), lease=False).environment
    for step in range(steps):
        manifest = Manifest(step, float(step), KIND_STATE, (), environment, "w",
                            metadata={"loss": 1 / (step + 1)})  # fmt: skip
        target = root / layout.manifest_path(step)
        target.parent.mkdir(parents=True)
        target.write_bytes(manifest.encode())
    parts(LocalBackend(str(root), {}))[0].rebuild_index()


def fill(root: Path, steps: int) -> Catalog:
    """``steps`` committed steps (0 .. steps-1), through the commit protocol."""
    catalog, committer = parts(LocalBackend(str(root), {}))
    environment = CheckpointStore(str(root), lease=False).environment
    for step in range(steps):
        committer.commit(Manifest(step, float(step), KIND_STATE, (), environment, "w",
                                  metadata={"loss": 1 / (step + 1)}))  # fmt: skip
    return catalog


def listed(backend: Backend) -> list[int]:
    return [s.step for s in parts(backend)[0].summaries()[0]]


def test_a_listing_of_2500_steps_reads_the_index_and_no_manifest(tmp_path: Path) -> None:
    seed(tmp_path, 2500)
    counted = CountingBackend(LocalBackend(str(tmp_path), {}))
    catalog = parts(counted)[0]
    infos = catalog.list()
    assert [i.step for i in infos] == list(range(2500))
    # the head, then sealed segments of up to 10 head-fulls each
    assert counted.take() == Counter({"index GET": 1 + 3})
    assert infos[7].metadata == {"loss": 1 / 8} and infos[7].file_count == 0
    assert catalog.list() == infos and counted.take() == Counter({"index GET": 1})
    # the summaries are what the manifests say
    truth = [Summary.of(m) for m in Catalog(LocalBackend(str(tmp_path), {})).scan()[0]]
    assert catalog.summaries()[0] == truth


def test_a_writer_killed_between_its_commit_and_the_index_update_is_listed(
    tmp_path: Path,
) -> None:
    fill(tmp_path, 5)
    # this commit's writes: announce (1), manifest (2), then it dies: no index update (3)
    faulty = FaultyBackend(LocalBackend(str(tmp_path), {}), fail_at=3, mode="crash")
    commit(parts(faulty)[1], 5)  # committed: the failed update is only logged
    assert (tmp_path / layout.manifest_path(5)).exists()  # committed
    assert listed(LocalBackend(str(tmp_path), {})) == [0, 1, 2, 3, 4, 5]  # found by its claim
    head, _ = StepIndex(LocalBackend(str(tmp_path), {})).read_head()
    assert head is not None and not head.pending and head.steps[-1].step == 5  # repaired


def test_a_step_announced_but_never_committed_is_not_listed(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    faulty = FaultyBackend(LocalBackend(str(tmp_path), {}), fail_at=2, mode="crash")
    with pytest.raises(InjectedFault):
        commit(parts(faulty)[1], 3)  # announced, then died before the manifest
    assert listed(LocalBackend(str(tmp_path), {})) == [0, 1, 2]
    head, _ = StepIndex(LocalBackend(str(tmp_path), {})).read_head()
    assert head is not None and [p.step for p in head.pending] == [3]  # may still commit


def test_two_writers_updating_the_index_lose_no_update(tmp_path: Path) -> None:
    """Writer A last wrote the head (and keeps its version); B then writes it; A's next
    update swaps against a stale version, loses, reads again and keeps B's step. Across the
    sealing of a segment as well."""
    fill(tmp_path, SEGMENT - 2)
    a, b = (
        parts(LocalBackend(str(tmp_path), {}), "a")[1],
        parts(LocalBackend(str(tmp_path), {}), "b")[1],
    )
    commit(a, 1000)
    commit(b, 1001)  # A's remembered head is stale now
    commit(a, 1002)  # seals a full segment: SEGMENT summaries
    commit(b, 1003)
    steps = listed(LocalBackend(str(tmp_path), {}))
    assert steps == [*range(SEGMENT - 2), 1000, 1001, 1002, 1003]
    head, _ = StepIndex(LocalBackend(str(tmp_path), {})).read_head()
    assert head is not None and len(head.segments) == 1 and len(head.steps) == 2
    sealed = [p.name for p in (tmp_path / ".ckptstore" / "index").glob("seg-*")]
    assert list(head.segments) == sealed  # no segment of a lost race is left behind


def test_a_reader_racing_a_prune_never_lists_a_deleted_step(tmp_path: Path) -> None:
    """The prune claims its steps, uncommits them, and is killed before it drops them from
    the index: a reader between those moments must not list a step already deleted."""
    fill(tmp_path, 250)
    root = LocalBackend(str(tmp_path), {})
    _, committer = parts(root)
    committer.advance_latest(249)
    reader = parts(LocalBackend(str(tmp_path), {}))[0]
    assert len(reader.list()) == 250  # its cache of sealed segments is warm
    # writes: claim (1), then per step a tombstone swap, its marking and delete (3 each):
    # killed after 10 steps are gone and 1 more is uncommitted (its tombstone stands)
    faulty = FaultyBackend(LocalBackend(str(tmp_path), {}), fail_at=1 + 3 * 10 + 2, mode="crash")
    pruner = CheckpointStore(str(tmp_path), backend=faulty, lease=False, keep_last=5)
    pruner._catalog.index.segment_size = SEGMENT
    with pytest.raises(InjectedFault):
        pruner.prune()
    steps = [i.step for i in reader.list()]
    assert steps == list(range(11, 250)), steps[:15]
    assert all(not (tmp_path / layout.step_dir(s)).exists() for s in range(10))
    store = CheckpointStore(str(tmp_path), lease=False, keep_last=5)
    assert store.prune() == list(range(11, 245))  # the next prune finishes step 10 too
    assert [i.step for i in store.list()] == list(range(245, 250))
    assert not (tmp_path / layout.step_dir(10)).exists()


def test_an_index_of_a_newer_schema_is_refused_never_overwritten(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    newer = b'{"schema_version": 2, "anything": "a newer ckptstore writes"}'
    (tmp_path / HEAD_NAME).write_bytes(newer)
    with pytest.raises(CompatibilityError, match=r"newer ckptstore.*upgrade ckptstore"):
        parts(LocalBackend(str(tmp_path), {}))[0].list()
    with pytest.raises(CompatibilityError, match="upgrade"):
        commit(parts(LocalBackend(str(tmp_path), {}))[1], 3)
    with pytest.raises(CompatibilityError):
        CheckpointStore(str(tmp_path), lease=False).rebuild_index()
    assert (tmp_path / HEAD_NAME).read_bytes() == newer
    assert not (tmp_path / layout.step_dir(3)).exists()  # refused before its manifest


@pytest.mark.parametrize("what", ["head", "segment"])
def test_a_corrupt_index_is_ignored_and_rebuilt_from_the_manifests(
    tmp_path: Path, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tmp_path, 250)
    index = tmp_path / ".ckptstore" / "index"
    victim = index / "head.json" if what == "head" else next(index.glob("seg-*"))
    victim.write_bytes(b'{"schema_version": 1, "steps": [[1, 2]]')  # truncated
    counted = CountingBackend(LocalBackend(str(tmp_path), {}))
    with caplog.at_level(logging.WARNING):
        assert listed(counted) == list(range(250))
    assert "unreadable index" in caplog.text and "rebuilt from the manifests" in caplog.text
    assert counted.take()["manifest GET"] == 250  # the manifests, not the corrupt index
    head, _ = StepIndex(LocalBackend(str(tmp_path), {})).read_head()
    assert head is not None and head.complete and len(head.segments) == 1
    counted = CountingBackend(LocalBackend(str(tmp_path), {}))
    assert listed(counted) == list(range(250)) and counted.take()["manifest GET"] == 0


def test_a_lying_index_never_reaches_a_load(tmp_path: Path) -> None:
    """The index says step 1 holds other metadata and files: a load reads the manifest."""
    store = CheckpointStore(str(tmp_path), lease=False)
    store.save(1, {"w": torch.ones(3)}, {"loss": 1.0})
    head_path = tmp_path / HEAD_NAME
    head = Head.decode(head_path.read_bytes(), "head")
    real = head.steps[0]
    forged = Summary(1, real.created, real.kind, 1, 0, real.writer, 0, "0" * 32, {"loss": 9.0})
    head_path.write_bytes(Head(steps=(forged,)).encode())
    reader = CheckpointStore(str(tmp_path), lease=False)
    info = reader.list()[0]
    assert info.metadata == {"loss": 9.0}  # a listing shows what the index says...
    assert len(info.files) == 2 and info.manifest.metadata == {"loss": 1.0}  # ...not a load
    assert torch.equal(reader.load(1)["w"], torch.ones(3))
    assert reader.latest() is not None and reader.latest().metadata == {"loss": 1.0}  # type: ignore[union-attr]


def test_an_index_less_store_is_listed_from_its_manifests_and_indexed(tmp_path: Path) -> None:
    """A store written by a ckptstore without the index: the first listing reads every
    manifest and writes the index; the next reads only the index."""
    environment = CheckpointStore(str(tmp_path), lease=False).environment
    for step in range(3):
        target = tmp_path / layout.manifest_path(step)
        target.parent.mkdir(parents=True)
        target.write_bytes(Manifest(step, 1.0, KIND_STATE, (), environment, "old").encode())
    counted = CountingBackend(LocalBackend(str(tmp_path), {}))
    assert listed(counted) == [0, 1, 2] and counted.take()["manifest GET"] == 3
    assert listed(counted) == [0, 1, 2] and counted.take() == Counter({"index GET": 1})


def test_a_step_deleted_by_hand_is_dropped_by_a_rebuild(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), lease=False)
    for step in range(3):
        store.save(step, {"w": torch.ones(1)})
    for path in sorted((tmp_path / layout.step_dir(1)).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (tmp_path / layout.step_dir(1)).rmdir()
    reader = CheckpointStore(str(tmp_path), lease=False)
    infos = reader.list()
    assert [i.step for i in infos] == [0, 1, 2]  # the index is not checked step by step...
    with pytest.raises(NotFoundError, match="step 1 is not committed"):
        infos[1].manifest  # noqa: B018  ...but what it lists is read from the manifest
    assert reader.rebuild_index() == {reader.uri: 2}
    assert [i.step for i in CheckpointStore(str(tmp_path), lease=False).list()] == [0, 2]


def indexed(backend: Backend) -> tuple[list[int], set[int]]:
    """What a tier's step index holds as it stands (no reader's repair): the steps it lists,
    and the steps it holds a claim on (readers check those against their manifests)."""
    snapshot = StepIndex(backend).snapshot()
    assert snapshot is not None, backend.uri
    claims = {p.step for p in snapshot.head.pending} | set(snapshot.head.removing)
    return sorted(snapshot.summaries), claims


def test_the_tools_keep_both_tiers_indexes_true(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A delete on both tiers takes the step out of both tiers' indexes (a reader trusting
    either index does not list it), and a prune of the local tier alone leaves the local
    index listing exactly the local manifests, the durable one untouched; ``ckptstore index
    --rebuild --local`` rebuilds each tier's."""
    local = tmp_path / "local"
    with CheckpointStore(s3_uri, storage_options=s3_options, local=str(local), persist_every=1,
                         local_keep_last=5) as store:  # fmt: skip
        for step in (1, 2, 3, 4):
            store.save(step, {"w": torch.full((8,), float(step))})
        store.wait()
        store.delete(2)
        durable = CheckpointStore(s3_uri, storage_options=s3_options, lease=False)
        nearby = LocalBackend(str(local), {})
        assert indexed(durable.backend) == ([1, 3, 4], set())
        assert indexed(nearby) == ([1, 3, 4], set())
        assert [i.step for i in durable.list()] == [1, 3, 4]
        assert listed(nearby) == [1, 3, 4]
    with CheckpointStore(s3_uri, storage_options=s3_options, local=str(local),
                         local_keep_last=1) as store:  # fmt: skip
        assert store.prune(tier="local") == [1, 3]
    assert indexed(nearby) == ([4], set())
    assert [p.parent.name for p in local.glob("*/" + layout.MANIFEST_NAME)] == ["global_step_4"]
    assert indexed(durable.backend) == ([1, 3, 4], set())
    capsys.readouterr()
    where = ["--local", str(local), "--endpoint-url", s3_options["endpoint_url"]]
    assert cli_run(["index", s3_uri, "--rebuild", *where]) == 0
    out = capsys.readouterr().out
    assert f"{local}: 1 step" in out and f"{s3_uri}: 3 steps" in out, out
    assert cli_run(["index", s3_uri, "--rebuild", "--tier", "local", *where]) == 0
    assert str(local) in (out := capsys.readouterr().out) and s3_uri not in out, out
