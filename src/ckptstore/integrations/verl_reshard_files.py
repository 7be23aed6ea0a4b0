"""One role folder (``actor/``, ``critic/``) of a verl FSDP2 step, rewritten for W' ranks: the
rank files in, the rank files out, one new rank at a time.

All W input files of a kind are memory-mapped together (their bytes are read on demand, from
the page cache), and each output file is built in its own scratch file and saved before the
next one starts, so memory holds metadata, not tensors (see verl_reshard_tensors).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from ckptstore.backends.fsutil import temp_path
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


__all__ = ["convert_folder", "rank_file"]
