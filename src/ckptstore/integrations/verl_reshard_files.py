"""One role folder (``actor/``, ``critic/``) of a verl FSDP2 step, rewritten for W' ranks: the
rank files in, the rank files out, one new rank at a time.

All W input files of a kind are memory-mapped together (their bytes are read on demand, from
the page cache), and each output file is built in its own scratch file and saved before the
next one starts, so memory holds metadata, not tensors (see verl_reshard_tensors).
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptstore.backends.fsutil import temp_path
from ckptstore.errors import CompatibilityError, CorruptCheckpointError
from ckptstore.integrations.verl_reshard_tensors import (
    EXTRA_STATE_GLOBALS,
    RankBuilder,
    Scratch,
    check_globals,
    load_rank_file,
)


def convert_folder(
    src: Path, out: Path, kinds: Mapping[str, Mapping[int, Path]], old: int, world: int
) -> None:
    """Write every kind of rank file of ``src`` (saved on ``old`` ranks) for ``world`` ranks."""
    out.mkdir(parents=True, exist_ok=True)
    for kind, ranks in sorted(kinds.items()):
        paths = [ranks[r] for r in range(old)]
        if kind == "extra_state":
            _copy_extra_state(paths, out, world)
        else:
            _reshard_kind(kind, paths, out, world)


def rank_file(kind: str, world: int, rank: int) -> str:
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


def _reshard_kind(kind: str, paths: list[Path], out: Path, world: int) -> None:
    trees = [load_rank_file(p) for p in paths]
    name = f"{paths[0].parent.name}/{kind}"
    for rank in range(world):
        scratch = Scratch(out)
        try:
            state = RankBuilder(name, len(paths), world, rank, scratch).build(trees)
            target = out / rank_file(kind, world, rank)
            tmp = temp_path(target)
            torch.save(state, tmp)
            del state
            os.replace(tmp, target)
        finally:
            scratch.close()


def _copy_extra_state(paths: list[Path], out: Path, world: int) -> None:
    """New rank ``r`` gets old rank ``r mod W``'s scheduler and RNG state, byte for byte."""
    for path in paths:
        check_globals(path, EXTRA_STATE_GLOBALS)
    for rank in range(world):
        shutil.copyfile(paths[rank % len(paths)], out / rank_file("extra_state", world, rank))


def reshard_loaders(paths: Sequence[Path], out: Path, data_ranks: int) -> None:
    """An SFT step's dataloader states (``data_D.pt``, one per old data-parallel rank, in
    order) for ``data_ranks`` new ones.

    Every rank's loader is at the same step, and verl's ``DistributedSampler`` gives rank r of
    D the positions r, r+D, ... of one permutation (seeded by epoch, not by D), so after ``n``
    samples on each of D ranks the job consumed the permutation's first ``n*D``. New rank d
    gets old ``d mod D``'s state with every ``samples_yielded`` set to ``n*D/D'``: the new
    ranks go on with exactly the samples not yet seen (when the data set divides by both
    sizes; else the epoch's padding differs). Batches counted stay: they are steps.
    """
    old = len(paths)
    if old == data_ranks:
        for rank, path in enumerate(paths):
            shutil.copyfile(path, out / f"data_{rank}.pt")
        return
    states = [_load_loader(path) for path in paths]
    for rank in range(data_ranks):
        state = copy.deepcopy(states[rank % old])
        _rescale(state, old, data_ranks, paths[rank % old])
        target = out / f"data_{rank}.pt"
        tmp = temp_path(target)
        torch.save(state, tmp)
        os.replace(tmp, target)


def _load_loader(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CompatibilityError(
            f"{path}: the dataloader state holds objects beyond plain values ({e}); a custom "
            "sampler or dataset state cannot be split over another number of ranks. Resume on "
            "the data-parallel size it was saved on",
            path=str(path),
        ) from e
    except (OSError, RuntimeError, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e})", path=str(path)) from e


def _rescale(state: Any, old: int, new: int, path: Path) -> None:
    """Every ``_sampler_iter_state.samples_yielded`` (the main process's and each worker
    snapshot's) from per-rank of ``old`` ranks to per-rank of ``new``."""
    if isinstance(state, list):
        for value in state:
            _rescale(value, old, new, path)
        return
    if not isinstance(state, dict):
        return
    sampler = state.get("_sampler_iter_state")
    if isinstance(sampler, dict) and isinstance(sampler.get("samples_yielded"), int):
        total = sampler["samples_yielded"] * old
        if total % new:
            raise CompatibilityError(
                f"{path}: {total} samples consumed over {old} ranks do not split evenly over "
                f"{new}; resume on a data-parallel size that divides data.train_batch_size",
                path=str(path),
            )
        sampler["samples_yielded"] = total // new
    for key, value in state.items():
        if key != "_sampler_iter_state":
            _rescale(value, old, new, path)


__all__ = ["convert_folder", "rank_file", "reshard_loaders"]
