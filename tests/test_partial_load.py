"""Partial loads: ``load(keys=[...])`` returns the selected parts and reads only their files.

A backend proxy records every object read, so each test proves which files a load touched, not
only what it returned. The manifest's ``files_by_key`` index is covered by signatures, and
manifests without it (schema 1 fixtures, schema 2) still load partially from the skeleton.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend, ObjectInfo
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.proxy import BackendProxy
from ckptstore.backends.registry import open_backend
from ckptstore.data.serialize import PICKLE_FILE, SKELETON_FILE
from ckptstore.domain.layout import LATEST_NAME, MANIFEST_NAME, META_DIR, manifest_path, step_dir
from ckptstore.errors import (
    ConfigError,
    NotFoundError,
    UnsafeLoadError,
    UntrustedCheckpointError,
)
from keys import file_key

FIXTURES = Path(__file__).parent / "fixtures"
KEY = b"partial-load-test-signing-key-0123"
SHARD = 256
"""Tensor bytes per shard: the model and optimizer below span several files each."""


class Recording(BackendProxy):
    """Records the path of every object read (payload, manifest, pointer) and every listing."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.reads: list[str] = []
        self.listings = 0

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self.reads.append(path)
        return super().read(path, start, end)

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        self.reads.append(path)
        return super().read_versioned(path)

    def read_into(self, path: str, out: memoryview) -> int:
        self.reads.append(path)
        return super().read_into(path, out)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        self.reads.append(path)
        return super().read_into_chunks(path, out, on_chunk)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.listings += 1
        return super().list(prefix)

    def payload_read(self) -> set[str]:
        """The payload files read since the last call, by their path in the step (the pointer,
        manifests and the store's own records, such as the step index, are not payload)."""
        names = {
            p.rsplit("/", 1)[-1]
            for p in self.reads
            if p != LATEST_NAME
            and not p.endswith("/" + MANIFEST_NAME)
            and not p.startswith(META_DIR + "/")
        }
        self.reads, self.listings = [], 0
        return names


def make_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "encoder": {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)},
            "decoder": {"w": torch.randn(8, 8, generator=gen)},
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(8, 8, generator=gen)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "step": 7 + seed,
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def open_recorded(uri: str, **options: Any) -> tuple[CheckpointStore, Recording]:
    backend = Recording(LocalBackend(uri, {}))
    return CheckpointStore(uri, backend=backend, shard_size=SHARD, **options), backend


def files_of(store: CheckpointStore, step: int, prefix: str) -> set[str]:
    return {f.path for f in store.info(step).files if f.path.startswith(prefix)}


def corrupt(store: CheckpointStore, root: Path, step: int, path: str) -> None:
    target = root / file_key(store, step, path)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # a tensor byte, so the header still parses: only the checksum tells
    target.write_bytes(bytes(data))


def rewrite_manifest(root: Path, step: int, edit: Any) -> None:
    path = root / manifest_path(step)
    body = json.loads(path.read_bytes())
    edit(body)
    path.write_text(json.dumps(body))


def test_keys_model_returns_the_model_and_never_reads_the_optimizer(tmp_path: Path) -> None:
    store, backend = open_recorded(str(tmp_path))
    state = make_state()
    info = store.save(1, state)
    model_files, optimizer_files = files_of(store, 1, "model-"), files_of(store, 1, "optimizer-")
    assert len(model_files) > 1 and optimizer_files  # the model spans several shards
    assert info.manifest.files_by_key == {
        "model": tuple(sorted(model_files)),
        "optimizer": tuple(sorted(optimizer_files)),
        "step": (),
    }
    backend.payload_read()

    loaded = store.load(keys=["model"])
    assert_same(loaded, {"model": state["model"]})
    assert backend.payload_read() == {SKELETON_FILE, *model_files}

    assert store.load(keys=["step"]) == {"step": 7}  # no tensor: the skeleton alone
    assert backend.payload_read() == {SKELETON_FILE}

    both = store.load(keys=["step", "model"])  # in the state's order, not the keys'
    assert list(both) == ["model", "step"]


def test_a_partial_load_costs_the_skeleton_and_the_selected_files_only(tmp_path: Path) -> None:
    """No listing of sizes (a large file is stat'ed instead): the skeleton GET and the index's
    shards go out together."""
    store, backend = open_recorded(str(tmp_path))
    store.save(1, make_state())
    backend.payload_read()
    store.load(keys=["model"])
    payload = [p for p in backend.reads if "/.attempt-" in p]
    assert len(payload) == 1 + len(files_of(store, 1, "model-")), backend.reads
    assert backend.listings == 0
    assert Counter(backend.reads)[LATEST_NAME] == 1


