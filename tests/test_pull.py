"""``pull_dir`` / ``ckptstore pull``: a safe target, streamed and verified files, filters.

A pull lands in a temporary directory beside its target and is renamed into place, so a
failure (corruption, an interrupted read) leaves the target as it was: absent, or unchanged. A
non-empty target is refused unless ``force`` (merge) or ``delete`` (exact copy). Files are read
in ranged chunks of at most ``transfer.CHUNK_SIZE``, never whole.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.proxy import BackendProxy
from ckptstore.data import transfer
from ckptstore.errors import ConfigError, CorruptCheckpointError, IncompleteCheckpointError
from keys import file_key
from test_cli import ckpt, data, error_line, ok
from test_integrity import forge_keeping_crc32c

SMALL_CHUNK = 64 << 10

FILES = {
    "actor/model_world_size_2_rank_0.pt": os.urandom(300_000),
    "actor/model_world_size_2_rank_1.pt": os.urandom(5_000),
    "actor/huggingface/config.json": b'{"a": 1}',
    "critic/model_world_size_2_rank_0.pt": os.urandom(70_000),
    "data.pt": b"dataloader state",
    "empty.bin": b"",
}
CRITIC = "critic/model_world_size_2_rank_0.pt"
ROOT = {"data.pt", "empty.bin"}


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary pull directories (or files) left in ``parent``."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".ckpt-tmp-")]


@pytest.fixture
def pushed(tmp_path: Path) -> Iterator[CheckpointStore]:
    """A local store holding FILES as step 5 and one different file as step 3."""
    src = tmp_path / "src"
    write_tree(src, FILES)
    old = tmp_path / "old"
    write_tree(old, {"data.pt": b"older"})
    with CheckpointStore(str(tmp_path / "store")) as store:
        store.push_dir(3, old)
        store.push_dir(5, src)
        yield store


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 64 KiB, so the 300 kB file takes several ranged reads."""
    monkeypatch.setattr(transfer, "CHUNK_SIZE", SMALL_CHUNK)
    return SMALL_CHUNK


