"""Training goes on through a bucket outage (issue 33, defect 9): a tiered store's local saves
commit while the bucket does not answer, due copies wait and resume when it does, ``close()``
returns by ``save_timeout`` plus its slack whatever the bucket does, and a takeover elsewhere
during the outage keeps the local steps made meanwhile out of the store.

The bucket is moto in a process of its own (s3process.py), stopped with SIGSTOP: it keeps its
sockets and answers nothing, the way a partitioned endpoint looks to a client, and SIGCONT
brings it back as it was. The takeover test partitions one writer only, through the fault
proxy (every request it sends stalls), while the new holder reaches moto directly.

What the close slack covers (README "Bounded saves", docs/tiers.md): a copy in flight stops by
the deadline plus the abort of its upload (``CLOSE_SLACK``, 2 s, persister.py), and the
lease's release waits at most ``RELEASE_WAIT`` (2 s, store.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.domain.layout import PINS_DIR
from ckptstore.errors import FencedError, SaveTimeoutError
from s3faults.faultmodes import Fault
from s3faults.faultproxy import FaultProxy
from s3process import Server

pytestmark = [pytest.mark.wallclock, pytest.mark.slow]

TIMEOUT = 3.0
"""save_timeout of every store here."""
TTL = 4.0
"""lease_ttl: the outage of the first test outlasts it."""
SLACK = 4.5
"""What close() may take past save_timeout (module docstring), plus 0.5 s of scheduling."""
LOCAL_SAVE = 1.0
"""A local save of a few KiB while the bucket is away takes far less."""


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step)), "step": torch.tensor(step)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tiered(uri: str, local: Path, options: dict[str, Any], **kwargs: Any) -> CheckpointStore:
    return CheckpointStore(
        uri,
        local=str(local),
        persist_every=1,
        save_timeout=TIMEOUT,
        lease_ttl=TTL,
        storage_options=options,
        **kwargs,
    )


def durable_steps(uri: str, options: dict[str, Any]) -> list[int]:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        return [i.step for i in store.list()]


def durable_latest(uri: str, options: dict[str, Any]) -> int | None:
    with CheckpointStore(uri, storage_options=options, lease=False) as store:
        latest = store.latest()
        return latest.step if latest is not None else None


def local_steps(local: Path) -> list[int]:
    """The steps committed in a local tier, read off its disk."""
    with CheckpointStore(str(local), lease=False) as store:
        return [i.step for i in store.list()]


def pins(local: Path) -> list[str]:
    folder = local / PINS_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def lease_record(server: Server, bucket: str) -> dict[str, Any]:
    body = server.client.get_object(Bucket=bucket, Key="run/.ckptstore/lease.json")["Body"]
    return dict(json.loads(body.read()))


def tiered_with_step_1(server: Server, bucket: str, local: Path) -> tuple[str, CheckpointStore]:
    """A tiered store at ``bucket``'s ``run``, whose step 1 is durable: its URI and the store."""
    uri = f"s3://{bucket}/run"
    store = tiered(uri, local, server.options())
    store.save(1, state(1))
    store.wait()
    return uri, store


def timed_save(store: CheckpointStore, step: int) -> float:
    started = time.monotonic()
    store.save(step, state(step))
    took = time.monotonic() - started
    assert took < LOCAL_SAVE, f"the local save of step {step} took {took:.1f} s"
    return took