def test_nested_keys_select_subtrees_and_read_only_their_shards(tmp_path: Path) -> None:
    store, backend = open_recorded(str(tmp_path))
    state = make_state()
    store.save(1, state)
    backend.payload_read()

    loaded = store.load(keys=["model.encoder"])
    assert_same(loaded, {"model": {"encoder": state["model"]["encoder"]}})
    read = backend.payload_read()
    assert SKELETON_FILE in read and not read & files_of(store, 1, "optimizer-")
    assert read < {SKELETON_FILE, *files_of(store, 1, "model-")}  # not the decoder's shard

    assert_same(
        store.load(keys=["model.encoder.w", "optimizer.param_groups"]),
        {
            "model": {"encoder": {"w": state["model"]["encoder"]["w"]}},
            "optimizer": {"param_groups": state["optimizer"]["param_groups"]},
        },
    )
    # a selection inside a part selected whole changes nothing
    assert_same(store.load(keys=["model.encoder", "model"]), {"model": state["model"]})


def test_a_flat_state_dict_key_with_dots_is_found(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), shard_size=SHARD)
    flat = {"encoder.weight": torch.ones(3), "encoder.bias": torch.zeros(3)}
    store.save(1, {"model": flat})
    assert_same(
        store.load(keys=["model.encoder.weight"]), {"model": {"encoder.weight": torch.ones(3)}}
    )


def test_an_unknown_key_names_itself_the_step_and_the_keys_there_are(tmp_path: Path) -> None:
    store, backend = open_recorded(str(tmp_path))
    info = store.save(3, make_state())
    backend.payload_read()
    with pytest.raises(NotFoundError) as caught:
        store.load(keys=["modle"])
    message = str(caught.value)
    assert "'modle'" in message and info.uri in message
    assert "['model', 'optimizer', 'step']" in message
    error = caught.value
    assert (error.uri, error.step, error.path) == (info.uri, 3, step_dir(3))
    assert backend.payload_read() == {SKELETON_FILE}  # no shard was read

    with pytest.raises(NotFoundError, match=r"'model.encoder.x'.*holds keys \['w', 'b'\]"):
        store.load(keys=["model.encoder.x"])
    with pytest.raises(NotFoundError, match="'step' holds no dict"):
        store.load(keys=["step.x"])


@pytest.mark.parametrize("keys", ["model", [], ["model..w"], [""], [3]])
def test_malformed_keys_are_a_config_error_before_any_read(tmp_path: Path, keys: Any) -> None:
    store, backend = open_recorded(str(tmp_path))
    store.save(1, make_state())
    backend.payload_read()
    with pytest.raises(ConfigError, match="keys"):
        store.load(keys=keys)
    assert backend.payload_read() == set()


def test_keys_on_schema_1_manifests_without_an_index(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURES / "store_v1", root)
    store = CheckpointStore(str(root))
    assert store.info(10).manifest.files_by_key is None
    whole = store.load(10)
    assert_same(store.load(10, keys=["model"]), {"model": whole["model"]})
    assert_same(
        store.load(10, keys=["model.b", "lr"]), {"model": {"b": whole["model"]["b"]}, "lr": 0.5}
    )
    with pytest.raises(NotFoundError, match=r"top-level keys are \['model', 'step', 'lr'\]"):
        store.load(10, keys=["optimizer"])
    with pytest.raises(ConfigError, match="pushed as a directory"):
        store.load(30, keys=["model"])  # a push_dir step, as without keys


def test_keys_on_a_schema_2_manifest_without_an_index(tmp_path: Path) -> None:
    """A manifest written before the index existed: the skeleton names the files to read."""
    store, backend = open_recorded(str(tmp_path))
    state = make_state()
    store.save(1, state)

    def drop_index(body: dict[str, Any]) -> None:
        del body["files_by_key"]
        body["schema_version"] = 2

    rewrite_manifest(tmp_path, 1, drop_index)
    info = store.info(1)
    assert info.manifest.schema_version == 2 and info.manifest.files_by_key is None
    backend.payload_read()
    assert_same(store.load(keys=["model"]), {"model": state["model"]})
    assert backend.payload_read() == {SKELETON_FILE, *files_of(store, 1, "model-")}
    assert_same(store.load(), state)  # and whole, as before


