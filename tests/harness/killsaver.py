"""The training-like saver the kill fuzzer runs, and kills, in a child process.

It resumes the store like a trainer (``latest``, ``takeover=True`` since the killed writer still
holds the lease, load and check the state), then saves one step after another, sync or async,
and appends each step to a record file once it knows the step committed. A line written with
``os.write`` survives the SIGKILL that follows it, so the record is a lower bound of what
committed: the checker (killcheck.py) may demand every recorded step.

States are a few MiB: a frozen part, equal in every step (incremental saves copy it), and a
part of random size drawn per step (on S3 with 5 MiB parts some steps go up as multipart
uploads). Everything is a function of ``(seed, step)``, so the checker can recompute it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.domain import layout
from ckptstore.domain.manifest import is_tombstone

MiB = 1 << 20
FROZEN_BYTES = 2 * MiB
MAX_VARYING_BYTES = 6 * MiB
MAX_STEPS = 100_000


@dataclass(frozen=True)
class SaverJob:
    """What one saver process is told."""

    uri: str
    mode: str
    """``sync`` or ``async``."""
    seed: int
    keep_last: int
    record: str
    """File that gets one line per committed step."""
    ready: str
    """File created once the saver has resumed and starts saving."""
    error: str
    """File that gets the traceback if the saver fails."""
    deadline: float
    """Seconds after which the saver stops by itself (the kill should come first)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    verbose: bool = False
    """Let ckptstore's warnings (lease taken over, stale pointer) through to stderr."""
    die_after_commit: bool = False
    """SIGKILL itself right after its first commit marker is written, before the step index
    hears of the step (the kill point between the commit and the index update)."""


class DiesAfterCommit(BackendProxy):
    """Kills its process the moment a manifest (not a tombstone) has been created."""

    def create(self, path: str, data: bytes) -> None:
        super().create(path, data)
        if path.endswith("/" + layout.MANIFEST_NAME) and not is_tombstone(data):
            os.kill(os.getpid(), signal.SIGKILL)


def make_state(seed: int, step: int) -> dict[str, Any]:
    """The state saved as ``step``: recomputable by the checker."""
    import torch

    frozen = torch.Generator().manual_seed(seed)
    varying = torch.Generator().manual_seed(seed * 1_000_003 + step)
    size = int(torch.randint(64 << 10, MAX_VARYING_BYTES, (1,), generator=varying)) // 4
    return {
        "frozen": torch.randn(FROZEN_BYTES // 4, generator=frozen),
        "varying": torch.randn(size, generator=varying),
        "step": step,
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return (
        a.keys() == b.keys()
        and a["step"] == b["step"]
        and all(torch.equal(a[k], b[k]) for k in ("frozen", "varying"))
    )


def run_saver(job: SaverJob) -> None:
    """Process entry point; never returns normally unless the deadline passes first."""
    if not job.verbose:
        logging.getLogger("ckptstore").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
    try:
        _save_forever(job)
    except BaseException:
        with open(job.error, "w") as f:
            f.write(traceback.format_exc())
        raise


def _save_forever(job: SaverJob) -> None:
    import torch

    from ckptstore.store import CheckpointStore

    torch.set_num_threads(1)
    record = os.open(job.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    backend = open_backend(job.uri, job.storage_options)
    if job.die_after_commit:
        backend = DiesAfterCommit(backend)
    with CheckpointStore(job.uri, keep_last=job.keep_last, takeover=True, backend=backend) as store:
        latest = store.latest()
        if latest is not None:
            state = store.load(latest.step)
            if not same_state(state, make_state(job.seed, latest.step)):
                raise AssertionError(f"step {latest.step} loaded other contents than it saved")
        start = latest.step + 1 if latest is not None else 1
        with open(job.ready, "w"):
            pass
        stop = time.monotonic() + job.deadline
        pending = None
        for step in range(start, start + MAX_STEPS):
            if time.monotonic() > stop:
                break
            state = make_state(job.seed, step)
            if job.mode == "sync":
                store.save(step, state)
                os.write(record, f"{step}\n".encode())
                continue
            handle = store.save_async(step, state)  # waits for the previous save first
            if pending is not None:
                os.write(record, f"{pending.wait().step}\n".encode())
            pending = handle
        if pending is not None:
            os.write(record, f"{pending.wait().step}\n".encode())
