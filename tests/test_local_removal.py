"""A local backend's delete among other processes in the same directories: the ranks of one
node delete the same step of their node's tier at once (every node at one local path), and a
writer may create a file in a directory a delete found empty. Each race is replayed at its
exact point (``os.listdir`` is where the delete looks), not hoped for with threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptstore.backends.local import LocalBackend


def _step(root: Path) -> LocalBackend:
    backend = LocalBackend(str(root), {})
    backend.write("global_step_1/.attempt-0/rank_00003/shard.bin", [b"x"])
    return backend


def test_a_directory_another_rank_removed_first_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _step(tmp_path)
    rank_dir = tmp_path / "global_step_1" / ".attempt-0" / "rank_00003"
    listdir = os.listdir

    def rival_removes_it_first(path: os.PathLike[str] | str) -> list[str]:
        if Path(path) == rank_dir and rank_dir.exists():
            os.rmdir(rank_dir)  # the other rank of the node, between our unlink and our look
        return listdir(path)

    monkeypatch.setattr(os, "listdir", rival_removes_it_first)
    backend.delete(["global_step_1/.attempt-0/rank_00003/shard.bin"])  # raised FileNotFoundError
    assert list(tmp_path.iterdir()) == []  # the empty parents went too


def test_a_file_created_after_the_directory_was_seen_empty_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _step(tmp_path)
    attempt = tmp_path / "global_step_1" / ".attempt-0"
    listdir = os.listdir

    def writer_arrives(path: os.PathLike[str] | str) -> list[str]:
        names = listdir(path)
        if Path(path) == attempt:  # seen empty; a writer then puts a file there
            (attempt / "rank_00002").mkdir()
            (attempt / "rank_00002" / "shard.bin").write_bytes(b"new")
        return names

    monkeypatch.setattr(os, "listdir", writer_arrives)
    backend.delete(["global_step_1/.attempt-0/rank_00003/shard.bin"])
    assert (attempt / "rank_00002" / "shard.bin").read_bytes() == b"new"  # was removed with it
    assert not (attempt / "rank_00003").exists()


def test_lock_files_alone_do_not_keep_a_directory(tmp_path: Path) -> None:
    backend = _step(tmp_path)
    rank_dir = tmp_path / "global_step_1" / ".attempt-0" / "rank_00003"
    (rank_dir / ".ckpt-lock-shard.bin").write_bytes(b"")
    backend.delete(["global_step_1/.attempt-0/rank_00003/shard.bin"])
    assert list(tmp_path.iterdir()) == []
