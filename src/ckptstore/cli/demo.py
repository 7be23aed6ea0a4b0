"""``ckptstore demo``: preempt a training job, resume it on a fresh process, prove nothing changed.

The story a cluster user lives through, end to end, in well under a minute on a laptop CPU:

1. an S3 bucket on an embedded server (moto, real HTTP on 127.0.0.1), unless ``--uri`` is given;
2. run 1, a subprocess, trains a tiny MLP, saving every ``save_every`` steps with ``keep_last``,
   and is SIGKILLed between two saves (a preempted node: no handler, no cleanup);
3. run 2, a fresh subprocess given nothing but the URI, resumes from ``latest`` and finishes;
4. the final state in the store is compared, tensor by tensor with ``torch.equal``, with an
   uninterrupted run computed here without any store. Any difference fails the demo.

Runs are subprocesses so that nothing survives in memory between them, as on real clusters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import ckptstore
from ckptstore.backends.registry import scheme_of
from ckptstore.cli.demo_train import Job, reference_run
from ckptstore.cli.format import steps_table, versions_table
from ckptstore.errors import ConfigError
from ckptstore.store import CheckpointStore
from ckptstore.testing.s3server import LocalS3Server

BUCKET = "ckptstore-demo"
PREFIX = "tiny-mlp"
WORKER_TIMEOUT = 300.0
EXIT_OK, EXIT_FAILED, EXIT_MISMATCH = 0, 1, 4


def default_kill_at(steps: int, save_every: int) -> int:
    """Half-way between two saves, around the middle of the run: 35 for 60 steps every 10."""
    return max(save_every, (steps // 2) // save_every * save_every) + save_every // 2


def run_demo(
    *,
    uri: str | None = None,
    storage_options: dict[str, Any] | None = None,
    steps: int = 60,
    save_every: int = 10,
    keep_last: int = 3,
    kill_at: int | None = None,
    verbose: int = 0,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """Run the demo, narrating through ``say``; returns the exit status (0: bit-identical)."""
    kill_at = _checked_kill_at(uri, steps, save_every, kill_at)
    started = time.perf_counter()
    with ExitStack() as stack:
        store, options = _open_empty_store(stack, uri, storage_options, say)
        say(f"store: {store.uri}  (save every {save_every} steps, keep_last={keep_last})")
        job = Job(
            uri=store.uri,
            steps=steps,
            save_every=save_every,
            keep_last=keep_last,
            label="run 1",
            storage_options=options,
            kill_at=kill_at,
            verbose=verbose,
        )
        if not _preempt_and_resume(store, job, say):
            return EXIT_FAILED
        _show_store(store, say)
        say(f"\nchecking: an uninterrupted {steps}-step run, in this process, no store")
        expected = reference_run(steps)
        resumed = store.load(steps)
        compared, differences = compare_states(expected, resumed)
    return _verdict(compared, differences, time.perf_counter() - started, say)


def _checked_kill_at(uri: str | None, steps: int, save_every: int, kill_at: int | None) -> int:
    """The step to kill run 1 at; refuses, before anything starts, what cannot tell a story."""
    kill_at = default_kill_at(steps, save_every) if kill_at is None else kill_at
    if not save_every <= kill_at < steps or kill_at % save_every == 0:
        raise ConfigError(
            f"--kill-at {kill_at} must fall between two saves, after the first one "
            f"(between {save_every} and {steps}, not a multiple of {save_every})"
        )
    if uri is not None and scheme_of(uri) == "memory":
        raise ConfigError(
            f"the demo cannot use {uri}: memory:// lives inside one process, and the demo's runs "
            "are separate processes. Use a local path or an s3:// URI"
        )
    return kill_at


def _open_empty_store(
    stack: ExitStack,
    uri: str | None,
    storage_options: dict[str, Any] | None,
    say: Callable[[str], None],
) -> tuple[CheckpointStore, dict[str, Any]]:
    """The store and its options, on an embedded S3 server without ``uri``; it must be empty,
    or the comparison at the end would be against someone else's steps."""
    if uri is None:
        server = stack.enter_context(LocalS3Server())
        uri = f"{server.create_bucket(BUCKET)}/{PREFIX}"
        storage_options = server.storage_options()
        say(f"started an embedded S3 server (moto) at {server.endpoint_url}")
    options = storage_options or {}
    store = stack.enter_context(CheckpointStore(uri, storage_options=options))
    if store.list():
        raise ConfigError(
            f"the demo needs an empty store, but {store.uri} holds committed steps; "
            "pass another --uri, or remove them with `ckptstore rm`"
        )
    return store, options


