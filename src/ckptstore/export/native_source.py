"""The ``model`` of a step saved with ``store.save``: safetensors shards and a JSON skeleton.

serialize.py writes every tensor into safetensors files and the structure into ``state.json``,
which names each tensor; a tensor saved under two names (tied weights) is stored once and named
twice, so aliases come for free. A shard's header (its first 8 bytes say how long it is) gives
each tensor's byte range (once the safetensors library accepts it, safetensors_header.py): two
small reads per shard, then each tensor read where it lies.

The exported part is the state's ``model`` entry, or the whole state when it is a flat dict of
tensors (``store.save(step, model.state_dict())``).
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptstore.data import safetensors_header
from ckptstore.data.serialize import FORMAT, SKELETON_FILE
from ckptstore.deadline import map_in_context
from ckptstore.errors import ConfigError, CorruptCheckpointError
from ckptstore.export.found import Found, hf_files, json_object
from ckptstore.export.plan import Piece, SourceTensor
from ckptstore.export.source import StepSource

MODEL_KEY = "model"


def is_native(paths: Container[str]) -> bool:
    return SKELETON_FILE in paths


def find_native(source: StepSource) -> Found:
    where = source.where(SKELETON_FILE)
    body = json_object(source.whole(SKELETON_FILE), where)
    if body.get("format") != FORMAT or not isinstance(body.get("shards"), dict):
        raise CorruptCheckpointError(f"{where}: not a ckptstore state ({body.get('format')!r})")
    state = body.get("state")
    model = state.get(MODEL_KEY) if isinstance(state, dict) else None
    if model is None and isinstance(state, dict) and all(_is_tensor(v) for v in state.values()):
        model = state
    if not isinstance(model, dict):
        keys = sorted(state) if isinstance(state, dict) else []
        raise ConfigError(
            f"{where}: the state has no {MODEL_KEY!r} entry holding a state dict (its keys: "
            f"{', '.join(map(str, keys)) or 'none'}); save {{'model': model.state_dict(), ...}} "
            "to export it",
            uri=where,
            step=source.step,
        )
    refs = dict(_tensors(model, ""))
    shard_of: dict[str, str] = body["shards"]
    paths = sorted({_shard(shard_of, ref, where) for ref in refs.values()})
    with ThreadPoolExecutor(8, thread_name_prefix="ckpt-export") as pool:
        found_headers = map_in_context(pool, lambda p: _header(source, p), paths)  # deadline too
        headers = dict(zip(paths, found_headers, strict=True))
    found = Found("native", [], hf_files=hf_files(source.entries, "huggingface"))
    names_of: dict[str, list[str]] = {}
    for name, ref in refs.items():
        path = _shard(shard_of, ref, where)
        entry = headers[path].tensors.get(ref)
        if entry is None:
            raise CorruptCheckpointError(f"{source.where(path)} does not hold tensor {ref}")
        begin, end, shape = entry.begin, entry.end, entry.shape
        offsets = tuple(0 for _ in shape)
        pieces = (Piece(path, begin, end - begin, offsets, shape),) if end > begin else ()
        tensor = SourceTensor(name, entry.dtype, shape, pieces, where=source.where(path))
        tensor.check()
        found.tensors.append(tensor)
        names_of.setdefault(ref, []).append(name)
    for names in names_of.values():
        found.aliases.add(names)
    return found


def _is_tensor(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"$tensor"}


def _tensors(value: dict[str, Any], prefix: str) -> Iterator[tuple[str, str]]:
    """``(dotted name, tensor id)`` for every tensor of a nested dict of the skeleton."""
    for key, inner in value.items():
        if _is_tensor(inner):
            yield prefix + key, str(inner["$tensor"])
        elif isinstance(inner, dict) and not any(str(k).startswith("$") for k in inner):
            yield from _tensors(inner, f"{prefix}{key}.")


def _shard(shard_of: dict[str, str], ref: str, where: str) -> str:
    try:
        return shard_of[ref]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: tensor {ref} is in no shard") from None


def _header(source: StepSource, path: str) -> safetensors_header.Header:
    """A shard's header, accepted by the safetensors library: two small reads."""
    where, size = source.where(path), source.size(path)
    first = source.read(path, 0, 8)
    length = safetensors_header.header_length(first, size, where)
    return safetensors_header.parse(first + source.read(path, 8, 8 + length), size, where)


__all__ = ["MODEL_KEY", "find_native", "is_native"]
