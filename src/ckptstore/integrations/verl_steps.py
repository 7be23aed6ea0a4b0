"""What a verl step directory must hold, and which node uploads which of its files.

Pure functions over listings (no I/O), so the rules are tested with plain values: every path
once, by a node that holds it (:func:`assign_files`), and a step that lacks what verl needs to
resume from it is never committed (:func:`check_complete`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ckptstore.domain import layout
from ckptstore.errors import ConfigError, ConflictError, IncompleteCheckpointError

RANK_FILE = re.compile(r"^(?P<kind>.+)_world_size_(?P<world>\d+)_rank_(?P<rank>\d+)\.pt$")
"""The per-rank files verl's FSDP checkpoint manager writes: ``{kind}_world_size_W_rank_R.pt``."""

Placement = Mapping[str, Sequence[str]]
"""Where verl placed each role's ranks: role folder (``actor``, ``critic``) -> the node of
rank 0, 1, ... (read from the placed worker groups, verl_placement.py)."""


class RankFile(NamedTuple):
    folder: str
    kind: str
    world: int
    rank: int


def rank_file(path: str) -> RankFile | None:
    """``actor/model_world_size_4_rank_2.pt`` -> ``("actor", "model", 4, 2)``; None for the
    files every rank shares (``data.pt``, ``huggingface/``, ``fsdp_config.json``)."""
    folder, _, name = path.rpartition("/")
    match = RANK_FILE.match(name)
    if match is None:
        return None
    return RankFile(folder, match["kind"], int(match["world"]), int(match["rank"]))


DEFAULT_ROLE = "actor"
"""The role an export or a resume means when none is named: the PPO trainer's policy, and the
one model of an SFT step."""


def role_folder(paths: Iterable[str], role: str = DEFAULT_ROLE) -> str:
    """The folder of a step that holds ``role``'s rank files and ``huggingface/``: ``role`` in
    a PPO step (``actor/``, ``critic/``); the top level (``""``) in an SFT step, whose rank
    files verl's SFT trainer saves there. An SFT step has one model, the default role's (or
    ``""``); another role of it is a ConfigError."""
    found = [held for p in paths if (held := rank_file(p)) is not None]
    if not any(held.folder == "" for held in found) or any(held.folder == role for held in found):
        return role
    if role not in (DEFAULT_ROLE, ""):
        raise ConfigError(
            f"this step holds rank files at its top level: a verl SFT step, whose one model is "
            f"not in a role folder, so it has no role {role!r}; leave the role out "
            f"({DEFAULT_ROLE})"
        )
    return ""


def in_folder(folder: str, name: str) -> str:
    """``name`` inside a step's ``folder`` (``""``: the top level)."""
    return f"{folder}/{name}" if folder else name


def node_shares(
    paths: Sequence[str], placement: Placement, nodes: Sequence[str]
) -> dict[str, list[str]] | None:
    """The files of a step each node needs to load it where verl placed its ranks: every
    shared file, and the rank files of the ranks it hosts; a rank file of a role the
    placement does not name goes to every node. None when the step's rank files are of
    another world size than the placement's (the step is resharded, which reads them all)."""
    shares: dict[str, list[str]] = {node: [] for node in nodes}
    for path in sorted(paths):
        found = rank_file(path)
        ranks = placement.get(found.folder) if found is not None else None
        if found is None or ranks is None:
            for share in shares.values():
                share.append(path)
            continue
        if found.world != len(ranks):
            return None
        node = ranks[found.rank]
        if node not in shares:
            raise ConfigError(
                f"rank {found.rank} of {found.folder}/ runs on node {node}, which has no "
                f"ckptstore agent, so it could not load {path}; the agents' node list is "
                "out of date (a node joined after the resume began): restart the job",
                path=path,
            )
        shares[node].append(path)
    return shares


def assign_files(
    listings: Mapping[str, Sequence[tuple[str, int]]], step: int
) -> dict[str, list[str]]:
    """Which node uploads which file of ``step``: each path exactly once, by a node that holds it.

    A path held by several nodes (shared storage, or a leftover) goes to the least loaded of
    them, largest files first, so shared storage still uploads in parallel. Copies of one path
    that differ in size mean stale files on some node: a ConflictError names them.
    """
    sizes: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for node in sorted(listings):
        for rel, size in listings[node]:
            if rel in sizes and sizes[rel] != size:
                raise ConflictError(
                    f"step {step}: {rel} is {size} bytes on node {node} but {sizes[rel]} bytes "
                    f"on node {holders[rel][0]}; one of them is a stale copy from another run. "
                    f"Delete {layout.step_dir(step)} on the node whose copy is stale and save "
                    "again",
                    step=step,
                )
            sizes[rel] = size
            holders.setdefault(rel, []).append(node)
    if not sizes:
        raise IncompleteCheckpointError(
            f"no node holds any file of {layout.step_dir(step)}; verl saved nothing there, or "
            "trainer.default_local_dir differs between nodes (use an absolute path)",
            step=step,
        )
    load = dict.fromkeys(listings, 0)
    plan: dict[str, list[str]] = {node: [] for node in listings}
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        node = min(holders[rel], key=lambda n: (load[n], n))
        plan[node].append(rel)
        load[node] += sizes[rel]
    return plan


def check_complete(paths: Sequence[str], step: int) -> None:
    """Refuse to commit a step that lacks what verl needs to resume from it.

    ``data.pt`` (the driver's trainer state), something under ``actor/``, and for each kind of
    per-rank file (``model_world_size_W_rank_R.pt`` and the like) all ``W`` ranks: a node whose
    agent did not report shows up here as missing ranks.
    """
    where = layout.step_dir(step)
    present = set(paths)
    if "data.pt" not in present:
        raise IncompleteCheckpointError(
            f"{where}/data.pt (the trainer state verl's driver writes) was found on no node; "
            "nothing was committed",
            step=step,
        )
    if not any(p.startswith("actor/") for p in present):
        raise IncompleteCheckpointError(
            f"{where} has no actor/ files; nothing was committed", step=step
        )
    check_ranks(present, step)


def check_ranks(paths: Iterable[str], step: int) -> None:
    """Refuse a step in which some kind of per-rank file (``model_world_size_W_rank_R.pt``
    and the like, per folder) lacks one of its ``W`` ranks."""
    where = layout.step_dir(step)
    ranks: dict[tuple[str, int], set[int]] = {}
    for path in paths:
        held = rank_file(path)
        if held is not None:
            kind = f"{held.folder}/{held.kind}" if held.folder else held.kind
            ranks.setdefault((kind, held.world), set()).add(held.rank)
    for (kind, world), found in sorted(ranks.items()):
        missing = sorted(set(range(world)) - found)
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise IncompleteCheckpointError(
                f"{where}: {kind}_world_size_{world}_rank_R.pt is missing for rank(s) {shown}: "
                "no node or rank that reported holds it (a node without an agent, or a save "
                "that did not write it), so nothing was committed",
                step=step,
            )
