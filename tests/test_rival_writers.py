"""Two writer processes on one store, on a local disk and on S3 (moto over HTTP).

(a) a zombie: A is saving when B takes the store over; A's next save is fenced, naming B, and A
never moves ``latest`` again; (b) two clusters by mistake: B, without ``takeover``, is refused
while A's lease is live, naming A; (c) two writers with ``lease=False`` commit different steps
at once: nothing is lost and ``latest`` ends at the newest step, never having gone back.

The writers are real processes, each with its own clients, lease and writer id, forked from
the fork server of ranks.py (torch and ckptstore imported once, not in every writer). They
report what happened through a pipe; a thread of the test polls ``latest.json`` meanwhile to
see every move it can.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.registry import open_backend
from ckptstore.domain.layout import LATEST_NAME
from ckptstore.errors import CheckpointError, NotFoundError
from ckptstore.protocol.lease import DEFAULT_TTL
from ckptstore.protocol.pointer import Pointer
from ranks import PRELOAD

TIMEOUT = 120.0
WRITERS = multiprocessing.get_context("forkserver")


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.randn(1 << 14, generator=torch.Generator().manual_seed(step)), "step": step}


# -- the writer process ---------------------------------------------------------------------


def worker(job: dict[str, Any], events: Connection, gate: Connection) -> int:
    """Save ``job["steps"]`` (``"resume"``: the three after latest); report every outcome."""

    def say(**event: Any) -> None:
        events.send(event)

    store = CheckpointStore(
        job["uri"],
        storage_options=job["options"],
        lease=job.get("lease", True),
        takeover=job.get("takeover", False),
        lease_ttl=job.get("lease_ttl", DEFAULT_TTL),
    )
    say(writer=store.writer)
    steps = job["steps"]
    if steps == "resume":
        latest = store.latest()
        start = latest.step + 1 if latest is not None else 1
        steps = [start, start + 1, start + 2]
    failures, deadline = 0, time.monotonic() + TIMEOUT / 2
    for step in steps:
        if job.get("gate") and step != steps[0]:
            gate.recv()  # the test says when
        try:
            store.save(step, state_for(step), allow_older=job.get("allow_older", False))
            say(saved=step)
        except CheckpointError as e:
            say(error=type(e).__name__, message=str(e), step=step)
            failures += 1
            if failures > job.get("tries_after_error", 0) or time.monotonic() > deadline:
                break
        time.sleep(job.get("pause", 0.0))
    try:
        store.close()
    except CheckpointError as e:
        say(error=type(e).__name__, message=str(e), step=None)
    return 0


def _writer_process(
    job: dict[str, Any], events: Connection, gate: Connection, err: str, env: dict[str, str]
) -> None:
    """A writer, forked from the fork server: the caller's environment, stderr to ``err``."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    try:
        code = worker(job, events, gate)
    except BaseException:
        traceback.print_exc()
        raise
    sys.stderr.flush()
    sys.exit(code)


# -- the test's side --------------------------------------------------------------------------


class Writer:
    """A writer process and the events it reported."""

    def __init__(self, **job: Any) -> None:
        events, sending = WRITERS.Pipe(duplex=False)
        gate, self._gate = WRITERS.Pipe(duplex=False)
        fd, self.err = tempfile.mkstemp(prefix="ckptstore-writer-", suffix=".err")
        os.close(fd)
        WRITERS.set_forkserver_preload(PRELOAD)  # no effect once the server runs
        args = (job, sending, gate, self.err, dict(os.environ))
        self.proc = WRITERS.Process(target=_writer_process, args=args, daemon=True)
        self.proc.start()
        sending.close()  # the writer holds the only sending end: its exit ends the pipe
        gate.close()
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events: Connection) -> None:
        with events:
            while True:
                try:
                    self.events.append(events.recv())
                except EOFError:
                    return

    def wait_for(self, done: Callable[[list[dict[str, Any]]], bool]) -> None:
        give_up = time.monotonic() + TIMEOUT
        while not done(self.events):
            if not self.proc.is_alive():
                self._reader.join(TIMEOUT)  # every event it sent is read
                assert done(self.events), self.report()
            assert time.monotonic() < give_up, self.report()
            time.sleep(0.02)

    def finish(self) -> None:
        self.proc.join(TIMEOUT)
        self._reader.join(TIMEOUT)
        assert self.proc.exitcode == 0 and not self._reader.is_alive(), self.report()
        Path(self.err).unlink()

    def release(self) -> None:
        self._gate.send("go")

    def report(self) -> str:
        err = Path(self.err)
        stderr = err.read_text(errors="replace")[-3000:] if err.exists() else ""
        return f"exit code {self.proc.exitcode}, events {self.events}\nstderr {stderr}"

    @property
    def writer(self) -> str:
        return str(self.events[0]["writer"])

    @property
    def saved(self) -> list[int]:
        return [int(e["saved"]) for e in self.events if "saved" in e]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "error" in e]


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "store"), {}
    endpoint = request.getfixturevalue("s3_endpoint")
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    return request.getfixturevalue("s3_uri"), {**options, "region": "us-east-1"}


