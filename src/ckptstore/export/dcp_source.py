"""The tensors of a DCP step (``dcp.save`` through ckptstore's CkptStoreWriter), found by name.

DCP's ``.metadata`` lists each tensor's chunks (offsets and sizes in the full tensor) and where
each chunk lies: a byte range of a rank's ``.distcp`` file holding ``torch.save`` of the chunk.
That archive's layout depends on the chunk's dtype and shape alone (archives.item_layout), so
a chunk is read as one range: the archive's header, checked against the layout it must have,
then the chunk's bytes, then the archive's tail. No chunk is unpickled.

``.metadata`` is read as dcp.py reads it (dcp_unpickle: DCP's classes only). Names are DCP's
flattened keys (``model.layers.0.mlp.up_proj.weight`` for a state saved as ``{"model": ...}``);
hf.py maps them (``--key-prefix-map``, by default ``model.`` dropped). Non-tensor items and a
chunk with DCP stream transforms are left out, and said so.
"""

from __future__ import annotations

import math
from collections.abc import Container

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ckptstore.errors import CompatibilityError, CorruptCheckpointError
from ckptstore.export.archives import item_layout
from ckptstore.export.found import Found, hf_files
from ckptstore.export.plan import Piece, SourceTensor
from ckptstore.export.source import StepSource
from ckptstore.integrations.dcp import METADATA_FILE
from ckptstore.integrations.dcp_unpickle import load_metadata


def is_dcp(paths: Container[str]) -> bool:
    return METADATA_FILE in paths


def find_dcp(source: StepSource) -> Found:
    where = source.where(METADATA_FILE)
    metadata = load_metadata(source.whole(METADATA_FILE), where, allow_pickle=False)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where} has no storage table", uri=where)
    found = Found("dcp", [], hf_files=hf_files(source.entries, "huggingface"))
    ranks: set[str] = set()
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            found.skipped.append(fqn)
            continue
        dtype = meta.properties.dtype
        shape = tuple(meta.size)
        pieces = []
        for chunk in meta.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if not isinstance(info, _StorageInfo):
                raise CorruptCheckpointError(
                    f"{where}: {fqn} has a chunk at {tuple(chunk.offsets)} that no file holds",
                    uri=where,
                )
            if info.transform_descriptors:
                raise CompatibilityError(
                    f"{where}: {fqn} is stored with DCP stream transforms "
                    f"{list(info.transform_descriptors)}, which an export does not undo",
                    uri=where,
                )
            ranks.add(info.relative_path)
            sizes = tuple(chunk.sizes)
            nbytes = math.prod(sizes) * dtype.itemsize
            if not nbytes:
                continue
            head, length = item_layout(dtype, sizes)
            if length != info.length:
                raise CorruptCheckpointError(
                    f"{source.where(info.relative_path)}: {fqn} at {tuple(chunk.offsets)} takes "
                    f"{info.length} bytes, but torch.save of a {dtype} tensor of {sizes} takes "
                    f"{length}; the item is not a saved tensor of its metadata's shape"
                )
            pieces.append(
                Piece(
                    info.relative_path,
                    info.offset,
                    nbytes,
                    tuple(chunk.offsets),
                    sizes,
                    lead=len(head),
                    end=info.offset + info.length,
                    expect=head,
                )
            )
        pieces.sort(key=lambda p: p.offsets)
        tensor = SourceTensor(fqn, dtype, shape, tuple(pieces), where=where)
        tensor.check()
        found.tensors.append(tensor)
    found.world_size = max(len(ranks), 1)
    return found


__all__ = ["find_dcp", "is_dcp"]
