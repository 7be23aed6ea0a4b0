"""Bad input gets a clear error and loses nothing.

Each row does one wrong thing to a store holding two committed steps, asserts the error class
and the words of its message, then checks that every committed step (but the one a row damages
on purpose) is byte-for-byte what it was and still loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.domain.layout import manifest_path
from ckptstore.errors import (
    AccessDeniedError,
    CheckpointError,
    CompatibilityError,
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    SerializationError,
)
from keys import file_key


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((8, 8), float(step)), "step": step}


def snapshot(store: CheckpointStore, skip: int | None = None) -> dict[str, bytes]:
    """Every object of every committed step (but ``skip``), by path."""
    objects = {}
    for info in store.list():
        if info.step == skip:
            continue
        for obj in store.backend.list(f"global_step_{info.step}/"):
            objects[obj.path] = store.backend.read(obj.path)
    return objects


def rewrite_manifest(
    store: CheckpointStore, step: int, edit: Callable[[dict[str, Any]], Any]
) -> None:
    body = json.loads(store.backend.read(manifest_path(step)))
    edit(body)
    store.backend.delete([manifest_path(step)])
    store.backend.create(manifest_path(step), json.dumps(body).encode())


@dataclass
class Case:
    name: str
    action: Callable[[CheckpointStore, Path], Any]
    error: type[CheckpointError]
    message: str
    damages: int | None = None  # the step the row breaks on purpose
    resumes_at: int | type[Exception] = 2  # what a fresh ``load()`` then gives


def _flip(store: CheckpointStore, step: int) -> None:
    path = file_key(store, step, "w-00000.safetensors")
    data = bytearray(store.backend.read(path))
    data[-1] ^= 0xFF
    store.backend.write(path, [bytes(data)])


def _corrupt_manifest(store: CheckpointStore, data: bytes) -> None:
    store.backend.delete([manifest_path(2)])
    store.backend.create(manifest_path(2), data)


CASES = [
    Case("malformed URI", lambda s, t: CheckpointStore("bad:uri/x"), ConfigError, "malformed"),
    Case("empty URI", lambda s, t: CheckpointStore(""), ConfigError, "non-empty string"),
    Case(
        "unknown scheme",
        lambda s, t: CheckpointStore("nope://b/x"),
        ConfigError,
        "unknown URI scheme 'nope'",
    ),
    Case(
        "local store with storage options",
        lambda s, t: CheckpointStore(str(t), storage_options={"endpoint_url": "x"}),
        ConfigError,
        "take no storage options",
    ),
    Case("negative step", lambda s, t: s.save(-1, {}), ConfigError, "non-negative integer"),
    Case("float step", lambda s, t: s.load(1.5), ConfigError, "non-negative integer"),  # type: ignore[arg-type]
    Case("text step", lambda s, t: s.pin("abc"), ConfigError, "non-negative integer"),  # type: ignore[arg-type]
    Case("step not found", lambda s, t: s.load(99), NotFoundError, "step 99 is not committed"),
    Case(
        "pull of a missing step",
        lambda s, t: s.pull_dir(t / "out", 99),
        NotFoundError,
        "step 99 is not committed",
    ),
    Case(
        "empty store",
        lambda s, t: CheckpointStore(str(t / "empty")).load(),
        NotFoundError,
        "holds no committed step",
    ),
    Case(
        "committing a step twice",
        lambda s, t: s.save(2, state_for(3)),
        CheckpointError,
        "already committed",
    ),
    Case(
        "unsupported object",
        lambda s, t: s.save(3, {"x": object()}),
        SerializationError,
        "state['x']: cannot save an object of type builtins.object",
    ),
    Case(
        "metadata that is not JSON",
        lambda s, t: s.save(3, {}, metadata={"t": torch.ones(1)}),
        ConfigError,
        "metadata must hold only JSON values",
    ),
    Case(
        "push of a missing directory",
        lambda s, t: s.push_dir(3, t / "nowhere"),
        ConfigError,
        "is not a directory",
    ),
    Case(
        "corrupt manifest",
        lambda s, t: (_corrupt_manifest(s, b'{"schema_version": 1, "st'), s.load(2)),
        CorruptCheckpointError,
        "corrupt or truncated",
        damages=2,
        resumes_at=1,
    ),
    Case(
        "truncated manifest",
        lambda s, t: (_corrupt_manifest(s, s.backend.read(manifest_path(2))[:-30]), s.load(2)),
        CorruptCheckpointError,
        "global_step_2/ckptstore.manifest.json",
        damages=2,
        resumes_at=1,
    ),
    Case(
        "manifest from a newer schema",
        lambda s, t: (rewrite_manifest(s, 2, lambda b: b.update(schema_version=9)), s.load(2)),
        CompatibilityError,
        "upgrade ckptstore",
        damages=2,
        resumes_at=CompatibilityError,
    ),
    Case(
        "checksum mismatch",
        lambda s, t: (_flip(s, 2), s.load(2)),
        CorruptCheckpointError,
        "w-00000.safetensors: checksum mismatch",
        damages=2,
        resumes_at=1,
    ),
    Case(
        "path traversal in a manifest",
        lambda s, t: (
            rewrite_manifest(s, 2, lambda b: b["files"][0].update(path="../../evil")),
            s.pull_dir(t / "out", 2),
        ),
        CorruptCheckpointError,
        "unsafe file path '../../evil'",
        damages=2,
        resumes_at=1,
    ),
    Case(
        "version mismatch under compat=strict",
        lambda s, t: (
            rewrite_manifest(s, 2, lambda b: b["environment"].update(torch="1.0.0")),
            CheckpointStore(s.uri, compat="strict").load(2),
        ),
        CompatibilityError,
        "torch 1.0.0 (written)",
        damages=2,
        resumes_at=2,
    ),
    Case(
        "unknown compat mode",
        lambda s, t: CheckpointStore(s.uri, compat="loose"),
        ConfigError,
        "compat must be one of strict, warn, ignore",
    ),
    Case(
        "bad retention",
        lambda s, t: CheckpointStore(s.uri, keep_last=0),
        ConfigError,
        "keep_last must be a positive integer",
    ),
    Case("prune without a policy", lambda s, t: s.prune(), ConfigError, "no retention policy"),
    Case(
        "rm of the latest step",
        lambda s, t: s.delete(2),
        CheckpointError,
        "step 2 (latest) cannot be deleted without force=True (CLI: --force)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_clearly_and_loses_nothing(case: Case, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.save(1, state_for(1))
    store.save(2, state_for(2))
    before = snapshot(store, skip=case.damages)
    with pytest.raises(case.error) as caught:
        case.action(store, tmp_path)
    assert case.message in str(caught.value)
    assert snapshot(store, skip=case.damages) == before
    fresh = CheckpointStore(str(tmp_path / "store"))
    assert fresh.load(1)["step"] == 1
    if isinstance(case.resumes_at, int):  # a damaged latest is skipped, never a restart at zero
        assert fresh.load()["step"] == case.resumes_at
    else:
        with pytest.raises(case.resumes_at):
            fresh.load()
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()


def test_bad_input_table_covers_what_users_get_wrong() -> None:
    assert len(CASES) >= 20


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_permission_denied_names_the_path_and_keeps_steps(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(str(root))
    store.save(1, state_for(1))
    before = snapshot(store)
    if os.geteuid() == 0:  # root ignores modes: save from a child without that power
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        root.chmod(0o555)
        code = (
            "import sys, torch\nfrom ckptstore import CheckpointStore, AccessDeniedError\n"
            f"store = CheckpointStore({str(root)!r}, lease=False)\n"
            "try:\n    store.save(2, {'w': torch.ones(2)})\n"
            "except AccessDeniedError as e:\n    print(e); sys.exit(42)\n"
        )
        drop = "--bounding-set=-dac_override,-dac_read_search"
        out = subprocess.run(
            [setpriv, drop, sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        root.chmod(0o755)
        assert out.returncode == 42, out.stderr
        message = out.stdout
    else:
        root.chmod(0o555)
        try:
            with pytest.raises(AccessDeniedError) as caught:
                store.save(2, state_for(2))
            message = str(caught.value)
        finally:
            root.chmod(0o755)
    assert "permission denied" in message and str(root) in message
    assert snapshot(store) == before
    assert [i.step for i in store.list()] == [1]
