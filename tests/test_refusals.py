"""Only an empty store means "start fresh" (invariant 14): a resume from a store whose steps all
fail raises, saying how many steps were refused and why; and one key, written the same way,
is the same key in the variable and in the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, CorruptCheckpointError, UntrustedCheckpointError
from ckptstore.config import SIGNING_KEY, SIGNING_KEY_FILE, signing_key_from_env
from ckptstore.integrations.training_state import resume

HEX_KEY = "3f" * 32  # what `openssl rand -hex 32` prints


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def saved_by_callback(uri: str, steps: list[int], **options: object) -> None:
    from ckptstore.integrations.training_state import training_state

    model, optimizer = model_and_optimizer()
    with CheckpointStore(uri, **options) as store:  # type: ignore[arg-type]
        for step in steps:
            store.save(step, training_state(model, optimizer))


def test_an_empty_store_resumes_from_step_0(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    with CheckpointStore(str(tmp_path / "empty")) as store:
        assert resume(store, model, optimizer) == 0


def test_a_store_signed_with_another_key_refuses_to_resume(tmp_path: Path) -> None:
    uri = str(tmp_path / "run")
    saved_by_callback(uri, [1, 2, 3], signing_key="a" * 64)
    model, optimizer = model_and_optimizer()
    with CheckpointStore(uri, signing_key="b" * 64) as store:
        for attempt in (lambda: resume(store, model, optimizer), store.load, store.latest):
            with pytest.raises(UntrustedCheckpointError) as caught:
                attempt()
            assert "3 steps refused: the manifest is signed with another key" in str(caught.value)
            assert "steps 1, 2, 3" in str(caught.value)


def test_a_store_whose_every_manifest_is_corrupt_refuses_to_resume(tmp_path: Path) -> None:
    uri = tmp_path / "run"
    saved_by_callback(str(uri), [1, 2])
    for manifest in uri.glob("global_step_*/ckptstore.manifest.json"):
        manifest.write_bytes(manifest.read_bytes()[:-40])  # truncated
    model, optimizer = model_and_optimizer()
    with CheckpointStore(str(uri)) as store:
        with pytest.raises(CorruptCheckpointError, match="2 steps refused") as caught:
            resume(store, model, optimizer)
        assert "not valid JSON" in str(caught.value)


def test_a_store_with_one_good_step_left_resumes_from_it(tmp_path: Path) -> None:
    uri = tmp_path / "run"
    saved_by_callback(str(uri), [1, 2, 3])
    for step in (2, 3):
        path = uri / f"global_step_{step}" / "ckptstore.manifest.json"
        path.write_bytes(b"{")
    model, optimizer = model_and_optimizer()
    with CheckpointStore(str(uri)) as store:
        assert resume(store, model, optimizer) == 1


@pytest.mark.parametrize("text", [HEX_KEY, HEX_KEY + "\n", f"  {HEX_KEY.upper()}\n"])
def test_a_hex_key_is_the_same_key_in_the_variable_and_in_the_file(
    tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(text)
    from_file = signing_key_from_env({SIGNING_KEY_FILE: str(key_file)})
    from_variable = signing_key_from_env({SIGNING_KEY: text})
    assert from_file == from_variable == bytes.fromhex(HEX_KEY)
    monkeypatch.setenv(SIGNING_KEY, HEX_KEY)
    with CheckpointStore(str(tmp_path / "run")) as store:
        store.save(1, {"x": 1})
    monkeypatch.delenv(SIGNING_KEY)
    monkeypatch.setenv(SIGNING_KEY_FILE, str(key_file))
    with CheckpointStore(str(tmp_path / "run")) as store:
        assert store.load() == {"x": 1}


def test_a_key_file_of_raw_bytes_is_read_as_it_is(tmp_path: Path) -> None:
    raw = bytes(range(200, 232))  # not text: the key's bytes as they are
    key_file = tmp_path / "key"
    key_file.write_bytes(raw)
    assert signing_key_from_env({SIGNING_KEY_FILE: str(key_file)}) == raw