def _preempt_and_resume(store: CheckpointStore, job: Job, say: Callable[[str], None]) -> bool:
    """Run 1 until its SIGKILL, then run 2 to the end; False (after saying why) if either
    did otherwise."""
    say(
        f"\nrun 1: training {job.steps} steps in a subprocess; "
        f"it will be killed at step {job.kill_at}"
    )
    code = _run_worker(job)
    if code != -signal.SIGKILL:
        say(f"FAILED: run 1 should have died by SIGKILL, but exited with status {code}")
        return False
    latest = store.latest()
    held = ", ".join(str(i.step) for i in store.list())
    say(
        f"run 1 was killed at step {job.kill_at} (exit status {code}: SIGKILL); the store holds "
        f"steps {held}, latest = {latest.step if latest else None}"
    )

    say(
        "\nrun 2: a fresh process (another cluster) resumes, given only the URI; the "
        "scheduler knows run 1 is dead, so run 2 takes over its writer lease"
    )
    code = _run_worker(replace(job, label="run 2", kill_at=None, takeover=True))
    if code != 0:
        say(f"FAILED: run 2 exited with status {code}")
        return False
    return True


def _show_store(store: CheckpointStore, say: Callable[[str], None]) -> None:
    """What ``ckptstore ls`` would print, and which versions wrote each step."""
    infos = store.list()
    latest = store.latest()
    say(f"\n$ ckptstore ls {store.uri}")
    say(steps_table(infos, latest=latest.step if latest else None, pins=store.pins()))
    say("\nwho wrote them (from the manifests):")
    say(versions_table(infos))


def _verdict(
    compared: int, differences: list[str], seconds: float, say: Callable[[str], None]
) -> int:
    """Say whether the resumed run matched the uninterrupted one; returns the exit status."""
    if differences:
        say(f"MISMATCH in {len(differences)} of {compared} tensors and values:")
        for path in differences[:20]:
            say(f"  {path}")
        say(f"FAILED: the resumed run differs from an uninterrupted run ({seconds:.1f} s)")
        return EXIT_MISMATCH
    say(
        f"compared {compared} tensors and values (model, optimizer, step, RNG) with torch.equal"
        f"\nOK: resumed run is bit-identical to an uninterrupted run ({seconds:.1f} s)"
    )
    return EXIT_OK


def _run_worker(job: Job) -> int:
    """Run one training process to its end (or its death); returns its exit status."""
    sys.stdout.flush()
    package_root = str(Path(ckptstore.__file__).resolve().parent.parent)
    env = dict(os.environ)
    # The child imports this very ckptstore, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli.demo_train"],
        input=job.to_json(),
        text=True,
        env=env,
        timeout=WORKER_TIMEOUT,
        check=False,
    )
    return done.returncode


def compare_states(expected: Any, actual: Any, path: str = "state") -> tuple[int, list[str]]:
    """``(values compared, paths that differ)``; tensors must match in dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        same = (
            isinstance(actual, torch.Tensor)
            and expected.dtype == actual.dtype
            and expected.shape == actual.shape
            and torch.equal(expected, actual)
        )
        return 1, [] if same else [path]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            return 1, [f"{path} (keys differ)"]
        return _compare_items([(f"{path}[{k!r}]", expected[k], actual[k]) for k in expected])
    if isinstance(expected, (list, tuple)):
        if type(expected) is not type(actual) or len(expected) != len(actual):
            return 1, [f"{path} (type or length differs)"]
        return _compare_items(
            [(f"{path}[{i}]", e, a) for i, (e, a) in enumerate(zip(expected, actual, strict=True))]
        )
    return 1, [] if expected == actual and type(expected) is type(actual) else [path]


def _compare_items(items: list[tuple[str, Any, Any]]) -> tuple[int, list[str]]:
    count, differences = 0, []
    for path, expected, actual in items:
        n, diff = compare_states(expected, actual, path)
        count += n
        differences += diff
    return count, differences
