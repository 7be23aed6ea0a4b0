"""The model of a verl FSDP step (``actor/`` or ``critic/``; an SFT step's top level), found
tensor by tensor.

verl 0.9.1's FSDPCheckpointManager saves ``model.state_dict()`` on every rank as
``{role}/model_world_size_W_rank_R.pt`` (the SFT trainer at the step's top level: the
role's folder is verl_steps.role_folder's). Under FSDP2 a parameter is a DTensor ``Shard(0)`` on a
1-D mesh of the W ranks, each rank holding ``torch.chunk``'s rows (the last ranks fewer, or
none); what FSDP did not shard (buffers, and on one rank everything, as plain tensors) is a
plain tensor, replicated on every rank. So a full tensor is its ranks' rows in order, and a
plain one is rank 0's copy, the others compared with it (verl's ``model_merger`` concatenated
them until verl#7610; here that case never arises). The shard rules are the elastic resume's
(verl_reshard_tensors: ``chunk_range``, ``check_shard``).

Names that share a storage in the files (tied embeddings: FSDP2 keeps one parameter under two
names) are recorded as aliases. ``fsdp_config.json`` is checked when present and not required
(older layouts lack it, verl#2252); the world size comes from the file names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptstore.errors import (
    CompatibilityError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotFoundError,
)
from ckptstore.export.archives import load_metas, tensor_span
from ckptstore.export.found import Found, hf_files, json_object
from ckptstore.export.plan import Piece, SourceTensor
from ckptstore.export.source import StepSource
from ckptstore.integrations.verl_reshard import FSDP_CONFIG, world_size_of
from ckptstore.integrations.verl_reshard_tensors import check_shard, chunk_range
from ckptstore.integrations.verl_steps import RANK_FILE, in_folder, rank_file, role_folder

LORA_META = "lora_train_meta.json"


def model_files(source: StepSource, role: str) -> dict[int, str]:
    """Rank -> path of ``{role}/model_world_size_W_rank_R.pt`` (an SFT step: at the top
    level); empty if the role has none."""
    found: dict[int, str] = {}
    folder = role_folder(source.entries, role)
    paths = [p for p in source.entries if p.rpartition("/")[0] == folder]
    world_size_of(paths, where=source.where(folder))  # several world sizes: ConflictError
    for path in paths:
        match = RANK_FILE.match(path.rpartition("/")[2])
        if match is not None and match["kind"] == "model":
            found[int(match["rank"])] = path
    return found


def find_verl(source: StepSource, role: str) -> Found:
    folder = role_folder(source.entries, role)
    files = model_files(source, folder)
    if not files:
        roles = sorted(
            {held.folder or "(top level)" for p in source.entries if (held := rank_file(p))}
        )
        raise NotFoundError(
            f"{source.where(folder)}: no model_world_size_W_rank_R.pt files, so no verl model "
            f"for role {role!r} (roles with rank files: {', '.join(roles) or 'none'}); pass "
            "--role critic for a critic",
            uri=source.info.uri,
            step=source.step,
        )
    world = len(files)
    expected = RANK_FILE.match(files[min(files)].rpartition("/")[2])
    assert expected is not None
    declared = int(expected["world"])
    missing = sorted(set(range(declared)) - set(files))
    if missing or world != declared:
        raise IncompleteCheckpointError(
            f"{source.where(folder)}: model files of {declared} ranks, rank(s) {missing} missing; "
            "a step whose rank files are incomplete cannot be exported",
            uri=source.info.uri,
            step=source.step,
        )
    _check_fsdp_config(source, folder, world)
    trees = load_metas(source, [files[r] for r in range(world)])
    found = Found("verl", [], world_size=world)
    found.hf_files = hf_files(source.entries, in_folder(folder, "huggingface"))
    meta_path = in_folder(folder, LORA_META)
    if meta_path in source.entries:
        found.lora_meta = json_object(source.whole(meta_path), source.where(meta_path))
    _collect(found, trees, [files[r] for r in range(world)], source)
    return found


def _check_fsdp_config(source: StepSource, folder: str, world: int) -> None:
    path = in_folder(folder, FSDP_CONFIG)
    if path not in source.entries:
        return  # older layouts (verl#2252): the file names say the world size
    config = json_object(source.whole(path), source.where(path))
    if config.get("FSDP_version") == 1:
        raise CompatibilityError(
            f"{source.where(path)}: FSDP_version 1. FSDP1 rank files hold flat-parameter "
            "shards (ShardedTensor), which an export does not read; train with "
            "actor_rollout_ref.actor.strategy=fsdp2, or use verl's model_merger for this step",
            uri=source.where(path),
            step=source.step,
        )
    if config.get("world_size", world) != world:
        raise CorruptCheckpointError(
            f"{source.where(path)} says world_size {config.get('world_size')!r} but the model "
            f"files are for {world} ranks",
            uri=source.where(path),
            step=source.step,
        )


def _collect(found: Found, trees: Sequence[Any], paths: Sequence[str], source: StepSource) -> None:
    first = trees[0]
    if not isinstance(first, dict):
        raise CorruptCheckpointError(
            f"{source.where(paths[0])} holds a {type(first).__name__}, not a state dict"
        )
    for rank, tree in enumerate(trees[1:], start=1):
        if not isinstance(tree, dict) or list(tree) != list(first):
            raise CorruptCheckpointError(
                f"{source.where(paths[rank])} holds other names than rank 0's file; the files "
                "do not belong to one step"
            )
    shares: dict[tuple[Any, ...], list[str]] = {}
    for name, value in first.items():
        nodes = [tree[name] for tree in trees]
        where = f"{source.where(paths[0])}: {name}"
        if isinstance(value, DTensor):
            tensor, key = _sharded(name, nodes, paths, where)
        elif isinstance(value, torch.Tensor):
            tensor, key = _replicated(name, nodes, paths, where)
        else:
            found.skipped.append(name)
            continue
        tensor.check()
        found.tensors.append(tensor)
        if tensor.nbytes:
            shares.setdefault(key, []).append(name)
    for names in shares.values():
        found.aliases.add(names)


def _sharded(
    name: str, nodes: Sequence[Any], paths: Sequence[str], where: str
) -> tuple[SourceTensor, tuple[Any, ...]]:
    first: DTensor = nodes[0]
    shape = tuple(first.shape)
    world = len(nodes)
    pieces = []
    for rank, node in enumerate(nodes):
        if not isinstance(node, DTensor):
            raise CorruptCheckpointError(f"{where} is a DTensor on some ranks only")
        check_shard(node, world, rank, shape, f"{paths[rank]}: {name}")
        if node.dtype != first.dtype:
            raise CorruptCheckpointError(f"{where}: dtype {node.dtype} on rank {rank}")
        lo, hi = chunk_range(shape[0], world, rank)
        if hi > lo:
            start, nbytes = tensor_span(node._local_tensor, name=f"{paths[rank]}: {name}")
            offsets = (lo, *[0] * (len(shape) - 1))
            pieces.append(Piece(paths[rank], start, nbytes, offsets, (hi - lo, *shape[1:])))
    tensor = SourceTensor(name, first.dtype, shape, tuple(pieces), where=where)
    return tensor, tuple((p.path, p.start, p.nbytes) for p in pieces)


def _replicated(
    name: str, nodes: Sequence[Any], paths: Sequence[str], where: str
) -> tuple[SourceTensor, tuple[Any, ...]]:
    first: torch.Tensor = nodes[0]
    copies = []
    for rank, node in enumerate(nodes):
        if (
            not isinstance(node, torch.Tensor)
            or isinstance(node, DTensor)
            or node.shape != first.shape
            or node.dtype != first.dtype
        ):
            raise CorruptCheckpointError(
                f"{where}: a plain {first.dtype} tensor of shape {tuple(first.shape)} on rank 0, "
                f"not on rank {rank}; replicated tensors must be the same on every rank"
            )
        start, nbytes = tensor_span(node, name=f"{paths[rank]}: {name}")
        offsets = tuple(0 for _ in first.shape)
        copies.append(Piece(paths[rank], start, nbytes, offsets, tuple(first.shape)))
    pieces = tuple(copies[:1]) if copies[0].nbytes else ()
    replicas = tuple(copies[1:]) if copies[0].nbytes else ()
    tensor = SourceTensor(name, first.dtype, tuple(first.shape), pieces, replicas, where=where)
    return tensor, tuple((p.path, p.start, p.nbytes) for p in copies)


__all__ = ["LORA_META", "find_verl", "model_files"]
