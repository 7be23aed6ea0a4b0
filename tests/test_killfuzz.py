"""The kill fuzzer (harness.killfuzz): a modest run in CI, and proof its checker bites.

The CI run SIGKILLs savers 32 times (8 for each of sync/async x local/S3) at seeded random
moments and checks the store after each kill; the long run (1,000 kills) is the same command
with ``--kills 250`` (see the README). The checker tests damage a store on purpose: a checker
that cannot fail would make the fuzzer's zeros meaningless.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.domain.layout import manifest_path
from harness import killfuzz
from harness.killcheck import Findings, LocalView, check
from harness.killsaver import make_state

SEED = 5


@pytest.mark.slow
def test_thirty_two_kills_lose_nothing(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "harness.killfuzz",
        "--seed",
        "20",
        "--kills",
        "8",
        "--modes",
        "sync,async",
        "--targets",
        "local,s3",
        "--workdir",
        str(tmp_path),
    ]
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    harness_on_path = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, env=harness_on_path
    )
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    rows = {tuple(line.split()[:2]): line.split() for line in done.stdout.splitlines()}
    for mode in ("sync", "async"):
        for target in ("local", "s3"):
            _, _, kills, saves, lost, corrupt, strays, _ = rows[(mode, target)]
            assert (kills, lost, corrupt, strays) == ("8", "0", "0", "0")
            assert int(saves) > 0
    _, kills, _, lost, corrupt, strays, _ = rows[("all", "32")]  # the total row
    assert (kills, lost, corrupt, strays) == ("32", "0", "0", "0")


def saved(root: Path, steps: list[int]) -> CheckpointStore:
    store = CheckpointStore(str(root), keep_last=2, lease=False)
    for step in steps:
        store.save(step, make_state(SEED, step))
    return store


def run_check(store: CheckpointStore, root: Path, recorded: list[int], **kw: int) -> Findings:
    fresh = CheckpointStore(str(root), lease=False)
    return check(
        fresh,
        LocalView(str(root)),
        seed=SEED,
        keep_last=2,
        recorded=recorded,
        previous_latest=kw.get("previous_latest"),
    )


def test_a_sound_store_passes(tmp_path: Path) -> None:
    store = saved(tmp_path, [1, 2, 3])
    found = run_check(store, tmp_path, [1, 2, 3])
    assert found.problems == [] and found.latest == 3


def test_the_checker_finds_a_lost_step(tmp_path: Path) -> None:
    store = saved(tmp_path, [1, 2, 3])
    store.backend.delete([manifest_path(3)])  # uncommitted behind the store's back
    found = run_check(store, tmp_path, [1, 2, 3])
    assert any(p.startswith("step 3 was committed, is gone") for p in found.lost), found.lost
    assert any("latest.json points at step 3" in p for p in found.broken)


def test_the_checker_finds_corruption_and_a_latest_that_went_back(tmp_path: Path) -> None:
    store = saved(tmp_path, [1, 2])
    path = store.info(2).manifest.file("varying-00000.safetensors").key(2)
    data = bytearray(store.backend.read(path))
    data[100] ^= 1
    store.backend.write(path, [bytes(data)])
    found = run_check(store, tmp_path, [1, 2], previous_latest=5)
    assert any("step 2 does not load" in p for p in found.corrupt)
    assert any("went back from 5 to 2" in p for p in found.broken)


def test_the_checker_finds_strays_gc_leaves(tmp_path: Path) -> None:
    store = saved(tmp_path, [1, 2])
    (tmp_path / ".ckptstore").mkdir(exist_ok=True)  # the step index lives there too
    (tmp_path / ".ckptstore" / "junk").write_bytes(b"x")  # gc does not own this path
    attempt = tmp_path / "global_step_9" / ".attempt-0123456789abcdef"
    attempt.mkdir(parents=True)
    for name in (".ckptstore-attempt.json", "orphan"):  # a killed save's: gc removes it
        (attempt / name).write_bytes(b"{}")
        os.utime(attempt / name, (0, 0))
    (tmp_path / "global_step_7").mkdir()  # a writer killed between mkdir and its first file
    os.utime(tmp_path / "global_step_7", (0, 0))
    found = run_check(store, tmp_path, [1, 2])
    assert found.strays == ["stray file .ckptstore/junk"]
    assert not attempt.exists()  # only gc's tombstone is left, for a day
    assert not (tmp_path / "global_step_7").exists()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="choose from sync, async"):
        killfuzz.main(["--modes", "sometimes"])
