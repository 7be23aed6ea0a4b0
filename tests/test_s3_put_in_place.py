"""A save's shards go up to S3 from the tensors' own memory, not from a copy.

A shard is a header and views of its tensors, which stay unchanged until its write returns
(``SourceFile.stable``): its PutObject sends those views one after another
(``ProgressBody`` over segments) instead of first copying them into one buffer, a copy that
cost more CPU than the checksums of a save. These tests check the bytes, the path taken, the
retries (a body read again from the tensors), and that what is not stable is still copied.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends import s3_write
from ckptstore.backends.base import Chunk
from ckptstore.backends.s3_progress import CancelToken, Meter, ProgressBody
from ckptstore.backends.s3_transfer import crc32c_base64
from ckptstore.data.payload import SourceFile
from s3faults.faultmodes import Fault
from s3faults.faultproxy import FaultProxy

MiB = 1 << 20


def state(mib: int, tensors: int = 4) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(mib)
    per = mib * MiB // tensors // 4
    return {"model": {f"w{i}": torch.rand(per, generator=gen) for i in range(tensors)}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the files whose bytes were copied into parts (``split``) on their way up."""
    sizes: list[int] = []
    real = s3_write.split

    def split(chunks: Iterable[Chunk], part_size: int) -> Iterator[bytearray]:
        sizes.append(0)
        for part in real(chunks, part_size):
            sizes[-1] += len(part)
            yield part

    monkeypatch.setattr(s3_write, "split", split)
    return sizes


def test_a_save_sends_its_shards_from_the_tensors_memory(
    s3_uri: str, s3_options: dict[str, Any], copied: list[int]
) -> None:
    saved = state(8)
    with CheckpointStore(s3_uri, storage_options=s3_options, shard_size=4 * MiB) as store:
        store.save(1, saved)
        assert len(store.info(1).files) >= 3  # shards and the skeleton, each one PUT
        assert max(copied, default=0) < 64 << 10  # control objects only (manifest, marker)
        assert same(store.load(1), saved)


def test_files_not_marked_stable_are_still_copied(
    s3_uri: str, s3_options: dict[str, Any], copied: list[int]
) -> None:
    """A source may reuse its buffer once the next chunk is asked for (a file read in pieces
    into one buffer): only a source that promises otherwise is sent in place."""
    data = os.urandom(3 * MiB)
    reused = bytearray(MiB)

    def pieces() -> Iterator[Chunk]:
        for start in range(0, len(data), MiB):
            reused[:] = data[start : start + MiB]
            yield memoryview(reused)

    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        entries = store.stage_files(1, [SourceFile("blob.bin", pieces, len(data))])
        store.commit_files(1, entries)
        assert len(data) in copied  # copied as it came: the reused buffer's pieces stay right
        assert bytes(store.read_file(store.info(1), "blob.bin")) == data


def test_a_stable_file_larger_than_one_put_goes_up_in_parts(
    s3_endpoint: str, s3_uri: str, copied: list[int]
) -> None:
    """Views are held only up to one PUT's worth; a larger file goes on into a multipart
    upload, the views held so far first, in order."""
    saved = state(16, tensors=8)
    options = {"endpoint_url": s3_endpoint, "part_size": 5 * MiB, "multipart_threshold": 5 * MiB}
    with FaultProxy(s3_endpoint) as proxy:
        options["endpoint_url"] = proxy.endpoint_url
        with CheckpointStore(s3_uri, storage_options=options, shard_size=16 * MiB) as store:
            store.save(1, saved)
            assert proxy.seen["CreateMultipartUpload"] == 1  # the one 16 MiB shard
            shard = max(f.size for f in store.info(1).files)
            assert [n for n in copied if n > 64 << 10] == [shard]  # its bytes, once, in order
            assert same(store.load(1), saved)


def test_a_put_broken_mid_body_is_sent_again_from_the_tensors(
    s3_endpoint: str, s3_uri: str
) -> None:
    saved = state(8)
    with FaultProxy(s3_endpoint) as proxy:
        fault = proxy.add_fault(
            Fault(
                "reset",
                operations=frozenset({"PutObject"}),
                glob="*.safetensors",
                direction="request",
                after=MiB,
                times=2,
            )
        )
        fault.on()
        options = {"endpoint_url": proxy.endpoint_url}
        with CheckpointStore(s3_uri, storage_options=options, shard_size=4 * MiB) as store:
            store.save(1, saved)
            assert fault.fired == 2
            assert same(store.load(1), saved)


# -- the body over segments -----------------------------------------------------------------


def body(segments: list[bytes]) -> ProgressBody:
    return ProgressBody([memoryview(s) for s in segments], Meter(60.0, 0, CancelToken()))


def test_a_body_of_segments_reads_them_in_order_without_copying() -> None:
    segments = [b"head", os.urandom(1000), b"", os.urandom(300)]
    whole = b"".join(segments)
    read = body(segments)
    assert len(read) == len(whole)
    got = []
    while block := read.read(256):
        assert isinstance(block, memoryview) and block.readonly
        got.append(bytes(block))
    assert b"".join(got) == whole
    assert read.read(256) == b"" and read.tell() == len(whole)


def test_a_body_of_segments_seeks_anywhere_and_reads_the_rest() -> None:
    segments = [b"head", os.urandom(1000), os.urandom(300)]
    whole = b"".join(segments)
    read = body(segments)
    for position in (0, 3, 4, 500, 1004, 1100, len(whole)):
        assert read.seek(position) == position
        assert bytes(read.read()) == whole[position:]  # read() spans what is left
    read.seek(-10, 2)
    assert bytes(read.read(100)) == whole[-10:]


def test_a_body_of_segments_counts_every_block_it_handed_out() -> None:
    counted: list[int] = []
    segments = [os.urandom(700), os.urandom(700)]
    read = ProgressBody(segments, Meter(60.0, 1400, CancelToken(), on_bytes=counted.append))
    while read.read(512):
        pass
    assert sum(counted) == 1400  # each block counted once the next was asked for


def test_the_checksum_of_a_body_of_segments_is_that_of_its_bytes() -> None:
    segments = [b"head", os.urandom(1000), b"", os.urandom(300)]
    assert crc32c_base64(segments) == crc32c_base64(b"".join(segments))