@pytest.fixture
def pointer_moves(where: tuple[str, dict[str, Any]]) -> Iterator[list[Pointer]]:
    """Every distinct ``latest.json`` seen while the test runs, polled every 10 ms."""
    backend = open_backend(*where)
    seen: list[Pointer] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.01):
            try:
                pointer = Pointer.decode(backend.read(LATEST_NAME), LATEST_NAME)
            except (NotFoundError, CheckpointError):
                continue
            if not seen or seen[-1] != pointer:
                seen.append(pointer)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    yield seen
    stop.set()
    thread.join()
    backend.close()


def final_pointer(uri: str, options: dict[str, Any]) -> Pointer:
    backend = open_backend(uri, options)
    try:
        return Pointer.decode(backend.read(LATEST_NAME), LATEST_NAME)
    finally:
        backend.close()


def assert_forward_only(moves: list[Pointer]) -> None:
    steps = [p.step for p in moves]
    assert steps == sorted(steps), steps


def assert_all_load(uri: str, options: dict[str, Any], steps: list[int]) -> None:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        committed = [i.step for i in store.list()]
        for step in steps:
            assert step in committed, (step, committed)
            state = store.load(step)
            assert state["step"] == step and torch.equal(state["w"], state_for(step)["w"])


@pytest.mark.slow
def test_a_zombie_is_fenced_and_never_moves_latest_again(
    where: tuple[str, dict[str, Any]], pointer_moves: list[Pointer]
) -> None:
    uri, options = where
    zombie = Writer(
        uri=uri, options=options, steps=list(range(10, 3000, 10)), pause=0.2, tries_after_error=2
    )
    zombie.wait_for(lambda events: sum("saved" in e for e in events) >= 2)
    successor = Writer(uri=uri, options=options, steps="resume", takeover=True)
    successor.finish()
    zombie.finish()
    assert successor.errors == [] and len(successor.saved) == 3, successor.report()
    fenced = zombie.errors
    assert [e["error"] for e in fenced] == ["FencedError"] * 3, zombie.report()
    assert successor.writer in fenced[0]["message"]
    assert max(zombie.saved) < fenced[0]["step"]  # nothing saved after the first refusal
    epoch = max(p.epoch for p in pointer_moves)
    taken = next(i for i, p in enumerate(pointer_moves) if p.epoch == epoch)
    assert all(p.writer == successor.writer for p in pointer_moves[taken:]), pointer_moves
    assert_forward_only(pointer_moves)
    last = final_pointer(uri, options)
    assert (last.writer, last.epoch) == (successor.writer, epoch)
    assert last.step == max(zombie.saved + successor.saved)
    assert_all_load(uri, options, zombie.saved + successor.saved)


@pytest.mark.slow
def test_a_second_cluster_is_refused_while_the_lease_is_live(
    where: tuple[str, dict[str, Any]], pointer_moves: list[Pointer]
) -> None:
    """The second writer watches the first's lease record until its heartbeat (every
    ``lease_ttl / 4``) renews it: a 20 s TTL refuses it after about 5 s, not 15, and still
    leaves a loaded machine 20 s to run the first's heartbeat before it would look dead."""
    uri, options = where
    first = Writer(uri=uri, options=options, steps=[1, 2], gate=True, lease_ttl=20.0)
    first.wait_for(lambda events: any("saved" in e for e in events))
    second = Writer(uri=uri, options=options, steps="resume")
    second.finish()
    (refused,) = second.errors
    assert refused["error"] == "LeaseHeldError", second.report()
    assert first.writer in refused["message"] and "takeover=True" in refused["message"]
    assert second.saved == []
    first.release()
    first.finish()
    assert first.saved == [1, 2] and first.errors == []
    last = final_pointer(uri, options)
    assert (last.step, last.writer) == (2, first.writer)
    assert_forward_only(pointer_moves)
    assert_all_load(uri, options, [1, 2])
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        assert [i.step for i in store.list()] == [1, 2]
        assert store.gc(dry_run=True, older_than=0).deleted == ()  # the refused one wrote nothing


def test_lease_free_writers_lose_no_commit(
    where: tuple[str, dict[str, Any]], pointer_moves: list[Pointer]
) -> None:
    uri, options = where
    # Interleaved on purpose: either may fall behind the other's latest (allow_older)
    both = {"uri": uri, "options": options, "lease": False, "allow_older": True}
    odd = Writer(steps=list(range(1, 21, 2)), **both)
    even = Writer(steps=list(range(2, 21, 2)), **both)
    odd.finish()
    even.finish()
    assert odd.errors == [] and even.errors == [], odd.report() + even.report()
    assert_all_load(uri, options, list(range(1, 21)))
    assert final_pointer(uri, options).step == 20
    assert_forward_only(pointer_moves)
