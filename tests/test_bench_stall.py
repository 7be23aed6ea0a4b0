"""The training-loop stall benchmark's smoke run, and its plot, at a tiny size.

Not a timed test: it asserts that every mode ran on a local dir and on moto, that every save
committed and the last one of each run loaded back bit-exact (in the overlapped mode that
proves the optimizer's pre-hook kept the next step out of the saved bytes), and that the JSON
carries what ``plot_stall.py`` draws.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
STEPS, EVERY = 5, 2
SAVE_POINTS = [1, 3]  # after steps 2 and 4 (1-based): each is followed by a step
TINY = ["--size-mb", "2", "--steps", str(STEPS), "--every", str(EVERY), "--rounds", "1"]
TINY += ["--batch", "1", "--seq", "16", "--threads", "1"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    tmp = tmp_path_factory.mktemp("stall")
    out = tmp / "stall.json"
    args = [*TINY, "--json", str(out), "--tmpdir", str(tmp)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_stall.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_mode_runs_commits_and_loads_back_bit_exact(bench_run: tuple[str, Path]) -> None:
    table, out = bench_run
    data: dict[str, Any] = json.loads(out.read_text())
    runs = {(r["target"], r["mode"]): r for r in data["runs"]}
    expected = {("-", "none")} | {
        (t, m) for t in ("local", "s3") for m in ("blocking", "async", "overlapped")
    }
    assert set(runs) == expected
    for (target, mode), run in runs.items():
        assert run["error"] is None, (target, mode, run["error"])
        assert len(run["fb"]) == len(run["opt"]) == len(run["call"]) == STEPS
        assert run["total"] >= sum(run["fb"]) + sum(run["opt"])
        if mode == "none":
            assert run["saves"] == [] and run["verified"] is None
            continue
        assert run["saves"] == SAVE_POINTS, (target, mode)
        assert run["committed"] == [0, *(i + 1 for i in SAVE_POINTS)], (target, mode)
        assert run["verified"] is True, (target, mode)
        if mode != "blocking":  # every save was seen done, by the end at the latest
            assert len(run["done_after"]) == len(SAVE_POINTS)
            assert all(d is not None and d >= 0 for d in run["done_after"])
    for target in ("local", "s3"):
        assert any(line.split()[:2] == [target, "overlapped"] for line in table.splitlines())
    assert "targets (ratios from this run):" in table
    assert table.count("overlapped stall <= 0.2x clone") == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plot_draws_a_png_from_the_json(bench_run: tuple[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (matplotlib)")
    _, out = bench_run
    data = json.loads(out.read_text())
    assert {"every"} <= set(data["args"])
    assert {"state_bytes", "clone_s", "save_points", "cpus"} <= set(data["meta"])
    png = tmp_path / "step-time.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "plot_stall.py"), str(out), str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < png.stat().st_size < 300_000


def test_the_bit_exact_check_catches_one_changed_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The smoke run's "loaded back bit-exact" can fail: one element of one tensor differs."""
    monkeypatch.syspath_prepend(str(BENCH))
    import torch
    from bench_stall import Trainer, _verify, tensors

    from ckptstore import CheckpointStore

    trainer = Trainer(200_000, batch=1, seq=8)
    trainer.step()
    expect = {p: t.clone() for p, t in tensors(trainer.state(1))}
    with CheckpointStore(str(tmp_path / "store"), lease=False) as store:
        store.save(1, trainer.state(1))
        assert _verify(store, 1, expect)
        moment = next(p for p in expect if p.endswith("exp_avg_sq"))
        expect[moment] = expect[moment].clone()
        expect[moment].view(-1)[0] = torch.nextafter(expect[moment].view(-1)[0], torch.tensor(1.0))
        assert not _verify(store, 1, expect)
