"""load_distributed's early reads (integrations/early_reads.py): a rank's files of the step its
node's local tier names, read while the ranks agree on the step, are used only for an offer
that lists the very same entries, and an early read that failed leaves the file to the usual
read with its fallbacks. One process, a real tiered store (a local tier in front of a
directory); the multi-rank loads that take these reads run in test_tiers_distributed.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.domain.info import CheckpointInfo
from ckptstore.integrations.early_reads import EarlyReads
from keys import file_key


def state(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), float(n)), "b": torch.arange(n + 100)}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore(
        str(tmp_path / "durable"), local=str(tmp_path / "local"), persist_every=1, lease=False
    ) as opened:
        for step in (1, 2):
            opened.save(step, state(step))
        opened.wait()
        yield opened


def test_the_step_the_local_tier_names_is_read_early_and_taken_once(
    store: CheckpointStore,
) -> None:
    assert store.tiers is not None
    named = store.tiers.named_here()
    assert named is not None and named.step == 2
    paths = [f.path for f in named.files]
    early = EarlyReads(store.tiers, named, paths)
    try:
        offer = store.info(2)
        for path in paths:
            taken = early.take(offer, path)
            assert taken is not None and bytes(taken) == bytes(store.read_file(offer, path))
            assert early.take(offer, path) is None  # handed out once
    finally:
        early.close()
    assert store.tiers.named_here(1) is not None and store.tiers.named_here(7) is None


def test_another_step_or_another_entry_is_read_as_usual(store: CheckpointStore) -> None:
    assert store.tiers is not None
    named = store.tiers.named_here()
    assert named is not None
    path = max(named.files, key=lambda f: f.size).path
    early = EarlyReads(store.tiers, named, [path])
    try:
        assert early.take(store.info(1), path) is None  # the offer is another step
        assert early.take(named, path) is None  # and the early reads were dropped for it
    finally:
        early.close()
    entry = named.manifest.file(path)
    other = dataclasses.replace(entry, crc32c="00000000")
    files = tuple(other if f.path == path else f for f in named.manifest.files)
    offer = CheckpointInfo.of(named.uri, dataclasses.replace(named.manifest, files=files))
    early = EarlyReads(store.tiers, named, [path])
    try:
        assert early.take(offer, path) is None  # same step, another entry for the file
    finally:
        early.close()


def test_an_early_read_that_failed_leaves_the_file_to_the_usual_read(
    store: CheckpointStore,
) -> None:
    assert store.tiers is not None
    named = store.tiers.named_here()
    assert named is not None
    entry = max(named.files, key=lambda f: f.size)
    local = Path(store.tiers.local.uri) / file_key(store, 2, entry.path)
    data = bytearray(local.read_bytes())
    data[len(data) // 2] ^= 0x08
    local.write_bytes(data)
    early = EarlyReads(store.tiers, named, [entry.path])
    try:
        assert early.take(named, entry.path) is None  # the local copy failed its check
    finally:
        early.close()
    good = store.read_file(store.info(2), entry.path)  # the usual read: the durable copy
    assert bytes(good) != bytes(data) and len(good) == len(data)
