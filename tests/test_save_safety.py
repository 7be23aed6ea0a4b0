"""Four data-safety behaviours: a rerun that forgot to resume cannot destroy its own saves,
Ctrl-C with a ``save_async`` pending, metadata from Lightning (0-d tensors, NumPy scalars),
and ``gc`` on a prefix that holds no store.

The Ctrl-C tests run a real child process and send it real SIGINTs. Its backend holds every
payload write at its first chunk until the test creates a gate file, so the save is
deterministically in flight when the signals arrive; the child says "pending" once it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import (
    CheckpointStore,
    ConfigError,
    ConflictError,
    NotFoundError,
    StepBehindLatestError,
)
from ckptstore.data.payload import SourceFile
from ckptstore.domain.manifest import check_metadata

# -- 1. a step behind latest ---------------------------------------------------------------------


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((4, 4), float(step)), "step": step}


def objects(store: CheckpointStore) -> dict[str, bytes]:
    """Every object of the store but the writer lease (renewed by every save), by path."""
    return {
        o.path: store.backend.read(o.path)
        for o in store.backend.list("")
        if not o.path.startswith(".ckptstore/")
    }


def opened(store_uri: tuple[str, dict[str, Any]], **options: Any) -> CheckpointStore:
    uri, storage = store_uri
    return CheckpointStore(uri, storage_options=storage, **options)


def files(tag: str) -> list[SourceFile]:
    return [SourceFile(f"rank0/{tag}.bin", lambda: [tag.encode() * 100], 100 * len(tag))]


def steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list()]


def test_a_step_behind_latest_is_refused_before_anything_is_uploaded(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    store = opened(store_uri, keep_last=2)
    for step in (10, 20, 30):
        store.save(step, state_for(step))
    before = objects(store)
    with pytest.raises(StepBehindLatestError) as caught:
        store.save(5, state_for(5))
    error = caught.value
    assert isinstance(error, ConflictError) and error.step == 5
    message = str(error)
    for part in (store.uri, "step 5", "latest is step 30", "nothing was uploaded"):
        assert part in message, message
    for fix in ("store.load()", "resume()", "new URI", "allow_older=True"):
        assert fix in message, message
    assert objects(store) == before  # no attempt directory, latest and manifests untouched
    assert steps(store) == [20, 30]
    assert store.save(31, state_for(31)).step == 31  # the store is usable as before
    store.close()


def test_allow_older_commits_without_moving_latest_back(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    store = opened(store_uri)
    for step in (10, 30):
        store.save(step, state_for(step))
    assert store.save(5, state_for(5), allow_older=True).step == 5
    assert steps(store) == [5, 10, 30]
    latest = store.latest()
    assert latest is not None and latest.step == 30
    assert store.load()["step"] == 30 and store.load(5)["step"] == 5
    store.close()


def test_allow_older_leaves_retention_as_usual(store_uri: tuple[str, dict[str, Any]]) -> None:
    """Documented: ``keep_last`` deletes an older step saved on purpose right after it."""
    store = opened(store_uri, keep_last=2)
    for step in (10, 20, 30):
        store.save(step, state_for(step))
    assert store.save(5, state_for(5), allow_older=True).step == 5
    assert steps(store) == [20, 30]
    store.close()


def test_saving_latest_again_is_still_already_committed(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    store = opened(store_uri)
    store.save(30, state_for(30))
    with pytest.raises(ConflictError, match="already committed") as caught:
        store.save(30, state_for(30))
    assert not isinstance(caught.value, StepBehindLatestError)
    with pytest.raises(ConflictError, match="already committed"):
        store.save(30, state_for(30), allow_older=True)
    store.close()


def test_save_async_refuses_in_the_call_itself(store_uri: tuple[str, dict[str, Any]]) -> None:
    """The error surfaces from ``save_async`` at once, before the snapshot: no handle."""
    store = opened(store_uri)
    store.save(30, state_for(30))
    before = objects(store)
    with pytest.raises(StepBehindLatestError, match="latest is step 30"):
        store.save_async(5, state_for(5))
    store.wait()  # nothing pending, nothing unreported
    assert objects(store) == before
    handle = store.save_async(6, state_for(6), allow_older=True)
    assert handle.wait().step == 6
    latest = store.latest()
    assert latest is not None and latest.step == 30
    store.close()


def test_an_async_save_overtaken_by_the_one_before_it_is_refused(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    """A save queued behind another waits for it, then checks: 20 pending, then 10."""
    store = opened(store_uri)
    store.save_async(20, state_for(20))
    with pytest.raises(StepBehindLatestError, match="latest is step 20"):
        store.save_async(10, state_for(10))
    assert steps(store) == [20]
    store.close()


def test_push_dir_refuses_an_older_step(
    store_uri: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    store = opened(store_uri)
    store.save(30, state_for(30))
    local = tmp_path / "global_step_5"
    local.mkdir()
    (local / "model.pt").write_bytes(b"x" * 100)
    before = objects(store)
    with pytest.raises(StepBehindLatestError):
        store.push_dir(5, local)
    assert objects(store) == before
    assert store.push_dir(5, local, allow_older=True).step == 5
    store.close()


def test_multi_rank_stage_and_commit_refuse_an_older_step(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    store = opened(store_uri, lease=False)
    store.save(20, state_for(20))
    with pytest.raises(StepBehindLatestError):
        store.begin_save(5)  # the coordinator refuses before any participant uploads
    assert not any(p.startswith("global_step_5") for p in objects(store))

    staged = store.stage_files(25, files("b"))  # newer than latest when staged
    rival = opened(store_uri, lease=False)
    rival.save(30, state_for(30))  # ... but another writer moved latest past it meanwhile
    before = objects(store)
    with pytest.raises(StepBehindLatestError, match="latest is step 30"):
        store.commit_files(25, staged)
    assert not any(p.startswith("global_step_25") for p in objects(store))  # staged: removed
    assert {p for p in before if not p.startswith("global_step_25")} == set(objects(store))
    assert steps(store) == [20, 30]

    again = store.stage_files(25, files("c"))
    assert store.commit_files(25, again, allow_older=True).step == 25
    assert steps(store) == [20, 25, 30]
    latest = store.latest()
    assert latest is not None and latest.step == 30
    store.close()
    rival.close()


def test_copy_to_replicates_steps_older_than_the_targets_latest(
    store_uri: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    source = CheckpointStore(str(tmp_path / "source"))
    for step in (10, 20):
        source.save(step, state_for(step))
    target = opened(store_uri)
    target.save(30, state_for(30))
    assert [i.step for i in source.copy_to(target)] == [10, 20]
    assert steps(target) == [10, 20, 30]
    latest = target.latest()
    assert latest is not None and latest.step == 30
    source.close()
    target.close()


def test_a_pointer_left_ahead_of_every_committed_step_does_not_refuse(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    """latest.json naming a step deleted behind its back is no reason to refuse older steps:
    the save goes through and repairs the pointer."""
    store = opened(store_uri)
    store.save(10, state_for(10))
    store.save(30, state_for(30))
    store.backend.delete([o.path for o in store.backend.list("global_step_30/")])
    assert store.save(20, state_for(20)).step == 20
    latest = store.latest()
    assert latest is not None and latest.step == 20
    store.close()


# -- 2. Ctrl-C with a save_async pending ---------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import signal, sys, threading, time
    from pathlib import Path

    import torch

    from ckptstore import CheckpointStore
    from ckptstore.backends.local import LocalBackend
    from ckptstore.backends.proxy import BackendProxy

    # As in a terminal, even where the test runner was started with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root, gate, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    said = threading.Lock()


    class Gated(BackendProxy):
        # Holds each payload write at its first chunk until the gate file exists.
        def write(self, path, chunks):
            if ".attempt-" in path and not path.endswith(".ckptstore-attempt.json"):
                chunks = self._gated(chunks)
            return super().write(path, chunks)

        def _gated(self, chunks):
            for chunk in chunks:
                if said.acquire(blocking=False):
                    print("pending", flush=True)
                while not gate.exists():
                    time.sleep(0.01)
                yield chunk


    state = {f"t{i}": torch.full((64, 64), float(i)) for i in range(6)}
    store = CheckpointStore(root, backend=Gated(LocalBackend(root, {})), shard_size=1 << 14)


    def train():  # short sleeps: a Ctrl-C that Linux hands to another thread is seen too
        while True:
            time.sleep(0.01)


    if mode == "with":
        with store:
            store.save_async(1, state)
            train()
    elif mode == "plain":
        store.save_async(1, state)
        train()
    else:  # "return": the script ends with the save in flight
        store.save_async(1, state)
    """
)


