"""What a new user's first hour with the command line found, each fixed and held here (the
command line runs in-process): a signed store verified without the key, what gc keeps and
why, step-directory URIs, the CLI's own option names, and warnings where an option would
silently do nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.main import run
from ckptstore.config import SIGNING_KEY
from ckptstore.data.payload import SourceFile

KEY = "5a" * 32


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def signed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "signed"
    monkeypatch.setenv(SIGNING_KEY, KEY)
    with CheckpointStore(str(root)) as store:
        store.save(1, {"w": torch.ones(4)}, metadata={"loss": 0.5})
    monkeypatch.delenv(SIGNING_KEY)
    return root


def test_verify_of_a_signed_store_without_the_key_says_so_and_exits_8(
    signed: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = signed / "global_step_1" / "ckptstore.manifest.json"
    body = json.loads(manifest.read_text())
    body["metadata"] = {"loss": 0.0}  # an edit only the signature can reveal
    manifest.write_text(json.dumps(body))
    code, out, err = cli(capsys, "verify", str(signed))
    assert code == 8, (out, err)
    assert "signed; signature not checked (no key)" in out
    code, out, _ = cli(capsys, "verify", str(signed), "--json")
    assert code == 8 and json.loads(out)["steps"][0]["signature"] == "not checked (no key)"
    code, out, err = cli(capsys, "show", str(signed), "1")
    assert code == 8 and "signed; not checked (no key)" in out and SIGNING_KEY in err
    monkeypatch.setenv(SIGNING_KEY, KEY)  # with the key, the edit is found
    code, _, err = cli(capsys, "verify", str(signed))
    assert code == 4 and "signature does not match its contents" in err


def test_verify_of_a_signed_store_with_the_key_is_a_plain_ok(
    signed: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SIGNING_KEY, KEY)
    code, out, _ = cli(capsys, "verify", str(signed), "--json")
    assert code == 0 and json.loads(out)["steps"][0]["signature"] == "checked"
    code, out, _ = cli(capsys, "show", str(signed), "1")
    assert code == 0 and "signed; checked" in out


def test_gc_shows_what_it_kept_and_why_and_what_is_foreign(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        store.save(1, {"w": torch.ones(4)})
        staged = store.stage_files(2, [SourceFile("in-flight.bin", lambda: [b"x"])])
        (root / "global_step_1" / "by-hand.txt").write_text("not ckptstore's")
        code, out, _ = cli(capsys, "gc", str(root))
        assert code == 0
        attempt = f"global_step_2/.attempt-{staged[0].attempt}"
        assert f"{attempt}: started under the writer lease held now (epoch 1)" in out
        assert "global_step_1/by-hand.txt" in out and "foreign" in out
        code, out, _ = cli(capsys, "gc", str(root), "--json")
        doc = json.loads(out)
        assert doc["kept"] == [{"path": attempt, "why": doc["kept"][0]["why"]}]
        assert "writer lease held now" in doc["kept"][0]["why"]
        assert doc["foreign"] == ["global_step_1/by-hand.txt"]
    code, out, _ = cli(capsys, "gc", str(root), "--older-than", "0", "--json")
    assert code == 0 and json.loads(out)["kept"] == []  # the lease was released at close


def test_pull_of_a_step_directory_names_the_pull_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        store.save(5, {"w": torch.ones(4)})
    dest = tmp_path / "out"
    code, _, err = cli(capsys, "pull", str(root / "global_step_5"), str(dest))
    assert code == 2
    assert f"run: ckptstore pull {root} {dest} 5" in err and "ckptstore show" not in err


def test_the_python_api_refuses_a_step_directory_as_a_store(tmp_path: Path) -> None:
    from ckptstore import ConfigError

    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        store.save(5, {"w": torch.ones(4)})
    with pytest.raises(ConfigError, match=r"global_step_5 is the directory of committed step 5"):
        CheckpointStore(str(root / "global_step_5")).save(1, {"x": 1})
    assert not (root / "global_step_5" / "latest.json").exists()
    assert not (root / "global_step_5" / "global_step_1").exists()


def test_an_older_push_names_the_cli_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        store.save(5, {"w": torch.ones(4)})
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    (folder / "data.pt").write_bytes(b"x")
    code, _, err = cli(capsys, "push", str(folder), str(root), "3")
    assert code == 5 and "--allow-older" in err


def test_ls_sort_by_a_metric_no_step_has_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        for step in (1, 2):
            store.save(step, {"w": torch.ones(4)}, metadata={"val_loss": 1.0 / step})
    code, _, err = cli(capsys, "ls", str(root), "--sort", "val_los")
    assert code == 0 and "no step has a number for 'val_los'" in err and "val_loss" in err
    code, _, err = cli(capsys, "ls", str(root), "--sort", "val_loss")
    assert code == 0 and "warning" not in err


def test_keep_best_by_a_metric_no_step_has_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.ones(4)}, metadata={"val_loss": 1.0 / step})
    options: dict[str, Any] = {"keep_best": 1, "best_metric": "val_los", "best_mode": "min"}
    with caplog.at_level(logging.WARNING), CheckpointStore(str(root), **options) as store:
        assert store.prune() == []
    assert "no step has a number for it" in caplog.text and "val_loss" in caplog.text


def test_a_lone_include_warns_that_it_selects_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with CheckpointStore(str(root)) as store:
        store.save(5, {"w": torch.ones(4)})
    with caplog.at_level(logging.WARNING):  # the CLI prints warnings on stderr; here, caught
        code, _, _ = cli(capsys, "pull", str(root), str(tmp_path / "out"), "--include", "*.j")
    assert code == 0 and "selects every file" in caplog.text and "--exclude '*'" in caplog.text
