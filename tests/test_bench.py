"""The benchmark's smoke run: every row of the table, on a local dir and on moto, at 8 MiB.

With ``--quick`` each raw limit times one setting, not its sweep. Not a timed test: it asserts
that the benchmark runs end to end, prints every row and the targets, and that the rows that
must run did (and loaded back the bytes they saved). Rows of
optional peers (s3torchconnector, DCP over s3fs) may say why they did not run, and so may the
rows through s3fs when it is not installed (it comes with the `bench` extra, not with `test`:
its aiobotocore caps botocore below the newest boto3).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
OPTIONAL = ("s3torchconnector", "dcp.save FsspecWriter", "dcp.load FsspecReader")
S3FS_ROWS = ("torch.save>s3fs.open", "s3fs.open>torch.load")
HAVE_S3FS = importlib.util.find_spec("s3fs") is not None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_smoke_prints_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    from bench_methods import catalog

    expected = [(row.target, row.name) for row in catalog()]
    out = tmp_path / "bench.json"
    args = ["--size-mb", "8", "--runs", "1", "--quick", "--json", str(out)]
    args += ["--tmpdir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "targets (ratios from this run):" in table
    lines = table.splitlines()
    for target, name in expected:
        assert any(line.split()[:1] == [target] and name in line for line in lines), (target, name)
    rows = {(r["target"], r["row"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(expected)
    for key, row in rows.items():
        if not row["ok"] and not HAVE_S3FS and key[1] in S3FS_ROWS:
            assert "s3fs" in str(row.get("error")), f"{key}: {row.get('error')}"
            continue
        if not row["ok"]:
            assert key[1].startswith(OPTIONAL), f"{key}: {row.get('error')}"
            assert "did not run:" in table
            continue
        assert len(row["seconds"]) == 1 and row["mb_s"] > 0, key
    incremental = rows[("s3", "ckptstore incremental")]
    assert 0 < incremental["notes"]["changed_fraction"] < 0.15


@pytest.mark.slow
def test_bench_peers_smoke_prints_both_comparisons(tmp_path: Path) -> None:
    """bench_peers.py at 8 MiB: the recovery beside raw gloo and the disk, the RSS rows, and
    the ratios, from one run."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_peers.py"), "--size-mb", "8", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = ["| raw gloo send/recv", "| disk: write + fsync", "| peer recovery of node 1",
            "| load_distributed, node 1 wiped", "| replicas=0 |", "| replicas=1 |"]  # fmt: skip
    for row in rows:
        assert row in proc.stdout, (row, proc.stdout)
    assert "ratios from this run: peer recovery takes" in proc.stdout


@pytest.mark.slow
def test_bench_resume_quick_prints_every_path_beside_its_limit(tmp_path: Path) -> None:
    """bench_resume.py --quick: every row (ckptstore, its limits, its peers) measured in one run,
    each with a positive speed and its path's limit, the ratios, and the resume of a lost node
    from its peer and from the bucket. Sane numbers, not speed."""
    out = tmp_path / "resume.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_resume.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["group"], r["role"], r["name"].split(",")[0]) for r in result["rows"]}
    groups = {"S3 load", "S3 save", "local load", "peer recovery (node 1 wiped)",
              "load_distributed, 2 ranks"}  # fmt: skip
    assert {g for g, _, _ in rows} == groups
    for group in groups:  # each path: ckptstore beside at least one limit
        assert {(group, "ckptstore"), (group, "limit")} <= {(g, r) for g, r, _ in rows}, group
    saves = [r["name"] for r in result["rows"] if r["group"] == "S3 save"]
    assert sum(r["role"] == "ckptstore" for r in result["rows"] if r["group"] == "S3 save") == 2
    assert "no retention" in saves[0]  # the group's row: the commit, beside the one that prunes
    pruning = next(n for n in saves if "keep_last=2" in n)
    assert 0 < result["ratios"][f"S3 save, {pruning}: to limit"] < 100
    peers = {(g, n) for g, role, n in rows if role == "peer"}
    for group in ("S3 save", "S3 load"):
        assert (
            group,
            "DCP FsspecWriter (s3fs)" if "save" in group else "DCP FsspecReader (s3fs)",
        ) in peers
        assert any(n.startswith("s3torchconnector") for g, n in peers if g == group)
    for row in result["rows"]:
        if row["error"]:  # only an optional peer may say why it did not run
            assert row["role"] == "peer", row
            continue
        assert len(row["seconds"]) == 1 and all(s > 0 for s in row["seconds"]), row
        assert 0 < row["mb_s"] < 1e6 and 0 < row["limit_mb_s"] < 1e6, row
        assert f"| {row['group']} | {row['name']} | " in proc.stdout
    for group in groups:
        assert 0 < result["ratios"][f"{group}: to limit"] < 100, group
    assert result["resume_peer_s"][0] > 0 and result["resume_bucket_s"][0] > 0
    assert "resume of a tiered replicas=1 job that lost node 1" in proc.stdout
