"""The ``ckptstore`` command: every command checked on its human output, its ``--json``
document and its documented exit status.

Commands run in-process (``ckptstore.cli.main.run``, stdout and stderr captured, warnings
printed on stderr as the installed command prints them), which spares each call an interpreter
start and an import of torch; the tests that depend on being a process of their own (the demo,
which kills itself; a push beside a live writer in another process; the installed entry point)
run the installed command as a subprocess, the way users and schedulers run it. Stores are
prepared through the Python API.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.common import parse_pair
from ckptstore.cli.main import _Formatter, exit_code_for, run
from ckptstore.errors import (
    AccessDeniedError,
    BackendError,
    CheckpointError,
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    FencedError,
    IncompleteCheckpointError,
    LeaseHeldError,
    NotFoundError,
    ObjectExistsError,
    PreconditionFailedError,
)
from ckptstore.testing.s3server import LocalS3Server

BIN = Path(sys.executable).parent
CKPTSTORE = shutil.which("ckptstore", path=str(BIN)) or shutil.which("ckptstore")


def ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the command line in this process; stdout and stderr come back separately, as text,
    with warnings on stderr as the installed command writes them."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(_Formatter())
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("ckptstore")
    level = logger.level
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run(list(args))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)  # -v raises it for the rest of a process
    return subprocess.CompletedProcess(["ckptstore", *args], code, out.getvalue(), err.getvalue())


def ckpt_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed command as a subprocess."""
    if CKPTSTORE is None:
        pytest.fail("the ckptstore command is not installed; run: pip install -e .")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("COLUMNS", None)
    return subprocess.run(
        [CKPTSTORE, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def ok(*args: str) -> str:
    done = ckpt(*args)
    assert done.returncode == 0, f"{args}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def data(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def committed(uri: str) -> list[int]:
    """The store's committed steps, read through the Python API (not the command under test)."""
    with CheckpointStore(uri) as s:
        return [info.step for info in s.list()]


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single error line on stderr, checked to be the only thing there besides warnings."""
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("ckptstore: error: ")]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A local store with steps 10, 20, 30 (latest), each with a loss in its metadata."""
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as s:
        for step in (10, 20, 30):
            s.save(step, {"w": torch.full((64,), float(step)), "step": step}, {"loss": 1 / step})
    return uri


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    """A verl-like step directory to push: nested files, one of them binary."""
    root = tmp_path / "global_step_7"
    (root / "actor").mkdir(parents=True)
    (root / "actor" / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(200_000))
    (root / "data.pt").write_bytes(b"dataloader state")
    return root


# -- help, exit code table, option parsing ---------------------------------------------------


def test_help_documents_exit_codes() -> None:
    out = ok("--help")
    assert "Exit codes" in out
    for line in ("3    not found", "4    verification failed", "5    conflict", "6    storage"):
        assert line in out
    readers = ("ls", "show", "verify", "prune", "pin", "unpin", "rm")
    for command in (*readers, "push", "pull", "cp", "adopt"):
        assert f"  {command} " in out


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("x"), 2),
        (NotFoundError("x"), 3),
        (CorruptCheckpointError("x"), 4),
        (IncompleteCheckpointError("x"), 4),
        (ConflictError("x"), 5),
        (ObjectExistsError("x"), 5),
        (PreconditionFailedError("x"), 5),
        (LeaseHeldError("x"), 5),
        (FencedError("x"), 5),
        (BackendError("x"), 6),
        (AccessDeniedError("x"), 6),
        (CompatibilityError("x"), 7),
        (CheckpointError("x"), 1),
        (RuntimeError("x"), 1),
    ],
)
def test_exit_code_table(error: BaseException, code: int) -> None:
    assert exit_code_for(error) == code


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("part_size=8388608", ("part_size", 8388608)),
        ("verify=false", ("verify", False)),
        ("region=us-east-1", ("region", "us-east-1")),
        ("token=", ("token", "")),
        ('client_kwargs={"a": 1}', ("client_kwargs", {"a": 1})),
        ("url=http://h:9000/x=y", ("url", "http://h:9000/x=y")),
    ],
)
def test_key_value_options_parse_json_else_string(text: str, expected: tuple[str, Any]) -> None:
    assert parse_pair(text, "--storage-option") == expected


def test_usage_errors_exit_2(store: str) -> None:
    cases = [
        ["ls"],  # missing URI
        ["ls", store, "--storage-option", "no-equals-sign"],
        ["verify", store, "10", "--all"],
        ["prune", store],  # no retention policy given: our ConfigError
        ["ls", "bad:uri"],
        ["push", store, store],  # a ckptstore store is copied with cp, not pushed
    ]
    results = [ckpt(*args) for args in cases]
    for args, done in zip(cases, results, strict=True):
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stdout == "", args


