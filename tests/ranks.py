"""Run a function on N gloo ranks in separate processes, for the multi-process tests.

``fn(rank, world_size, *args)`` runs in every rank after ``init_process_group`` (gloo on CPU,
a file rendezvous, a short collective timeout so a protocol bug fails the test instead of
hanging it). Each rank's return value comes back pickled through a file; a rank that raises
fails the test with its traceback. Functions must be importable (module level in a test file).

Ranks are forked from a fork server that imported torch once, which makes a launch take a
second instead of many (importing torch in every fresh interpreter dominated these tests on
two cores), without forking the multi-threaded pytest process itself. The server outlives a
test, so each rank gets the caller's current environment (the dummy AWS credentials) as an
argument rather than inheriting the server's.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch._dynamo.symbolic_convert",  # DTensor's first op imports it: 2 s per rank
    "boto3",
    "ckptstore.integrations.distributed",
    "ckptstore.integrations.dcp",
]


def run_ranks(
    fn: Callable[..., Any], world_size: int, tmp: Path, *args: Any, timeout: float = 150.0
) -> list[Any]:
    """Each rank's return value, in rank order."""
    tmp.mkdir(parents=True, exist_ok=True)
    init = f"file://{tmp / 'rendezvous'}"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, init, tmp, env, args), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    results, errors = [], []
    for rank in range(world_size):
        out = tmp / f"rank{rank}.pkl"
        if not out.exists():
            errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
            continue
        status, value = pickle.loads(out.read_bytes())
        if status == "error":
            errors.append(f"rank {rank} raised:\n{value}")
        results.append(value)
    if hung or errors:
        raise AssertionError(f"ranks {hung} hung after {timeout} s; " + "\n".join(errors))
    return results


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init: str,
    tmp: Path,
    env: dict[str, str],
    args: tuple[Any, ...],
) -> None:
    """A rank: ``fn``'s result (or traceback) pickled to ``rank{rank}.pkl``. On SIGUSR1 it
    dumps its threads' stacks to ``rank{rank}.stacks``, so a harness can say where a hung
    rank hangs (harness/nodes.py)."""
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING)
    result: tuple[str, Any]
    with open(tmp / f"rank{rank}.stacks", "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
        )
        try:
            result = ("ok", fn(rank, world_size, *args))
        except BaseException:
            result = ("error", traceback.format_exc())
        finally:
            dist.destroy_process_group()
    (tmp / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


class Records(logging.Handler):
    """Collects log records' messages, for asserting on warnings inside a rank."""

    def __init__(self, logger: str = "ckptstore") -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger(logger).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
