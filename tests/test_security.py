"""Signed manifests, and credentials that never leak into logs, errors, manifests or --json."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointError, CheckpointStore
from ckptstore.domain.layout import manifest_path
from ckptstore.errors import ConfigError, UntrustedCheckpointError

KEY = "9f2c" * 8
OTHER_KEY = "a1b2" * 8


def test_signed_steps_load_and_unsigned_or_foreign_ones_are_refused(
    store_uri: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    uri, options = store_uri
    signed = CheckpointStore(uri, storage_options=options, signing_key=KEY)
    signed.save(1, {"w": torch.ones(3), "step": 1})
    assert signed.info(1).manifest.signature is not None
    assert signed.info(1).manifest.signature.split(":")[1] == signed.signer.key_id  # type: ignore[union-attr]
    # a writer without the key (or with another) plants newer steps
    CheckpointStore(uri, storage_options=options, takeover=True).save(2, {"step": 2})
    CheckpointStore(uri, storage_options=options, signing_key=OTHER_KEY, takeover=True).save(
        3, {"step": 3}
    )
    reader = CheckpointStore(uri, storage_options=options, signing_key=KEY)
    with pytest.raises(UntrustedCheckpointError, match="not signed"):
        reader.load(2)
    with pytest.raises(UntrustedCheckpointError, match="signed with another key"):
        reader.load(3)
    with caplog.at_level(logging.WARNING):
        state = reader.load()  # resume skips what it cannot trust, loudly
    assert state["step"] == 1
    assert reader.latest().step == 1  # type: ignore[union-attr]
    assert [r.step for r in reader.verify_all() if not r.ok] == [2, 3]
    assert CheckpointStore(uri, storage_options=options).load()["step"] == 3  # no key: trusts all


def test_a_tampered_signed_manifest_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), signing_key=KEY)
    store.save(1, {"w": torch.ones(3)})
    path = tmp_path / manifest_path(1)
    body = json.loads(path.read_bytes())
    body["metadata"] = {"loss": 0.0}  # any change, even to metadata
    path.write_text(json.dumps(body))
    with pytest.raises(UntrustedCheckpointError, match="altered after signing"):
        store.load(1)


def test_signing_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"a-secret-key-of-some-length\n")
    monkeypatch.setenv("CKPTSTORE_SIGNING_KEY_FILE", str(key_file))
    store = CheckpointStore(str(tmp_path / "s"))
    assert store.signer is not None
    store.save(1, {"x": 1})
    monkeypatch.delenv("CKPTSTORE_SIGNING_KEY_FILE")
    monkeypatch.setenv("CKPTSTORE_SIGNING_KEY", "a-secret-key-of-some-length")
    assert CheckpointStore(str(tmp_path / "s")).load(1) == {"x": 1}
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        CheckpointStore(str(tmp_path / "s"), signing_key="short")


SECRET = "wJalrXUtnFEMI-K7MDENG-PLANTED-SECRET"


def test_credentials_never_leak(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"endpoint_url": s3_endpoint, "key": "AKIAPLANTED", "secret": SECRET}
    uri = f"s3://{s3_bucket}/run"
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        store = CheckpointStore(uri, storage_options=options)
        info = store.save(1, {"w": torch.ones(4)}, metadata={"note": "x"})
        seen += [repr(store), repr(store.backend), str(info), info.manifest.encode().decode()]
        seen.append(store.backend.read(manifest_path(1)).decode())
        failures: list[BaseException] = []
        for bad in (
            {**options, "endpoint_url": "http://127.0.0.1:9"},  # nothing listens there
            {**options, "part_size": 1},
            {**options, "bogus_option": 1},
        ):
            try:
                CheckpointStore(f"s3://{s3_bucket}/other", storage_options=bad).save(
                    2, {"w": torch.ones(1)}
                )
            except CheckpointError as e:
                failures.append(e)
        assert len(failures) == 3
        seen += [str(e) + repr(e) + str(e.__cause__) for e in failures]
    seen.append(caplog.text)
    cli = shutil.which("ckptstore", path=os.path.dirname(sys.executable))
    assert cli is not None
    for args in (["ls", uri], ["show", uri, "1"], ["verify", uri, "--all"]):
        out = subprocess.run(
            [
                cli,
                "--json",
                "-vv",
                "--endpoint-url",
                s3_endpoint,
                "-o",
                "key=AKIAPLANTED",
                "-o",
                f"secret={SECRET}",
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        json.loads(out.stdout)
        seen += [out.stdout, out.stderr]
    leaks = [text for text in seen if SECRET in text]
    assert not leaks, leaks[0][:500]
