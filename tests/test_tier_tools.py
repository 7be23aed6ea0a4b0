"""Every tool on a tiered store as users see it (issue 33, defects 3 and 10): ``delete``,
``pin``/``unpin``, ``prune``, ``verify``, ``gc`` and their CLI forms act on both tiers, so
that ``latest``, ``load`` and ``list`` agree with what the tools did, a deleted step can be
saved again, and every message names the tier where the step actually is.

A tiered store over S3 on moto (HTTP) with a local directory; only public surfaces: the
store, its reads, plain stores opened on either tier, and the CLI in-process.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.cli.main import run as cli_run
from ckptstore.errors import (
    BackendError,
    ConflictError,
    NotFoundError,
    StepBehindLatestError,
)
from faults import FailsManifestOf, Gate


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(n)), "b": torch.arange(n + 1)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def steps_of(uri: str, options: dict[str, Any] | None = None) -> list[int]:
    """The steps committed at ``uri`` alone (one tier), as a plain reader sees them."""
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        return [i.step for i in plain.list()]


def latest_of(uri: str, options: dict[str, Any] | None = None) -> int | None:
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        latest = plain.latest()
        return latest.step if latest is not None else None


def pins_of(uri: str, options: dict[str, Any] | None = None) -> list[int]:
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        return plain.pins()


def files_under(root: Path, step: int) -> list[str]:
    folder = root / f"global_step_{step}"
    return sorted(str(p.relative_to(root)) for p in folder.rglob("*") if p.is_file())


def keys_under(s3_client: Any, uri: str, folder: str) -> list[str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{folder}")
    return [o["Key"] for o in listed.get("Contents", [])]


@contextlib.contextmanager
def bucket_backend(uri: str, options: dict[str, Any]) -> Iterator[Backend]:
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        yield plain.backend


class DiesDeleting(BackendProxy):
    """A process that dies while it deletes the files of ``step`` (armed): every delete of
    them fails, after the manifest was swapped for a tombstone."""

    def __init__(self, inner: Backend, step: int) -> None:
        super().__init__(inner)
        self.folder = f"global_step_{step}/"
        self.armed = False

    def delete(self, paths: Sequence[str]) -> None:
        if self.armed and any(p.startswith(self.folder) for p in paths):
            raise BackendError(f"injected: killed while deleting {paths[0]}", retryable=False)
        super().delete(paths)


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "local"


def tiered(uri: str, options: dict[str, Any], local: Path, **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(uri, storage_options=options, local=str(local), **kwargs)


# -- defect 3: delete ----------------------------------------------------------------------------


def test_a_deleted_step_is_gone_from_both_tiers_and_can_be_saved_again(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """verl's replace flow: ``delete(2, force=True)`` then ``save(2)`` again. The step goes
    from both tiers, both pointers move back to step 1, and the new step 2 is what loads."""
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(1, state(1))
        store.save(2, state(2))
        store.wait()
        assert [i.tier for i in store.list()] == ["local+durable", "local+durable"]
        store.delete(2, force=True)
        latest = store.latest()
        assert latest is not None and latest.step == 1
        assert [i.step for i in store.list()] == [1]
        assert same(store.load(), state(1))
        with pytest.raises(NotFoundError):
            store.load(2)
        assert steps_of(s3_uri, s3_options) == [1] and steps_of(str(local)) == [1]
        assert latest_of(s3_uri, s3_options) == 1 and latest_of(str(local)) == 1
        store.save(2, state(20))  # the replace: no "rm it first"
        store.wait()
        assert same(store.load(), state(20))
    with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as reader:
        assert same(reader.load(2), state(20))


def test_deleting_every_step_leaves_no_latest_in_either_tier(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(1, state(1))
        store.wait()
        store.delete(1, force=True)
        assert store.latest() is None and store.list() == []
        store.save(1, state(10))
        assert same(store.load(), state(10))


def test_deleting_a_due_step_drops_its_local_pin_and_no_copy_brings_it_back(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """Step 3's copy failed: it is pinned in the local tier, due and not durable. Deleting
    it drops the pin; neither this store's ``wait``/``close`` nor the next writer (which
    persists every pinned step the bucket lacks) brings it back."""
    with bucket_backend(s3_uri, s3_options) as inner:
        failing = FailsManifestOf(inner, 3)
        store = CheckpointStore(s3_uri, backend=failing, local=str(local), persist_every=1)
        for step in (1, 2, 3):
            store.save(step, state(step))
        with pytest.raises(BackendError, match="injected"):
            store.wait()
        assert failing.failures == 1
        assert 3 in pins_of(str(local))  # due: pinned until it is durable, which it never is
        store.delete(3, force=True)
        assert 3 not in pins_of(str(local)) and 3 not in store.pins()
        assert [i.step for i in store.list()] == [1, 2]
        store.close()  # nothing to copy: the newest step, 2, is durable
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(4, state(4))  # the next writer persists every pinned step the bucket lacks
        store.wait()
    assert steps_of(s3_uri, s3_options) == [1, 2, 4]
    assert 3 not in steps_of(str(local))


def test_a_copy_queued_or_in_flight_does_not_bring_a_deleted_step_back(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """The copies of steps 1 and 2 wait behind a slow bucket; step 2 is deleted as the bucket
    answers again, whether its copy has not started, runs, or just ended: it is in no tier
    afterwards, and no later writer copies it."""
    with bucket_backend(s3_uri, s3_options) as inner:
        gate = Gate(inner)
        store = CheckpointStore(s3_uri, backend=gate, local=str(local), persist_every=1)
        store.save(1, state(1))
        store.save(2, state(2))
        gate.open.set()
        store.delete(2, force=True)
        store.wait()
        assert [i.step for i in store.list()] == [1]
        store.close()
    assert steps_of(s3_uri, s3_options) == [1] and steps_of(str(local)) == [1]
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(3, state(3))
    assert steps_of(s3_uri, s3_options) == [1, 3]


def test_delete_refuses_a_pinned_or_latest_step_of_either_tier_without_force(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """Invariant 4's protections hold for a step only the local tier holds."""
    with tiered(s3_uri, s3_options, local, persist_every=100, local_keep_last=5) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
        with pytest.raises(ConflictError, match=r"3 \(latest\)"):
            store.delete(3)
        store.pin(1)
        with pytest.raises(ConflictError, match=r"1 \(pinned\)"):
            store.delete(1)
        store.delete(2)
        assert [i.step for i in store.list()] == [1, 3]


