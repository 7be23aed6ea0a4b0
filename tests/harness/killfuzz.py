"""Kill fuzzer: SIGKILL a saving trainer at random moments, resume, and check the store.

::

    python -m harness.killfuzz --seed 1 --kills 8 --modes sync,async --targets local,s3

(32 kills, as tests/test_killfuzz.py runs in CI; ``--kills 250`` is the long run, 1,000 kills,
about half an hour on 2 cores.)
For each mode (``save`` or ``save_async``) and target (a local directory, or a bucket on an
embedded moto S3 server started here), it runs ``--kills`` rounds on one store: start a saver
process (killsaver.py: resume from ``latest`` with ``takeover=True``, then save step after step
with ``keep_last`` retention), wait a seeded random time, SIGKILL it (every fourth round the
saver kills itself right after its first commit marker, before the step index hears of the
step), then check the store with
fresh objects (killcheck.py) and run ``gc``. It prints one row per mode and target and exits 1
if any round found a lost or corrupt step, a stray after gc, or a broken ``latest``.

Savers are forked from a forkserver that imported torch and ckptstore once, so a round costs
a fork, not a 2-second interpreter start. Kill moments are drawn from a seeded RNG; the
interleaving of threads inside the saver is not reproducible, so a seed reproduces a run's
shape, not its every byte.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.context import ForkServerContext
from typing import Any

from ckptstore.errors import CheckpointError
from ckptstore.store import CheckpointStore
from ckptstore.testing.s3server import LocalS3Server
from harness.killcheck import Findings, LocalView, RawView, S3View, check
from harness.killsaver import MiB, SaverJob, run_saver

MODES = ("sync", "async")
TARGETS = ("local", "s3")
BUCKET = "killfuzz"
READY_TIMEOUT = 120.0
SHOWN_PROBLEMS = 20


@dataclass
class Tally:
    """One row of the summary."""

    mode: str
    target: str
    kills: int = 0
    saves: int = 0
    lost: int = 0
    corrupt: int = 0
    strays: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """Where one mode's store lives, and how to see it without the store."""

    uri: str
    options: dict[str, Any]
    raw: RawView


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    modes, targets = _choices(args.modes, MODES), _choices(args.targets, TARGETS)
    if not args.verbose:
        logging.getLogger("ckptstore").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
    workdir = args.workdir or tempfile.mkdtemp(prefix="killfuzz-")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "ckptstore.store", "ckptstore.backends.s3", run_saver.__module__]
    )
    tallies = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LocalS3Server()) if "s3" in targets else None
        if server is not None:
            server.create_bucket(BUCKET)
        for mode in modes:
            for name in targets:
                target = _target(name, mode, workdir, server)
                tallies.append(fuzz(ctx, args, mode, name, target, os.path.join(workdir, mode)))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(tallies))
    problems = [f"{t.mode}/{t.target}: {p}" for t in tallies for p in t.problems]
    for problem in problems[:SHOWN_PROBLEMS]:
        print(f"VIOLATION {problem}", file=sys.stderr)
    return 1 if problems else 0


def fuzz(
    ctx: ForkServerContext,
    args: argparse.Namespace,
    mode: str,
    name: str,
    target: Target,
    scratch: str,
) -> Tally:
    """``args.kills`` rounds of start, kill, check on one store."""
    tally = Tally(mode, name)
    rng = random.Random(f"{args.seed}:{mode}:{name}")
    os.makedirs(scratch, exist_ok=True)
    record = os.path.join(scratch, f"{name}.record")
    started, latest, seen = time.monotonic(), None, set[str]()
    for round_ in range(args.kills):
        job = SaverJob(
            uri=target.uri,
            mode=mode,
            seed=args.seed,
            keep_last=args.keep_last,
            record=record,
            ready=os.path.join(scratch, f"{name}.ready{round_}"),
            error=os.path.join(scratch, f"{name}.error{round_}"),
            deadline=max(30.0, 10 * args.window),
            storage_options=target.options,
            verbose=args.verbose,
            die_after_commit=round_ % 4 == 2,  # the kill point between commit and index
        )
        # the last round of a store that no save reached yet (a loaded machine makes the
        # saver slow to its first commit) kills only after one: the run proves saves happen
        first_save = record if round_ == args.kills - 1 and not _read_record(record) else None
        failure = _run_and_kill(ctx, job, rng.uniform(0.0, args.window), after_save=first_save)
        if failure:
            tally.problems.append(f"round {round_}: the saver failed:\n{failure}")
        recorded = _read_record(record)
        try:
            with CheckpointStore(target.uri, storage_options=target.options, lease=False) as store:
                found = check(
                    store,
                    target.raw,
                    seed=args.seed,
                    keep_last=args.keep_last,
                    recorded=recorded,
                    previous_latest=latest,
                )
        except CheckpointError as e:  # the store itself is unusable: that is a finding too
            found = Findings(latest, broken=[f"checking the store failed: {e!r}"])
        latest = found.latest if found.latest is not None else latest
        tally.kills += 1
        tally.saves = len(set(recorded))
        fresh = {p for p in found.problems if p not in seen}  # a stray stays: count it once
        seen |= fresh
        tally.lost += len(fresh.intersection(found.lost))
        tally.corrupt += len(fresh.intersection(found.corrupt))
        tally.strays += len(fresh.intersection(found.strays))
        tally.problems += [f"round {round_}: {p}" for p in found.problems if p in fresh]
        if args.verbose or (round_ + 1) % 50 == 0:
            print(
                f"{mode}/{name}: {round_ + 1}/{args.kills} kills, {tally.saves} steps saved, "
                f"{len(tally.problems)} violations, {time.monotonic() - started:.0f} s",
                flush=True,
            )
    tally.seconds = time.monotonic() - started
    return tally


