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
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckptstore import layout
from ckptstore.backends.registry import open_backend, scheme_of
from ckptstore.checksum import Crc32c
from ckptstore.environment import package_version
from ckptstore.errors import ConfigError, ConflictError, NotFoundError
from ckptstore.export.dcp_source import find_dcp, is_dcp
from ckptstore.export.found import Found, hf_files, json_object
from ckptstore.export.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, has_lora, split_lora
from ckptstore.export.native_source import find_native, is_native
from ckptstore.export.plan import (
    DTYPES,
    INDEX_NAME,
    KeyMap,
    OutShard,
    OutTensor,
    Source,
    SourceTensor,
    drop_tied,
    out_dtype,
    plan_shards,
    with_leads,
)
from ckptstore.export.records import ExportRecord, find_record, write_record
from ckptstore.export.source import StepSource
from ckptstore.export.stream import ShardStream
from ckptstore.export.target import Target, open_target
from ckptstore.export.verl_source import find_verl, model_files
from ckptstore.info import CheckpointInfo
from ckptstore.store import CheckpointStore
from ckptstore.transfer import CHUNK_SIZE

DEFAULT_SHARD_SIZE = 5 * 10**9
"""``save_pretrained``'s default ``max_shard_size`` ("5GB")."""
READ_SLOTS = 8
"""Ranged reads in flight at once (each at most a chunk: :func:`memory_plan`)."""
OUT_PART_CONCURRENCY = 4
"""Parts an S3 destination uploads at once, unless its storage options say otherwise."""
DCP_MODEL_PREFIX = "model."
"""A DCP state saved as ``{"model": ..., "optim": ...}`` has its model under ``model.``: by
default a DCP export takes those names, without the prefix."""


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
    docs/export.md for what is written and checked."""
    started = time.perf_counter()
    info = _resolve(store, step)
    wanted = _dtype(dtype)
    keymap = KeyMap.parse(key_prefix_map)
    options = {
        "role": role,
        "dtype": dtype,
        "shard_size": shard_size,
        "merge_lora": merge_lora,
        "key_prefix_map": [list(rule) for rule in keymap.rules],
    }
    chunk, parts = memory_plan(shard_size)
    out_options = dict(storage_options or {})
    if scheme_of(os.fspath(out)) == "s3":
        out_options = parts | out_options  # what the caller set wins
    target = open_target(out, out_options)
    try:
        existing = target.existing_index()
        if existing is not None:
            return _already(store, info, target, existing, options, started)
        target.check_empty()
        with _source(store, info, role, chunk) as source:
            writer = _Export(source, target, role, wanted, keymap, merge_lora, hf_config)
            report = writer.run(shard_size)
            source.verify()
            index = writer.index()
            target.commit(index)
            bytes_read = source.bytes_read
        record = writer.record(info.step, target.uri, options, index)
        write_record(store.backend, record)
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


@dataclass
class _Done:
    kind: str
    world_size: int
    lora: str | None
    peak: int


class _Export:
    """One export in progress: found, shaped, written file by file."""

    def __init__(
        self,
        source: StepSource,
        target: Target,
        role: str,
        wanted: torch.dtype | None,
        keymap: KeyMap,
        merge_lora: bool,
        hf_config: str | os.PathLike[str] | None,
    ) -> None:
        self.source, self.target, self.role = source, target, role
        self.wanted, self.keymap, self.merge_lora = wanted, keymap, merge_lora
        self.hf_config = Path(hf_config) if hf_config is not None else None
        self.files: list[dict[str, Any]] = []
        self.shards: list[OutShard] = []
        self.notes: list[str] = []
        self.tensors = 0
        self.bytes = 0
        self.kind = ""
        self.world_size = 1

    def run(self, shard_size: int) -> _Done:
        found = self._find()
        config = self._config(found)
        model, adapter, adapter_config = self._shape(found, config)
        lora = None if adapter_config is None else ("merged" if self.merge_lora else "adapter")
        peak = 0
        self.shards = plan_shards(model, shard_size) if model else []
        for shard in self.shards:
            peak = max(peak, self._write(shard.path, list(shard.tensors)))
        if adapter:
            peak = max(peak, self._write(f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}", adapter))
            text = json.dumps(adapter_config, indent=2, sort_keys=True).encode()
            self._small(f"{ADAPTER_DIR}/{ADAPTER_CONFIG}", text)
        for name, data in self._hf_files(found, config, model):
            self._small(name, data)
        return _Done(found.kind, found.world_size, lora, peak)

    def index(self) -> bytes:
        weight_map = {t.name: s.path for s in self.shards for t in s.tensors}
        total = sum(s.nbytes for s in self.shards)
        params = sum(int(torch.Size(t.shape).numel()) for s in self.shards for t in s.tensors)
        body = {
            "metadata": {"total_size": total, "total_parameters": params},
            "weight_map": dict(sorted(weight_map.items())),
        }
        return (json.dumps(body, indent=2) + "\n").encode()

    def record(self, step: int, out: str, options: dict[str, Any], index: bytes) -> ExportRecord:
        return ExportRecord(
            step=step,
            out=out,
            format="hf",
            options=options,
            source={"kind": self.kind, "world_size": self.world_size},
            files=[*self.files, {"path": INDEX_NAME, "size": len(index)}],
            tensors=self.tensors,
            tensor_bytes=self.bytes,
            index_sha256=hashlib.sha256(index).hexdigest(),
            created=time.time(),
            ckptstore=package_version("ckptstore") or "unknown",
            notes=self.notes,
        )

    # -- finding and shaping ---------------------------------------------------------------

    def _find(self) -> Found:
        if model_files(self.source, self.role):
            found = find_verl(self.source, self.role)
        elif is_dcp(self.source.entries):
            found = find_dcp(self.source)
            if not self.keymap.rules and any(
                t.name.startswith(DCP_MODEL_PREFIX) for t in found.tensors
            ):
                self.keymap = KeyMap.parse({DCP_MODEL_PREFIX: ""})
        elif is_native(self.source.entries):
            found = find_native(self.source)
        else:
            raise NotFoundError(
                f"{self.source.info.uri}: step {self.source.step} holds no model an export "
                f"knows: no {self.role}/model_world_size_W_rank_R.pt (verl), no .metadata "
                "(DCP), no state.json (ckptstore.save)",
                uri=self.source.info.uri,
                step=self.source.step,
            )
        self.kind, self.world_size = found.kind, found.world_size
        if found.skipped:
            self.notes.append(f"left out {len(found.skipped)} non-tensor entries")
        found.tensors = with_leads(found.tensors)
        return found

    def _shape(
        self, found: Found, config: dict[str, Any] | None
    ) -> tuple[list[OutTensor], list[OutTensor], dict[str, Any] | None]:
        names = [t.name for t in found.tensors]
        adapter: list[OutTensor] = []
        adapter_config = None
        renamed: dict[str, str] = {}
        entries: list[tuple[str, Source]]
        if has_lora(names):
            split = split_lora(
                found.tensors, found.lora_meta, merge=self.merge_lora, where=self.source.info.uri
            )
            entries, adapter_config = split.model, split.config
            adapter = [OutTensor(n, out_dtype(t.dtype, self.wanted), t) for n, t in split.adapter]
            if split.merged:
                self.notes.append(f"merged LoRA into {split.merged} weights")
        else:
            if self.merge_lora:
                raise ConfigError(
                    f"{self.source.info.uri}: step {self.source.step} has no LoRA adapter to "
                    "merge (no lora_A/lora_B tensors); export it without --merge-lora"
                )
            entries = [(t.name, t) for t in found.tensors]
        mapped: list[tuple[str, Source]] = []
        for name, tensor in entries:
            new = self.keymap.apply(name)
            if new is not None:
                mapped.append((new, tensor))
                renamed[tensor.name if isinstance(tensor, SourceTensor) else tensor.base.name] = new
        if not mapped and not adapter:
            raise ConfigError(
                f"{self.source.info.uri}: no tensor of step {self.source.step} is left after "
                f"--key-prefix-map {self.keymap.rules} (its names start like {names[:3]})"
            )
        seen: set[str] = set()
        for name, _ in mapped:
            if name in seen:
                raise ConfigError(f"two tensors would be exported as {name!r}; fix the key map")
            seen.add(name)
        found.aliases.groups = {
            renamed.get(k, k): [renamed.get(n, n) for n in g]
            for k, g in found.aliases.groups.items()
        }
        tied = config.get("tie_word_embeddings") if config is not None else None
        dropped = drop_tied(
            [n for n, _ in mapped], found.aliases, tied if isinstance(tied, bool) else None
        )
        for name, kept in dropped.items():
            self.notes.append(f"{name} is tied to {kept}: written once, as {kept}")
        model = [
            OutTensor(name, out_dtype(tensor.dtype, self.wanted), tensor)
            for name, tensor in mapped
            if name not in dropped
        ]
        return model, adapter, adapter_config

    # -- writing -----------------------------------------------------------------------------

    def _write(self, path: str, tensors: Sequence[OutTensor]) -> int:
        stream = ShardStream(self.source, list(tensors))
        self.target.write(path, stream.chunks())
        self.files.append(
            {"path": path, "size": stream.written.size, "crc32c": stream.written.crc.hexdigest()}
        )
        self.tensors += len(tensors)
        self.bytes += sum(t.nbytes for t in tensors)
        return stream.peak_tensor

    def _small(self, path: str, data: bytes) -> None:
        self.target.write(path, [data])
        crc = Crc32c()
        crc.update(data)
        self.files.append({"path": path, "size": len(data), "crc32c": crc.hexdigest()})

    def _config(self, found: Found) -> dict[str, Any] | None:
        sources = self._hf_sources(found)
        if "config.json" not in sources:
            self.notes.append(
                "no config.json (the step has no huggingface/ folder): pass --hf-config DIR "
                "for a model that loads with from_pretrained"
            )
            return None
        return json_object(sources["config.json"](), "config.json")

    def _hf_sources(self, found: Found) -> dict[str, Callable[[], bytes]]:
        """The config and tokenizer files to copy, each as a function that reads it."""
        folder = self.hf_config
        if folder is None:
            return {n: partial(self.source.whole, p) for n, p in found.hf_files.items()}
        if not folder.is_dir():
            raise ConfigError(
                f"--hf-config {folder} is not a directory (expected one holding config.json "
                "and the tokenizer files)",
                path=str(folder),
            )
        local = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        return {n: (folder / p).read_bytes for n, p in hf_files(local, "").items()}

    def _hf_files(
        self, found: Found, config: dict[str, Any] | None, model: Sequence[OutTensor]
    ) -> Iterator[tuple[str, bytes]]:
        for name, read in sorted(self._hf_sources(found).items()):
            if name == "config.json" and config is not None:
                yield name, _with_dtype(config, model, self.notes)
            else:
                yield name, read()


def _with_dtype(config: dict[str, Any], model: Sequence[OutTensor], notes: list[str]) -> bytes:
    """config.json with its dtype set to the exported weights' (``save_pretrained`` does the
    same): a loader that takes the config's dtype gets the weights as they are."""
    floats = {t.dtype for t in model if t.dtype.is_floating_point}
    if len(floats) == 1:
        name = str(floats.pop()).removeprefix("torch.")
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
        for key in keys:
            if config.get(key) != name:
                notes.append(f"config.json {key}: {config.get(key)!r} -> {name!r}")
                config = {**config, key: name}
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


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
        include = [f"{role}/model_*", f"{role}/*.json", f"{role}/huggingface/*", ".metadata"]
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
