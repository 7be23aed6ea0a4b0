"""Options a person and an IDE can see (issue 28): every StoreOptions field is a keyword
parameter of CheckpointStore, a mistyped name names the closest, a storage option given beside
them names where it goes, and ``storage_options=None`` is none."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.s3_options import OPTIONS as S3_OPTIONS
from ckptstore.errors import ConfigError
from ckptstore.options import CLI, VERL, StoreOptions, refuse_unknown

INJECTED = {"options", "backend", "clock", "observer", "writer", "environment"}
"""CheckpointStore's keywords that are no StoreOptions field: parts handed in whole."""


def keywords() -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(CheckpointStore).parameters
    return {n: p for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def test_the_signature_has_a_keyword_per_option_and_nothing_else() -> None:
    parameters = inspect.signature(CheckpointStore).parameters
    assert set(keywords()) == set(StoreOptions.names()) | INJECTED
    others = {n: p.kind for n, p in parameters.items() if n not in keywords()}
    rest = [n for n, kind in others.items() if kind is inspect.Parameter.VAR_KEYWORD]
    assert len(rest) == 1  # only to refuse unknown names with a ConfigError
    assert others == {"uri": inspect.Parameter.POSITIONAL_OR_KEYWORD, rest[0]: others[rest[0]]}


@pytest.mark.parametrize("field", dataclasses.fields(StoreOptions), ids=lambda f: f.name)
def test_each_keyword_defaults_as_its_option_does(field: dataclasses.Field[Any]) -> None:
    parameter = keywords()[field.name]
    assert parameter.annotation != inspect.Parameter.empty  # typed, for IDEs and mypy
    if field.name == "storage_options":  # None, not a shared {}: none
        assert parameter.default is None and field_default(field) == {}
    else:
        assert parameter.default == field_default(field)
    assert "StoreOptions" in (CheckpointStore.__init__.__doc__ or "")


def test_keywords_reach_the_options(tmp_path: Path) -> None:
    store = CheckpointStore(
        str(tmp_path / "s"), keep_last=3, save_timeout=30.0, local=str(tmp_path / "l"),
        local_keep_last=1, lease_ttl=5.0, shard_size=1 << 20, incremental=False,
    )  # fmt: skip
    with store:
        assert store.options == StoreOptions(
            keep_last=3, save_timeout=30.0, local=str(tmp_path / "l"), local_keep_last=1,
            lease_ttl=5.0, shard_size=1 << 20, incremental=False,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("typo", "closest"),
    [("keep_lst", "keep_last"), ("save_timout", "save_timeout"), ("locall", "local"),
     ("observe", "observer"), ("persist_evry", "persist_every")],
)  # fmt: skip
def test_a_mistyped_option_names_the_closest(tmp_path: Path, typo: str, closest: str) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointStore(str(tmp_path), **{typo: 3})
    assert str(caught.value) == f"unknown option {typo}; did you mean {closest}?"
    assert not (tmp_path / ".ckptstore").exists()


def test_a_name_close_to_nothing_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option zzzzz; known options: keep_last, "):
        CheckpointStore(str(tmp_path), zzzzz=1)


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [("stall_timeout", 1, '"stall_timeout": 1'), ("part_size", 8 << 20, '"part_size": 8388608'),
     ("retry_timeout", 2.5, '"retry_timeout": 2.5'), ("endpoint_url", "http://h:9000",
      '"endpoint_url": ...'), ("checksums", False, '"checksums": False')],
)  # fmt: skip
def test_a_storage_option_beside_the_others_names_storage_options(
    tmp_path: Path, name: str, value: Any, shown: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointStore(str(tmp_path), save_timeout=60, **{name: value})
    assert str(caught.value) == (
        f"{name} is a storage option of the S3 backend, not a store option: "
        f"pass storage_options={{{shown}}}"
    )


def test_a_secret_given_in_the_wrong_place_is_not_echoed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointStore(str(tmp_path), key="AKIAKEY", secret="hunter2", stall_timeout=1)
    message = str(caught.value)
    assert "hunter2" not in message and "AKIAKEY" not in message
    assert "key, secret, stall_timeout are storage options" in message
    assert 'storage_options={"key": ..., "secret": ..., "stall_timeout": 1}' in message


def test_a_mistyped_storage_option_names_it_and_where_it_goes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointStore(str(tmp_path), stall_timout=1)
    assert str(caught.value) == (
        "unknown option stall_timout; did you mean the storage option stall_timeout "
        '(pass storage_options={"stall_timeout": 1})?'
    )


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointStore(str(tmp_path), keep_lst=2, stall_timeout=1, zzzzz=0)
    message = str(caught.value)
    assert message.startswith("stall_timeout is a storage option")
    assert "unknown option keep_lst; did you mean keep_last? unknown option zzzzz;" in message


def test_the_s3_options_named_are_the_ones_the_backend_reads() -> None:
    for name in ("endpoint_url", "region", "part_size", "max_concurrency", "stall_timeout",
                 "retry_timeout", "max_attempts", "checksums"):  # fmt: skip
        assert name in S3_OPTIONS
    assert not set(S3_OPTIONS) & set(StoreOptions.names())  # never ambiguous


@pytest.mark.parametrize(
    ("spelling", "fix", "typo"),
    [(VERL, "set trainer.ckptstore.storage_options.stall_timeout=1",
      "unknown option trainer.ckptstore.keep_lst; did you mean trainer.ckptstore.keep_last?"),
     (CLI, "pass -o stall_timeout=1", "unknown option --keep-lst; did you mean --keep-last?")],
)  # fmt: skip
def test_other_faces_spell_the_fix_their_way(spelling: Any, fix: str, typo: str) -> None:
    with pytest.raises(ConfigError) as caught:
        StoreOptions.from_mapping({"stall_timeout": 1}, spelling=spelling)
    assert str(caught.value).endswith(fix)
    with pytest.raises(ConfigError) as caught:
        refuse_unknown({"keep_lst": 3}, StoreOptions.names(), spelling=spelling)
    assert str(caught.value) == typo


def test_storage_options_none_is_none_and_the_store_works(tmp_path: Path) -> None:
    assert StoreOptions(storage_options=None).storage_options == {}  # type: ignore[arg-type]
    assert StoreOptions.from_mapping({"storage_options": None}, spelling=VERL).storage_options == {}
    with CheckpointStore(str(tmp_path), storage_options=None) as store:
        assert store.options.storage_options == {}
        store.save(1, {"w": torch.arange(4.0)})
    with CheckpointStore(str(tmp_path), storage_options=None) as again:
        assert torch.equal(again.load()["w"], torch.arange(4.0))


def test_options_and_keywords_are_not_both_given(tmp_path: Path) -> None:
    options = StoreOptions(keep_last=2)
    with pytest.raises(ConfigError, match=r"not both \(got \['keep_last', 'save_timeout'\]\)"):
        CheckpointStore(str(tmp_path), options=options, keep_last=3, save_timeout=9.0)
    with pytest.raises(ConfigError, match=r"not both \(got \['storage_options'\]\)"):
        CheckpointStore(str(tmp_path), options=options, storage_options={})
    # a keyword left at its default is no second set of options
    with CheckpointStore(str(tmp_path), options=options, keep_last=None, compat="warn") as store:
        assert store.options is options


def test_an_unknown_name_beside_options_is_refused_as_unknown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean keep_last"):
        CheckpointStore(str(tmp_path), options=StoreOptions(), keep_lst=3)


def test_a_field_the_signature_lacks_fails_loudly() -> None:
    def opener(uri: str, *, keep_last: int | None = None, **unknown: Any) -> None: ...

    with pytest.raises(TypeError, match="lacks a keyword parameter for StoreOptions' keep_every"):
        StoreOptions.from_call(opener, {"uri": "x", "keep_last": None, "unknown": {}})