def test_the_index_is_signed_and_tampering_with_it_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), shard_size=SHARD, signing_key=KEY)
    first, second = make_state(0), make_state(1)
    store.save(1, first)
    store.save(2, second)

    def swap(body: dict[str, Any]) -> None:
        index = body["files_by_key"]
        index["model"], index["optimizer"] = index["optimizer"], index["model"]

    rewrite_manifest(tmp_path, 2, swap)
    reader = CheckpointStore(str(tmp_path), signing_key=KEY)  # remembers no manifest
    with pytest.raises(UntrustedCheckpointError, match="altered after signing"):
        reader.load(2, keys=["model"])
    loaded = reader.load(keys=["model"], with_info=True)  # resume skips what it cannot trust
    assert loaded.step == 1
    assert_same(loaded.state, {"model": first["model"]})


def test_fallback_passes_a_latest_step_whose_selected_file_is_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(str(tmp_path), shard_size=SHARD)
    first, second = make_state(0), make_state(1)
    store.save(1, first)
    store.save(2, second)

    corrupt(store, tmp_path, 2, sorted(files_of(store, 2, "optimizer-"))[0])
    loaded = store.load(keys=["model"], with_info=True)  # the corrupt file is not selected
    assert loaded.step == 2
    assert_same(loaded.state, {"model": second["model"]})

    corrupt(store, tmp_path, 2, sorted(files_of(store, 2, "model-"))[-1])
    with caplog.at_level(logging.WARNING):
        loaded = store.load(keys=["model"], with_info=True)
    assert loaded.step == 1 and store.last_loaded is not None and store.last_loaded.step == 1
    assert_same(loaded.state, {"model": first["model"]})
    assert "step 2 failed verification" in caplog.text


def test_tensors_shared_across_keys_load_from_the_shard_that_holds_them(tmp_path: Path) -> None:
    """A tied tensor is stored once, in the shard of the key saved first; selecting the other
    key reads that shard too, and selecting both gives one tensor object, as a whole load."""
    store, backend = open_recorded(str(tmp_path))
    shared = torch.arange(12.0)
    state = {"ema": {"w": shared}, "model": {"w": shared, "own": torch.ones(2)}}
    info = store.save(1, state)
    ema_files = files_of(store, 1, "ema-")
    assert set(info.manifest.files_by_key["model"]) >= ema_files  # type: ignore[index]
    backend.payload_read()

    loaded = store.load(keys=["model"])
    assert_same(loaded, {"model": state["model"]})
    assert backend.payload_read() == {SKELETON_FILE, *ema_files, *files_of(store, 1, "model-")}
    both = store.load(keys=["model.w", "ema"])
    assert both["model"]["w"] is both["ema"]["w"]


def test_pickled_objects_elsewhere_are_neither_read_nor_refused(tmp_path: Path) -> None:
    store, backend = open_recorded(str(tmp_path))
    state = {"model": {"w": torch.ones(2)}, "extra": {"when": complex(1, 2)}}
    store.save(1, state, allow_pickle=True)
    backend.payload_read()
    assert_same(store.load(keys=["model"]), {"model": state["model"]})
    assert PICKLE_FILE not in backend.payload_read()
    with pytest.raises(UnsafeLoadError):
        store.load(keys=["extra"])
    assert store.load(keys=["extra.when"], allow_pickle=True) == {"extra": {"when": 1 + 2j}}


def test_async_saves_index_and_directory_steps_do_not(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), shard_size=SHARD)
    store.save_async(1, make_state()).wait()
    assert set(store.info(1).manifest.files_by_key or {}) == {"model", "optimizer", "step"}
    assert_same(store.load(keys=["model"]), {"model": make_state()["model"]})
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("a")
    assert store.push_dir(2, tmp_path / "dir").manifest.files_by_key is None
    store.save(3, [torch.ones(1)])  # no dict: nothing to index, and no key to select
    assert store.info(3).manifest.files_by_key is None
    with pytest.raises(NotFoundError, match="not a dict"):
        store.load(3, keys=["model"])


def test_partial_load_over_s3(s3_uri: str, s3_options: dict[str, Any]) -> None:
    backend = Recording(open_backend(s3_uri, s3_options))
    with CheckpointStore(s3_uri, backend=backend, shard_size=SHARD) as store:
        state = make_state()
        store.save(1, state)
        backend.payload_read()
        assert_same(store.load(keys=["model"]), {"model": state["model"]})
        assert backend.payload_read() == {SKELETON_FILE, *files_of(store, 1, "model-")}
        assert_same(
            store.load(keys=["optimizer.state"]),
            {"optimizer": {"state": state["optimizer"]["state"]}},
        )
        assert not backend.payload_read() & files_of(store, 1, "model-")
