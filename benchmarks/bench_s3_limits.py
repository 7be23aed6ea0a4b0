"""The raw S3 limits: the same bytes through boto3's plain API, at the best of a sweep.

The upload calls CreateMultipartUpload / UploadPart / CompleteMultipartUpload (or PutObject for
objects no larger than a part) directly from a thread pool, each part one ``bytes`` slice of
the flat state, with no client-side checksum: the least work a boto3 client can do per byte.
The download is the mirror image: parallel (ranged) GetObjects into one preallocated buffer.
boto3's transfer manager (``upload_fileobj``) was slower than this here (it copies each part and
streams it in 8 KiB writes); the tuned ``upload_fileobj`` row shows it.

The sweep covers part (range) size and concurrency, and also how the bytes are cut into
objects: one object, or objects of 32 or 128 MiB. That matters on moto, where completing a
multipart upload rewrites the whole object and every ranged GET reads the whole object, so a
single 1 GiB object is several times slower than the same bytes in small objects; a limit
measured only on one big object would flatter any method that writes smaller files. Each
setting is timed once, in the row's own process just before its timed runs; the sweep is in
the JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import bench_state as st
import torch
from bench_s3 import MiB, _Boto, _s3, boto_client

Config = tuple[int, int, int]
"""(object size, part or range size, concurrency), in bytes where sizes."""
WHOLE = 1 << 62
"""An object size meaning "all the bytes in one object"."""


def _cuts(total: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def _label(config: Config) -> str:
    objects, part, conc = config
    layout = "1 object" if objects >= WHOLE else f"{objects // MiB} MiB objects"
    pieces = "whole objects" if part >= WHOLE else f"{part // MiB} MiB pieces"
    return f"{layout}, {pieces} x {conc}"


def _sweep(
    timed: Callable[[Config], float], configs: list[Config], quick: bool
) -> tuple[Config, dict[str, float]]:
    """Time each config once, then the best layout and size at other concurrencies; ``quick``
    (a smoke run) times the first config alone."""
    tried = {config: timed(config) for config in (configs[:1] if quick else configs)}
    objects, part, _ = min(tried, key=tried.__getitem__)
    for concurrency in () if quick else (4, 16):
        if (objects, part, concurrency) not in tried:
            tried[(objects, part, concurrency)] = timed((objects, part, concurrency))
    best = min(tried, key=tried.__getitem__)
    return best, {_label(c): round(s, 3) for c, s in tried.items()}


class RawUpload(_Boto):
    """boto3 multipart uploads of the flat bytes, at the best layout, part size, concurrency."""

    def setup(self, state: Any) -> None:
        self.client = boto_client(self.spec, checksums=False, pool=64)
        self.flat = st.flat_bytes(state).numpy().data
        part, conc = self.spec.part_size, self.spec.concurrency
        configs = [(WHOLE, part, conc), (WHOLE, 64 * MiB, conc), (128 * MiB, part, conc)]
        configs += [(32 * MiB, part, conc), (32 * MiB, 32 * MiB, conc)]
        self.best, sweep = _sweep(self._timed, configs, self.spec.quick)
        self.notes |= {"best": _label(self.best), "best_transfer": list(self.best), "sweep": sweep}

    def _timed(self, config: Config) -> float:
        started = time.perf_counter()
        self.upload("sweep", config)
        return time.perf_counter() - started

    def upload(self, name: str, config: Config) -> None:
        objects, part, concurrency = config
        bucket, waits = _s3(self.spec).bucket, []
        with ThreadPoolExecutor(concurrency) as pool, ThreadPoolExecutor(4) as completer:
            for n, (start, end) in enumerate(_cuts(len(self.flat), objects)):
                key = self.key(f"{name}/{n:05d}")
                if end - start <= part:
                    waits.append(pool.submit(self._put, key, start, end))
                    continue
                upload_id = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
                parts = [
                    pool.submit(self._part, key, upload_id, number, start + a, start + b)
                    for number, (a, b) in enumerate(_cuts(end - start, part), 1)
                ]
                waits.append(completer.submit(self._complete, key, upload_id, parts))
            for future in waits:
                future.result()

    def _put(self, key: str, a: int, b: int) -> None:
        body = bytes(self.flat[a:b])
        self.client.put_object(Bucket=_s3(self.spec).bucket, Key=key, Body=body)

    def _part(self, key: str, upload_id: str, number: int, a: int, b: int) -> dict[str, Any]:
        bucket, body = _s3(self.spec).bucket, bytes(self.flat[a:b])
        resp = self.client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
        )
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _complete(self, key: str, upload_id: str, parts: list[Future[dict[str, Any]]]) -> None:
        done = [future.result() for future in parts]
        self.client.complete_multipart_upload(
            Bucket=_s3(self.spec).bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": done},
        )

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.upload(f"raw-{i}", self.best)
        return None, {}


class RawDownload(_Boto):
    """Parallel (ranged) GetObjects into a fresh buffer, at the best layout, range, concurrency."""

    kind = "load"

    def setup(self, state: Any) -> None:
        self.client = boto_client(self.spec, checksums=False, pool=64)
        flat = st.flat_bytes(state)
        self.crc, self.size = st.fingerprint(flat), flat.numel()
        uploader = RawUpload(self.spec)
        uploader.client, uploader.flat = self.client, flat.numpy().data
        part, conc = self.spec.part_size, self.spec.concurrency
        for objects in (WHOLE,) if self.spec.quick else (WHOLE, 128 * MiB, 32 * MiB):
            uploader.upload(f"layout-{objects}", (objects, part, conc))
        del uploader, flat
        share = max(MiB, -(-self.size // conc))
        configs = [(WHOLE, part, conc), (WHOLE, share, conc), (WHOLE, WHOLE, 1)]
        configs += [(128 * MiB, part, conc), (128 * MiB, WHOLE, conc)]
        configs += [(32 * MiB, part, conc), (32 * MiB, WHOLE, conc)]
        self.best, sweep = _sweep(self._timed, configs, self.spec.quick)
        self.notes |= {"best": _label(self.best), "best_transfer": list(self.best), "sweep": sweep}

    def _timed(self, config: Config) -> float:
        started = time.perf_counter()
        self.download(config)
        return time.perf_counter() - started

    def download(self, config: Config) -> torch.Tensor:
        objects, span, concurrency = config
        out = torch.empty(self.size, dtype=torch.uint8)
        view, bucket = out.numpy().data, _s3(self.spec).bucket

        def one(task: tuple[str, int, int, int]) -> None:
            key, base, a, b = task
            whole = a == 0 and b >= min(objects, self.size - base)
            extra = {} if whole else {"Range": f"bytes={a}-{b - 1}"}
            resp = self.client.get_object(Bucket=bucket, Key=key, **extra)
            view[base + a : base + b] = resp["Body"].read()

        tasks = [
            (self.key(f"layout-{objects}/{n:05d}"), start, a, b)
            for n, (start, end) in enumerate(_cuts(self.size, objects))
            for a, b in _cuts(end - start, span)
        ]
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, tasks))
        return out

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        return self.download(self.best), {}

    def verify(self, out: Any) -> None:
        if st.fingerprint(out) != self.crc:
            raise AssertionError("raw download returned other bytes")
