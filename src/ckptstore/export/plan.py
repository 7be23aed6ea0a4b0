"""What an export writes, as plain values: each tensor, where its bytes lie, which file it goes to.

Every source format (verl rank files, DCP, ckptstore's own) is turned into
:class:`SourceTensor` values: a name, a dtype, a full shape, and the :class:`Piece` values that
tile it, each a run of contiguous bytes in one file of the step. FSDP2's ``Shard(0)`` gives
one piece per rank holding ``torch.chunk``'s rows; a replicated tensor (a buffer, anything
FSDP did not shard) gives one piece, and its copies on the other ranks are ``replicas`` that
must hold the same bytes: taken once, never concatenated. Nothing here reads a byte.

The output side: names mapped (:class:`KeyMap`), tensors that alias one another written once
where Hugging Face ties them again on load (:func:`drop_tied`), dtypes converted only when
asked, and shards cut as ``save_pretrained`` cuts them (:func:`plan_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ckptstore.errors import ConfigError, CorruptCheckpointError

LEAD_MAX = 64 << 10
"""A piece's read starts this much early at most, to take the gap before it (an archive's
record headers) in the same request instead of reading it separately when checking the file."""
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""What ``--dtype`` takes."""


@dataclass(frozen=True)
class Piece:
    """Contiguous bytes of a tensor (or of a block of it) in one file of the step.

    The read covers ``[start, end)``; the data are ``nbytes`` from ``start + lead``. Bytes
    before the data (``lead``) and after it are read only so that checking the file needs no
    request for them; ``expect`` says what the lead must hold (a DCP item's archive header).
    ``offsets`` and ``shape`` place the piece in the full tensor.
    """

    path: str
    start: int
    nbytes: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    lead: int = 0
    end: int | None = None
    expect: bytes | None = None

    @property
    def data_start(self) -> int:
        return self.start + self.lead

    @property
    def stop(self) -> int:
        return self.end if self.end is not None else self.data_start + self.nbytes


@dataclass(frozen=True)
class SourceTensor:
    """A full tensor of the step: where each block of it lies, and the copies to compare."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    replicas: tuple[Piece, ...] = ()
    where: str = ""
    """The file(s) it comes from, for messages."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def rows_in_order(self) -> bool:
        """Whether the pieces are blocks of whole rows, in order, so they stream into the
        output as they are read (FSDP2's shards are; a tensor-parallel split is not)."""
        if not self.shape:
            return len(self.pieces) == 1
        position = 0
        for piece in self.pieces:
            whole_rows = piece.shape[1:] == self.shape[1:] and not any(piece.offsets[1:])
            if not whole_rows or piece.offsets[0] != position:
                return False
            position += piece.shape[0]
        return position == self.shape[0]

    def check(self) -> None:
        """Raise unless the pieces tile the tensor exactly (sizes and boxes)."""
        size = self.dtype.itemsize
        covered = 0
        for piece in self.pieces:
            if piece.nbytes != math.prod(piece.shape) * size or len(piece.offsets) != len(
                self.shape
            ):
                raise self._bad(f"a piece of {piece.shape} holds {piece.nbytes} bytes")
            if any(
                o + s > d for o, s, d in zip(piece.offsets, piece.shape, self.shape, strict=True)
            ):
                raise self._bad(f"a piece at {piece.offsets} of {piece.shape} lies outside")
            covered += math.prod(piece.shape)
        if covered != math.prod(self.shape):
            raise self._bad(f"its pieces hold {covered} of {math.prod(self.shape)} elements")
        for replica in self.replicas:
            if replica.nbytes != self.nbytes:
                raise self._bad(f"a copy of it holds {replica.nbytes} bytes, not {self.nbytes}")

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {self.name} of shape {self.shape}: {what}; the step's files do not "
            "add up to this tensor"
        )


@dataclass(frozen=True)
class Merged:
    """A LoRA-merged weight: ``base + scale * (b @ a)``, computed in float32 (lora.py)."""

    name: str
    base: SourceTensor
    a: SourceTensor
    b: SourceTensor
    scale: float

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


