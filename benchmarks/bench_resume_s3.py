"""bench_resume.py's S3 rows: ckptstore's save and load, their raw boto3 limits, and the peers
(s3torchconnector's ``S3Checkpoint``, DCP through s3fs) on the same server."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, cast

import torch
from bench_resume_base import (
    BUCKET,
    REGION,
    MiB,
    Row,
    Server,
    State,
    cuts,
    flat_bytes,
    fsspec_options,
    nbytes,
    payload,
)

from ckptstore import CheckpointStore
from ckptstore.backends.s3_options import DEFAULT_PART_SIZE
from ckptstore.domain import layout


def raw_get_rows(client: Any, keys: dict[str, int], part: int, conc: int) -> list[Row]:
    """Parallel GetObjects of ``keys`` (key -> size), whole and in ranges of ``part``."""

    def download(span: int | None) -> None:
        buffers = {key: torch.empty(size, dtype=torch.uint8) for key, size in keys.items()}
        tasks = [(k, a, b) for k, size in keys.items() for a, b in cuts(size, span or size)]

        def one(task: tuple[str, int, int]) -> None:
            key, a, b = task
            extra = {} if span is None else {"Range": f"bytes={a}-{b - 1}"}
            body = client.get_object(Bucket=BUCKET, Key=key, **extra)["Body"]
            view = memoryview(buffers[key].numpy())[a:b]
            while len(view):  # readinto in 4 MiB calls, as boto3's fastest path
                n = body.readinto(view[: 4 * MiB])
                if not n:
                    raise AssertionError(f"{key}: body ended early")
                view = view[n:]

        with ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, tasks))

    whole = f"raw GET of the store's {len(keys)} objects, whole, x{conc}"
    ranged = f"raw GET of the store's objects, {part // MiB} MiB ranges, x{conc}"
    return [
        Row("S3 load", whole, "limit", lambda: download(None)),
        Row("S3 load", ranged, "limit", lambda: download(part)),
    ]


class RawUpload:
    """boto3's plain PutObject / multipart API from a thread pool, no client checksums."""

    def __init__(self, client: Any, flat: memoryview) -> None:
        self.client, self.flat = client, flat

    def upload(self, prefix: str, sizes: list[int], part: int, conc: int) -> None:
        """The flat bytes cut into objects of ``sizes``, each put whole or in ``part`` parts."""
        waits: list[Future[Any]] = []
        with ThreadPoolExecutor(conc) as pool, ThreadPoolExecutor(4) as completer:
            start = 0
            for n, size in enumerate(sizes):
                key, end = f"{prefix}/{n:05d}", start + size
                if size <= part:
                    waits.append(pool.submit(self._put, key, start, end))
                else:
                    upload = self.client.create_multipart_upload(Bucket=BUCKET, Key=key)
                    parts = [
                        pool.submit(self._part, key, upload["UploadId"], i, start + a, start + b)
                        for i, (a, b) in enumerate(cuts(size, part), 1)
                    ]
                    waits.append(completer.submit(self._complete, key, upload["UploadId"], parts))
                start = end
            for future in waits:
                future.result()

    def _put(self, key: str, a: int, b: int) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(self.flat[a:b]))

    def _part(self, key: str, upload_id: str, number: int, a: int, b: int) -> dict[str, Any]:
        resp = self.client.upload_part(
            Bucket=BUCKET,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=bytes(self.flat[a:b]),
        )
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _complete(self, key: str, upload_id: str, parts: list[Future[dict[str, Any]]]) -> None:
        done = [f.result() for f in parts]
        self.client.complete_multipart_upload(
            Bucket=BUCKET, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
        )


def tuned_one_object(raw: RawUpload, total: int, quick: bool) -> tuple[int, int, dict[str, float]]:
    """The best (part size, threads) for the bytes as one object: each setting timed once."""
    settings = [(16 * MiB, 8), (32 * MiB, 8), (8 * MiB, 16)]
    if quick:
        settings = [(5 * MiB, 8), (8 * MiB, 4)]
    tried: dict[tuple[int, int], float] = {}
    for part, conc in settings:
        started = time.perf_counter()
        raw.upload("sweep", [total], part, conc)
        tried[(part, conc)] = time.perf_counter() - started
    part, conc = min(tried, key=tried.__getitem__)
    return part, conc, {f"{p // MiB} MiB x{c}": round(s, 3) for (p, c), s in tried.items()}


