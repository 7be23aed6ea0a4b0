"""A takeover while the old job still saves: only the old job is fenced, and a fenced writer
never writes the lease record again (invariant 13), on S3 over HTTP (moto) and locally.

The schedule is deterministic: the old job saves, the new job takes over, the old job's next
save (or heartbeat) finds out, and the old job closes (its release must not write) before or
after the new job saves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, FencedError
from ckptstore.cli.main import run as cli_run
from ckptstore.protocol.lease_record import LeaseRecord, read_lease


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), float(n))}


CLI_ARGS: dict[str, list[str]] = {}


@pytest.fixture(params=["local", "s3"])
def opener(
    request: pytest.FixtureRequest, tmp_path: Any
) -> Iterator[Callable[..., CheckpointStore]]:
    """Opens stores on one URI; ``open_store.cli`` holds the CLI arguments that reach it."""
    opened: list[CheckpointStore] = []
    if request.param == "local":
        uri, options, cli = str(tmp_path / "run"), {}, []
    else:
        uri, options = request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")
        cli = ["--endpoint-url", options["endpoint_url"]]

    def open_store(**kwargs: Any) -> CheckpointStore:
        store = CheckpointStore(uri, storage_options=options, **kwargs)
        opened.append(store)
        CLI_ARGS[store.uri] = cli
        return store

    yield open_store
    for store in opened:
        with contextlib.suppress(FencedError):
            store.close()


def record(store: CheckpointStore) -> LeaseRecord:
    found, _, _ = read_lease(store.backend)
    assert found is not None
    return found


def test_a_takeover_while_the_old_job_saves_fences_only_the_old_job(
    opener: Callable[..., CheckpointStore],
) -> None:
    old = opener()
    old.save(1, state(1))
    new = opener(takeover=True)
    assert record(new).epoch == 2 and record(new).holder == new.writer
    with pytest.raises(FencedError, match=r"taken by .*\(epoch 2\)"):
        old.save(2, state(2))
    old.close()  # a fenced writer's release must not write the record back
    held = record(new)
    assert (held.epoch, held.holder, held.released) == (2, new.writer, False)
    new.save(3, state(3))  # the new job goes on saving
    new.close()
    released = record(new)
    assert (released.epoch, released.holder, released.released) == (2, new.writer, True)
    assert [i.step for i in new.list()] == [1, 3]


def test_a_fenced_heartbeat_leaves_the_new_record_alone(
    opener: Callable[..., CheckpointStore],
) -> None:
    old = opener()
    old.save(1, state(1))
    new = opener(takeover=True)
    assert old.lease is not None and not old.lease.heartbeat()  # finds out: fenced
    old.close()
    new.save(2, state(2))
    assert (record(new).epoch, record(new).holder) == (2, new.writer)


def test_cli_push_with_takeover_fences_the_old_job_and_keeps_the_lease(
    opener: Callable[..., CheckpointStore],
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = opener()
    old.save(1, state(1))
    folder = tmp_path / "global_step_5"
    folder.mkdir()
    (folder / "data.pt").write_bytes(b"payload")
    code = cli_run(["push", str(folder), old.uri, "5", "--takeover", *CLI_ARGS[old.uri]])
    assert code == 0, capsys.readouterr().err
    with pytest.raises(FencedError):
        old.save(6, state(6))
    old.close()
    reader = opener(lease=False)
    assert [i.step for i in reader.list()] == [1, 5]
    held = record(reader)
    assert held.epoch == 2 and held.released  # the push released its own epoch at exit
