"""State dicts to files and back, without pickle.

A state is split in two: every tensor goes into safetensors shards, and the structure around
them (dicts, lists, tuples, str, int, float, bool, None) into a JSON skeleton that refers to
tensors by name. Neither format can execute code on load, which matters because a writable
bucket must not become code execution on the machines that resume from it.

The safetensors bytes are produced part by part (header, then each tensor's own memory), so a
shard streams into storage, its CRC32C computed as the bytes pass, without a whole-file copy in
memory: that is why the header is built here (safetensors_header.py) rather than by
``safetensors.torch.save``, which returns the whole file as one ``bytes``. Reading back, the
library judges each shard's header, so a file it rejects is rejected here too.

Tensors are laid out by descending element size, so every tensor starts at an offset aligned to
its element size and loads as a zero-copy view of the bytes read. Tensors that share memory
(tied weights) are stored once and come back as one tensor object.

Anything else in a state is an error at save time, naming where it sits. Callers who accept
the risk can pass ``allow_pickle=True`` to keep such objects in a separate pickle file, which
``load`` then refuses to read unless it is given ``allow_pickle=True`` as well.

A load may select parts of a dict state by dotted paths (``keys=["model", "optim.state"]``,
resolved by state_selection.py): only the shards holding the selected tensors are read, and the
pickle file only if a selected part holds pickled objects. For a dict state,
:attr:`EncodedState.files_by_key` says which shards hold each top-level key's tensors, for the
manifest, so a loader can fetch them alongside the skeleton instead of after it.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.backends.base import Chunk
from ckptstore.data import safetensors_header
from ckptstore.data.payload import SourceFile
from ckptstore.domain.layout import DEFAULT_SHARD_SIZE
from ckptstore.domain.state_selection import (
    Selection,
    check_keys,
    dict_entries,
    select,
    selected_parts,
    shards_of,
)
from ckptstore.errors import (
    CorruptCheckpointError,
    SerializationError,
    UnsafeLoadError,
)

SKELETON_FILE = "state.json"
PICKLE_FILE = "objects.pt"
SHARD_PATTERN = "{}-{:05d}.safetensors"
DEFAULT_GROUP = "tensors"
FORMAT = "ckptstore-state-1"

_SUPPORTED = "tensors, dict, list, tuple, str, int, float, bool and None"


@dataclass
class Shard:
    """One safetensors file: tensors by name, in the order their bytes are written."""

    path: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def header(self) -> bytes:
        specs = ((name, t.dtype, t.shape) for name, t in self.tensors.items())
        return safetensors_header.build(specs, {"format": FORMAT})

    @property
    def size(self) -> int:
        return len(self.header()) + self.nbytes

    def chunks(self) -> Iterator[Chunk]:
        yield self.header()
        for tensor in self.tensors.values():
            if tensor.numel():
                yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


@dataclass
class EncodedState:
    """A state ready to write: the skeleton, tensor shards and optional pickle."""

    skeleton: bytes
    shards: list[Shard]
    pickled: bytes | None = None
    files_by_key: dict[str, tuple[str, ...]] | None = None
    """Each top-level str key of a dict state, and the shards holding its tensors (a tied
    tensor sits in the shard of the key that came first); ``None`` if the state is no dict."""

    def files(self) -> list[SourceFile]:
        files = [SourceFile(s.path, s.chunks, s.size, stable=True) for s in self.shards]
        for path, data in ((SKELETON_FILE, self.skeleton), (PICKLE_FILE, self.pickled)):
            if data is not None:
                files.append(SourceFile(path, _single(data), len(data), stable=True))
        return files


def _single(data: bytes) -> Callable[[], Iterator[Chunk]]:
    return lambda: iter((data,))


def encode_state(
    state: Any,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    allow_pickle: bool = False,
    snapshot: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> EncodedState:
    """Split ``state`` into a JSON skeleton and tensor shards.

    ``snapshot`` turns each tensor into the CPU tensor to store (default: a detached,
    contiguous view when the tensor is already on the CPU, a copy otherwise); an async save
    passes a function that clones, so training may go on changing the originals.
    """
    encoder = _Encoder(allow_pickle, snapshot or _as_cpu)
    skeleton = encoder.encode(state, "state")
    shards = _shard(encoder.tensors, encoder.groups, shard_size)
    names = {name: shard.path for shard in shards for name in shard.tensors}
    body = {"format": FORMAT, "state": skeleton, "shards": names}
    pickled = None
    if encoder.objects:
        buffer = io.BytesIO()
        torch.save(encoder.objects, buffer)
        pickled = buffer.getvalue()
    entries = dict_entries(skeleton)
    files_by_key = (
        None
        if entries is None
        else {key: shards_of([value], names) for key, value in entries.items()}
    )
    return EncodedState(json.dumps(body, allow_nan=False).encode(), shards, pickled, files_by_key)


def _as_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()


class _Encoder:
    def __init__(self, allow_pickle: bool, snapshot: Callable[[torch.Tensor], torch.Tensor]):
        self.allow_pickle = allow_pickle
        self.snapshot = snapshot
        self.tensors: dict[str, torch.Tensor] = {}
        self.groups: dict[str, str] = {}
        """Tensor name -> the top-level key of the state it sits under."""
        self.objects: list[Any] = []
        self._seen_tensors: dict[tuple[Any, ...], str] = {}
        self._active: set[int] = set()

    def encode(self, value: Any, where: str, group: str | None = None) -> Any:
        """Encode ``value`` found at ``where``; ``group`` is None only for the state itself."""
        kind = type(value)
        if value is None or kind in (str, int, bool):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._tensor(value, where, group or DEFAULT_GROUP)}
        if kind is torch.Size:
            return {"$size": list(value)}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind in (list, tuple) or isinstance(value, dict):
            return self._container(value, where, group)
        if self.allow_pickle:
            self.objects.append(value)
            return {"$pickle": len(self.objects) - 1}
        raise SerializationError(
            f"{where}: cannot save an object of type {kind.__module__}.{kind.__qualname__}; "
            f"the safe format holds {_SUPPORTED}. Convert it (to a tensor or a dict), or pass "
            "allow_pickle=True to store it with pickle (loading then needs allow_pickle=True)"
        )

    def _container(self, value: Any, where: str, group: str | None) -> Any:
        if id(value) in self._active:
            raise SerializationError(f"{where}: the state contains a reference cycle")
        self._active.add(id(value))

        def child(key: Any) -> str:  # top-level keys name the groups of shards
            return group if group is not None else _group_name(key)

        try:
            if isinstance(value, dict):
                if all(type(k) is str and not k.startswith("$") for k in value):
                    return {
                        k: self.encode(v, f"{where}[{k!r}]", child(k)) for k, v in value.items()
                    }
                return {
                    "$dict": [
                        [
                            self.encode(k, f"{where} key {k!r}", child(k)),
                            self.encode(v, f"{where}[{k!r}]", child(k)),
                        ]
                        for k, v in value.items()
                    ]
                }
            items = [self.encode(v, f"{where}[{i}]", child(None)) for i, v in enumerate(value)]
            return items if type(value) is list else {"$tuple": items}
        finally:
            self._active.discard(id(value))

    def _tensor(self, tensor: torch.Tensor, where: str, group: str) -> str:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise SerializationError(
                f"{where}: cannot save a {tensor.layout} tensor; convert it with .to_dense() first"
            )
        if tensor.device.type == "meta":
            raise SerializationError(f"{where}: a tensor on the meta device holds no data")
        if tensor.dtype not in safetensors_header.DTYPES:
            raise SerializationError(f"{where}: tensors of dtype {tensor.dtype} are not supported")
        key = (
            tensor.device,
            tensor.data_ptr(),
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
        )
        if tensor.numel() and key in self._seen_tensors:
            return self._seen_tensors[key]
        name = str(len(self.tensors))
        self.tensors[name] = self.snapshot(tensor)
        self.groups[name] = group
        if tensor.numel():
            self._seen_tensors[key] = name
        return name


def _shard(
    tensors: Mapping[str, torch.Tensor], groups: Mapping[str, str], shard_size: int
) -> list[Shard]:
    """Shards of about ``shard_size`` bytes, never mixing groups (top-level keys of the state).

    Keeping ``model``, ``optimizer`` and, say, a frozen ``ref`` model in files of their own
    means a part of the state that did not change produces byte-identical files, which an
    incremental save then copies instead of uploading.
    """
    by_group: dict[str, list[Shard]] = {}
    sizes: dict[str, int] = {}
    for name, tensor in tensors.items():
        group = groups[name]
        shards = by_group.setdefault(group, [Shard(SHARD_PATTERN.format(group, 0))])
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1].tensors and sizes.get(group, 0) + nbytes > shard_size:
            shards.append(Shard(SHARD_PATTERN.format(group, len(shards))))
            sizes[group] = 0
        shards[-1].tensors[name] = tensor
        sizes[group] = sizes.get(group, 0) + nbytes
    result = [shard for shards in by_group.values() for shard in shards]
    for shard in result:  # widest elements first keeps every tensor aligned
        shard.tensors = dict(sorted(shard.tensors.items(), key=lambda kv: -kv[1].element_size()))
    return result


def _group_name(key: object) -> str:
    """A file-name-safe group for a top-level key of the state."""
    if not isinstance(key, str) or not key:
        return DEFAULT_GROUP
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64].lstrip(".") or DEFAULT_GROUP


def decode_shard(data: bytearray | memoryview, where: str) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file, as views of ``data`` (no copy), once the safetensors
    library accepts its header (safetensors_header.parse)."""
    header = safetensors_header.parse(data, len(data), where)
    tensors = {}
    for name, entry in header.tensors.items():
        count = math.prod(entry.shape)
        if count == 0:
            tensors[name] = torch.empty(entry.shape, dtype=entry.dtype)
        else:
            flat = torch.frombuffer(data, dtype=entry.dtype, count=count, offset=entry.begin)
            tensors[name] = flat.reshape(entry.shape)
    return tensors