def peer_rows(server: Server, state: State, bump: Callable[[], None]) -> list[Row]:
    """s3torchconnector's S3Checkpoint and DCP over s3fs: save and load of the same state."""
    rows: list[Row] = []
    try:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        checkpoint = S3Checkpoint(
            REGION, server.url, s3client_config=S3ClientConfig(force_path_style=True)
        )
        uri = f"s3://{BUCKET}/s3tc/state.pt"

        def tc_save() -> None:
            with checkpoint.writer(uri) as writer:
                torch.save(state, writer)

        def tc_load() -> Any:
            with checkpoint.reader(uri) as reader:
                return torch.load(cast(IO[bytes], reader), map_location="cpu")

        tc_save()
        rows += [
            Row("S3 save", "s3torchconnector S3Checkpoint (torch.save)", "peer", tc_save, bump),
            Row("S3 load", "s3torchconnector S3Checkpoint (torch.load)", "peer", tc_load),
        ]
    except ImportError as e:
        rows += [
            Row(g, "s3torchconnector S3Checkpoint", "peer", lambda: None, error=f"{e}")
            for g in ("S3 save", "S3 load")
        ]
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = fsspec_options(server)
    dcp_uri = f"s3://{BUCKET}/dcp"

    def dcp_save() -> None:
        save(state, storage_writer=FsspecWriter(dcp_uri, **opts))

    def dcp_load() -> Any:
        out = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        load(out, storage_reader=FsspecReader(dcp_uri, **opts))
        return out

    try:
        dcp_save()
    except ImportError as e:  # s3fs: the bench extra, which .venv-newest leaves out
        rows += [
            Row("S3 save", "DCP FsspecWriter (s3fs)", "peer", lambda: None, error=f"{e}"),
            Row("S3 load", "DCP FsspecReader (s3fs)", "peer", lambda: None, error=f"{e}"),
        ]
        return rows
    rows += [
        Row("S3 save", "DCP FsspecWriter (s3fs)", "peer", dcp_save, bump),
        Row("S3 load", "DCP FsspecReader (s3fs)", "peer", dcp_load),
    ]
    return rows


def prune_untimed(store: CheckpointStore, bump: Callable[[], None]) -> None:
    """The older steps of a store without retention deleted outside the timing (the bucket
    stays small), then a new step's bytes."""
    for info in store.list()[:-1]:
        store.delete(info.step)
    bump()


def s3_rows(
    server: Server, state: State, args: argparse.Namespace, notes: dict[str, Any]
) -> list[Row]:
    """ckptstore's S3 save and load beside their limits and peers."""
    options = server.options()
    client = server.client()
    total = nbytes(state)
    steps = iter(range(10, 10**6))

    def bump() -> None:  # a new step's bytes, as training changes every tensor
        for t in state["model"].values():
            t.view(-1)[0] += 1.0

    saver = CheckpointStore(f"s3://{BUCKET}/save", storage_options=options, keep_last=2)
    plain = CheckpointStore(f"s3://{BUCKET}/plain", storage_options=options)
    loader = CheckpointStore(f"s3://{BUCKET}/load", storage_options=options)
    loader.save(1, state)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"load/{layout.step_dir(1)}/")
    objects = {o["Key"]: o["Size"] for o in listed["Contents"] if payload(o["Key"])}
    notes["store objects"] = sorted(objects.values(), reverse=True)
    part, conc = DEFAULT_PART_SIZE, args.concurrency

    rows = [
        Row("S3 load", "ckptstore load (every byte verified)", "ckptstore", lambda: loader.load(1)),
        *raw_get_rows(client, objects, part, conc),
        Row(
            "S3 save",
            "ckptstore save (the commit; no retention)",
            "ckptstore",
            lambda: plain.save(next(steps), state),
            lambda: prune_untimed(plain, bump),
        ),
        Row(
            "S3 save",
            "ckptstore save with keep_last=2 (the commit, then the prune of a step)",
            "ckptstore",
            lambda: saver.save(next(steps), state),
            bump,
        ),
    ]
    raw = RawUpload(client, flat_bytes(state))
    one_part, one_conc, sweep = tuned_one_object(raw, total, args.quick)
    notes["one-object upload sweep (s)"] = sweep
    sizes = sorted(objects.values(), reverse=True)  # with the skeleton: a few bytes more
    sizes = [s for s in sizes if sum(sizes) <= total or s > 64 << 10]
    sizes[-1] += total - sum(sizes)  # the state's bytes exactly, in the store's cuts
    rows += [
        Row(
            "S3 save",
            f"raw multipart upload, one object, {one_part // MiB} MiB parts x{one_conc} (tuned)",
            "limit",
            lambda: raw.upload("raw-one", [total], one_part, one_conc),
        ),
        Row(
            "S3 save",
            f"raw PutObject of the store's {len(sizes)} objects, whole, x{conc}",
            "limit",
            lambda: raw.upload("raw-store", sizes, max(sizes), conc),
        ),
    ]
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_threshold=16 * MiB,
        multipart_chunksize=16 * MiB,
        max_concurrency=8,
        use_threads=True,
    )

    def fileobj() -> None:
        import io

        client.upload_fileobj(io.BytesIO(raw.flat), BUCKET, "raw-fileobj/state", Config=config)

    rows.append(Row("S3 save", "raw upload_fileobj, one object, 16 MiB parts x8", "limit", fileobj))
    return rows + peer_rows(server, state, bump)