# -- reading ---------------------------------------------------------------------------------


def test_ls_table_and_json(store: str) -> None:
    out = ok("ls", store)
    rows = out.splitlines()
    assert rows[0].split()[:4] == ["STEP", "TIME", "(UTC)", "SIZE"]
    assert [r.split()[0] for r in rows[1:4]] == ["10", "20", "30"]
    assert rows[4].startswith("total: 3 steps, ") and len(rows) == 5
    assert "latest" in rows[3] and "latest" not in rows[1]
    assert "loss=0.1" in rows[1]

    doc = data("ls", store)
    assert doc == data("--json", "ls", store)  # options work before or after the command
    assert doc["latest"] == 30
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30]
    first = doc["steps"][0]
    assert first["metadata"] == {"loss": 0.1}
    assert first["files"] == 2 and first["size"] > 256 and first["kind"] == "state"
    assert first["time"].endswith("Z") and not first["pinned"] and not first["latest"]


def test_ls_empty_store_exits_3(tmp_path: Path) -> None:
    done = ckpt("ls", str(tmp_path / "nothing"), "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout)["steps"] == []
    assert "holds no committed step" in error_line(done)


def test_show_latest_and_a_given_step(store: str) -> None:
    doc = data("show", store)
    assert doc["latest"] is True
    assert doc["manifest"]["step"] == 30
    assert {f["path"] for f in doc["manifest"]["files"]} >= {"state.json"}
    assert doc["manifest"]["environment"]["torch"] == metadata.version("torch")

    out = ok("show", store, "10")
    for needle in ("step       10", "files:", "state.json", "metadata:", "loss", "environment:"):
        assert needle in out
    assert "latest" not in out.splitlines()[0]


def test_show_missing_step_exits_3_with_one_line(store: str) -> None:
    done = ckpt("show", store, "99")
    assert done.returncode == 3
    assert "step 99" in error_line(done)
    assert done.stdout == ""


def test_verify_ok_then_corrupt_byte_exits_4_and_names_file(store: str) -> None:
    assert ok("verify", store) == "step 30: OK\n"
    shard = next(Path(store, "global_step_20").rglob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(raw)

    assert ckpt("verify", store).returncode == 0  # latest (30) is intact
    done = ckpt("verify", store, "20")
    assert done.returncode == 4
    assert "step 20: FAILED" in done.stdout and shard.name in done.stdout

    done = ckpt("verify", store, "--all", "--json")
    assert done.returncode == 4
    doc = json.loads(done.stdout)
    assert doc["ok"] is False
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [(10, True), (20, False), (30, True)]
    assert shard.name in doc["steps"][1]["problems"][0]


# -- managing --------------------------------------------------------------------------------


def test_prune_dry_run_then_prune_keeps_pinned(store: str) -> None:
    doc = data("prune", store, "--keep-last", "1", "--dry-run")
    assert doc["deleted"] == [10, 20] and doc["kept"] == [30] and doc["dry_run"] is True
    assert committed(store) == [10, 20, 30]

    assert data("pin", store, "10") == {"uri": store, "step": 10, "pinned": True, "changed": True}
    doc = data("prune", store, "--keep-last", "1")
    assert doc["deleted"] == [20] and doc["kept"] == [10, 30]
    assert committed(store) == [10, 30]
    with CheckpointStore(store) as s:
        assert s.pins() == [10]


def test_pin_unpin_rm_and_conflicts(store: str) -> None:
    ok("pin", store, "10")
    done = ckpt("rm", store, "10")
    assert done.returncode == 5 and "pinned" in error_line(done)

    assert data("unpin", store, "10")["changed"] is True
    assert data("unpin", store, "10")["changed"] is False
    doc = data("rm", store, "10")
    assert doc == {"uri": store, "dry_run": False, "deleted": [10], "latest": 30}

    done = ckpt("rm", store, "30")
    assert done.returncode == 5 and "latest" in error_line(done)
    assert data("rm", store, "30", "--force")["latest"] == 20

    done = ckpt("pin", store, "30")
    assert done.returncode == 3 and "30" in error_line(done)


def test_verbose_error_shows_traceback(store: str) -> None:
    done = ckpt("-v", "rm", store, "30")
    assert done.returncode == 5
    assert "Traceback" in done.stderr and "ckptstore: error: " in done.stderr


def test_gc_removes_only_old_uncommitted_files(store: str) -> None:
    attempt = Path(store, "global_step_40", ".attempt-0123456789abcdef")  # a crashed save's
    attempt.mkdir(parents=True)
    (attempt / ".ckptstore-attempt.json").write_text('{"lease_epoch": 0}')
    (attempt / "half-written.bin").write_bytes(b"x" * 100)
    foreign = Path(store, "global_step_40", "synced-by-hand.bin")
    foreign.write_bytes(b"y")
    half = "global_step_40/.attempt-0123456789abcdef/half-written.bin"

    assert data("gc", store, "--dry-run")["deleted"] == []  # younger than the 1 h grace
    doc = data("gc", store, "--dry-run", "--older-than", "0")
    assert half in doc["deleted"] and doc["dry_run"] is True
    assert (attempt / "half-written.bin").exists()

    assert "removed 2 objects" in ok("gc", store, "--older-than", "0")
    assert not (attempt / "half-written.bin").exists()
    assert foreign.exists()  # not ckptstore's: reported, never deleted
    assert committed(store) == [10, 20, 30]


# -- retention by metric and time, ls --sort/--last ------------------------------------------

BEST2 = ("--keep-best", "2", "--best-metric", "val_loss", "--best-mode", "min")


@pytest.fixture
def scored(tmp_path: Path) -> str:
    """Steps 1-6 with a val_loss in their metadata (none for 4); 6, the latest, is the worst."""
    uri = str(tmp_path / "scored")
    with CheckpointStore(uri) as s:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.9), (4, None), (5, 0.1), (6, 0.95)]:
            meta = {} if loss is None else {"val_loss": loss}
            s.save(step, {"w": torch.full((16 * step,), float(step))}, meta)
    return uri


