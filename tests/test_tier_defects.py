"""Regression tests for defects of the local tier (a tiered store over S3 on moto), written
before their fix: a re-copied step of a killed writer taken for a fenced one, a rerun that
forgot to resume let through, ``local_keep_last`` not holding, and ``close()`` failing a job
over an old copy that later steps superseded.

Only the public API: ``CheckpointStore`` (with ``local=``), its reads, and the CLI in-process.
A killed process is simulated in-process, as tests/test_tiers.py does: its durable backend
dies (every mutating request fails from the fault on), its store is abandoned without
``close()``, and the next writer opens the same local directory with ``takeover=True`` (the
holder of both leases is this very process, which a contender cannot take for dead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.cli.main import run as cli_run
from ckptstore.errors import BackendError, CheckpointError, StepBehindLatestError
from faults import FailsManifestOf, FaultyBackend, Gate, InjectedFault


def state(n: int) -> dict[str, torch.Tensor]:
    """A few KiB, different for every step."""
    return {"w": torch.full((256,), float(n)), "b": torch.arange(n + 1)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def durable_steps(uri: str, options: dict[str, Any]) -> list[int]:
    """The steps committed in the bucket, as a plain reader (no lease) sees them."""
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


def bucket_of(uri: str) -> tuple[str, str]:
    """``s3://bucket/run`` as ``(bucket, "run/")``."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/"


def keys_under(s3_client: Any, uri: str, folder: str) -> list[str]:
    """Every object key of the bucket under ``folder`` of the store at ``uri``."""
    bucket, prefix = bucket_of(uri)
    pages = s3_client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}{folder}"
    )
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


@contextlib.contextmanager
def plain_backend(uri: str, options: dict[str, Any]) -> Iterator[Backend]:
    """The bucket's backend, to wrap in a faulty one (closed with its store)."""
    with CheckpointStore(uri, storage_options=options, lease=False) as plain:
        yield plain.backend


class DiesInStep(FaultyBackend):
    """The process dies while it copies ``step``: the first write of the step's files lands,
    the next mutating request (and every one after it, lease renewals included) fails."""

    def __init__(self, inner: Backend, step: int) -> None:
        super().__init__(inner, fail_at=None, mode="crash")
        self.folder = f"global_step_{step}/"
        self.landed = 0

    def _tick(self, op: str, path: str) -> None:
        if not self.fired and self.folder in path:
            if self.landed >= 1:
                self.fired = True
                raise InjectedFault(f"the process was killed during {op} {path}")
            self.landed += 1
        super()._tick(op, path)

    def revive(self) -> None:
        """Cleanup only: requests pass again, so the dead writer's store can be closed and
        nothing of it is left for this process's exit to release through a dead backend."""
        self.fired = False
        self.folder = "\0"


# -- 1. a killed copy, re-copied by the next writer, is not a fenced writer's step --------------