class Child:
    """The child saver, its stderr in a file (a pipe could fill up and block it)."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.root = tmp_path / "store"
        self.gate = tmp_path / "gate"
        self.err_path = tmp_path / "stderr.txt"
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        self.err = self.err_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.root), str(self.gate), mode],
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for_pending(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the child prints it, or exits (EOF)
        assert line.strip() == "pending", f"child said {line!r}; stderr:\n{self.stderr()}"

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, f"child exited; stderr:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {text!r}; stderr:\n{self.stderr()}"
            time.sleep(0.02)

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
            self.err.close()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Callable[[str], Child]]:
    made: list[Child] = []

    def make(mode: str) -> Child:
        made.append(Child(tmp_path, mode))
        return made[-1]

    yield make
    for c in made:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def assert_clean(stderr: str) -> None:
    """One traceback (the KeyboardInterrupt that stopped the script), and no noise."""
    for noise in ("cannot schedule new futures", "Exception ignored", "failed: \n", "Error: \n"):
        assert noise not in stderr, stderr
    assert stderr.count("Traceback") <= 1, stderr


def step_files(root: Path) -> list[Path]:
    return [p for p in root.glob("global_step_*/**/*") if p.is_file()]


@pytest.mark.parametrize("mode", ["plain", "with"])
def test_one_ctrl_c_announces_the_pending_save_and_finishes_it(
    child: Callable[[str], Child], mode: str
) -> None:
    c = child(mode)
    c.wait_for_pending()
    c.interrupt()
    c.wait_for("finishing the save of step 1 to ")
    assert "press Ctrl-C again to abandon it" in c.stderr()
    c.gate.touch()
    assert c.finish() != 0  # it was interrupted: the script still stops
    stderr = c.stderr()
    assert_clean(stderr)
    assert "KeyboardInterrupt" in stderr
    store = CheckpointStore(str(c.root), lease=False)
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert torch.equal(store.load()["t5"], torch.full((64, 64), 5.0))


def test_a_save_pending_when_the_script_returns_is_announced_and_committed(
    child: Callable[[str], Child],
) -> None:
    c = child("return")
    c.wait_for_pending()
    c.wait_for("finishing the save of step 1 to ")
    assert "press Ctrl-C to abandon it" in c.stderr()
    c.gate.touch()
    assert c.finish() == 0
    assert_clean(c.stderr())
    assert "Traceback" not in c.stderr()
    latest = CheckpointStore(str(c.root), lease=False).latest()
    assert latest is not None and latest.step == 1


@pytest.mark.parametrize(("mode", "presses"), [("plain", 2), ("with", 2), ("return", 1)])
def test_a_ctrl_c_after_the_announcement_abandons_the_save_and_removes_its_files(
    child: Callable[[str], Child], mode: str, presses: int
) -> None:
    """Ctrl-C stops training and the save is announced; the next Ctrl-C abandons it. A
    script that returned gets the announcement alone: one Ctrl-C abandons."""
    c = child(mode)
    c.wait_for_pending()
    if presses == 2:
        c.interrupt()
    c.wait_for("to abandon it")
    c.interrupt()
    c.wait_for("abandoning the save of step 1 to ")  # the flag is set: now let writes go on
    c.gate.touch()
    code = c.finish()
    assert code != 0  # an abandoned save is never a success, even after the script returned
    if mode == "return":
        assert code == 130
    stderr = c.stderr()
    assert_clean(stderr)
    assert "nothing was committed" in stderr, stderr
    assert not (c.root / "latest.json").exists()
    assert step_files(c.root) == []  # the attempt's marker and files are gone
    store = CheckpointStore(str(c.root), lease=False)
    assert store.list() == []
    assert store.gc(older_than=0).deleted == ()  # nothing left over for gc either


# -- 3. metadata: 0-d tensors and NumPy scalars ----------------------------------------------------


def test_0d_tensors_and_numpy_scalars_become_python_numbers() -> None:
    metadata = {
        "loss": torch.tensor(0.25),
        "acc": np.float32(0.5),
        "epoch": np.int64(3),
        "nested": {"flags": [torch.tensor(True), np.bool_(False)], "lr": torch.tensor(1e-3)},
        "half": torch.tensor(2.0, dtype=torch.bfloat16),
        "plain": "x",
    }
    plain = check_metadata(metadata)
    assert plain == {
        "loss": 0.25,
        "acc": 0.5,
        "epoch": 3,
        "nested": {"flags": [True, False], "lr": pytest.approx(1e-3)},
        "half": 2.0,
        "plain": "x",
    }
    assert type(plain["epoch"]) is int and type(plain["nested"]["flags"][0]) is bool
    assert type(plain["loss"]) is float


def test_a_save_keeps_lightning_style_metadata(store_uri: tuple[str, dict[str, Any]]) -> None:
    store = opened(store_uri, keep_best=1, best_metric="val_loss", best_mode="min")
    info = store.save(1, state_for(1), {"val_loss": torch.tensor(0.5), "step": np.int32(1)})
    assert info.metadata == {"val_loss": 0.5, "step": 1}
    assert store.info(1).metadata == {"val_loss": 0.5, "step": 1}
    store.close()


@pytest.mark.parametrize(
    ("value", "where", "shape"),
    [
        (torch.ones(3), "metadata['t']", "(3,)"),
        (torch.ones(1), "metadata['t']", "(1,)"),
        ({"inner": [np.zeros((2, 2))]}, "metadata['t']['inner'][0]", "(2, 2)"),
    ],
)
def test_a_tensor_with_dimensions_is_refused_naming_the_key(
    value: Any, where: str, shape: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_metadata({"t": value})
    message = str(caught.value)
    for part in (where, shape, ".item()", ".tolist()", "metadata must hold only JSON values"):
        assert part in message, message


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), torch.tensor(float("nan")), np.float64("-inf")]
)
def test_nan_and_infinity_stay_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"metadata\['m'\]\['loss'\] is .*JSON has no NaN"):
        check_metadata({"m": {"loss": value}})


def test_the_manifest_module_imports_neither_torch_nor_numpy() -> None:
    code = (
        "import sys, ckptstore.domain.manifest; "
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# -- 4. gc on a prefix that holds no store ---------------------------------------------------------


def assert_refused(store: CheckpointStore, dry_run: bool = False) -> None:
    with pytest.raises(NotFoundError) as caught:
        store.gc(dry_run=dry_run, older_than=0)
    message = str(caught.value)
    for part in (store.uri, "holds no ckptstore store", "deleted nothing", "Check the URI"):
        assert part in message, message
    assert "first save" in message and caught.value.uri == store.uri


def test_gc_refuses_an_empty_prefix(store_uri: tuple[str, dict[str, Any]]) -> None:
    store = opened(store_uri, lease=False)
    assert_refused(store)
    assert_refused(store, dry_run=True)


def test_gc_refuses_a_prefix_of_foreign_files_and_touches_none(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    """A verl run copied there with ``aws s3 sync``: step-named directories, no store."""
    store = opened(store_uri, lease=False)
    foreign = {
        "global_step_5/actor/model_world_size_1_rank_0.pt": b"weights",
        "global_step_5/data.pt": b"loader",
        "global_step_10/actor/huggingface/config.json": b"{}",
        "latest_checkpointed_iteration.txt": b"10",
    }
    for path, data in foreign.items():
        store.backend.write(path, [data])
    assert_refused(store)
    assert {o.path: store.backend.read(o.path) for o in store.backend.list("")} == foreign


def test_gc_inside_a_store_reports_foreign_directories_untouched(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    store = opened(store_uri, lease=False)
    store.save(1, state_for(1))
    store.backend.write("global_step_7/actor/model.pt", [b"weights"])
    store.backend.write("global_step_1/notes.txt", [b"mine"])
    report = store.gc(older_than=0)
    assert set(report.foreign) >= {"global_step_7/actor/model.pt", "global_step_1/notes.txt"}
    assert report.deleted == ()
    assert store.backend.read("global_step_7/actor/model.pt") == b"weights"
    assert store.verify(1).ok


def test_gc_accepts_a_store_whose_only_save_failed(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    """No latest, no .ckptstore/, no committed step: an abandoned attempt is a store's."""
    store = opened(store_uri, lease=False)
    store.stage_files(1, files("a"))
    report = store.gc(older_than=0)
    assert report.deleted and not any(
        o.path.startswith("global_step_1/.attempt-") for o in store.backend.list("")
    )


def test_gc_on_s3_leaves_another_tools_multipart_upload_alone(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, s3_bucket: str
) -> None:
    upload = s3_client.create_multipart_upload(Bucket=s3_bucket, Key="run/global_step_1/big.pt")
    store = CheckpointStore(s3_uri, storage_options=s3_options, lease=False)
    assert_refused(store)
    uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [upload["UploadId"]]


def test_the_gc_command_refuses_too(tmp_path: Path) -> None:
    (tmp_path / "run" / "global_step_3").mkdir(parents=True)
    (tmp_path / "run" / "global_step_3" / "model.pt").write_bytes(b"w")
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", "gc", str(tmp_path / "run"), "--older-than", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode != 0, result
    assert "holds no ckptstore store" in result.stderr, result.stderr
    assert (tmp_path / "run" / "global_step_3" / "model.pt").read_bytes() == b"w"
