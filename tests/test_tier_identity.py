"""A local tier's directory belongs to one store (tiers/identity.py): a node runs one job
after another at the same ``local=`` path, and one run's steps must never leak into the next.
Over moto HTTP: run A saved 100 and 101 at ``local=L``; run B, another store at the same L,
is refused with a message that names both stores and the fix, and nothing of A reaches B's
prefix. The same run (same URI) opens its directory again, from any process of the node; a
directory from before identities is claimed only where the store itself shows it is its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.main import run as cli_run
from ckptstore.errors import ForeignTierError
from ckptstore.tiers.identity import IDENTITY_NAME


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(n)), "b": torch.arange(n % 7 + 1)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def prefix_objects(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


@pytest.fixture
def run_a(s3_bucket: str, s3_options: dict[str, Any], tmp_path: Path) -> tuple[str, str]:
    """Run A: steps 100 (durable) and 101 (local only) at ``local=L``, closed."""
    uri, local = f"s3://{s3_bucket}/runA", str(tmp_path / "L")
    with CheckpointStore(uri, storage_options=s3_options, local=local) as a:
        a.save(100, state(100), persist=True)
        a.save(101, state(101))
        a.wait()
    return uri, local


def test_another_store_at_the_same_local_path_is_refused_naming_both(
    run_a: tuple[str, str], s3_bucket: str, s3_client: Any, s3_options: dict[str, Any]
) -> None:
    uri_a, local = run_a
    uri_b = f"s3://{s3_bucket}/runB"
    with pytest.raises(ForeignTierError) as raised:
        CheckpointStore(uri_b, storage_options=s3_options, local=local)
    message = str(raised.value)
    assert uri_a in message and uri_b in message and local in message
    assert "directory of its own" in message  # the fix
    assert raised.value.uri == local
    assert prefix_objects(s3_client, s3_bucket, "runB/") == []  # nothing of A reached B


def test_a_killed_run_pinned_step_never_reaches_the_next_run(
    s3_bucket: str, s3_client: Any, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """A dies with step 100 due but not yet copied (pinned in its local tier): B, opened at
    the same path, is refused before it could persist A's step into its own prefix."""
    local = str(tmp_path / "L")
    a = CheckpointStore(f"s3://{s3_bucket}/runA", storage_options=s3_options, local=local,
                        persist_every=1000)  # fmt: skip
    a.save(100, state(100), persist=True)  # due: A would copy it...
    a.save(101, state(101))
    # ... A is killed here (no close); B starts on the same node
    with pytest.raises(ForeignTierError):
        CheckpointStore(f"s3://{s3_bucket}/runB", storage_options=s3_options, local=local)
    a.close()
    assert prefix_objects(s3_client, s3_bucket, "runB/") == []


def test_the_same_run_opens_its_directory_again_from_any_process(
    run_a: tuple[str, str], s3_options: dict[str, Any]
) -> None:
    uri, local = run_a
    with CheckpointStore(uri, storage_options=s3_options, local=local) as again:
        assert again.latest().step == 101
        assert same(again.load(), state(101))
        node = again.node
        # a second process of the same run on this node (a participant: no lease)
        with CheckpointStore(uri, storage_options=s3_options, local=local, lease=False) as rank1:
            assert rank1.node == node  # one node id per directory, whoever opens it
            assert same(rank1.load(100), state(100))
        again.save(102, state(102))
    assert node is not None


def test_the_cli_with_local_is_refused_for_another_store(
    run_a: tuple[str, str],
    s3_bucket: str,
    s3_options: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    uri_a, local = run_a
    endpoint = ["--endpoint-url", s3_options["endpoint_url"]]
    assert cli_run([*endpoint, "ls", uri_a, "--local", local]) == 0
    assert "101" in capsys.readouterr().out
    assert cli_run([*endpoint, "ls", f"s3://{s3_bucket}/runB", "--local", local]) != 0
    err = capsys.readouterr().err
    assert uri_a in err and f"s3://{s3_bucket}/runB" in err


# -- directories from before identities ---------------------------------------------------


def forget_identity(local: str) -> None:
    """What a local tier written before identities looks like: steps, no tier.json."""
    Path(local, IDENTITY_NAME).unlink()


def test_an_old_directory_whose_steps_the_store_holds_is_claimed(
    run_a: tuple[str, str], s3_options: dict[str, Any]
) -> None:
    """An upgrade: A's directory, from before identities, holds step 100 that A's store
    holds too (the same commit): it is A's, and A opens it as before."""
    uri, local = run_a
    forget_identity(local)
    with CheckpointStore(uri, storage_options=s3_options, local=local) as a:
        assert a.latest().step == 101
        assert same(a.load(), state(101))
    assert uri in Path(local, IDENTITY_NAME).read_text()


def test_an_old_directory_of_another_run_is_refused(
    run_a: tuple[str, str], s3_bucket: str, s3_client: Any, s3_options: dict[str, Any]
) -> None:
    """No step of the directory is in B's store: it may be any run's, so B is refused (it
    would otherwise resume from A's 101), with the steps it holds and the fix."""
    _, local = run_a
    forget_identity(local)
    uri_b = f"s3://{s3_bucket}/runB"
    with pytest.raises(ForeignTierError) as raised:
        CheckpointStore(uri_b, storage_options=s3_options, local=local)
    message = str(raised.value)
    assert uri_b in message and local in message and "100, 101" in message
    assert not Path(local, IDENTITY_NAME).exists()  # left as it was
    assert prefix_objects(s3_client, s3_bucket, "runB/") == []


def test_an_old_directory_without_steps_is_claimed(
    s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    local = tmp_path / "L"
    (local / "global_step_5" / ".attempt-0123").mkdir(parents=True)  # leftovers, no commit
    with CheckpointStore(s3_uri, storage_options=s3_options, local=str(local)) as store:
        store.save(1, state(1))
    assert s3_uri in (local / IDENTITY_NAME).read_text()
