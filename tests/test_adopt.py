"""Adopting step directories ckptstore did not write, and pushing whole verl run directories.

The foreign files are written behind ckptstore's back, the way ``aws s3 sync`` or ``cp -r``
would (boto3 against moto on 127.0.0.1, plain file writes locally), in verl's layout. After
adoption every other operation must treat the step like one ckptstore saved; the refusals and
their messages are checked, and so is the one thing adoption must never do: delete or move a
file it did not write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.registry import open_backend
from ckptstore.cli.main import run
from ckptstore.core.adoption import Adopter
from ckptstore.data.payload import SourceFile
from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.layout import VERL_TRACKER_NAME, manifest_path
from ckptstore.domain.manifest import encode_tombstone
from ckptstore.errors import (
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)

KEY = "5e1f" * 8
Put = Callable[[str, bytes], None]


def verl_step(step: int, world: int = 2) -> dict[str, bytes]:
    """The files of one verl ``global_step_N`` (FSDP actor shards, HF config, dataloader)."""
    rng = random.Random(step)
    files = {
        f"actor/model_world_size_{world}_rank_{r}.pt": rng.randbytes(150_000) for r in range(world)
    }
    files |= {
        f"actor/optim_world_size_{world}_rank_{r}.pt": rng.randbytes(40_000) for r in range(world)
    }
    files["actor/huggingface/config.json"] = b'{"model_type": "qwen2"}'
    files["data.pt"] = rng.randbytes(1000)
    return files


def sync(put: Put, steps: dict[int, dict[str, bytes]]) -> None:
    """Upload ``steps`` as a verl run directory, tracker file included."""
    for step, files in steps.items():
        for rel, data in files.items():
            put(f"global_step_{step}/{rel}", data)
    put(VERL_TRACKER_NAME, str(max(steps)).encode())


@pytest.fixture(params=["local", "memory", "s3"])
def foreign(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any], Put]:
    """``(uri, storage_options, put)``: an empty store, and a writer of raw objects in it that
    is not ckptstore (plain files; boto3 for S3)."""
    if request.param == "local":
        root = tmp_path / "store"

        def put_file(path: str, data: bytes) -> None:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)

        return str(root), {}, put_file
    if request.param == "memory":
        uri = request.getfixturevalue("memory_uri")
        backend = open_backend(uri, {})

        def write(path: str, data: bytes) -> None:
            backend.write(path, [data])

        return uri, {}, write
    client, bucket = request.getfixturevalue("s3_client"), request.getfixturevalue("s3_bucket")
    options = request.getfixturevalue("s3_options")

    def put_object(path: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"run/{path}", Body=data)

    return f"s3://{bucket}/run", options, put_object


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB ranged reads, so the verl shards above are checksummed in several chunks."""
    monkeypatch.setattr("ckptstore.data.transfer.CHUNK_SIZE", 64 << 10)


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def error_of(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("ckptstore: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# -- adopt: the API ----------------------------------------------------------------------------


def test_adopted_verl_run_is_a_step_like_any_other(
    foreign: tuple[str, dict[str, Any], Put], tmp_path: Path
) -> None:
    uri, options, put = foreign
    steps = {10: verl_step(10), 20: verl_step(20)}
    sync(put, steps)
    with CheckpointStore(uri, storage_options=options) as store:
        planned = store.adoptable()
        assert [(f.step, len(f.files), f.size) for f in planned] == [
            (s, len(files), sum(map(len, files.values()))) for s, files in steps.items()
        ]
        adopted = store.adopt(metadata={"source": "aws s3 sync"})
        assert [i.step for i in adopted] == [10, 20]
        latest = store.latest()
        assert latest is not None and latest.step == 20
        manifest = store.info(10).manifest
        assert manifest.metadata == {"source": "aws s3 sync"}
        assert manifest.environment.world_size == 2  # from verl's file names
        assert {f.attempt for f in manifest.files} == {None}  # in place: nothing copied
        assert {f.path for f in manifest.files} == set(steps[10])
        assert all(r.ok for r in store.verify_all())
        for rel, data in steps[20].items():
            assert bytes(store.read_file(latest, rel)) == data
        store.pull_dir(tmp_path / "pulled", 10)
        assert files_under(tmp_path / "pulled") == steps[10]
        report = store.gc(older_than=0)
        assert report.deleted == () and report.foreign == ()
        assert store.adoptable() == []  # nothing left to adopt: the step is committed
        listed = {o.path for o in store.backend.list("global_step_10/")}
        assert listed == {f"global_step_10/{rel}" for rel in steps[10]} | {manifest_path(10)}
        assert [i.step for i in store.list()] == [10, 20]


def test_adopted_steps_copy_prune_and_rm_like_saved_ones(tmp_path: Path) -> None:
    root = tmp_path / "store"
    steps = {s: verl_step(s, world=1) for s in (1, 2, 3)}
    for s, files in steps.items():
        for rel, data in files.items():
            (root / f"global_step_{s}" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / f"global_step_{s}" / rel).write_bytes(data)
    with CheckpointStore(str(root)) as store:
        store.adopt()
        replica = CheckpointStore(str(tmp_path / "replica"))
        assert [i.step for i in store.copy_to(replica)] == [1, 2, 3]
        assert all(r.ok for r in replica.verify_all())
        replica.close()
    with CheckpointStore(str(root), keep_last=1) as store:
        assert store.prune() == [1, 2]
        assert not (root / "global_step_1" / "data.pt").exists()
        assert not (root / "global_step_2" / "actor").exists()
        store.delete(3, force=True)
        assert store.list() == [] and not (root / "global_step_3" / "data.pt").exists()


def test_adopting_steps_older_than_latest_keeps_latest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with CheckpointStore(str(root)) as store:
        (tmp_path / "new").mkdir()
        (tmp_path / "new" / "x.pt").write_bytes(b"newer")
        store.push_dir(100, tmp_path / "new")
        (root / "global_step_50").mkdir()
        (root / "global_step_50" / "x.pt").write_bytes(b"older")
        assert [i.step for i in store.adopt()] == [50]  # migration: never refused as older
        latest = store.latest()
        assert latest is not None and latest.step == 100
        assert bytes(store.read_file(store.info(50), "x.pt")) == b"older"


def test_adopt_refusals_name_the_store_and_the_step(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with CheckpointStore(str(root)) as store:
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "a.pt").write_bytes(b"a")
        store.push_dir(5, tmp_path / "d")
        with pytest.raises(ConflictError, match="step 5 is already committed in") as e:
            store.adopt(5)
        assert str(root) in str(e.value)
        store.stage_files(6, [SourceFile("a.pt", lambda: [b"staged"], 6)])  # never committed
        with pytest.raises(NotFoundError, match="holds only ckptstore save attempts") as absent:
            store.adopt(6)
        assert f"{root}/global_step_6" in str(absent.value)
        with pytest.raises(NotFoundError, match="global_step_7 does not exist or holds no files"):
            store.adopt(7)
        with pytest.raises(ConfigError, match="non-negative integer"):
            store.adopt(-1)
        assert store.adopt() == []  # committed steps and attempts are not foreign
        assert [i.step for i in store.list()] == [5]


def test_never_adopts_attempts_or_marker_names(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with CheckpointStore(str(root)) as store:
        step = root / "global_step_3"
        (step / ".attempt-0123456789abcdef").mkdir(parents=True)
        (step / ".attempt-0123456789abcdef" / "w.pt").write_bytes(b"a ckptstore attempt")
        (step / ".attempt-junk").mkdir()
        (step / ".attempt-junk" / "w.pt").write_bytes(b"looks like one")
        (step / "actor").mkdir()
        (step / "actor" / "ckptstore.manifest.json").write_bytes(b"{}")
        (step / "actor" / "w.pt").write_bytes(b"foreign")
        (info,) = store.adopt(3)
        assert [f.path for f in info.files] == ["actor/w.pt"]
        assert (step / ".attempt-0123456789abcdef" / "w.pt").exists()


def test_a_byte_changed_after_adoption_fails_verify(tmp_path: Path) -> None:
    root = tmp_path / "store"
    shard = root / "global_step_4" / "actor" / "model_world_size_1_rank_0.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(bytes(range(256)) * 100)
    with CheckpointStore(str(root)) as store:
        store.adopt()
        data = bytearray(shard.read_bytes())
        data[1234] ^= 1
        shard.write_bytes(data)
        report = store.verify(4)
        assert not report.ok
        assert "model_world_size_1_rank_0.pt" in report.problems[0]
        with pytest.raises(CorruptCheckpointError):
            store.pull_dir(tmp_path / "pulled", 4)
        assert not (tmp_path / "pulled").exists()


def test_a_file_changed_while_adopting_commits_nothing_and_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    shard = root / "global_step_8" / "w.pt"
    shard.parent.mkdir(parents=True)
    changes: list[bytes] = []
    commit = Adopter.commit

    def changed_then_commit(self: Adopter, found: Any, metadata: Any, progress: Any) -> Any:
        shard.write_bytes(changes.pop(0))  # a writer still at work: the listing is stale
        return commit(self, found, metadata, progress)

    # adopt() plans and commits in one call: the file changes between the two, through the
    # one seam there is, the commit of a planned step
    monkeypatch.setattr(Adopter, "commit", changed_then_commit)
    with CheckpointStore(str(root)) as store:
        shard.write_bytes(b"x" * 100_000)
        changes.append(b"x" * 50_000)
        with pytest.raises(IncompleteCheckpointError, match="changed while it was adopted"):
            store.adopt(8)
        assert store.list() == [] and shard.read_bytes() == b"x" * 50_000
        shard.write_bytes(b"y" * 50_000)
        changes.append(b"y" * 60_000)  # grew: read as listed, then the size check catches it
        with pytest.raises(IncompleteCheckpointError, match="vanished or changed size"):
            store.adopt(8)
        assert store.list() == [] and shard.exists()
        assert changes == []  # both changes happened after planning


def test_a_step_being_removed_is_not_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    (root / "global_step_2").mkdir(parents=True)
    (root / "global_step_2" / "left.pt").write_bytes(b"what an interrupted rm left")
    (root / manifest_path(2)).write_bytes(encode_tombstone("someone", 0.0, []))
    with CheckpointStore(str(root)) as store:
        with pytest.raises(ConflictError, match="is being removed") as e:
            store.adopt(2)
        assert str(root) in str(e.value)
        with caplog.at_level(logging.WARNING):
            assert store.adopt() == []


def test_unsafe_names_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "global_step_1").mkdir(parents=True)
    (root / "global_step_1" / "a\\b.pt").write_bytes(b"x")
    with (
        CheckpointStore(str(root)) as store,
        pytest.raises(
            ConfigError, match=r"cannot be adopted: .*'a\\\\b.pt' \(contains a backslash\)"
        ),
    ):
        store.adopt(1)


def _crc_preserving_forgery(data: bytes) -> bytes:
    """``data`` with a few bits flipped so that its size and CRC32C stay the same (CRC is
    affine: find flips whose CRC contributions cancel, by elimination over GF(2))."""
    zero = Crc32c()
    zero.update(bytes(len(data)))

    def contribution(bit: int) -> int:
        delta = bytearray(len(data))
        delta[bit // 8] = 1 << (bit % 8)
        crc = Crc32c()
        crc.update(bytes(delta))
        return crc.value ^ zero.value

    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (vector, flips)
    for bit in range(64):
        vector, flips = contribution(bit), 1 << bit
        while vector:
            pivot = vector.bit_length() - 1
            if pivot not in basis:
                basis[pivot] = (vector, flips)
                break
            vector, flips = vector ^ basis[pivot][0], flips ^ basis[pivot][1]
        if not vector:
            forged = bytearray(data)
            for b in range(64):
                if flips >> b & 1:
                    forged[b // 8] ^= 1 << (b % 8)
            return bytes(forged)
    raise AssertionError("64 vectors in 32 dimensions are dependent")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_signed_adoption_records_sha256_and_catches_a_crc_preserving_forgery(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    files = verl_step(30)
    if where == "local":
        uri, options = str(tmp_path / "store"), {}
    else:
        uri, options = request.getfixturevalue("s3_uri"), request.getfixturevalue("s3_options")
    backend = open_backend(uri, options)
    for rel, data in files.items():
        backend.write(f"global_step_30/{rel}", [data])
    with CheckpointStore(uri, storage_options=options, signing_key=KEY) as store:
        (info,) = store.adopt()
        assert info.manifest.signature is not None
        assert {f.path: f.sha256 for f in info.files} == {
            rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()
        }
        assert store.verify(30).ok
        rel = "actor/model_world_size_2_rank_0.pt"
        forged = _crc_preserving_forgery(files[rel])
        assert forged != files[rel] and len(forged) == len(files[rel])
        backend.write(f"global_step_30/{rel}", [forged])
        crcs = [Crc32c(), Crc32c()]
        crcs[0].update(files[rel])
        crcs[1].update(forged)
        assert crcs[0].value == crcs[1].value  # invisible to the CRC32C alone
        report = store.verify(30)
        assert not report.ok and "sha256" in report.problems[0]
    backend.close()


def test_a_step_of_marker_names_only_has_nothing_to_adopt(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "global_step_1" / "actor").mkdir(parents=True)
    (root / "global_step_1" / "actor" / "ckptstore.manifest.json").write_bytes(b"{}")
    with CheckpointStore(str(root)) as store:
        with pytest.raises(NotFoundError, match="holds only ckptstore's own marker files"):
            store.adopt(1)
        assert store.adoptable() == []


# -- adopt: the command --------------------------------------------------------------------


def test_adopt_command_dry_run_json_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    for step, files in {1: {"a.pt": b"a" * 2048}, 2: verl_step(2)}.items():
        for rel, data in files.items():
            (root / f"global_step_{step}" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / f"global_step_{step}" / rel).write_bytes(data)
    code, out, _ = cli(capsys, "adopt", str(root), "--dry-run")
    assert code == 0
    assert out.splitlines() == [
        f"would adopt 2 steps in {root} (7 files, 374.1 KiB):",
        "  step 1: 1 file, 2.0 KiB",
        "  step 2: 6 files, 372.1 KiB",
    ]
    code, out, _ = cli(capsys, "adopt", str(root), "--dry-run", "--json")
    doc = json.loads(out)
    assert doc["dry_run"] is True and [s["step"] for s in doc["steps"]] == [1, 2]
    with CheckpointStore(str(root)) as store:
        assert store.list() == []  # a dry run commits nothing

    code, out, _ = cli(capsys, "adopt", str(root), "1", "-m", "origin=rsync")
    assert code == 0
    assert out.startswith(f"adopted step 1 in {root}: 1 file, 2.0 KiB checksummed in ")
    code, out, _ = cli(capsys, "adopt", str(root), "--json")
    doc = json.loads(out)
    assert doc["dry_run"] is False and doc["files"] == 6 and doc["steps"][0]["step"] == 2
    code, out, _ = cli(capsys, "adopt", str(root))
    assert code == 0 and out.startswith(f"nothing to adopt in {root}")
    with CheckpointStore(str(root)) as store:
        assert [i.step for i in store.list()] == [1, 2]
        assert store.info(1).metadata == {"origin": "rsync"}


def test_adopt_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    (root / "global_step_1").mkdir(parents=True)
    (root / "global_step_1" / "a.pt").write_bytes(b"a")
    (root / "global_step_2").mkdir()
    (root / "global_step_2" / "b.pt").write_bytes(b"b")
    assert cli(capsys, "adopt", str(root), "1")[0] == 0
    code, _, err = cli(capsys, "adopt", str(root), "2", "1")  # all checked before any adopted
    assert code == 5
    assert f"step 1 is already committed in {root}" in error_of(err)
    code, _, err = cli(capsys, "adopt", str(root), "9")
    assert code == 3 and "global_step_9 does not exist or holds no files" in error_of(err)
    code, _, err = cli(capsys, "adopt", str(root), "latest")
    assert code == 2 and "adopt takes step numbers, not 'latest'" in err
    with CheckpointStore(str(root)) as store:
        assert [i.step for i in store.list()] == [1]


def test_adopt_command_against_s3(
    s3_client: Any,
    s3_bucket: str,
    s3_endpoint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    steps = {5: verl_step(5), 6: verl_step(6)}
    sync(
        lambda path, data: s3_client.put_object(Bucket=s3_bucket, Key=f"run/{path}", Body=data),
        steps,
    )
    uri = f"s3://{s3_bucket}/run"
    code, out, err = cli(capsys, "adopt", uri, "--endpoint-url", s3_endpoint, "--progress")
    assert code == 0, err
    assert out.startswith(f"adopted steps 5, 6 in {uri}: 12 files, 744.2 KiB checksummed in ")
    assert "adopt: 100%" in err
    code, out, err = cli(
        capsys, "pull", uri, str(tmp_path / "p"), "latest", "--endpoint-url", s3_endpoint
    )
    assert code == 0, err
    assert files_under(tmp_path / "p") == steps[6]
    code, out, _ = cli(capsys, "verify", uri, "--all", "--endpoint-url", s3_endpoint)
    assert code == 0 and out.splitlines() == ["step 5: OK", "step 6: OK"]


# -- push of run directories, and STEP arguments -----------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """verl's ``trainer.default_local_dir`` after three saves."""
    root = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        for rel, data in verl_step(step, world=1).items():
            (root / f"global_step_{step}" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / f"global_step_{step}" / rel).write_bytes(data)
    (root / VERL_TRACKER_NAME).write_text("300")
    return root


def test_push_run_directory_commits_each_step_then_skips_them(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    code, out, err = cli(capsys, "push", str(run_dir), uri)
    assert code == 0, err
    assert out.startswith(f"pushed steps 100, 200, 300 from {run_dir} to {uri}: 12 files, ")
    with CheckpointStore(uri) as store:
        assert [i.step for i in store.list()] == [100, 200, 300]
        assert all(VERL_TRACKER_NAME not in {f.path for f in i.files} for i in store.list())
        store.pull_dir(tmp_path / "pulled", 200)
        assert files_under(tmp_path / "pulled") == files_under(run_dir / "global_step_200")

    code, out, _ = cli(capsys, "push", str(run_dir), uri)
    assert code == 0
    assert out.splitlines() == [
        f"nothing to push from {run_dir} to {uri}",
        f"skipped steps 100, 200, 300: already committed in {uri} with the same files",
    ]
    (run_dir / "global_step_400").mkdir()
    (run_dir / "global_step_400" / "data.pt").write_bytes(b"new")
    code, out, _ = cli(capsys, "push", str(run_dir), uri, "--json")
    doc = json.loads(out)
    assert [s["step"] for s in doc["pushed"]] == [400] and doc["skipped"] == [100, 200, 300]
    assert doc["files"] == 1 and doc["size"] == 3


def test_push_run_directory_with_a_changed_step_pushes_nothing(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    assert cli(capsys, "push", str(run_dir / "global_step_200"), uri)[0] == 0
    (run_dir / "global_step_200" / "data.pt").write_bytes(b"retrained")
    code, _, err = cli(capsys, "push", str(run_dir), uri)
    assert code == 5
    line = error_of(err)
    assert f"step 200 is already committed in {uri} with other files than" in line
    assert "'data.pt' has 9 bytes here, 1000 in the step" in line and "Nothing was pushed" in line
    with CheckpointStore(uri) as store:
        assert [i.step for i in store.list()] == [200]  # 100 was not pushed before the refusal


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: (d / "extra.pt").write_bytes(b"e"), "'extra.pt' is here but not in the step"),
        (lambda d: (d / "data.pt").unlink(), "'data.pt' is in the step but not here"),
        (lambda d: (d / "data.pt").write_bytes(b"x" * 1000), "'data.pt' has other bytes here"),
    ],
)
def test_push_says_how_a_committed_step_differs(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: Callable[[Path], object],
    why: str,
) -> None:
    uri = str(tmp_path / "store")
    step = run_dir / "global_step_100"
    assert cli(capsys, "push", str(step), uri)[0] == 0
    change(step)
    code, _, err = cli(capsys, "push", str(step), uri)
    assert code == 5 and f"({why}" in error_of(err)


def test_push_refuses_the_attempts_of_a_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        store.stage_files(3, [SourceFile("a.pt", lambda: [b"staged"], 6)])
    code, _, err = cli(capsys, "push", f"{uri}/global_step_3", str(tmp_path / "other"))
    assert code == 2 and "is a step of a ckptstore store (it holds .attempt-" in error_of(err)


def test_push_step_from_directory_name_argument_or_option(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    code, out, _ = cli(capsys, "push", str(run_dir / "global_step_100"), uri)
    assert code == 0 and out.startswith(f"pushed {run_dir / 'global_step_100'} as step 100 ")
    code, out, _ = cli(capsys, "push", str(run_dir / "global_step_100"), uri, "--json")
    doc = json.loads(out)
    assert doc["step"] == 100 and doc["skipped"] is True
    assert cli(capsys, "push", str(run_dir), uri, "global_step_200")[0] == 0  # one step of a run
    assert cli(capsys, "push", str(run_dir / "global_step_300"), uri, "--step", "1000")[0] == 0
    single = tmp_path / "one"
    single.mkdir()
    (single / "f.bin").write_bytes(b"1")
    code, out, _ = cli(capsys, "push", str(single), uri, "2000")
    assert code == 0 and out.startswith(f"pushed {single} as step 2000 to {uri}: 1 file, 1 B in ")
    with CheckpointStore(uri) as store:
        assert [i.step for i in store.list()] == [100, 200, 1000, 2000]

    code, _, err = cli(capsys, "push", str(single), uri)
    assert code == 2 and f"cannot tell which step {single} holds: give the STEP" in error_of(err)
    code, _, err = cli(capsys, "push", str(single), uri, "1", "--step", "2")
    assert code == 2 and "STEP 1 and --step 2 disagree" in err
    code, _, err = cli(capsys, "push", str(run_dir), uri, "5")
    assert code == 2 and "is a run directory (it holds global_step_100, " in error_of(err)
    code, _, err = cli(capsys, "push", str(single), uri, "latest")
    assert code == 2 and "push takes step numbers, not 'latest'" in err
    code, _, err = cli(capsys, "push", uri, str(tmp_path / "s2"))
    assert code == 2
    assert "global_step_100 is a step of a ckptstore store (it holds" in error_of(err)


def test_push_allow_older(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    assert cli(capsys, "push", str(run_dir / "global_step_300"), uri)[0] == 0
    code, _, _ = cli(capsys, "push", str(run_dir / "global_step_100"), uri)
    assert code == 5
    code, out, _ = cli(capsys, "push", str(run_dir), uri, "--allow-older")
    assert code == 0 and out.startswith("pushed steps 100, 200 from")
    with CheckpointStore(uri) as store:
        latest = store.latest()
        assert latest is not None and latest.step == 300
        assert [i.step for i in store.list()] == [100, 200, 300]


def test_pull_and_cp_take_positional_steps_and_latest(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = str(tmp_path / "store")
    assert cli(capsys, "push", str(run_dir), uri)[0] == 0
    code, out, _ = cli(capsys, "pull", uri, str(tmp_path / "a"), "latest")
    assert code == 0 and out.startswith(f"pulled step 300 from {uri} into {tmp_path / 'a'}: ")
    assert files_under(tmp_path / "a") == files_under(run_dir / "global_step_300")
    code, out, _ = cli(capsys, "pull", uri, str(tmp_path / "b"), "global_step_100", "--json")
    assert json.loads(out)["step"] == 100
    code, out, _ = cli(capsys, "pull", uri, str(tmp_path / "c"), "--step", "200")
    assert code == 0 and ": 4 files, " in out
    code, out, _ = cli(
        capsys, "pull", uri, str(tmp_path / "d"), "200", "--exclude", "*", "--include", "data.pt"
    )
    assert code == 0 and ": 1 of 4 files (partial: --include/--exclude), 1000 B in " in out
    code, _, err = cli(capsys, "pull", uri, str(tmp_path / "e"), "7")
    assert code == 3 and "step 7 is not committed" in error_of(err)

    dst = str(tmp_path / "replica")
    code, out, _ = cli(capsys, "cp", uri, dst, "latest", "100")
    assert code == 0 and out.startswith(f"copied steps 100, 300 to {dst}: 8 files, ")
    code, out, _ = cli(capsys, "cp", uri, dst, "--step", "200", "100")
    assert code == 0
    assert out.splitlines()[0].startswith(f"copied step 200 to {dst}: 4 files, ")
    assert out.splitlines()[1] == f"skipped step 100: already in {dst} with the same files"
    code, out, _ = cli(capsys, "cp", uri, dst)
    assert code == 0 and out.splitlines()[0] == f"copied nothing to {dst}"
    empty = str(tmp_path / "empty")
    code, _, err = cli(capsys, "cp", empty, dst, "latest")
    assert code == 3 and f"{empty} holds no committed step" in error_of(err)


@pytest.fixture(autouse=True)
def _no_leaked_handlers() -> Iterator[None]:
    """``run`` installs a stderr log handler on the root logger if it has none; keep the
    root logger as the test found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