def test_local_saves_commit_while_the_bucket_is_stopped_and_copies_resume(
    server: Server, tmp_path: Path
) -> None:
    bucket, local = server.bucket(), tmp_path / "local"
    uri, store = tiered_with_step_1(server, bucket, local)
    with server.stopped():
        timed_save(store, 2)
        timed_save(store, 3)
        time.sleep(TTL + 1)  # no renewal for a TTL: the lease is in doubt, local saves go on
        assert store.lease is not None and store.lease.unconfirmed() is not None
        timed_save(store, 4)
        assert local_steps(local) == [2, 3, 4]  # pinned, none durable (1 is: retention)
    store.wait()  # the copies resume: the newest is durable (older ones may be superseded)
    durable = durable_steps(uri, server.options())
    assert durable[0] == 1 and durable[-1] == 4 and set(durable) <= {1, 2, 3, 4}
    assert pins(local) == []
    assert durable_latest(uri, server.options()) == 4
    assert store.lease.unconfirmed() is None  # renewed: nobody took it over meanwhile
    timed_save(store, 5)
    store.close()
    assert durable_steps(uri, server.options()) == [*durable, 5]
    assert lease_record(server, bucket)["released"] is True
    with CheckpointStore(uri, storage_options=server.options(), lease=False) as reader:
        assert same(reader.load(), state(5))


def test_without_save_timeout_local_saves_do_not_wait_for_the_bucket_either(
    server: Server, tmp_path: Path
) -> None:
    bucket = server.bucket()
    uri, local = f"s3://{bucket}/run", tmp_path / "local"
    store = CheckpointStore(
        uri, local=str(local), persist_every=1, lease_ttl=TTL, storage_options=server.options()
    )
    store.save(1, state(1))
    store.wait()
    with server.stopped():
        timed_save(store, 2)  # the copy of step 2 waits in the bucket's retries meanwhile
        timed_save(store, 3)
    store.wait()
    assert durable_steps(uri, server.options())[-1] == 3
    store.close()


def test_close_returns_by_its_deadline_while_the_bucket_is_stopped(
    server: Server, tmp_path: Path
) -> None:
    bucket, local = server.bucket(), tmp_path / "local"
    uri, store = tiered_with_step_1(server, bucket, local)
    with server.stopped():
        timed_save(store, 2)
        started = time.monotonic()
        with pytest.raises(SaveTimeoutError, match=r"steps \[2\] are not durable") as caught:
            store.close()
        took = time.monotonic() - started
        assert took < TIMEOUT + SLACK, f"close() took {took:.1f} s"
    message = str(caught.value)
    assert str(local) in message and uri in message and "next writer" in message
    # The bucket is back: the next writer on this node makes step 2 durable at its close.
    again = tiered(uri, local, server.options(), takeover=True)
    again.close()
    assert durable_steps(uri, server.options()) == [1, 2]
    assert durable_latest(uri, server.options()) == 2


def test_local_steps_of_a_writer_taken_over_during_an_outage_never_reach_the_store(
    server: Server, tmp_path: Path
) -> None:
    bucket = server.bucket()
    uri = f"s3://{bucket}/run"
    direct = server.options()
    with FaultProxy(server.url) as proxy:
        away = tiered(uri, tmp_path / "a", {**direct, "endpoint_url": proxy.endpoint_url})
        away.save(1, state(1))
        away.wait()
        outage = proxy.add_fault(Fault.stall())  # this writer's bucket stops answering
        timed_save(away, 2)
        holder = tiered(uri, tmp_path / "b", direct, takeover=True)  # another node takes over
        holder.save(5, state(5))
        holder.wait()
        timed_save(away, 3)  # it cannot know yet: its local tier commits
        outage.off()
        with pytest.raises(FencedError, match="taken by"):
            away.wait()  # its persist's renewal finds the new holder: nothing persisted
        with pytest.raises(FencedError):
            away.save(4, state(4))  # it knows now: not even locally
        away.close()
    assert local_steps(tmp_path / "a") == [2, 3]  # never persisted (1 went by retention)
    assert durable_steps(uri, direct) == [1, 5]
    assert durable_latest(uri, direct) == 5
    assert lease_record(server, bucket)["holder"] == holder.writer
    holder.close()
    # The next writer on the first node drops those steps' pins and never persists them.
    later = tiered(uri, tmp_path / "a", direct)
    later.save(6, state(6))
    later.close()
    assert durable_steps(uri, direct) == [1, 5, 6]
    assert durable_latest(uri, direct) == 6