def test_prune_keeps_the_best_by_a_metric_and_one_step_per_interval(scored: str) -> None:
    doc = data("prune", scored, *BEST2, "--dry-run")
    assert doc["deleted"] == [1, 3] and doc["kept"] == [2, 4, 5, 6]  # 4: no val_loss, kept
    # the saves took seconds: one step per hour keeps the oldest (and latest, always)
    doc = data("prune", scored, "--keep-every-seconds", "3600", "--dry-run")
    assert doc["deleted"] == [2, 3, 4, 5]
    doc = data("prune", scored, "--keep-every-seconds", "3600", "--keep-last", "3", "--dry-run")
    assert doc["deleted"] == [2, 3]
    assert committed(scored) == [1, 2, 3, 4, 5, 6]

    assert data("prune", scored, *BEST2)["deleted"] == [1, 3]
    assert committed(scored) == [2, 4, 5, 6]
    ok("pin", scored, "5")
    max_mode = ("--keep-best", "1", "--best-metric", "val_loss", "--best-mode", "max")
    doc = data("prune", scored, *max_mode)
    assert doc["deleted"] == [2] and doc["kept"] == [4, 5, 6]  # 6 is the best; 5 is pinned


def test_retention_option_errors_exit_2(scored: str) -> None:
    cases = [
        # the CLI's own names for the options, never the Python arguments'
        (["prune", scored, "--keep-best", "2"], "--keep-best needs --best-metric"),
        (["prune", scored, "--keep-best", "2", "--best-metric", "val_loss"], "--best-mode"),
        (["prune", scored, "--best-metric", "val_loss"], "only apply with --keep-best"),
        (["ls", scored, "--keep-best", "1"], "--keep-best needs --best-metric"),
        ([*("prune", scored), *BEST2[:4], "--best-mode", "avg"], "'avg' is not one of"),
        (["prune", scored, "--keep-every-seconds", "0"], "--keep-every-seconds"),
        (["prune", scored, "--keep-best", "0"], "--keep-best"),
        (["ls", scored, "--last", "0"], "--last"),
    ]
    results = [ckpt(*case[0]) for case in cases]
    for (args, needle), done in zip(cases, results, strict=True):
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stdout == "" and needle in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert "keep_best" not in done.stderr and "best_metric" not in done.stderr, done.stderr
    assert committed(scored) == [1, 2, 3, 4, 5, 6]