def test_a_delete_that_dies_half_way_is_finished_by_gc_in_both_tiers(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, local: Path
) -> None:
    """Tombstone first in both tiers: a delete killed while it deletes the bucket's files
    leaves no committed step 2 in any tier, and ``gc`` finishes the removal in both."""
    with bucket_backend(s3_uri, s3_options) as inner:
        dying = DiesDeleting(inner, 2)
        with CheckpointStore(s3_uri, backend=dying, local=str(local), persist_every=1) as store:
            for step in (1, 2, 3):
                store.save(step, state(step))
            store.wait()
            dying.armed = True
            with pytest.raises(BackendError, match="injected"):
                store.delete(2)
            assert [i.step for i in store.list()] == [1, 3]
            dying.armed = False
            store.gc(older_than=0)
            assert files_under(local, 2) == []
            assert keys_under(s3_client, s3_uri, "global_step_2/") == []
            store.save(4, state(4))
            assert [i.step for i in store.list()] == [1, 3, 4]


def test_deleting_an_unknown_step_names_both_tiers(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    with tiered(s3_uri, s3_options, local, persist_every=100) as store:
        store.save(1, state(1))
        with pytest.raises(NotFoundError) as e:
            store.delete(7)
        assert s3_uri in str(e.value) and str(local) in str(e.value)


# -- defect 3: pin, verify, prune, gc --------------------------------------------------------------


def test_pin_verify_and_prune_act_on_a_step_only_the_local_tier_holds(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """Steps 1..4 are local only (none due). ``pin(1)`` keeps step 1 through the local
    retention; ``verify`` checks the local copies; unpinned, ``prune`` drops it by the local
    tier's retention. None of this may say "not committed in s3://...": list() shows them."""
    with tiered(s3_uri, s3_options, local, persist_every=100, local_keep_last=2) as store:
        store.save(1, state(1))
        store.save(2, state(2))
        store.pin(1)
        assert store.pins() == [1]
        store.save(3, state(3))
        store.save(4, state(4))
        assert [i.step for i in store.list()] == [1, 3, 4]
        report = store.verify(1)
        assert report.ok and report.step == 1
        assert store.verify().step == 4
        assert [r.step for r in store.verify_all()] == [1, 3, 4]
        assert store.unpin(1) is True
        assert store.pins() == []
        assert store.prune() == [1]
        assert [i.step for i in store.list()] == [3, 4]
    assert steps_of(s3_uri, s3_options) == [4]  # close made the newest step durable


def test_unpin_keeps_the_local_pin_of_a_step_whose_copy_failed(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """Invariant 17: a due step is never dropped from the local tier before it is durable.
    Unpinning it removes the store's pin, not the one that keeps it for its copy."""
    with bucket_backend(s3_uri, s3_options) as inner:
        failing = FailsManifestOf(inner, 3)
        store = CheckpointStore(s3_uri, backend=failing, local=str(local), persist_every=1,
                                local_keep_last=1)  # fmt: skip
        for step in (1, 2, 3):
            store.save(step, state(step))
        store.pin(3)
        assert store.unpin(3) is True
        assert 3 in store.pins() and 3 not in pins_of(s3_uri, s3_options)
        assert 3 not in store.prune()
        with pytest.raises(BackendError, match="injected"):
            store.close()  # the newest step is not durable: the job hears of it
    assert 3 in pins_of(str(local)) and 3 in steps_of(str(local))


def test_verify_finds_a_corrupt_local_copy_and_names_it(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(1, state(1))
        store.wait()
        victim = next((local / "global_step_1").rglob("*.safetensors"))
        victim.write_bytes(b"\0" * victim.stat().st_size)
        report = store.verify(1)
        assert not report.ok
        assert any(str(local) in p for p in report.problems), report.problems
        assert not any(s3_uri in p for p in report.problems), report.problems


def test_prune_applies_each_tiers_retention(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    """Opened with smaller retention than the steps were saved under, ``prune`` brings both
    tiers to it; latest stays in both."""
    with tiered(s3_uri, s3_options, local, persist_every=1, local_keep_last=5) as store:
        for step in (1, 2, 3, 4):
            store.save(step, state(step))
    with tiered(s3_uri, s3_options, local, keep_last=2, local_keep_last=1) as store:
        assert store.prune(dry_run=True) == [1, 2, 3]
        assert store.prune() == [1, 2, 3]
        assert [(i.step, i.tier) for i in store.list()] == [(3, "durable"), (4, "local+durable")]
    assert steps_of(str(local)) == [4] and steps_of(s3_uri, s3_options) == [3, 4]


# -- the CLI forms ---------------------------------------------------------------------------------


def test_the_cli_tools_act_on_both_tiers_with_local(
    s3_uri: str, s3_options: dict[str, Any], local: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tiered(s3_uri, s3_options, local, persist_every=2, local_keep_last=5) as store:
        for step in (1, 2, 3):
            store.save(step, state(step))
        store.wait()
    # step 3 was made durable by close; 1 is local only
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    where = ["--local", str(local), *endpoint]
    capsys.readouterr()
    assert cli_run(["verify", s3_uri, "1", "--json", *where]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["steps"][0]["tiers"] == [str(local)], doc
    assert cli_run(["verify", s3_uri, "3", *where]) == 0
    assert capsys.readouterr().out.strip() == f"step 3: OK ({local}, {s3_uri})"
    assert cli_run(["pin", s3_uri, "1", *where]) == 0
    assert "pinned step 1" in capsys.readouterr().out
    assert cli_run(["unpin", s3_uri, "1", *where]) == 0
    assert "unpinned step 1" in capsys.readouterr().out
    assert cli_run(["rm", s3_uri, "3", "--force", "--json", *where]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["deleted"] == [3] and out["latest"] == 2, out
    assert steps_of(s3_uri, s3_options) == [2] and steps_of(str(local)) == [1, 2]
    assert (
        cli_run(["prune", s3_uri, "--keep-last", "1", "--local-keep-last", "1", "--json", *where])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["deleted"] == [1] and out["kept"] == [2], out
    assert steps_of(str(local)) == [2]
    assert cli_run(["gc", s3_uri, "--older-than", "0", "--json", *where]) == 0
    capsys.readouterr()


def test_the_cli_tier_option_picks_one_tier(
    s3_uri: str, s3_options: dict[str, Any], local: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(1, state(1))
        store.save(2, state(2))
        store.wait()
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    where = ["--local", str(local), *endpoint]
    assert cli_run(["rm", s3_uri, "1", "--tier", "local", *where]) == 0
    assert steps_of(str(local)) == [2] and steps_of(s3_uri, s3_options) == [1, 2]
    capsys.readouterr()
    assert cli_run(["rm", s3_uri, "1", "--tier", "local", *where]) == 3  # not there any more
    err = capsys.readouterr().err
    assert str(local) in err and "durable" in err, err
    assert cli_run(["rm", s3_uri, "2", "--tier", "local"]) != 0  # --tier needs --local


def test_the_cli_without_local_says_a_step_is_not_in_the_bucket(
    s3_uri: str, s3_options: dict[str, Any], local: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The durable tier alone (no --local): a local-only step is not there, and the message
    says how to reach the local tier."""
    with tiered(s3_uri, s3_options, local, persist_every=100, local_keep_last=5) as store:
        store.save(1, state(1))
        store.save(2, state(2))
        store.save(3, state(3), persist=True)
        store.wait()
    capsys.readouterr()
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    assert cli_run(["rm", s3_uri, "1", *endpoint]) == 3
    err = capsys.readouterr().err
    assert "--local" in err, err


# -- defect 10: messages name the tier where the step is ------------------------------------------


def test_a_step_behind_latest_names_the_tier_that_holds_latest(
    s3_uri: str, s3_options: dict[str, Any], local: Path
) -> None:
    with CheckpointStore(s3_uri, storage_options=s3_options) as plain:
        plain.save(30, state(30))
    with tiered(s3_uri, s3_options, local) as store:
        with pytest.raises(StepBehindLatestError) as e:
            store.save(1, state(1))
        assert f"{s3_uri}/global_step_30" in str(e.value), str(e.value)
        store.save(31, state(31))
    with tiered(s3_uri, s3_options, local, persist_every=100) as store:
        store.save(40, state(40))  # local only
        with pytest.raises(StepBehindLatestError) as e:
            store.save(35, state(35))
        assert f"{local}/global_step_40" in str(e.value), str(e.value)


def test_a_wiped_local_copy_is_not_told_to_load_an_earlier_step(
    s3_uri: str, s3_options: dict[str, Any], local: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose local copy of a file is gone reads it from the bucket: the log says so,
    and does not also tell it to load an earlier step."""
    with tiered(s3_uri, s3_options, local, persist_every=1) as store:
        store.save(1, state(1))
        store.wait()
        for f in (local / "global_step_1").rglob("*.safetensors"):
            f.unlink()
        caplog.set_level(logging.WARNING, logger="ckptstore")
        assert same(store.load(), state(1))
        lines = [r.getMessage() for r in caplog.records]
        assert any("next copy" in m for m in lines), lines
        assert not any("earlier step" in m for m in lines), lines
        caplog.clear()
        info = store.info(1)  # the local tier's; a face that reads file by file (the DCP
        assert info.tier == "local"  # reader) takes each from the fastest tier holding it
        entry = next(f for f in info.files if f.path.endswith(".safetensors"))
        assert len(store.read_file(info, entry.path)) == entry.size
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"reading the file from {s3_uri}" in m for m in lines), lines
    assert not any("earlier step" in m for m in lines), lines
