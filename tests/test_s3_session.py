"""S3 clients share botocore's parsed models, and nothing else (backends/s3_session.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.loaders import JSONFileLoader

from ckptstore.backends.s3_options import S3Options
from ckptstore.backends.s3_session import new_session


def profile_file(path: Path, key: str) -> Path:
    path.write_text(
        f"[profile train]\naws_access_key_id = {key}\naws_secret_access_key = s\n"
        "region = us-east-1\n"
    )
    return path


def test_sessions_share_one_loader_and_read_their_own_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile file changed between two sessions is read anew by the second (config and
    credentials are per session); the models come from one loader, whose list of model
    directories does not grow with each session."""
    sessions, keys = [], []
    for name, key in (("one", "KEYONE"), ("two", "KEYTWO")):
        monkeypatch.setenv("AWS_CONFIG_FILE", str(profile_file(tmp_path / name, key)))
        sessions.append(new_session(profile_name="train"))
        keys.append(sessions[-1].get_credentials().access_key)  # type: ignore[union-attr]
    sessions.append(new_session(aws_access_key_id="KEYTHREE", aws_secret_access_key="s"))
    keys.append(sessions[-1].get_credentials().access_key)  # type: ignore[union-attr]
    assert keys == ["KEYONE", "KEYTWO", "KEYTHREE"]
    first = sessions[0]
    loaders = {id(s._session.get_component("data_loader")) for s in sessions}
    assert len(loaders) == 1
    paths = first._session.get_component("data_loader").search_paths
    assert len(paths) == len(set(paths))


def test_a_second_client_reads_no_model_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first client of a process reads and parses S3's model files; the next ones, with
    other credentials, read none (botocore's loader caches what it parsed, and is shared)."""
    options = S3Options.parse(
        "s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    )
    options.client("s3://bucket/run")  # whatever earlier tests left, the models are in now
    reads: list[str] = []
    load = JSONFileLoader.load_file

    def counted(self: JSONFileLoader, file_path: str) -> object:
        reads.append(file_path)
        return load(self, file_path)

    monkeypatch.setattr(JSONFileLoader, "load_file", counted)
    other = S3Options.parse(
        "s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9", "key": "k2", "secret": "s2"}
    )
    client = other.client("s3://bucket/run")
    assert reads == []
    assert client.meta.service_model.service_name == "s3"