def test_ls_sorts_by_a_metric_shows_the_newest_and_a_total(scored: str) -> None:
    def steps(doc: dict[str, Any]) -> list[int]:
        return [s["step"] for s in doc["steps"]]

    doc = data("ls", scored, "--sort", "val_loss")
    assert steps(doc) == [5, 2, 1, 3, 6, 4]  # 4 has no val_loss: last
    sizes = [s["size"] for s in doc["steps"]]
    assert doc["total"] == {"steps": 6, "size": sum(sizes)}
    assert steps(data("ls", scored, "--sort", "val_loss", "--reverse")) == [6, 3, 1, 2, 5, 4]
    assert steps(data("ls", scored, "--sort", "no_such_key")) == [1, 2, 3, 4, 5, 6]
    assert steps(data("ls", scored, "--reverse")) == [6, 5, 4, 3, 2, 1]
    doc = data("ls", scored, "--last", "3")
    assert steps(doc) == [4, 5, 6] and doc["total"]["steps"] == 6  # the total is the store's
    assert steps(data("ls", scored, "--last", "3", "--sort", "val_loss")) == [5, 6, 4]

    rows = ok("ls", scored, "--last", "2").splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["5", "6"] and len(rows) == 4
    assert rows[3].startswith("total: 6 steps, ") and "(2 shown, " in rows[3]


def test_ls_marks_what_prune_would_delete_and_deletes_nothing(scored: str) -> None:
    doc = data("ls", scored, *BEST2)
    assert doc["prune"] == [1, 3]
    assert [s["step"] for s in doc["steps"] if s["prune"]] == [1, 3]
    rows = ok("ls", scored, *BEST2).splitlines()
    assert "PRUNE" in rows[0].split()
    assert [r.split()[0] for r in rows[1:7] if " prune " in r] == ["1", "3"]
    assert "prune would delete 2 steps" in rows[7]
    assert committed(scored) == [1, 2, 3, 4, 5, 6]
    plain = data("ls", scored)
    assert "prune" not in plain and "prune" not in plain["steps"][0]
    assert "PRUNE" not in ok("ls", scored).splitlines()[0]


def test_push_applies_the_same_retention_options(tmp_path: Path, step_dir: Path) -> None:
    uri = str(tmp_path / "pushed")
    best1 = ("--keep-best", "1", "--best-metric", "val_loss", "--best-mode", "min")
    for step, loss in [(1, "0.3"), (2, "0.1"), (3, "0.2")]:
        ok("push", str(step_dir), uri, "--step", str(step), "-m", f"val_loss={loss}", *best1)
    assert committed(uri) == [2, 3]


# -- transfers -------------------------------------------------------------------------------


def test_push_pull_roundtrip(tmp_path: Path, step_dir: Path) -> None:
    uri = str(tmp_path / "pushed")
    done = ckpt("push", str(step_dir), uri, "-m", "loss=0.5", "-m", "note=hi", "--json")
    assert done.returncode == 0, done.stderr
    pushed = json.loads(done.stdout)
    assert pushed["step"] == 7 and pushed["files"] == 2 and pushed["kind"] == "directory"
    assert pushed["metadata"] == {"loss": 0.5, "note": "hi"} and pushed["skipped"] is False

    assert "with the same files" in ok("push", str(step_dir), uri, "7")  # a rerun: skipped
    (step_dir / "data.pt").write_bytes(b"other dataloader state")
    done = ckpt("push", str(step_dir), uri, "--step", "7")
    assert done.returncode == 5 and "already committed" in error_line(done)
    (step_dir / "data.pt").write_bytes(b"dataloader state")

    target = tmp_path / "pulled"
    pulled = data("pull", uri, str(target))
    assert pulled["step"] == 7 and pulled["size"] == pushed["size"]
    for rel in ("actor/model_world_size_1_rank_0.pt", "data.pt"):
        assert (target / rel).read_bytes() == (step_dir / rel).read_bytes()

    done = ckpt("pull", uri, str(tmp_path / "other"), "8")
    assert done.returncode == 3


def test_push_into_a_store_a_live_writer_holds_needs_takeover(
    tmp_path: Path, step_dir: Path
) -> None:
    uri = str(tmp_path / "live")
    # a training job, alive, holds the writer lease (a short TTL: its heartbeat is seen at once)
    with CheckpointStore(uri, lease_ttl=2) as trainer:
        trainer.save(1, {"w": torch.zeros(2)})
        done = ckpt_process("push", str(step_dir), uri, "--step", "2")  # another process
        assert done.returncode == 5
        assert "--takeover" in error_line(done)
        pushed = ckpt_process("push", str(step_dir), uri, "--step", "2", "--takeover", "--json")
        assert json.loads(pushed.stdout)["step"] == 2
        with pytest.raises(FencedError):  # the old writer is fenced off
            trainer.save(3, {"w": torch.ones(2)})
    assert committed(uri) == [1, 2]