Source = SourceTensor | Merged


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the exported model: its name, the dtype written, and where it comes from."""

    name: str
    dtype: torch.dtype
    source: Source

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OutShard:
    path: str
    tensors: tuple[OutTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class KeyMap:
    """Renames by prefix: the first rule whose ``old`` starts a name replaces it with ``new``.

    With rules, a name no rule matches is left out (``model.=`` exports a DCP state's model and
    not its optimizer); without rules every name stays as it is.
    """

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, given: Iterable[str] | Mapping[str, str] | None) -> KeyMap:
        if given is None:
            return cls()
        if isinstance(given, Mapping):
            pairs = list(given.items())
        else:
            pairs = []
            for text in given:
                old, sep, new = text.partition("=")
                if not sep:
                    raise ConfigError(
                        f"key prefix map {text!r} is not OLD=NEW (e.g. 'model.=' to drop the "
                        "'model.' prefix, 'module.=model.' to rename it)"
                    )
                pairs.append((old, new))
        return cls(tuple(pairs))

    def apply(self, name: str) -> str | None:
        if not self.rules:
            return name
        for old, new in self.rules:
            if name.startswith(old):
                return new + name[len(old) :]
        return None


@dataclass
class Aliases:
    """Names that share their bytes in the step (tied weights): ``groups`` by first name."""

    groups: dict[str, list[str]] = field(default_factory=dict)

    def add(self, names: Sequence[str]) -> None:
        if len(names) > 1:
            self.groups[names[0]] = list(names)


def drop_tied(names: Sequence[str], aliases: Aliases, tied: bool | None) -> dict[str, str]:
    """The names to leave out, each with the name it repeats.

    safetensors cannot hold two names for one storage, and Hugging Face models tie the output
    embedding to the input one again on load when ``tie_word_embeddings`` is set; with both
    names written, transformers 5 does not tie them. So a group of aliases is written once,
    under its first name (the input embedding comes before ``lm_head`` in a model's state
    dict), unless the config says the weights are not tied (``tied`` is False): then every
    name gets its own copy of the bytes.
    """
    if tied is False:
        return {}
    present = set(names)
    dropped: dict[str, str] = {}
    for group in aliases.groups.values():
        kept = [n for n in group if n in present]
        for name in kept[1:]:
            dropped[name] = kept[0]
    return dropped


def plan_shards(tensors: Sequence[OutTensor], shard_size: int) -> list[OutShard]:
    """Tensors cut into files of at most ``shard_size`` bytes in order, as ``save_pretrained``
    cuts them: a tensor larger than that gets a file of its own."""
    if shard_size < 1:
        raise ConfigError(f"shard size must be positive, got {shard_size}")
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    count = len(groups)
    return [OutShard(SHARD_NAME.format(i + 1, count), tuple(g)) for i, g in enumerate(groups)]


def out_dtype(source: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """The dtype written: ``wanted`` for floating-point tensors when asked, else the source's."""
    if wanted is not None and source.is_floating_point:
        return wanted
    return source


def with_leads(tensors: Sequence[SourceTensor]) -> list[SourceTensor]:
    """Start each piece's read at the end of the piece before it in the same file, when the
    gap is small: the record headers between tensors come with the data, not in a request of
    their own when the file is checked."""
    ends: dict[str, list[tuple[int, int]]] = {}
    for tensor in tensors:
        for piece in (*tensor.pieces, *tensor.replicas):
            if piece.lead == 0 and piece.expect is None:
                ends.setdefault(piece.path, []).append((piece.start, piece.stop))
    leads: dict[tuple[str, int], int] = {}
    for path, spans in ends.items():
        previous = None
        for start, stop in sorted(set(spans)):
            if previous is not None and 0 < start - previous <= LEAD_MAX:
                leads[(path, start)] = start - previous
            previous = stop if previous is None else max(previous, stop)

    def lead(piece: Piece) -> Piece:
        extra = leads.get((piece.path, piece.start), 0) if piece.expect is None else 0
        if not extra or piece.lead:
            return piece
        return replace(piece, start=piece.start - extra, lead=extra)

    return [
        replace(
            t,
            pieces=tuple(lead(p) for p in t.pieces),
            replicas=tuple(lead(p) for p in t.replicas),
        )
        for t in tensors
    ]


__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "SHARD_NAME",
    "Aliases",
    "KeyMap",
    "Merged",
    "OutShard",
    "OutTensor",
    "Piece",
    "Source",
    "SourceTensor",
    "drop_tied",
    "out_dtype",
    "plan_shards",
    "with_leads",
]
