"""From a committed step to a Hugging Face model directory: ``export_hf``.

The step's model is found where its writer put it (a verl role folder's rank files, a DCP
step's chunks, a native step's ``model``), named as Hugging Face names it, and written as
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, beside the config
and tokenizer files of the step's ``huggingface/`` folder. The order of work is what makes it
safe to publish:

1. the destination is checked first: a complete export of this step with these options is
   skipped (its record says so), anything else there is a conflict;
2. every tensor streams from ranged reads of the step into its output file (stream.py);
3. every file of the step that was read is checked against the manifest (source.py);
4. only then is the export published (target.py: a rename, or the index written last) and
   recorded beside the step (records.py).

A failure at any point leaves no export behind, locally none at all.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstore.backends.registry import open_backend, scheme_of
from ckptstore.data.transfer import CHUNK_SIZE
from ckptstore.domain import layout
from ckptstore.domain.info import CheckpointInfo
from ckptstore.errors import CheckpointError, ConfigError, ConflictError, NotFoundError
from ckptstore.export.plan import (
    DTYPES,
    KeyMap,
)
from ckptstore.export.records import ExportRecord, find_record, write_record
from ckptstore.export.source import StepSource
from ckptstore.export.target import Target, open_target
from ckptstore.export.writer import ModelWriter
from ckptstore.integrations.verl_steps import in_folder, role_folder
from ckptstore.store import CheckpointStore

DEFAULT_SHARD_SIZE = 5 * 10**9
"""``save_pretrained``'s default ``max_shard_size`` ("5GB")."""
READ_SLOTS = 8
"""Ranged reads in flight at once (each at most a chunk: :func:`memory_plan`)."""
OUT_PART_CONCURRENCY = 4
"""Parts an S3 destination uploads at once, unless its storage options say otherwise."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportReport:
    """What an export did (or found already done, ``skipped``)."""

    step: int
    source: str
    out: str
    kind: str
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    """Tensor bytes written."""
    bytes_read: int = 0
    """Bytes read from the step, the file checks included."""
    seconds: float = 0.0
    skipped: bool = False
    world_size: int = 1
    lora: str | None = None
    """``adapter`` (written beside the base model), ``merged``, or None."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    peak_tensor_bytes: int = 0
    """The largest tensor built whole in memory (a LoRA merge, a DCP chunk across columns);
    every other tensor streamed."""

    def record(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


def export_hf(
    store: CheckpointStore,
    step: int | None,
    out: str | os.PathLike[str],
    *,
    role: str = "actor",
    dtype: str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    merge_lora: bool = False,
    key_prefix_map: Iterable[str] | Mapping[str, str] | None = None,
    hf_config: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ExportReport:
    """Export ``step`` (None: latest) of ``store`` as a Hugging Face model into ``out``, a new
    local directory or a store URI (``storage_options`` for it). See the module docstring and
    docs/export.md for what is written and checked. One load, by the store's ``load_timeout``
    (resolver.py): choosing the step, reading it and writing the export; one that passes it
    leaves no export behind."""
    started = time.perf_counter()
    with store.resolver.loading():
        info = _resolve(store, step)
        with store.resolver.loading(info.step):
            return _export(
                store,
                info,
                out,
                role,
                dtype,
                shard_size,
                merge_lora,
                key_prefix_map,
                hf_config,
                storage_options,
                started,
            )


def _export(
    store: CheckpointStore,
    info: CheckpointInfo,
    out: str | os.PathLike[str],
    role: str,
    dtype: str | None,
    shard_size: int,
    merge_lora: bool,
    key_prefix_map: Iterable[str] | Mapping[str, str] | None,
    hf_config: str | os.PathLike[str] | None,
    storage_options: Mapping[str, Any] | None,
    started: float,
) -> ExportReport:
    wanted = _dtype(dtype)
    keymap = KeyMap.parse(key_prefix_map)
    options: dict[str, Any] = {"role": role, "dtype": dtype, "shard_size": shard_size}
    options |= {"merge_lora": merge_lora, "key_prefix_map": [list(r) for r in keymap.rules]}
    chunk, parts = memory_plan(shard_size)
    target = _open_out(out, storage_options, parts)
    try:
        existing = target.existing_index()
        if existing is not None:
            return _already(store, info, target, existing, options, started)
        target.check_empty()
        with _source(store, info, role, chunk) as source:
            writer = ModelWriter(source, target, role, wanted, keymap, merge_lora, hf_config)
            report = writer.run(shard_size)
            source.verify()
            index = writer.index()
            target.commit(index)
            bytes_read = source.bytes_read
        record = writer.record(info.step, target.uri, options, index)
        _record_beside_the_step(store, record)
    except BaseException:
        target.abort()
        raise
    finally:
        target.close()
    return ExportReport(
        step=info.step,
        source=info.uri,
        out=target.uri,
        kind=report.kind,
        files=tuple(f["path"] for f in record.files),
        tensors=record.tensors,
        tensor_bytes=record.tensor_bytes,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - started,
        world_size=report.world_size,
        lora=report.lora,
        notes=tuple(record.notes),
        peak_tensor_bytes=report.peak,
    )


def _open_out(
    out: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, parts: Mapping[str, Any]
) -> Target:
    """The export's target; an S3 one writes parts sized by the memory plan unless the caller
    set them."""
    out_options = dict(storage_options or {})
    if scheme_of(os.fspath(out)) == "s3":
        out_options = {**parts, **out_options}
    return open_target(out, out_options)


def _record_beside_the_step(store: CheckpointStore, record: ExportRecord) -> None:
    try:
        write_record(store.backend, record)
    except CheckpointError as e:  # the export is published; only its record is missing
        log.warning(
            "exported step %d to %s, but could not record it: %s", record.step, record.out, e
        )
        record.notes.append(f"not recorded beside the step ({e})")


def _already(
    store: CheckpointStore,
    info: CheckpointInfo,
    target: Target,
    index: bytes,
    options: dict[str, Any],
    started: float,
) -> ExportReport:
    record = find_record(store.backend, info.step, target.uri)
    digest = hashlib.sha256(index).hexdigest()
    if record is None or record.index_sha256 != digest or record.options != options:
        what = (
            "another model"
            if record is None or record.index_sha256 != digest
            else (f"an export of step {info.step} with other options ({record.options})")
        )
        raise ConflictError(
            f"{target.uri} already holds {what}; an export never overwrites one. Choose "
            "another OUT, or remove it",
            uri=target.uri,
            step=info.step,
        )
    return ExportReport(
        step=info.step,
        source=info.uri,
        out=target.uri,
        kind=str(record.source.get("kind")),
        files=tuple(f["path"] for f in record.files),
        tensors=record.tensors,
        tensor_bytes=record.tensor_bytes,
        seconds=time.perf_counter() - started,
        skipped=True,
        world_size=int(record.source.get("world_size", 1)),
        notes=tuple(record.notes),
    )


def memory_plan(shard_size: int) -> tuple[int, dict[str, int]]:
    """The read chunk and the S3 destination's part options for ``shard_size``.

    The reads in flight (``READ_SLOTS`` chunks) take at most a quarter of a shard, the parts
    in flight an eighth (the S3 backend may hold twice its parts while one fills), so the
    export's memory stays below a shard's size with room for the rest; from 64 MiB of reads
    and 128 MiB of parts down to fixed floors (1 MiB reads; S3's 5 MiB parts, 2 at once).
    """
    chunk = min(CHUNK_SIZE, max(1 << 20, shard_size // (4 * READ_SLOTS)))
    part = min(32 << 20, max(5 << 20, shard_size // (8 * OUT_PART_CONCURRENCY)))
    concurrency = max(2, min(OUT_PART_CONCURRENCY, shard_size // (8 * part)))
    return chunk, {"part_size": part, "max_concurrency": concurrency}


def _resolve(store: CheckpointStore, step: int | None) -> CheckpointInfo:
    if step is not None:
        return store.info(layout.check_step(step))
    latest = store.latest()
    if latest is None:
        raise NotFoundError(f"{store.uri} holds no committed step to export", uri=store.uri)
    return latest


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"dtype {name!r} is not one of {', '.join(DTYPES)}; leave it out to keep the "
            "step's dtypes"
        ) from None


@contextmanager
def _source(
    store: CheckpointStore, info: CheckpointInfo, role: str, chunk: int
) -> Iterator[StepSource]:
    """The step read in place; in a signed store, a verified local copy of what the export
    needs (SHA-256 cannot be checked on ranges)."""
    if store.signer is None:
        with StepSource(store.backend, info, chunk_size=chunk, slots=READ_SLOTS) as source:
            yield source
        return
    with tempfile.TemporaryDirectory(prefix="ckptstore-export-") as tmp:
        local = Path(tmp) / "step"
        folder = role_folder((f.path for f in info.files), role)
        include = [in_folder(folder, n) for n in ("model_*", "*.json", "huggingface/*")]
        include.append(".metadata")
        include += ["*.distcp", "state.json", "*.safetensors", "huggingface/*"]
        pulled = store.pull_dir(local, step=info.step, fallback=False, include=include, exclude="*")
        keys = {e.path: e.path for e in pulled.files if (local / e.path).is_file()}
        backend = open_backend(str(local))
        try:
            with StepSource(backend, info, keys=keys, chunk_size=chunk) as source:
                yield source
        finally:
            backend.close()
            shutil.rmtree(local, ignore_errors=True)


__all__ = ["DEFAULT_SHARD_SIZE", "ExportReport", "export_hf"]
