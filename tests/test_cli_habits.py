"""The CLI as aws CLI users expect it: ``latest`` for a step, ``--profile``/``--region``, ``rm`` of
several steps, ``diff``, ``ls`` of a bucket, JSON errors, torch-free start-up, completion.

Most commands run in-process through :func:`ckptstore.cli.main.run` (fast; stdout and stderr
captured apart); start-up (no torch import) and shell completion run the real command in a
subprocess, as a shell would. Stores are made through the Python API, and checked through it
after each command that changes them, never through the command under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.cli import commands, common, discover
from ckptstore.cli.format import human_size, plural
from ckptstore.cli.main import cli, run

# -- helpers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def error_line(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.startswith("ckptstore: error: ")]
        assert len(lines) == 1, self.err
        return lines[0]


@pytest.fixture
def ck(capsys: pytest.CaptureFixture[str]) -> Any:
    """``ck(*args)``: run the command line in-process, stdout and stderr apart."""

    def call(*args: str) -> Result:
        capsys.readouterr()
        code = run(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return call


@dataclass(frozen=True)
class Where:
    """A store location: its URI, the CLI options that reach it, the same as storage_options."""

    uri: str
    args: tuple[str, ...]
    options: dict[str, Any]

    def store(self, uri: str | None = None) -> CheckpointStore:
        return CheckpointStore(uri or self.uri, storage_options=self.options)

    def steps(self) -> list[int]:
        with self.store() as s:
            return [i.step for i in s.list()]


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    if request.param == "local":
        return Where(str(tmp_path / "run"), (), {})
    options = request.getfixturevalue("s3_options")
    uri = request.getfixturevalue("s3_uri")
    return Where(uri, ("--endpoint-url", options["endpoint_url"]), options)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "frozen": torch.arange(256), "step": step}


@pytest.fixture
def three(where: Where) -> Where:
    """Steps 10, 20, 30 (latest), each with a loss."""
    with where.store() as s:
        for step in (10, 20, 30):
            s.save(step, _state(step), {"loss": 1 / step})
    return where


# -- 1. latest wherever a STEP is ------------------------------------------------------------


def test_latest_and_step_dir_names_are_steps_in_every_command(ck: Any, three: Where) -> None:
    uri, o = three.uri, three.args
    assert ck("show", uri, "latest", "--json", *o).json()["manifest"]["step"] == 30
    assert ck("show", uri, "global_step_20", "--json", *o).json()["manifest"]["step"] == 20
    assert ck("verify", uri, "LATEST", *o).out == "step 30: OK\n"
    assert ck("pin", uri, "latest", "--json", *o).json()["step"] == 30
    with three.store() as s:
        assert s.pins() == [30]
    assert ck("unpin", uri, "latest", "--json", *o).json() == {
        "uri": uri,
        "step": 30,
        "pinned": False,
        "changed": True,
    }
    refused = ck("rm", uri, "latest", *o)
    assert refused.code == 5 and "30 (latest)" in refused.error_line()
    assert ck("rm", uri, "latest", "--force", "--json", *o).json()["latest"] == 20
    assert three.steps() == [10, 20]
    assert ck("show", uri, "--json", *o).json()["manifest"]["step"] == 20  # default: latest


def test_latest_in_an_empty_store_is_not_found(ck: Any, tmp_path: Path) -> None:
    done = ck("pin", str(tmp_path / "empty"), "latest")
    assert done.code == 3 and "holds no committed step" in done.error_line()


def test_step_is_positional_in_every_store_command() -> None:
    for command in [*commands.COMMANDS, cli.commands["diff"]]:
        for param in command.params:
            if param.name in ("step", "steps", "a", "b"):
                assert isinstance(param, click.Argument), (command.name, param.name)
                assert param.type is common.STEP


# -- 2. --profile and --region ---------------------------------------------------------------


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[CheckpointStore]:
    """The stores the CLI opens, kept so a test can look at their backend afterwards."""
    stores: list[CheckpointStore] = []

    class Recording(CheckpointStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            stores.append(self)

    monkeypatch.setattr(common, "CheckpointStore", Recording)
    return stores


def _region(store: CheckpointStore) -> str:
    return str(store.backend.client.meta.region_name)  # type: ignore[attr-defined]


def test_region_reaches_the_s3_client_before_or_after_the_command(
    ck: Any, s3_uri: str, s3_endpoint: str, opened: list[CheckpointStore]
) -> None:
    with CheckpointStore(s3_uri, storage_options={"endpoint_url": s3_endpoint}) as s:
        s.save(1, _state(1))
    done = ck("ls", s3_uri, "--endpoint-url", s3_endpoint, "--region", "eu-west-1", "--json")
    assert done.code == 0, done.err
    assert done.json()["latest"] == 1
    done = ck("--region", "ap-south-1", "show", s3_uri, "1", "--endpoint-url", s3_endpoint)
    assert done.code == 0, done.err
    assert [_region(s) for s in opened] == ["eu-west-1", "ap-south-1"]


def test_profile_picks_the_named_profile_and_an_unknown_one_says_how_to_fix_it(
    ck: Any,
    s3_uri: str,
    s3_endpoint: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    opened: list[CheckpointStore],
) -> None:
    config = tmp_path / "aws-config"
    config.write_text(  # an explicit profile takes its credentials from its own section
        "[profile trainer]\nregion = eu-central-1\n"
        "aws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_DEFAULT_REGION")  # it would win over the profile's region
    with CheckpointStore(s3_uri, storage_options={"endpoint_url": s3_endpoint}) as s:
        s.save(1, _state(1))
    done = ck("ls", s3_uri, "--profile", "trainer", "--endpoint-url", s3_endpoint)
    assert done.code == 0, done.err
    assert _region(opened[-1]) == "eu-central-1"

    done = ck("ls", s3_uri, "--profile", "no-such-profile", "--endpoint-url", s3_endpoint)
    assert done.code == 2 and done.out == ""
    line = done.error_line()
    assert "'no-such-profile'" in line and "aws configure --profile no-such-profile" in line


# -- 3. rm of several steps ------------------------------------------------------------------


def test_rm_deletes_several_steps_or_none(ck: Any, where: Where) -> None:
    with where.store() as s:
        for step in (1, 2, 3, 4, 5):
            s.save(step, _state(step))
        s.pin(2)
    uri, o = where.uri, where.args
    cases = [
        (("1", "3", "99"), 3, "step 99 is not committed"),  # unknown: refuses the rest too
        (("1", "2"), 5, "2 (pinned)"),
        (("1", "5", "2"), 5, "steps 2 (pinned), 5 (latest)"),
    ]
    for steps, code, needle in cases:
        done = ck("rm", uri, *steps, *o)
        assert done.code == code, (steps, done.err)
        assert needle in done.error_line() and "nothing was deleted" in done.error_line()
        assert where.steps() == [1, 2, 3, 4, 5]

    doc = ck("rm", uri, "3", "latest", "1", "--force", "--dry-run", "--json", *o).json()
    assert doc == {"uri": uri, "dry_run": True, "deleted": [1, 3, 5], "latest": 4}
    assert where.steps() == [1, 2, 3, 4, 5]
    assert ck("rm", uri, "1", "3", *o).out == "deleted steps 1, 3; latest is now 5\n"
    assert where.steps() == [2, 4, 5]
    doc = ck("rm", uri, "2", "5", "--force", "--json", *o).json()
    assert doc == {"uri": uri, "dry_run": False, "deleted": [2, 5], "latest": 4}
    assert where.steps() == [4]
    with where.store() as s:
        latest = s.latest()
        assert latest is not None and latest.step == 4 and s.pins() == []


def test_rm_without_a_step_is_a_usage_error(ck: Any, tmp_path: Path) -> None:
    done = ck("rm", str(tmp_path))
    assert done.code == 2 and done.out == "" and "STEP" in done.err


# -- 4. diff ---------------------------------------------------------------------------------


def test_diff_classifies_files_copies_and_metadata(ck: Any, where: Where) -> None:
    big = torch.arange(4096, dtype=torch.float32)
    with where.store() as s:
        s.save(1, {"w": torch.zeros(8), "frozen": big, "old": torch.ones(2)}, {"loss": 0.5})
        s.save(
            2, {"w": torch.ones(8), "frozen": big, "new": torch.ones(3)}, {"loss": 0.25, "lr": 1}
        )
    doc = ck("diff", where.uri, "1", "latest", "--json", *where.args).json()
    files = doc["files"]
    assert doc["a"]["step"] == 1 and doc["b"]["step"] == 2 and doc["identical"] is False
    assert [f["path"] for f in files["added"]] == ["new-00000.safetensors"]
    assert [f["path"] for f in files["removed"]] == ["old-00000.safetensors"]
    changed = {f["path"] for f in files["changed"]}
    assert "w-00000.safetensors" in changed and "state.json" in changed  # the skeleton too
    same = {f["path"]: f for f in files["identical"]}
    assert same["frozen-00000.safetensors"]["copied_from"] == 1  # the save copied it
    frozen = same["frozen-00000.safetensors"]
    assert frozen["size_a"] == frozen["size_b"] > big.numel() * 4  # tensor bytes and a header
    assert doc["metadata"] == {"loss": {"a": 0.5, "b": 0.25}, "lr": {"b": 1}}
    assert doc["environment"] == {}

    text = ck("diff", where.uri, "global_step_1", "2", *where.args).out
    rows = {line.split()[1]: line.split()[0] for line in text.splitlines() if "safetensors" in line}
    assert rows == {
        "w-00000.safetensors": "M",
        "new-00000.safetensors": "A",
        "old-00000.safetensors": "D",
        "frozen-00000.safetensors": "=",
    }
    assert "copied from step 1" in text and human_size(frozen["size_b"]) in text
    assert "lr: (absent) -> 1" in text and "loss: 0.5 -> 0.25" in text

    same_step = ck("diff", where.uri, "2", "2", "--json", *where.args).json()
    assert same_step["identical"] is True and same_step["metadata"] == {}
    missing = ck("diff", where.uri, "1", "7", *where.args)
    assert missing.code == 3 and "step 7" in missing.error_line()


# -- 5. ls of a URI that is not a store ------------------------------------------------------


def _make_tree(where: Where) -> None:
    """Stores at team/a (2 steps), b (1 step), and x/y/z/deep (below the search depth)."""
    for path, steps in [("team/a", (1, 2)), ("b", (7,)), ("x/y/z/deep", (3,))]:
        with where.store(f"{where.uri}/{path}") as s:
            for step in steps:
                s.save(step, _state(step))


def test_ls_of_a_parent_lists_the_stores_below_it(ck: Any, where: Where) -> None:
    _make_tree(where)
    doc = ck("ls", where.uri, "--json", *where.args).json()
    found = {s["uri"].removeprefix(where.uri + "/"): s for s in doc["stores"]}
    assert set(found) == {"b", "team/a"}  # x/y/z/deep is 4 levels down
    assert found["team/a"]["latest"] == 2 and found["team/a"]["steps"] == 2
    assert found["b"]["latest"] == 7 and found["b"]["size"] > 1024
    assert doc["steps"] == [] and doc["search"] == {"depth": 3, "truncated": True}

    text = ck("ls", where.uri, *where.args).out
    assert "2 stores below it (searched 3 levels down; the search was cut short" in text
    assert "total: 2 stores, 3 steps" in text and "ckptstore ls STORE" in text
    deeper = ck("ls", f"{where.uri}/x", "--json", *where.args).json()
    assert [s["uri"] for s in deeper["stores"]] == [f"{where.uri}/x/y/z/deep"]


def test_ls_of_a_bucket_root(ck: Any, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    with CheckpointStore(f"s3://{s3_bucket}/runs/r1", storage_options=s3_options) as s:
        s.save(5, _state(5))
    done = ck("ls", f"s3://{s3_bucket}/", "--endpoint-url", s3_options["endpoint_url"])
    assert done.code == 0, done.err
    assert f"s3://{s3_bucket}/runs/r1" in done.out and "1 store below it" in done.out


def test_ls_of_nothing_still_exits_3(ck: Any, where: Where) -> None:
    done = ck("ls", where.uri, "--json", *where.args)
    assert done.code == 3
    doc = done.json()  # one document: what ls found (nothing) and the error
    assert doc["steps"] == [] and doc["stores"] == []
    assert doc["error"]["type"] == "NotFoundError" and doc["error"]["exit_code"] == 3


def test_a_step_directory_uri_names_its_store_and_the_command(ck: Any, three: Where) -> None:
    step_uri = f"{three.uri}/global_step_20"
    for command, expected in [
        ("ls", f"ckptstore show {three.uri} 20"),
        ("show", f"ckptstore show {three.uri} 20"),
        ("verify", f"ckptstore verify {three.uri} 20"),
        ("gc", f"ckptstore show {three.uri} 20"),
    ]:
        done = ck(command, step_uri, *three.args)
        assert done.code == 2 and done.out == "", (command, done.err)
        assert expected in done.error_line(), command
    assert three.steps() == [10, 20, 30]


def test_an_uncommitted_step_directory_gets_the_hint_in_the_not_found_error(
    ck: Any, tmp_path: Path
) -> None:
    raw = tmp_path / "ckpts" / "global_step_5"  # e.g. verl's own directory, not a store
    (raw / "actor").mkdir(parents=True)
    done = ck("ls", str(raw))
    assert done.code == 3
    assert f"its store is {tmp_path / 'ckpts'}; run: ckptstore show" in done.error_line()


def test_the_search_is_bounded_in_depth_and_listings(tmp_path: Path) -> None:
    for path in ("a/s1/global_step_1", "b/c/s2/.ckptstore", "d/e/f/g/s3/global_step_1"):
        (tmp_path / path).mkdir(parents=True)
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "latest.json").write_text("{}")
    backend = LocalBackend(str(tmp_path), {})
    full = discover.find_stores(backend, depth=9)
    assert full == discover.StoresFound(("h", "a/s1", "b/c/s2", "d/e/f/g/s3"), False)
    assert discover.find_stores(backend, depth=3) == discover.StoresFound(
        ("h", "a/s1", "b/c/s2"), True
    )
    cut = discover.find_stores(backend, depth=9, max_listings=3)
    assert cut.truncated and len(cut.found) < 4


# -- 6. --json errors ------------------------------------------------------------------------


def test_json_errors_are_the_only_stdout(ck: Any, three: Where) -> None:
    done = ck("show", three.uri, "99", "--json", *three.args)
    assert done.code == 3
    error = done.json()["error"]
    assert set(done.json()) == {"error"}
    assert error["type"] == "NotFoundError" and error["exit_code"] == 3 and error["step"] == 99
    assert error["uri"].startswith(three.uri) and "step 99" in error["message"]
    assert "step 99" in done.error_line()  # and the usual line on stderr

    done = ck("--json", "rm", three.uri, "30", *three.args)
    assert done.code == 5
    assert done.json()["error"]["type"] == "ConflictError" and done.json()["error"]["step"] == 30

    for args in (["show", three.uri, "abc", "--json"], ["--json", "ls"], ["ls", "--json", "x:y"]):
        done = ck(*args)
        assert done.code == 2, args
        assert done.json()["error"]["exit_code"] == 2, args

    plain = ck("show", three.uri, "99", *three.args)
    assert plain.code == 3 and plain.out == ""


# -- 7. start-up without torch ---------------------------------------------------------------

_NO_TORCH = textwrap.dedent(
    """
    import sys
    from ckptstore.cli.main import run
    for args in ({commands}):
        code = run(list(args))
        assert code == 0, (args, code)
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, loaded[:5]
    """
)


def test_file_commands_start_without_importing_torch(three: Where, tmp_path: Path) -> None:
    uri, o = three.uri, list(three.args)
    command_lines = [
        ["ls", uri, *o],
        ["show", uri, *o],
        ["show", uri, "10", "--json", *o],
        ["verify", uri, "latest", *o],
        ["diff", uri, "10", "latest", *o],
        ["ls", str(Path(uri).parent) if not o else uri, *o],
        ["--help"],
    ]
    script = _NO_TORCH.format(commands=", ".join(repr(tuple(c)) for c in command_lines))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


# -- 8. units and plurals --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "expected"), [(0, "0 files"), (1, "1 file"), (2, "2 files"), (1_000, "1000 files")]
)
def test_plural(n: int, expected: str) -> None:
    assert plural(n, "file") == expected


def test_plural_irregular_and_binary_sizes() -> None:
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries").endswith(
        "entries"
    )
    assert [human_size(n) for n in (0, 1023, 1024, 3 << 20, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


def test_messages_use_singulars_and_binary_units(ck: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "one")
    with CheckpointStore(uri) as s:
        s.save(1, {"w": torch.zeros(1 << 18)})  # 1 MiB of tensor
    attempt = Path(uri, "global_step_2", ".attempt-0123456789abcdef")
    attempt.mkdir(parents=True)
    (attempt / ".ckptstore-attempt.json").write_text('{"lease_epoch": 0}')
    out = ck("gc", uri, "--older-than", "0", "--dry-run").out
    assert out.startswith("would remove 1 object and 0 uploads")
    text = ck("ls", uri).out
    assert "total: 1 step, 1.0 MiB" in text
    assert " MB" not in text and " GB" not in text
    assert "in 2 files" in ck("show", uri).out


# -- 9. each command's --help shows what acts there ------------------------------------------


def test_help_shows_only_the_options_that_apply(ck: Any, tmp_path: Path) -> None:
    helps = {name: ck(name, "--help").out for name in ("ls", "show", "diff", "rm", "demo", "prune")}
    group = ck("--help").out
    for option in ("--profile", "--region", "--endpoint-url", "--compat", "--json"):
        assert option in group, option
    for name in ("ls", "show", "diff", "rm", "prune"):
        assert "--profile" in helps[name] and "--region" in helps[name]
        assert "--compat" not in helps[name], name
    assert "--keep-last" in helps["ls"] and "--keep-last" in helps["prune"]
    for name in ("show", "diff", "rm"):
        assert "--keep-last" not in helps[name] and "--best-metric" not in helps[name]
    assert "--compat" in helps["demo"] and "--json" not in helps["demo"]
    assert "--dry-run" in helps["rm"] and "STEP..." in helps["rm"]
    # hidden is still accepted, before and after the command (scripts keep working)
    with CheckpointStore(str(tmp_path / "s")) as s:
        s.save(1, _state(1))
    assert ck("ls", str(tmp_path / "s"), "--compat", "strict").code == 0
    assert ck("--compat", "ignore", "ls", str(tmp_path / "s")).code == 0


# -- 10. shell completion --------------------------------------------------------------------


def _complete(words: str, cword: int) -> list[str]:
    env = {
        **os.environ,
        "_CKPTSTORE_COMPLETE": "bash_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": str(cword),
    }
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line.split(",", 1)[1] for line in done.stdout.splitlines()]


def test_shell_completion_names_commands_options_and_latest() -> None:
    names = _complete("ckptstore ", 1)
    assert {"ls", "show", "verify", "diff", "rm", "pin", "prune", "gc", "push", "pull"} <= set(
        names
    )
    assert _complete("ckptstore ls --pro", 2) == ["--profile"]
    assert "latest" in _complete("ckptstore show s3://b/run la", 3)
    script = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli"],
        capture_output=True,
        text=True,
        env={**os.environ, "_CKPTSTORE_COMPLETE": "bash_source"},
        timeout=60,
        check=False,
    )
    assert "_ckptstore_completion" in script.stdout and "complete " in script.stdout