def decode_state(
    read: Callable[[str], bytearray | memoryview],
    *,
    where: str,
    allow_pickle: bool = False,
    keys: Sequence[str] | None = None,
    prefetch: Callable[[list[str]], None] | None = None,
) -> Any:
    """Rebuild a state; ``read(path)`` returns a verified file of the step.

    With ``keys`` (dotted paths into nested dicts, see :func:`check_keys`), only those parts,
    nested as in the state (``{"model": {"encoder": ...}}`` for ``"model.encoder"``), and only
    the shards they need are read; a key the state lacks is a NotFoundError. ``prefetch``, if
    given, is called once with every shard about to be read, before the first is read.
    """
    selected = check_keys(keys) if keys is not None else None
    try:
        body = json.loads(bytes(read(SKELETON_FILE)))
        if body.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where}: unknown state format {body.get('format')!r}")
        shard_of: dict[str, str] = body["shards"]
        skeleton = body["state"]
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: {SKELETON_FILE} is malformed ({e!r})") from e
    selection: Selection | None = None
    try:
        if selected is None:
            paths = sorted(set(shard_of.values()))
        else:
            selection = select(skeleton, selected, where)
            paths = list(shards_of(selected_parts(skeleton, selection), shard_of))
    except (AttributeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: {SKELETON_FILE} is malformed ({e!r})") from e
    if prefetch is not None:
        prefetch(paths)
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(decode_shard(read(path), f"{where}/{path}"))
    objects: list[Any] | None = None

    def load_objects() -> list[Any]:
        nonlocal objects
        if objects is None:
            if not allow_pickle:
                raise UnsafeLoadError(
                    f"{where}: this step holds pickled objects, and unpickling runs code from "
                    "the store. Load with allow_pickle=True only if you trust every writer"
                )
            objects = torch.load(io.BytesIO(read(PICKLE_FILE)), weights_only=False)
        return objects

    decoder = _Decoder(tensors, load_objects, where)
    return decoder.decode(skeleton) if selection is None else decoder.select(skeleton, selection)


@dataclass
class _Decoder:
    tensors: dict[str, torch.Tensor]
    objects: Callable[[], list[Any]]
    where: str

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag.startswith("$"):
                return self._tagged(tag, inner)
        return {k: self.decode(v) for k, v in value.items()}

    def select(self, value: Any, selection: Selection) -> dict[Any, Any]:
        """The selected parts of an encoded dict, in the state's order."""
        result = {}
        for name, inner in (dict_entries(value) or {}).items():
            if name in selection:
                within = selection[name]
                result[name] = self.decode(inner) if within is None else self.select(inner, within)
        return result

    def _tagged(self, tag: str, inner: Any) -> Any:
        try:
            if tag == "$tensor":
                return self.tensors[inner]
            if tag == "$tuple":
                return tuple(self.decode(v) for v in inner)
            if tag == "$dict":
                return {_hashable(self.decode(k)): self.decode(v) for k, v in inner}
            if tag == "$float":
                return float(inner)
            if tag == "$size":
                return torch.Size(inner)
            if tag == "$dtype" and isinstance(getattr(torch, inner, None), torch.dtype):
                return getattr(torch, inner)
            if tag == "$pickle":
                return self.objects()[inner]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: {SKELETON_FILE} refers to {tag} {inner!r}, which is missing"
            ) from e
        raise CorruptCheckpointError(f"{self.where}: {SKELETON_FILE} has unknown tag {tag!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