def _run_and_kill(
    ctx: ForkServerContext, job: SaverJob, delay: float, *, after_save: str | None = None
) -> str | None:
    """Start a saver, SIGKILL it ``delay`` s after it resumed (and, with ``after_save``, after
    that record file names a saved step); its traceback if it failed."""
    proc = ctx.Process(target=run_saver, args=(job,), daemon=True)
    proc.start()
    try:
        give_up = time.monotonic() + READY_TIMEOUT
        while not os.path.exists(job.ready) and proc.is_alive():
            if time.monotonic() > give_up:
                return f"not ready after {READY_TIMEOUT:.0f} s"
            time.sleep(0.005)
        while after_save is not None and not _read_record(after_save) and proc.is_alive():
            if time.monotonic() > give_up:
                return f"no step saved after {READY_TIMEOUT:.0f} s"
            time.sleep(0.01)
        if proc.is_alive():
            time.sleep(delay)
    finally:
        proc.kill()
        proc.join(30)
    if os.path.exists(job.error):
        with open(job.error) as f:
            return f.read()
    return None


def _read_record(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


def _target(name: str, mode: str, workdir: str, server: LocalS3Server | None) -> Target:
    if name == "local":
        root = os.path.join(workdir, mode, "store")
        return Target(root, {}, LocalView(root))
    assert server is not None
    options = {**server.storage_options(), "part_size": 5 * MiB, "max_concurrency": 4}
    return Target(f"s3://{BUCKET}/{mode}", options, S3View(server.client(), BUCKET, mode))


def table(tallies: Sequence[Tally]) -> str:
    """The summary, one row per mode and target, as the README shows it."""
    head = ("mode", "target", "kills", "saves", "lost", "corrupt", "strays", "seconds")
    rows = [head] + [
        (t.mode, t.target, t.kills, t.saves, t.lost, t.corrupt, t.strays, f"{t.seconds:.1f}")
        for t in tallies
    ]
    total = sum(t.kills for t in tallies)
    rows.append(
        (
            "all",
            "",
            total,
            sum(t.saves for t in tallies),
            sum(t.lost for t in tallies),
            sum(t.corrupt for t in tallies),
            sum(t.strays for t in tallies),
            f"{sum(t.seconds for t in tallies):.1f}",
        )
    )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            str(v).ljust(w) if i < 2 else str(v).rjust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )


def _choices(value: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in chosen if v not in allowed]
    if bad or not chosen:
        raise SystemExit(f"choose from {', '.join(allowed)} (comma-separated), got {value!r}")
    return chosen


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness.killfuzz",
        description="SIGKILL a saving trainer at random moments and check the store each time.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds kill moments and states")
    parser.add_argument("--kills", type=int, default=13, help="kills per mode and target")
    parser.add_argument("--modes", default="sync,async", help="sync,async")
    parser.add_argument("--targets", default="local,s3", help="local,s3 (s3: embedded moto)")
    parser.add_argument("--keep-last", type=int, default=2, help="retention of the saver")
    parser.add_argument(
        "--window", type=float, default=1.5, help="kill within this many s after resume"
    )
    parser.add_argument("--workdir", help="keep stores and records here (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="one line per kill, warnings")
    return parser


if __name__ == "__main__":
    sys.exit(main())
