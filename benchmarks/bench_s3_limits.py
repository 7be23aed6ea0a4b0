"""The raw S3 limits: the same bytes through boto3's multipart API, at the best of a sweep.

The upload calls CreateMultipartUpload / UploadPart / CompleteMultipartUpload directly from a
thread pool, each part one ``bytes`` slice of the flat state, with no client-side checksum:
the least work a boto3 client can do per byte. The download is the mirror image: parallel
ranged GetObjects into one preallocated buffer. boto3's transfer manager (``upload_fileobj``,
``download_fileobj``) was slower than both on this machine (it copies each part and streams
it in 8 KiB writes), so it is not the limit; the tuned ``upload_fileobj`` row shows it.

Part (range) size and concurrency are swept with one transfer each, in the row's own process
just before its timed runs; the sweep is in the notes and the JSON. On moto, a ranged GET
costs the server a read of the whole object, so the download sweep includes ranges of a
1/concurrency share of the object.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import bench_state as st
import torch
from bench_s3 import MiB, _Boto, _s3, boto_client

Config = tuple[int, int]
"""(part or range size in bytes, concurrency)."""


def _sweep(
    attempt: Any, configs: list[Config], widen: list[int]
) -> tuple[Config, dict[str, float]]:
    """Time ``attempt(config)`` once per config, then at the best size with other concurrency."""
    tried = {config: attempt(config) for config in configs}
    size = min(tried, key=tried.__getitem__)[0]
    for concurrency in widen:
        if (size, concurrency) not in tried:
            tried[(size, concurrency)] = attempt((size, concurrency))
    best = min(tried, key=tried.__getitem__)
    return best, {f"{p / MiB:.0f}MiBx{c}": round(s, 3) for (p, c), s in tried.items()}


class RawUpload(_Boto):
    """boto3 multipart upload of the flat bytes, at the best part size and concurrency."""

    def setup(self, state: Any) -> None:
        self.client = boto_client(self.spec, checksums=False, pool=64)
        self.flat = st.flat_bytes(state).numpy().data
        conc = self.spec.concurrency
        sizes = sorted({8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, self.spec.part_size})
        self.best, sweep = _sweep(self._timed, [(s, conc) for s in sizes], [4, 16, 32])
        self.notes |= {"best_transfer": list(self.best), "sweep": sweep}

    def _timed(self, config: Config) -> float:
        started = time.perf_counter()
        self.upload("sweep.bin", config)
        return time.perf_counter() - started

    def upload(self, name: str, config: Config) -> None:
        part, concurrency = config
        bucket, key = _s3(self.spec).bucket, self.key(name)
        upload_id = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(number: int) -> dict[str, Any]:
            start = (number - 1) * part
            body = bytes(self.flat[start : start + part])
            resp = self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        with ThreadPoolExecutor(concurrency) as pool:
            parts = list(pool.map(one, range(1, -(-len(self.flat) // part) + 1)))
        self.client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.upload(f"raw-{i}.bin", self.best)
        return None, {}


class RawDownload(_Boto):
    """Parallel ranged GetObjects into a fresh buffer, at the best range size and concurrency."""

    kind = "load"

    def setup(self, state: Any) -> None:
        self.client = boto_client(self.spec, checksums=False, pool=64)
        flat = st.flat_bytes(state)
        self.crc, self.size = st.fingerprint(flat), flat.numel()
        uploader = RawUpload(self.spec)
        uploader.client, uploader.flat = self.client, flat.numpy().data
        uploader.upload("raw.bin", self.spec.transfer or (self.spec.part_size, 8))
        del uploader, flat
        conc = self.spec.concurrency
        sizes = {16 * MiB, 64 * MiB, self.spec.part_size, max(MiB, -(-self.size // conc))}
        self.best, sweep = _sweep(self._timed, [(s, conc) for s in sorted(sizes)], [4, 16])
        self.notes |= {"best_transfer": list(self.best), "sweep": sweep}

    def _timed(self, config: Config) -> float:
        started = time.perf_counter()
        self.download(config)
        return time.perf_counter() - started

    def download(self, config: Config) -> torch.Tensor:
        span, concurrency = config
        out = torch.empty(self.size, dtype=torch.uint8)
        view = out.numpy().data
        bucket, key = _s3(self.spec).bucket, self.key("raw.bin")

        def one(start: int) -> None:
            end = min(start + span, self.size)
            resp = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
            view[start:end] = resp["Body"].read()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(0, self.size, span)))
        return out

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        return self.download(self.best), {}

    def verify(self, out: Any) -> None:
        if st.fingerprint(out) != self.crc:
            raise AssertionError("raw download returned other bytes")