def test_transfer_progress_bar_goes_to_stderr(tmp_path: Path, step_dir: Path) -> None:
    done = ckpt("push", str(step_dir), str(tmp_path / "s"), "--step", "1", "--progress")
    assert done.returncode == 0, done.stderr
    assert "100%" in done.stderr and "push step 1" in done.stderr
    assert "100%" not in done.stdout and done.stdout.startswith("pushed ")


def test_cp_copies_skips_and_conflicts(store: str, tmp_path: Path, step_dir: Path) -> None:
    dst = str(tmp_path / "replica")
    doc = data("cp", store, dst)
    assert doc["copied"] == [10, 20, 30] and doc["skipped"] == []
    with CheckpointStore(dst) as replica:
        latest = replica.latest()
        assert latest is not None
        assert latest.step == 30
        assert all(report.ok for report in replica.verify_all())

    doc = data("cp", store, dst, "--step", "20")
    assert doc["copied"] == [] and doc["skipped"] == [20]

    other = str(tmp_path / "other")
    ok("push", str(step_dir), other, "--step", "20")
    done = ckpt("cp", store, other, "--step", "20")
    assert done.returncode == 5 and "other contents" in error_line(done)


# -- S3 (moto on 127.0.0.1, from conftest) ---------------------------------------------------


def test_cli_against_s3(s3_uri: str, s3_options: dict[str, Any], step_dir: Path) -> None:
    endpoint = s3_options["endpoint_url"]
    secret = "do-not-print-this-secret"
    creds = ["-o", "key=AKIADONOTPRINT", "-o", f"secret={secret}", "-o", "region=us-east-1"]
    done = ckpt("push", str(step_dir), s3_uri, "--step", "3", "--endpoint-url", endpoint, *creds)
    assert done.returncode == 0, done.stderr
    done = ckpt("--endpoint-url", endpoint, *creds, "ls", s3_uri, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["latest"] == 3
    done = ckpt("verify", s3_uri, "-o", f"endpoint_url={endpoint}", *creds)
    assert done.returncode == 0 and done.stdout == "step 3: OK\n"
    shown = ckpt("show", s3_uri, "--json", "--endpoint-url", endpoint, *creds)
    assert json.loads(shown.stdout)["manifest"]["step"] == 3
    for output in (done.stdout + done.stderr, shown.stdout + shown.stderr):
        assert secret not in output
        assert "AKIADONOTPRINT" not in output


def test_cli_unreachable_endpoint_exits_6(s3_uri: str) -> None:
    done = ckpt("ls", s3_uri, "--endpoint-url", "http://127.0.0.1:9", "-o", "max_attempts=1")
    assert done.returncode == 6
    assert "127.0.0.1:9" in error_line(done)


# -- embedded S3 server and demo -------------------------------------------------------------


def test_local_s3_server_serves_a_store() -> None:
    with LocalS3Server() as server:
        assert server.endpoint_url.startswith("http://127.0.0.1:") and server.port > 0
        uri = server.create_bucket("cli-test") + "/run"
        options = server.storage_options()
        assert options["endpoint_url"] == server.endpoint_url
        with CheckpointStore(uri, storage_options=options) as s:
            s.save(1, {"x": torch.arange(4)})
            assert torch.equal(s.load()["x"], torch.arange(4))
    assert not server.running
    with pytest.raises(ConfigError, match="not running"):
        _ = server.endpoint_url


def test_demo_rejects_bad_kill_step_and_non_empty_store(store: str) -> None:
    done = ckpt_process("demo", "--uri", store, "--kill-at", "20")
    assert done.returncode == 2 and "--kill-at 20" in error_line(done)
    done = ckpt_process("demo", "--uri", store)
    assert done.returncode == 2 and "empty store" in error_line(done)


@pytest.mark.slow
def test_demo_end_to_end_on_embedded_s3() -> None:
    done = ckpt_process("demo", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "started an embedded S3 server (moto) at http://127.0.0.1:" in out
    assert "run 1 was killed at step 35" in out
    assert "resumed from step 30" in out
    table = out[out.index("$ ckptstore ls") :].splitlines()
    assert [row.split()[0] for row in table[2:5]] == ["40", "50", "60"]
    assert "latest" in table[4]
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith("OK: resumed run is bit-identical to an uninterrupted run")
    )


@pytest.mark.slow
def test_demo_on_a_local_path(tmp_path: Path) -> None:
    uri = str(tmp_path / "demo")
    done = ckpt_process(
        "demo", "--uri", uri, "--steps", "20", "--save-every", "5", "--keep-last", "2"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run 1 was killed at step 12" in done.stdout
    assert "OK: resumed run is bit-identical" in done.stdout
    assert committed(uri) == [15, 20]
