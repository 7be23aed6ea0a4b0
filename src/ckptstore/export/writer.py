"""The model of a step, found, named and written file by file into an export's target.

Finding is the source formats' (verl_source, dcp_source, native_source); naming is this
module's: LoRA split or merged (lora.py), ``--key-prefix-map`` applied (a DCP step's
``model.`` dropped by default), tied aliases written once, dtypes converted only when asked.
Then every output shard streams into the target (stream.py), the adapter beside it, and the
config and tokenizer files of the step's (or ``--hf-config``'s) ``huggingface/`` folder,
``config.json`` with its dtype set to the weights'. The index, written last, is hf.py's to
publish.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckptstore.domain.checksum import Crc32c
from ckptstore.domain.environment import package_version
from ckptstore.errors import ConfigError, NotFoundError
from ckptstore.export.dcp_source import find_dcp, is_dcp
from ckptstore.export.found import Found, hf_files, json_object
from ckptstore.export.lora import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, has_lora, split_lora
from ckptstore.export.native_source import find_native, is_native
from ckptstore.export.plan import (
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
from ckptstore.export.records import ExportRecord
from ckptstore.export.source import StepSource
from ckptstore.export.stream import ShardStream
from ckptstore.export.target import Target
from ckptstore.export.verl_source import find_verl, model_files

DCP_MODEL_PREFIX = "model."
"""A DCP state saved as ``{"model": ..., "optim": ...}`` has its model under ``model.``: by
default a DCP export takes those names, without the prefix."""


@dataclass
class Summary:
    """What :meth:`ModelWriter.run` found and wrote, for the report."""

    kind: str
    world_size: int
    lora: str | None
    peak: int


class ModelWriter:
    """One export in progress: the step's model found, shaped, written file by file."""

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

    def run(self, shard_size: int) -> Summary:
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
        return Summary(found.kind, found.world_size, lora, peak)

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


__all__ = ["DCP_MODEL_PREFIX", "ModelWriter", "Summary"]
