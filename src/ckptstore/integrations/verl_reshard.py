"""Elastic resume for verl: turn a ``global_step_N`` saved on W ranks into the one verl would have
saved on W' ranks, so a job resumes on whatever cluster is free.

verl 0.9.1's ``FSDPCheckpointManager`` writes, per checkpointed role (``actor/``,
``critic/``), one ``model_``, ``optim_`` and ``extra_state_world_size_W_rank_R.pt`` per rank
plus ``fsdp_config.json`` (FSDP version and W) and ``huggingface/``, and loads only the files
of its own world size. This module rewrites those folders for W' ranks:

* **model and optimizer** (FSDP2, every DTensor ``Shard(0)``): each new rank gets the rows
  ``torch.chunk`` gives it on W' ranks, copied from the old ranks' shards, so gathering the
  new files gives back bit-identical full tensors; the replicated rest (optimizer step
  counters, ``param_groups``) must agree on every old rank and is kept (verl_reshard_tensors).
* **extra state** (lr scheduler and RNG states) is copied byte for byte: new rank ``r`` gets
  old rank ``r mod W``'s file. The scheduler state is the same on every rank; the RNG states
  are not, so a run resumed on another world size continues deterministically but does not
  draw the same random numbers it would have drawn on W ranks.
* ``fsdp_config.json`` gets the new world size; every other file (``huggingface/``,
  ``data.pt``, the driver's dataloader state) is kept as it is (hard-linked when possible).
* An SFT step's folder is its top level (verl_steps.role_folder), converted the same way; its
  per-data-parallel-rank dataloader states ``data_D.pt`` are rewritten for the new number of
  data-parallel ranks so the new ranks go on with the samples not yet seen
  (verl_reshard_files.reshard_loaders).

What cannot be resharded is refused before anything is written: FSDP1 (its optimizer state is
flat-parameter shards whose layout the files do not record), tensor-parallel or HSDP meshes,
rank files of a kind verl does not write, and a folder missing ranks. Output appears only
whole: it is written beside the target and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptstore.backends.fsutil import TMP_PREFIX, temp_name
from ckptstore.domain import layout
from ckptstore.errors import (
    CompatibilityError,
    ConfigError,
    ConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ckptstore.integrations.verl_reshard_files import convert_folder, reshard_loaders
from ckptstore.integrations.verl_sft_files import DATA_FILE
from ckptstore.integrations.verl_steps import RANK_FILE
from ckptstore.store import CheckpointStore

log = logging.getLogger(__name__)

SHARDED_KINDS = ("model", "optim")
COPIED_KINDS = ("extra_state",)
FSDP_CONFIG = "fsdp_config.json"
_SKIPPED = (TMP_PREFIX, ".ckptstore-")


@dataclass(frozen=True)
class Resharded:
    """What :func:`reshard_dir` did: the folders it converted (``actor``, ``critic``) and the
    world sizes before and after."""

    source_world_size: int
    world_size: int
    folders: tuple[str, ...]


def world_size_of(paths: Iterable[str], *, where: str = "the step") -> int | None:
    """The world size the rank files among ``paths`` (relative paths) were saved on; None when
    there are none. Files of several world sizes in one step are a ConflictError."""
    worlds = {int(m["world"]) for p in paths if (m := RANK_FILE.match(p.rpartition("/")[2]))}
    if len(worlds) > 1:
        raise ConflictError(
            f"{where} holds rank files of world sizes {sorted(worlds)}; a step is saved on one "
            "world size, so some files are stale copies: delete them and pull the step again"
        )
    return worlds.pop() if worlds else None


def reshard_dir(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    world_size: int,
    *,
    data_ranks: int | None = None,
) -> Resharded:
    """Write ``src`` (a verl ``global_step_N``) resharded for ``world_size`` ranks into ``dst``,
    which must not exist or be empty; ``dst`` appears only once complete. ``data_ranks`` is
    the new job's data-parallel size, for an SFT step's ``data_D.pt`` files (default:
    ``world_size``)."""
    source, target = Path(src), Path(dst)
    _check_world(world_size)
    _check_world(world_size if data_ranks is None else data_ranks)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConflictError(
            f"{target} exists and is not an empty directory; choose a new output directory",
            path=str(target),
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name(target.name)
    tmp.mkdir()
    try:
        done = _convert(source, tmp, world_size, data_ranks or world_size)
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return done


def reshard_in_place(
    step_dir: str | os.PathLike[str], world_size: int, *, data_ranks: int | None = None
) -> Resharded | None:
    """Reshard a local ``global_step_N`` for ``world_size`` ranks where it is; None (and nothing
    touched) when it is missing or already saved on ``world_size`` ranks."""
    root = Path(step_dir)
    if not root.is_dir():
        return None
    old = world_size_of((p.name for p in root.rglob("*.pt")), where=str(root))
    if old is None or old == world_size:
        return None
    new = root.parent / temp_name(f"reshard-{root.name}")
    done = reshard_dir(root, new, world_size, data_ranks=data_ranks)
    aside = root.parent / temp_name(f"old-{root.name}")
    os.replace(root, aside)
    os.replace(new, root)
    shutil.rmtree(aside, ignore_errors=True)
    return done


def reshard_from_store(
    store: CheckpointStore, step: int, dst: str | os.PathLike[str], world_size: int
) -> Resharded:
    """Pull ``step`` (every byte verified, signatures too in a signed store) beside ``dst`` and
    reshard it into ``dst`` for ``world_size`` ranks; the store is not changed."""
    _check_world(world_size)
    target = Path(dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    pulled = target.parent / temp_name(f"pull-{layout.step_dir(step)}")
    try:
        store.pull_dir(pulled, step=step, fallback=False)
        return reshard_dir(pulled, target, world_size)
    finally:
        shutil.rmtree(pulled, ignore_errors=True)


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"the world size to reshard for must be a positive integer, got {world_size!r}"
        )


def _convert(src: Path, out: Path, world: int, data_ranks: int) -> Resharded:
    ranked: dict[str, dict[str, dict[int, Path]]] = {}
    others: list[tuple[str, Path]] = []
    loaders: dict[int, Path] = {}
    old_worlds: dict[str, int] = {}
    for rel, path in _files(src):
        folder, _, name = rel.rpartition("/")
        match = RANK_FILE.match(name)
        if match is None and not folder and (data := DATA_FILE.match(name)):
            loaders[int(data["dp"])] = path
            continue
        if match is None:
            others.append((rel, path))
            continue
        ranked.setdefault(folder, {}).setdefault(match["kind"], {})[int(match["rank"])] = path
        old_worlds.setdefault(folder, int(match["world"]))
        if old_worlds[folder] != int(match["world"]):
            raise ConflictError(
                f"{src / folder} holds rank files of world sizes {old_worlds[folder]} and "
                f"{match['world']}; delete the stale ones and pull the step again",
                path=str(src / folder),
            )
    if not ranked:
        raise IncompleteCheckpointError(
            f"{src} holds no *_world_size_W_rank_R.pt files: not a verl FSDP checkpoint",
            path=str(src),
        )
    for folder, kinds in sorted(ranked.items()):
        _check_folder(src / folder, kinds, old_worlds[folder])
    sources = {old_worlds[f] for f in ranked}
    if len(sources) > 1:
        raise ConflictError(f"{src}: roles saved on different world sizes {sorted(sources)}")
    for rel, path in others:
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        folder, _, name = rel.rpartition("/")
        if name == FSDP_CONFIG and folder in ranked:
            target.write_text(json.dumps(_fsdp_config(path) | {"world_size": world}, indent=4))
        else:
            _link_or_copy(path, target)
    for folder, kinds in sorted(ranked.items()):
        convert_folder(src / folder, out / folder, kinds, old_worlds[folder], world)
    _copy_loaders(src, loaders, out, data_ranks)
    done = Resharded(sources.pop(), world, tuple(sorted(f or "." for f in ranked)))
    log.info(
        "resharded %s from %d to %d ranks (%s)", src, done.source_world_size, world, done.folders
    )
    return done


def _check_folder(folder: Path, kinds: dict[str, dict[int, Path]], old: int) -> None:
    config_path = folder / FSDP_CONFIG
    if not config_path.is_file():
        raise IncompleteCheckpointError(
            f"{config_path} is missing: verl writes it with every FSDP checkpoint, and without it "
            "the FSDP version is unknown",
            path=str(config_path),
        )
    config = _fsdp_config(config_path)
    if config.get("FSDP_version") != 2:
        raise CompatibilityError(
            f"{config_path}: FSDP_version {config.get('FSDP_version')!r}; only FSDP2 checkpoints "
            "can be resharded (FSDP1's optimizer state is flat-parameter shards whose layout the "
            f"files do not record). Resume on {old} ranks, or train with "
            "actor_rollout_ref.actor.strategy=fsdp2 (and critic.strategy=fsdp2)",
            path=str(config_path),
        )
    if config.get("world_size") != old:
        raise CorruptCheckpointError(
            f"{config_path} says world_size {config.get('world_size')!r} but the rank files are "
            f"for {old} ranks",
            path=str(config_path),
        )
    unknown = sorted(set(kinds) - set(SHARDED_KINDS) - set(COPIED_KINDS))
    if unknown:
        raise CompatibilityError(
            f"{folder}: rank files of kind {', '.join(unknown)}, which verl's FSDP checkpoint "
            "manager does not write; refusing to guess how to reshard them",
            path=str(folder),
        )
    for kind, ranks in sorted(kinds.items()):
        missing = sorted(set(range(old)) - set(ranks))
        extra = sorted(set(ranks) - set(range(old)))
        if missing or extra:
            raise IncompleteCheckpointError(
                f"{folder}: {kind}_world_size_{old}_rank_R.pt is missing rank(s) "
                f"{missing or 'none'} (unexpected: {extra or 'none'}); a step whose rank files "
                "are incomplete cannot be resharded",
                path=str(folder),
            )


def _copy_loaders(src: Path, loaders: dict[int, Path], out: Path, data_ranks: int) -> None:
    """An SFT step's ``data_D.pt`` for each new data-parallel rank."""
    if not loaders:
        return
    missing = sorted(set(range(len(loaders))) - set(loaders))
    if missing:
        raise IncompleteCheckpointError(
            f"{src}: the dataloader states data_D.pt are {sorted(loaders)}, missing "
            f"data_{missing[0]}.pt; pull the step again (every rank's loader state is needed)",
            path=str(src),
        )
    reshard_loaders([loaders[d] for d in range(len(loaders))], out, data_ranks)


def _fsdp_config(path: Path) -> dict[str, object]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e})", path=str(path)) from e
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object", path=str(path))
    return config


def _files(root: Path) -> list[tuple[str, Path]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(_SKIPPED)]
        for name in filenames:
            if not name.startswith(_SKIPPED):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


__all__ = [
    "COPIED_KINDS",
    "RANK_FILE",
    "SHARDED_KINDS",
    "Resharded",
    "reshard_dir",
    "reshard_from_store",
    "reshard_in_place",
    "world_size_of",
]