def corrupt(store: CheckpointStore, step: int, path: str, *, truncate: bool = False) -> None:
    key = file_key(store, step, path)
    data = bytearray(store.backend.read(key))
    if truncate:
        del data[-1]
    else:
        data[len(data) // 2] ^= 0xFF
    store.backend.write(key, [bytes(data)])


class Reads(BackendProxy):
    """Records every read of a payload file of ``step`` (requested sizes, whole reads, reads
    in flight); raises ``fail`` once ``fail_after`` reads went through, listing ``watch`` (as
    ``seen_during``) when it first does."""

    def __init__(
        self,
        store: CheckpointStore,
        step: int,
        *,
        fail_after: int | None = None,
        fail: BaseException | None = None,
    ) -> None:
        super().__init__(store.backend)
        self.payload = {f.key(step) for f in store.info(step).files}
        self.sizes: list[int] = []
        self.whole: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.seen_during: list[str] = []
        self.watch: Path | None = None
        self._lock = threading.Lock()
        self.fail_after, self.fail = fail_after, fail

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if path not in self.payload:
            return self.inner.read(path, start, end)
        with self._lock:
            if end is None:
                self.whole.append(path)
            if self.fail_after is not None and len(self.sizes) >= self.fail_after:
                if self.watch is not None and not self.seen_during:  # the first failure's:
                    # reads still in flight fail later, after the pull has cleaned up
                    self.seen_during = sorted(p.name for p in self.watch.iterdir())
                assert self.fail is not None
                raise self.fail
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            chunk = self.inner.read(path, start, end)
        finally:
            with self._lock:
                self.in_flight -= 1
        with self._lock:
            self.sizes.append(len(chunk) if end is None else end - start)
        return chunk

    def read_into(self, path: str, out: memoryview) -> int:
        if path in self.payload:
            self.whole.append(path)
        return self.inner.read_into(path, out)

    def read_into_chunks(
        self, path: str, out: memoryview, on_chunk: Callable[[memoryview], None]
    ) -> int:
        if path in self.payload:
            self.whole.append(path)
        return self.inner.read_into_chunks(path, out, on_chunk)


def through(store: CheckpointStore, proxy: Reads) -> CheckpointStore:
    return CheckpointStore(store.uri, backend=proxy, lease=False)


class Interrupted(Exception):
    """A read that fails half-way, as a lost connection does."""


# -- the target ------------------------------------------------------------------------------


def test_a_new_directory_receives_the_whole_step_and_no_temp_stays(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    target = tmp_path / "deep" / "global_step_5"
    progress: list[int] = []
    info = pushed.pull_dir(target, progress=progress.append)
    assert info.step == 5 and tree(target) == FILES
    assert sum(progress) == sum(len(b) for b in FILES.values())
    assert leftovers(target.parent) == []


def test_an_empty_directory_is_a_fine_target(pushed: CheckpointStore, tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    pushed.pull_dir(target, 5)
    assert tree(target) == FILES


def test_a_non_empty_target_is_refused_naming_it_and_the_fixes(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    target = tmp_path / "busy"
    write_tree(target, {"mine.txt": b"keep me", "data.pt": b"mine"})
    with pytest.raises(ConfigError) as caught:
        pushed.pull_dir(target, 5)
    message = str(caught.value)
    assert f"{target} is not empty" in message
    assert "force=True (CLI: --force)" in message and "delete=True (CLI: --delete)" in message
    assert tree(target) == {"mine.txt": b"keep me", "data.pt": b"mine"}
    assert leftovers(tmp_path) == []


def test_a_file_as_target_is_refused(pushed: CheckpointStore, tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        pushed.pull_dir(target, 5, force=True)
    assert target.read_bytes() == b"x"


def test_force_merges_the_step_files_over_and_keeps_the_others(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    target = tmp_path / "busy"
    write_tree(target, {"notes.txt": b"mine", "data.pt": b"stale", "actor/extra.pt": b"x"})
    pushed.pull_dir(target, 5, force=True)
    assert tree(target) == {**FILES, "notes.txt": b"mine", "actor/extra.pt": b"x"}
    assert leftovers(tmp_path) == []


def test_delete_makes_an_exact_copy_of_the_step(pushed: CheckpointStore, tmp_path: Path) -> None:
    target = tmp_path / "busy"
    write_tree(
        target,
        {"notes.txt": b"mine", "data.pt": b"stale", "old/deep/x.bin": b"x", "actor/extra.pt": b"y"},
    )
    pushed.pull_dir(target, 5, delete=True)  # no force needed: delete says it all
    assert tree(target) == FILES
    assert not (target / "old").exists()  # folders left empty go too


def test_delete_spares_files_the_filters_exclude(pushed: CheckpointStore, tmp_path: Path) -> None:
    target = tmp_path / "busy"
    write_tree(target, {"logs/run.txt": b"mine", "notes.txt": b"stray"})
    pushed.pull_dir(target, 5, delete=True, exclude="logs/*")
    assert tree(target) == {**FILES, "logs/run.txt": b"mine"}


def test_force_refuses_a_folder_where_the_step_has_a_file_and_delete_replaces_it(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    target = tmp_path / "busy"
    write_tree(target, {"data.pt/inside.txt": b"a folder named like a file"})
    with pytest.raises(ConfigError, match=r"data\.pt is a directory.*--delete"):
        pushed.pull_dir(target, 5, force=True)
    assert tree(target) == {"data.pt/inside.txt": b"a folder named like a file"}
    pushed.pull_dir(target, 5, delete=True)
    assert tree(target) == FILES


def test_force_does_not_write_through_a_symlink_leading_outside(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "busy"
    target.mkdir()
    (target / "actor").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        pushed.pull_dir(target, 5, force=True)
    assert list(outside.iterdir()) == []
    pushed.pull_dir(target, 5, delete=True)  # replaces the link itself, never follows it
    assert list(outside.iterdir()) == [] and tree(target) == FILES


def test_a_symlink_to_an_empty_directory_is_followed(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    real = tmp_path / "big-disk" / "out"
    real.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(real)
    pushed.pull_dir(link, 5)
    assert link.is_symlink() and tree(real) == FILES
    assert leftovers(real.parent) == [] and leftovers(tmp_path) == []


def test_a_mount_point_gets_the_temp_directory_inside_and_the_files_one_by_one(
    pushed: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_chunks: int
) -> None:
    """A volume's root cannot be replaced by a rename, nor take one from another filesystem."""
    target = tmp_path / "volume"
    target.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == target)
    proxy = Reads(pushed, 5, fail_after=3, fail=Interrupted("connection lost"))
    proxy.watch = target
    with pytest.raises(Interrupted):
        through(pushed, proxy).pull_dir(target, 5)
    assert next(n for n in proxy.seen_during if n.startswith(".ckpt-tmp-")).endswith("-pull-volume")
    assert list(target.iterdir()) == [] and leftovers(tmp_path) == []

    pushed.pull_dir(target, 5)
    assert tree(target) == FILES and leftovers(target) == []
    (target / "stray.txt").write_bytes(b"x")
    pushed.pull_dir(target, 5, delete=True)
    assert tree(target) == FILES and leftovers(target) == []


# -- filters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ((), (), set(FILES)),
        (("actor/*",), (), set(FILES)),  # include alone changes nothing, as in aws s3
        ((), ("*",), None),
        (("actor/*",), ("*",), {p for p in FILES if p.startswith("actor/")}),
        ((), ("*.pt",), {"actor/huggingface/config.json", "empty.bin"}),
        (("critic/*",), ("*.pt",), {"actor/huggingface/config.json", "empty.bin", CRITIC}),
        (("*rank_0*",), ("actor/*", "critic/*"), {p for p in FILES if "rank_0" in p} | ROOT),
        ("data.pt", "*", {"data.pt"}),  # a string is one pattern, not its characters
    ],
)
def test_include_and_exclude_follow_the_aws_cli(
    pushed: CheckpointStore,
    tmp_path: Path,
    include: Any,
    exclude: Any,
    expected: set[str] | None,
) -> None:
    target = tmp_path / "part"
    if expected is None:
        with pytest.raises(ConfigError, match="take none of the 6 files of step 5"):
            pushed.pull_dir(target, 5, include=include, exclude=exclude)
        assert not target.exists() and leftovers(tmp_path) == []
        return
    progress: list[int] = []
    pushed.pull_dir(target, 5, include=include, exclude=exclude, progress=progress.append)
    assert tree(target) == {p: FILES[p] for p in expected}
    assert sum(progress) == sum(len(FILES[p]) for p in expected)


# -- verification, interruption --------------------------------------------------------------


@pytest.mark.parametrize("truncate", [False, True], ids=["flipped-byte", "truncated"])
def test_a_corrupt_file_raises_and_leaves_no_target(
    pushed: CheckpointStore, tmp_path: Path, truncate: bool, small_chunks: int
) -> None:
    corrupt(pushed, 5, "actor/model_world_size_2_rank_0.pt", truncate=truncate)
    target = tmp_path / "out"
    message = "bytes, but the manifest" if truncate else "checksum mismatch"
    with pytest.raises(CorruptCheckpointError, match=message) as caught:
        pushed.pull_dir(target, 5)
    assert caught.value.step == 5
    assert not target.exists() and leftovers(tmp_path) == []

    busy = tmp_path / "busy"
    write_tree(busy, {"data.pt": b"mine", "notes.txt": b"x"})
    for flags in ({"force": True}, {"delete": True}):
        with pytest.raises(CorruptCheckpointError, match=message):
            pushed.pull_dir(busy, 5, **flags)
        assert tree(busy) == {"data.pt": b"mine", "notes.txt": b"x"}  # untouched
    assert leftovers(tmp_path) == []


def test_a_file_that_shrinks_while_it_is_read_raises_and_leaves_no_target(
    pushed: CheckpointStore, tmp_path: Path, small_chunks: int
) -> None:
    class Shrinking(Reads):
        def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
            chunk = super().read(path, start, end)
            return chunk[:-1] if end is not None and end == len(FILES[big]) else chunk

    big = "actor/model_world_size_2_rank_0.pt"
    proxy = Shrinking(pushed, 5)
    proxy.payload = {file_key(pushed, 5, big)}
    with pytest.raises(CorruptCheckpointError, match="bytes, but the manifest"):
        through(pushed, proxy).pull_dir(tmp_path / "out", 5)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_signed_store_refuses_bytes_forged_to_keep_the_crc(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", FILES)
    with CheckpointStore(str(tmp_path / "store"), signing_key=b"k" * 32) as store:
        store.push_dir(5, tmp_path / "src")
        key = file_key(store, 5, CRITIC)
        original = store.backend.read(key)
        store.backend.write(key, [forge_keeping_crc32c(original, len(original) // 2)])
        with pytest.raises(CorruptCheckpointError, match="SHA-256 mismatch"):
            store.pull_dir(tmp_path / "out", 5)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_missing_file_raises_incomplete(pushed: CheckpointStore, tmp_path: Path) -> None:
    pushed.backend.delete([file_key(pushed, 5, "data.pt")])
    with pytest.raises(IncompleteCheckpointError, match="is missing"):
        pushed.pull_dir(tmp_path / "out", 5)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_corrupt_latest_falls_back_to_the_older_step(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    corrupt(pushed, 5, "data.pt")
    target = tmp_path / "out"
    assert pushed.pull_dir(target).step == 3
    assert tree(target) == {"data.pt": b"older"}
    with pytest.raises(CorruptCheckpointError):
        pushed.pull_dir(tmp_path / "strict", fallback=False)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fail", [Interrupted("connection lost"), KeyboardInterrupt()])
def test_a_pull_interrupted_mid_file_leaves_no_partial_target(
    pushed: CheckpointStore, tmp_path: Path, small_chunks: int, fail: BaseException
) -> None:
    target = tmp_path / "out"
    proxy = Reads(pushed, 5, fail_after=3, fail=fail)
    proxy.watch = tmp_path
    with pytest.raises(type(fail)):
        through(pushed, proxy).pull_dir(target, 5)
    # the pull was under way in a clearly named temporary directory beside the target...
    temp = next(n for n in proxy.seen_during if n.startswith(".ckpt-tmp-"))
    assert temp.endswith("-pull-out")
    # ...which is gone, and the target never appeared
    assert not target.exists() and leftovers(tmp_path) == []

    busy = tmp_path / "busy"
    write_tree(busy, {"data.pt": b"mine"})
    proxy = Reads(pushed, 5, fail_after=3, fail=fail)
    with pytest.raises(type(fail)):
        through(pushed, proxy).pull_dir(busy, 5, delete=True)
    assert tree(busy) == {"data.pt": b"mine"} and leftovers(tmp_path) == []


# -- memory ------------------------------------------------------------------------------------


def test_files_larger_than_a_chunk_are_read_in_ranges_of_at_most_a_chunk(
    pushed: CheckpointStore, tmp_path: Path, small_chunks: int
) -> None:
    big = FILES["actor/model_world_size_2_rank_0.pt"]
    assert len(big) > 4 * small_chunks
    proxy = Reads(pushed, 5)
    through(pushed, proxy).pull_dir(tmp_path / "out", 5)
    assert tree(tmp_path / "out") == FILES
    assert proxy.whole == []  # no whole-file read, ever
    assert max(proxy.sizes) == small_chunks
    assert all(size <= small_chunks for size in proxy.sizes)
    assert len(proxy.sizes) >= len(big) // small_chunks
    assert proxy.most_in_flight <= transfer.PULL_CONCURRENCY


def test_the_default_chunk_bounds_reads_of_a_larger_file(tmp_path: Path) -> None:
    size = transfer.CHUNK_SIZE + transfer.CHUNK_SIZE // 2 + 7
    content = os.urandom(size)
    write_tree(tmp_path / "src", {"shard.pt": content})
    with CheckpointStore(str(tmp_path / "store")) as store:
        store.push_dir(1, tmp_path / "src")
        proxy = Reads(store, 1)
        through(store, proxy).pull_dir(tmp_path / "out", 1)
    assert (tmp_path / "out" / "shard.pt").read_bytes() == content
    assert proxy.whole == []
    assert sorted(proxy.sizes) == [size - transfer.CHUNK_SIZE, transfer.CHUNK_SIZE]


# -- S3 --------------------------------------------------------------------------------------


def test_pull_over_s3_streams_filters_and_verifies(
    s3_uri: str, s3_options: dict[str, Any], s3_client: Any, tmp_path: Path, small_chunks: int
) -> None:
    write_tree(tmp_path / "src", FILES)
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        store.push_dir(5, tmp_path / "src")
        proxy = Reads(store, 5)
        reader = CheckpointStore(s3_uri, backend=proxy, lease=False)
        target = tmp_path / "busy"
        write_tree(target, {"stray.txt": b"x", "data.pt": b"stale"})
        reader.pull_dir(target, 5, delete=True, exclude="*", include=["actor/*", "data.pt"])
        actor = {p: b for p, b in FILES.items() if p.startswith("actor/")}
        # stray.txt stays: --delete removes only what the filters take, as in aws s3
        assert tree(target) == {**actor, "data.pt": FILES["data.pt"], "stray.txt": b"x"}
        assert proxy.whole == [] and max(proxy.sizes) <= small_chunks

        bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
        key = f"{prefix}/{file_key(store, 5, 'actor/model_world_size_2_rank_0.pt')}"
        body = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[-1] ^= 0x01
        s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            store.pull_dir(tmp_path / "fresh", 5)
        assert not (tmp_path / "fresh").exists() and leftovers(tmp_path) == []


# -- the command line ------------------------------------------------------------------------


def test_cli_pull_refuses_a_non_empty_dir_then_force_and_delete(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    uri = pushed.uri
    target = tmp_path / "busy"
    write_tree(target, {"notes.txt": b"mine", "data.pt": b"stale"})

    done = ckpt("pull", uri, str(target), "--step", "5")
    assert done.returncode == 2
    line = error_line(done)
    assert str(target) in line and "--force" in line and "--delete" in line
    assert tree(target) == {"notes.txt": b"mine", "data.pt": b"stale"}

    pulled = data("pull", uri, str(target), "--step", "5", "--force")
    assert pulled["files"] == len(FILES) and pulled["partial"] is False
    assert tree(target) == {**FILES, "notes.txt": b"mine"}

    ok("pull", uri, str(target), "--step", "5", "--delete")
    assert tree(target) == FILES


def test_cli_pull_with_filters_says_it_is_partial(pushed: CheckpointStore, tmp_path: Path) -> None:
    target = tmp_path / "actor-only"
    args = ("pull", pushed.uri, str(target), "--exclude", "*", "--include", "actor/*")
    pulled = data(*args)
    actor = {p: b for p, b in FILES.items() if p.startswith("actor/")}
    assert pulled["partial"] is True and pulled["files"] == len(actor)
    assert pulled["size"] == sum(len(b) for b in actor.values())
    assert tree(target) == actor
    text = ok(*args[:2], str(tmp_path / "again"), *args[3:])
    assert f"{len(actor)} of {len(FILES)} files (partial" in text


def test_cli_pull_of_a_corrupt_step_exits_4_and_leaves_no_target(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    corrupt(pushed, 5, "data.pt")
    target = tmp_path / "out"
    done = ckpt("pull", pushed.uri, str(target), "--step", "5")
    assert done.returncode == 4 and "checksum mismatch" in error_line(done)
    assert not target.exists() and leftovers(tmp_path) == []