@pytest.mark.slow
def test_a_killed_copy_recopied_by_the_next_writer_is_not_fenced(
    s3_uri: str,
    s3_options: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The copy of step 12 dies with its process; the next writer (a takeover of the dead
    one's leases) copies it again from the pin. That copy is the new writer's doing, after
    its takeover: the step must count as durable everywhere (fenced_steps, wait, replicate),
    not as a zombie's late commit that the takeover fence excludes."""
    local = str(tmp_path / "local")
    tiers: dict[str, Any] = {"persist_every": 4, "local_keep_last": 2, "keep_last": 5}
    with plain_backend(s3_uri, s3_options) as inner:
        dying = DiesInStep(inner, 12)
        old = CheckpointStore(s3_uri, backend=dying, local=local, **tiers)
        try:
            for step in range(1, 13):
                old.save(step, state(step))
            with pytest.raises(InjectedFault):
                old.wait()  # the copy of 12 died half-way; the process dies here, no close()
            assert dying.fired
            assert durable_steps(s3_uri, s3_options) == [4, 8]
            new = CheckpointStore(
                s3_uri, storage_options=s3_options, local=local, takeover=True, **tiers
            )
            try:
                loaded = new.load(with_info=True)
                assert loaded.step == 12 and same(loaded.state, state(12))
                new.save(13, state(13))
                new.wait()  # the pinned step 12 is copied again, by the new writer
                assert 12 in durable_steps(s3_uri, s3_options)
                assert 12 not in new.fenced_steps()
                with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as reader:
                    assert 12 not in reader.fenced_steps()
                    assert reader.wait_for_step(newer_than=8, timeout=3, interval=0.2).step == 12
                endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
                capsys.readouterr()
                code = cli_run(["wait", s3_uri, "--newer-than", "8", "--timeout", "3",
                                "--interval", "0.2", *endpoint])  # fmt: skip
                out = capsys.readouterr().out
                assert code == 0 and out.strip() == "12", out
                replica = str(tmp_path / "replica")
                assert cli_run(["replicate", s3_uri, replica, "--json", *endpoint]) == 0
                report = json.loads(capsys.readouterr().out)
                assert 12 in report["copied"], report
                latest = new.latest()
                assert latest is not None and latest.step == 13
                assert same(new.load(), state(13))
            finally:
                new.close()  # the newest step, 13, is made durable
            with CheckpointStore(s3_uri, storage_options=s3_options, lease=False) as reader:
                loaded = reader.load(with_info=True)
                assert loaded.step == 13 and same(loaded.state, state(13))
                assert reader.fenced_steps() == []
        finally:
            dying.revive()
            with contextlib.suppress(CheckpointError):
                old.close()


# -- 2. a rerun that forgot to resume is refused, as a plain store refuses it -------------------


def test_a_tiered_rerun_that_forgot_to_resume_is_refused(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """A plain store refuses a step behind the bucket's latest; a tiered store with a fresh
    local directory must too, or a rerun that forgot ``load()`` trains from step 1 and its
    copies land beside (or, under retention, in place of) the run it was meant to continue."""
    with CheckpointStore(s3_uri, storage_options=s3_options) as plain:
        for step in (10, 20, 30):
            plain.save(step, state(step))
        with pytest.raises(StepBehindLatestError):
            plain.save(1, state(1))  # what the plain store does
    store = CheckpointStore(
        s3_uri, storage_options=s3_options, local=str(tmp_path / "fresh"), persist_every=1
    )
    try:
        with pytest.raises(StepBehindLatestError):
            store.save(1, state(1))
    finally:
        with contextlib.suppress(CheckpointError):
            store.close()
    assert durable_steps(s3_uri, s3_options) == [10, 20, 30]


def test_a_tiered_rerun_never_logs_a_step_durable_that_the_bucket_does_not_resume_from(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saves 1..8 of a rerun over a bucket at step 30 must be refused; whatever happens, no
    log line may say "step N is durable" of a step the bucket does not hold as committed and
    resumable (a copy behind latest, or one that retention deleted at once, is not)."""
    with CheckpointStore(s3_uri, storage_options=s3_options, keep_last=2) as plain:
        for step in (10, 20, 30):
            plain.save(step, state(step))
    caplog.set_level(logging.INFO, logger="ckptstore")
    store = CheckpointStore(
        s3_uri,
        storage_options=s3_options,
        local=str(tmp_path / "fresh"),
        persist_every=4,
        keep_last=2,
    )
    refused = []
    try:
        for step in range(1, 9):
            try:
                store.save(step, state(step))
            except StepBehindLatestError:
                refused.append(step)
        with contextlib.suppress(CheckpointError):
            store.wait()
    finally:
        with contextlib.suppress(CheckpointError):
            store.close()
    held = durable_steps(s3_uri, s3_options)
    claimed = [int(m) for m in re.findall(r"step (\d+) is durable", caplog.text)]
    false_claims = [s for s in claimed if s not in held or s < max(held)]
    assert false_claims == [], f"logged as durable: steps {claimed}; the bucket holds {held}"
    assert refused == list(range(1, 9))
    assert held == [20, 30]


# -- 3. local_keep_last holds once the copies are done ------------------------------------------


def test_local_keep_last_holds_after_close(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """Once every due step is durable nothing needs a local copy beyond ``local_keep_last``:
    a node's disk must not fill with steps that are already in the bucket. The copies lag
    behind the saves (held until the last save), so every due step was still pinned when the
    local retention last ran."""
    local = str(tmp_path / "local")
    with plain_backend(s3_uri, s3_options) as inner:
        gate = Gate(inner)
        store = CheckpointStore(
            s3_uri, backend=gate, local=local, persist_every=3, local_keep_last=2
        )
        for step in range(1, 11):
            store.save(step, state(step))
        gate.open.set()
        store.close()
    with CheckpointStore(local, lease=False) as local_tier:
        assert [i.step for i in local_tier.list()] == [9, 10]
        assert local_tier.pins() == []
    assert durable_steps(s3_uri, s3_options) == [3, 6, 9, 10]


# -- 4. close() and a copy failure that later steps superseded ----------------------------------


@pytest.mark.slow
def test_close_does_not_fail_the_job_over_a_superseded_copy_failure(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, tmp_path: Path
) -> None:
    """Step 6's copy failed, steps 8..40 reached the bucket since: the run is durable up to
    its last step, so close() must not raise over step 6, and step 6 must leave nothing
    behind (no files without a manifest in the bucket, no multipart upload, no local pin
    that would make every later writer copy it again)."""
    local = str(tmp_path / "local")
    with plain_backend(s3_uri, s3_options) as inner:
        failing = FailsManifestOf(inner, 6)
        store = CheckpointStore(s3_uri, backend=failing, local=local, persist_every=2)
        for step in range(1, 41):
            store.save(step, state(step))
        problems = []
        try:
            store.close()
        except CheckpointError as e:
            problems.append(f"close() raised {type(e).__name__}: {e}")
    assert failing.failures >= 1  # step 6's copy did fail
    held = durable_steps(s3_uri, s3_options)
    assert [s for s in range(8, 41, 2) if s not in held] == []
    leftovers = keys_under(s3_client, s3_uri, "global_step_6/")
    if leftovers and not any(k.endswith("manifest.json") for k in leftovers):
        problems.append(f"step 6 left files without a manifest in the bucket: {leftovers}")
    bucket, _ = bucket_of(s3_uri)
    uploads = s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    if uploads:
        problems.append(f"multipart uploads left open: {uploads}")
    with CheckpointStore(local, lease=False) as local_tier:
        if 6 in local_tier.pins():
            problems.append(f"the local tier still pins step 6: pins {local_tier.pins()}")
    assert not problems, "\n".join(problems)


def test_close_still_raises_when_the_last_step_is_not_durable(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """The contrast to the test above: a failed copy of the newest step is not superseded
    by anything, so the job must hear that its final step is not in the bucket."""
    local = str(tmp_path / "local")
    with plain_backend(s3_uri, s3_options) as inner:
        failing = FailsManifestOf(inner, 8)
        store = CheckpointStore(s3_uri, backend=failing, local=local, persist_every=2)
        for step in range(1, 9):
            store.save(step, state(step))
        with pytest.raises(BackendError, match="injected"):
            store.close()
    assert 8 not in durable_steps(s3_uri, s3_options)
    with CheckpointStore(local, lease=False) as local_tier:
        assert 8 in local_tier.pins()  # kept, and copied again by the next writer
